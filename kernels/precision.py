"""MindSpore's reduce-precision rule, for SelectKernel: when no kernel takes a
node's int64 operands, run it on int32 with casts around it - but only where
that is exact: every int64 input provably fits in int32, and the op's results
are drawn from its inputs' values (so they fit too). Otherwise refuse, and
say why, in the KernelSelectError.
"""
import numpy as np

from jaxsession.ir import Literal

INT32 = np.iinfo(np.int32)

# Ops whose integer results are values of their inputs (or positions bounded
# by a dimension): narrowing them loses nothing when the inputs fit. A fused
# op with that property may add its name.
RANGE_PRESERVING = {
    "max", "min", "clamp", "select_n", "reshape", "transpose", "broadcast_in_dim", "slice",
    "dynamic_slice", "gather", "concatenate", "sort", "reduce_max", "reduce_min", "copy",
    "squeeze", "rev", "expand_dims",
}


def fits_int32(value, consts, depth=0):
  """Whether every element `value` can take provably lies in int32's range."""
  if isinstance(value, Literal):
    return INT32.min <= int(np.asarray(value.value)) <= INT32.max
  if value.kind == "const":
    arr = np.asarray(consts[value.id])
    return arr.size == 0 or (arr.min() >= INT32.min and arr.max() <= INT32.max)
  node = value.producer
  if node is None or depth > 32:
    return False  # a run-time input: its values are unknown
  if node.op == "convert_element_type":
    src = node.inputs[0].aval.dtype
    return (np.issubdtype(src, np.integer) and np.iinfo(src).bits <= 32) or src == np.bool_
  if node.op == "iota":
    return max(node.params["shape"]) <= INT32.max
  if node.op in RANGE_PRESERVING:
    return all(fits_int32(v, consts, depth + 1) for v in node.inputs
               if getattr(v.aval, "dtype", None) == np.int64)
  return False


def narrowing_refusal(node, consts):
  """None if the node may run on int32 in place of int64, else why not."""
  int64_inputs = [i for i, v in enumerate(node.inputs) if v.aval.dtype == np.int64]
  if not int64_inputs and not any(o.aval.dtype == np.int64 for o in node.outputs):
    return "no int64 operand to narrow"
  if node.op not in RANGE_PRESERVING:
    return f"'{node.op}' may compute values outside int32 (not range-preserving)"
  for i in int64_inputs:
    if not fits_int32(node.inputs[i], consts):
      return f"input {i} is int64 of unknown range"
  return None


def int32_aval(aval):
  return aval.update(dtype=np.dtype(np.int32)) if aval.dtype == np.int64 else aval


def as_int32(value):
  """A stand-in with the narrowed aval (for kernel selection only)."""
  if isinstance(value, Literal):
    return Literal(value.value, int32_aval(value.aval))
  stand_in = type(value).__new__(type(value))
  for slot in type(value).__slots__:
    setattr(stand_in, slot, getattr(value, slot))
  stand_in.aval = int32_aval(value.aval)
  return stand_in


def insert_casts(graph, node):
  """Casts node's int64 inputs to int32 before it and its int32 results back
  to int64 after it; the node itself then computes on int32."""
  from jax import lax  # the cast nodes bind the convert primitive
  position = graph.nodes.index(node)
  new_inputs = []
  for value in node.inputs:
    if value.aval.dtype != np.int64:
      new_inputs.append(value)
    elif isinstance(value, Literal):
      new_inputs.append(Literal(np.int32(value.value), int32_aval(value.aval)))
    else:
      cast = graph.make_node("convert_element_type", lax.convert_element_type_p,
                             {"new_dtype": np.dtype(np.int32), "weak_type": False,
                              "sharding": None}, [value], [int32_aval(value.aval)],
                             source=node.source)
      cast.notes.append(f"reduce precision for node {node.id}: int64 -> int32 (values fit)")
      graph.insert_node(position, cast)
      position += 1
      new_inputs.append(cast.outputs[0])
  graph.unlink(node)
  node.inputs = new_inputs
  graph.link(node)
  position += 1
  for out in node.outputs:
    if out.aval.dtype != np.int64:
      continue
    wide = graph.make_node("convert_element_type", lax.convert_element_type_p,
                           {"new_dtype": np.dtype(np.int64), "weak_type": False,
                            "sharding": None}, [out], [out.aval], source=node.source)
    graph.replace_uses(out, wide.outputs[0])
    out.aval = int32_aval(out.aval)
    out.users = []
    graph.insert_node(position, wide)  # links `wide` as out's only reader
    wide.notes.append(f"reduce precision for node {node.id}: int32 -> int64")
    position += 1
  node.notes.append("runs on int32 (MindSpore reduce precision): its int64 values fit")
