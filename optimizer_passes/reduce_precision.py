"""MindSpore's reduce-precision rule, for SelectKernel: when no kernel takes a
node's int64 operands, run it on int32 with casts around it - but only where
that is exact: every int64 input provably fits in int32, and the op's results
are drawn from its inputs' values (so they fit too). Otherwise refuse, and
say why, in the KernelSelectError. "Drawn from its inputs' values" is the
op table's `range_preserving` fact (a fused op declares it with register_op).
"""
from jax import lax
import numpy as np

from jaxsession.graph import op_properties
from jaxsession.graph.ir import Literal, Node, Value

INT32 = np.iinfo(np.int32)


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
  if op_properties.facts(node.op).range_preserving:
    return all(fits_int32(v, consts, depth + 1) for v in node.inputs
               if getattr(v.aval, "dtype", None) == np.int64)
  return False


def narrowing_refusal(node, consts):
  """None if the node may run on int32 in place of int64, else why not."""
  int64_inputs = [i for i, v in enumerate(node.inputs) if v.aval.dtype == np.int64]
  if not int64_inputs and not any(o.aval.dtype == np.int64 for o in node.outputs):
    return "no int64 operand to narrow"
  if not op_properties.facts(node.op).range_preserving:
    return f"'{node.op}' may compute values outside int32 (not range-preserving)"
  for i in int64_inputs:
    if not fits_int32(node.inputs[i], consts):
      return f"input {i} is int64 of unknown range"
  return None


def int32_aval(aval):
  return aval.update(dtype=np.dtype(np.int32)) if aval.dtype == np.int64 else aval


def narrowed_view(node):
  """A detached copy of `node` with int64 avals narrowed to int32: what
  SelectKernel asks the registry about before anything in the graph changes."""
  def narrow(value):
    if isinstance(value, Literal):
      return Literal(value.value, int32_aval(value.aval))
    return Value(value.id, int32_aval(value.aval))
  view = Node(node.id, node.op, node.prim, node.params, [narrow(v) for v in node.inputs],
              ctx=node.ctx)
  view.outputs = [narrow(o) for o in node.outputs]
  view.origin = node.origin
  return view


def _cast_node(graph, value, dtype, out_aval, node, note):
  cast = graph.make_node("convert_element_type", lax.convert_element_type_p,
                         {"new_dtype": np.dtype(dtype), "weak_type": False, "sharding": None},
                         [value], [out_aval], source=node.source, ctx=node.ctx,
                         origin=node.origin)
  cast.notes.append(f"reduce precision for node {node.id}: {note}")
  return cast


def insert_casts(graph, node):
  """Casts node's int64 inputs to int32 before it and its int32 results back
  to int64 after it; the node itself then computes on int32."""
  position = graph.nodes.index(node)
  new_inputs = []
  for value in node.inputs:
    if value.aval.dtype != np.int64:
      new_inputs.append(value)
    elif isinstance(value, Literal):
      new_inputs.append(Literal(np.int32(value.value), int32_aval(value.aval)))
    else:
      cast = _cast_node(graph, value, np.int32, int32_aval(value.aval), node,
                        "int64 -> int32 (values fit)")
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
    wide = _cast_node(graph, out, np.int64, out.aval, node, "int32 -> int64")
    graph.replace_uses(out, wide.outputs[0])
    out.aval = int32_aval(out.aval)
    out.users = []
    graph.insert_node(position, wide)  # links `wide` as out's only reader
    position += 1
  node.notes.append("runs on int32 (MindSpore reduce precision): its int64 values fit")
