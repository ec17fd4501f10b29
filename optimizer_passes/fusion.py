"""Fusion passes (Optimize): a subgraph becomes one fused node with its own op
name and kernel (kernels/fused.py). Patterns cover the forms users write by
hand, as jax.nn writes them and as flax writes them; `simplify` and
`remove_nops` run before (same fixed-point sweep) to strip what those forms add
(stop_gradient, max with -inf, x**1). A fusion never fires when a value inside
it has a reader outside it (the rule engine checks that).

A fused node records the user's form - literals as written, association, and
the operand order of each add that may meet a product - in its params, and
its kernel repeats that arithmetic, so the result is bit-identical to the
unfused graph (tests/fusion_test.py compares bits). Order matters for adds:
XLA on CPU contracts a*b + c into one fused multiply-add, so a*b + c*d and
c*d + a*b round differently. A form the kernel cannot repeat is not fused.
"""
import jax.numpy as jnp
import numpy as np

from jaxsession.graph import op_properties
from jaxsession.graph.ir import Literal, same_value
from jaxsession.optimizer_passes.base import PassResult
from jaxsession.optimizer_passes.pattern import Pat, RewritePass, Rule

x = Pat.var("x")


def _is_float(value):
  """Real floating point (bfloat16 included; not complex)."""
  dtype = value.aval.dtype
  return jnp.issubdtype(dtype, jnp.floating) and not jnp.issubdtype(dtype, jnp.complexfloating)


def _literal(literal):
  """A captured scalar literal as a numpy scalar of its own dtype (a param)."""
  return np.asarray(literal.value, literal.aval.dtype)[()]


def _near(literal, want, dtype):
  """`literal` is `want` up to a few roundings in `dtype` (how users spell a
  constant: np.sqrt(2/np.pi) in float64 or jnp.sqrt(2/jnp.pi) in float32). Only
  recognises the op: the kernel uses the literal itself, never `want`."""
  return isinstance(literal, Literal) and abs(float(literal.value) - want) <= (
      4 * float(jnp.finfo(dtype).eps) * abs(want))


# Written on every fused node whose op also has a Pallas kernel (GPU only).
PALLAS_NOTE = ("bit-identical to the unfused graph with its XLA kernel; on GPU the "
               "Pallas kernel reduces and contracts in Triton's order: not claimed")


def first(add, operand):
  """Whether `operand` (or a duplicate of it cse marked) is the first input
  of the add that computes `add`."""
  inputs = add.producer.inputs
  return inputs[0] is operand or (inputs[1] is not operand and same_value(inputs[0], operand))


def _keeps_reduced_axes(expanded, x, axes):
  """`expanded` is a reduction over `axes` brought back to x's rank (keepdims
  shape, or x's shape) without moving any other axis."""
  shape = tuple(x.aval.shape)
  keep = tuple(1 if i in axes else n for i, n in enumerate(shape))
  if tuple(expanded.aval.shape) not in (keep, shape):
    return False
  node = expanded.producer
  if node.op == "broadcast_in_dim":
    return node.params["broadcast_dimensions"] == tuple(
        i for i in range(len(shape)) if i not in axes)
  return node.op == "reshape" and node.params.get("dimensions") is None


# -- softmax: exp(x - max(x)) / sum(exp(x - max(x))) ----------------------------
_expand = ("broadcast_in_dim", "reshape")
_exp = Pat("exp", Pat("sub", x, Pat(_expand, Pat("reduce_max", x, name="mx"), name="mx_b")),
           name="e", params={"accuracy": None})
SOFTMAX = Pat("div", _exp, Pat(_expand, Pat("reduce_sum", _exp, name="sm"), name="sm_b"))


def fuse_softmax(r, x, e, mx, mx_b, sm, sm_b):
  axes = tuple(mx.producer.params["axes"])
  if tuple(sm.producer.params["axes"]) != axes or not _is_float(x):
    return None
  if not (_keeps_reduced_axes(mx_b, x, axes) and _keeps_reduced_axes(sm_b, x, axes)):
    return None
  if r.root.outputs[0].aval.shape != x.aval.shape:
    return None
  return r.fused("Softmax", [x], {"axes": axes}, r.root.outputs[0].aval,
                 f"fused softmax over axes {axes}; {PALLAS_NOTE}")


# -- tanh-GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) -------------------
# mul and add are commutative bit for bit, so operand order within one of
# them is free; association is not, so each form is its own rule.
_cube = Pat.either(Pat("integer_pow", x, params={"y": 3}, name="cube_pow"),  # x**3
                   Pat("mul", x, Pat("mul", x, x), name="cube_x_xx"),       # x*(x*x)
                   Pat("mul", Pat("mul", x, x), x, name="cube_x_xx"))       # (x*x)*x, the same
_inner = Pat("mul", Pat.lit(name="c1"),
              Pat("add", x, Pat("mul", Pat.lit(name="c2"), _cube, name="c2_cube"), name="inner"))
_one_plus_tanh = Pat("add", Pat.lit(1, name="one"),
                     Pat("tanh", _inner, params={"accuracy": None}))
GELU_FORMS = {
    "x_half_t": Pat("mul", x, Pat("mul", Pat.lit(0.5, name="half"), _one_plus_tanh)),  # jax.nn
    "half_x_t": Pat("mul", Pat("mul", Pat.lit(0.5, name="half"), x), _one_plus_tanh),  # 0.5*x*(..)
    "half_xt": Pat("mul", Pat.lit(0.5, name="half"), Pat("mul", x, _one_plus_tanh)),   # 0.5*(x*..)
}


def _make_gelu(form):
  def fuse_gelu(r, x, c1, c2, one, half, inner, c2_cube, **cube):
    if not _is_float(x) or r.root.outputs[0].aval.shape != x.aval.shape:
      return None
    if not (_near(c1, np.sqrt(2 / np.pi), x.aval.dtype) and _near(c2, 0.044715, x.aval.dtype)):
      return None
    params = {"form": form, "cube": "pow" if "cube_pow" in cube else "x_xx",
              "x_first": first(inner, x),
              "c1": _literal(c1), "c2": _literal(c2), "one": _literal(one),
              "half": _literal(half)}
    return r.fused("GeluTanh", [x], params, r.root.outputs[0].aval,
                   f"fused tanh-GELU ({form}, the user's literals)")
  fuse_gelu.__name__ = f"fuse_gelu_{form}"
  return fuse_gelu


# -- MatMul + BiasAdd: dot_general(a, w) + bias over the last axis --------------------
MATMUL_BIAS = Pat("add", Pat("dot_general", Pat.var("a"), Pat.var("w"), name="mm"),
                  Pat(("broadcast_in_dim", "reshape"), Pat.var("bias"), name="bb"))


def fuse_matmul_bias(r, a, w, mm, bias, bb):
  out = mm.aval
  if bias.aval.ndim != 1 or not out.shape or bias.aval.shape[0] != out.shape[-1]:
    return None
  if bias.aval.dtype != out.dtype or r.root.outputs[0].aval.shape != out.shape:
    return None
  node = bb.producer
  if node.op == "broadcast_in_dim" and node.params["broadcast_dimensions"] != (
      len(bb.aval.shape) - 1,):
    return None
  if node.op == "reshape" and tuple(bb.aval.shape) != (1,) * (out.ndim - 1) + bias.aval.shape:
    return None
  params = {"dot": tuple(sorted(mm.producer.params.items())),
            "bias_first": first(r.root.outputs[0], bb)}
  return r.fused("MatMulBiasAdd", [a, w, bias], params, r.root.outputs[0].aval,
                 "fused dot_general + bias add (MindSpore MatMulBiasAdd)")


# -- AddN: a chain or tree of same-shape adds ------------------------------------
ADDS = op_properties.ops_with(add=True)  # add, add_any


def _same_aval_add(value, aval):
  node = getattr(value, "producer", None)
  return (node is not None and node.op in ADDS and value.aval.shape == aval.shape
          and value.aval.dtype == aval.dtype
          and all(getattr(v, "aval", None) is not None and v.aval.shape == aval.shape
                  for v in node.inputs))


def _add_tree(root, aval, graph_outputs):
  """The adds under `root` as (leaves, steps): step k adds slots (i, j), where
  slots 0..n-1 are the leaves and slot n+k is step k's sum - the user's own
  association and operand order. Iterative: a 1500-term sum is a chain 1500 deep."""
  leaves, slot_of, steps = [], {}, []
  result = {}  # id(add output) -> its slot
  stack = [(root, False)]
  while stack:
    value, expanded = stack.pop()
    node = value.producer
    inner = [v for v in node.inputs if _absorbed(v, aval, graph_outputs)]
    if not expanded:
      stack.append((value, True))
      stack.extend((v, False) for v in reversed(inner))
      continue
    slots = []
    for v in node.inputs:
      if _absorbed(v, aval, graph_outputs):
        slots.append(result[id(v)])
        continue
      key = v.key() if isinstance(v, Literal) else id(v)
      if key not in slot_of:
        slot_of[key] = len(leaves)
        leaves.append(v)
      slots.append(slot_of[key])
    result[id(value)] = ("step", len(steps))
    steps.append(tuple(slots))
  n = len(leaves)
  fix = lambda s: n + s[1] if isinstance(s, tuple) else s
  return leaves, tuple((fix(i), fix(j)) for i, j in steps)


def _absorbed(value, aval, graph_outputs):
  """An inner add the fused node takes in: read by its parent add alone."""
  return (not isinstance(value, Literal) and len(value.users) == 1
          and id(value) not in graph_outputs and _same_aval_add(value, aval))


def fuse_add_n(r, a, b):
  out = r.root.outputs[0]
  if not _same_aval_add(out, out.aval):
    return None
  graph_outputs = {id(v) for v in r.graph.outputs}
  parent = out.users[0].outputs if out.users else ()  # (a debug print has no outputs:
  if _absorbed(out, out.aval, graph_outputs) and parent and \
      _same_aval_add(parent[0], out.aval):  # a break-it find, an IndexError)
    return None  # the parent add will take this one in
  leaves, steps = _add_tree(out, out.aval, graph_outputs)
  if len(steps) < 2:
    return None
  return r.fused("AddN", leaves, {"n": len(leaves), "steps": steps}, out.aval,
                 f"fused {len(steps)} adds of {len(leaves)} values (the user's association)")


FUSION_RULES = {
    "fuse_softmax": [Rule(SOFTMAX, fuse_softmax)],
    "fuse_gelu": [Rule(pat, _make_gelu(form)) for form, pat in GELU_FORMS.items()],
    "fuse_matmul_bias": [Rule(MATMUL_BIAS, fuse_matmul_bias)],
    "fuse_add_n": [Rule(Pat(ADDS, Pat.var("a"), Pat.var("b")), fuse_add_n)],
}


class FuseSoftmax(RewritePass):
  """Optimize: softmax -> one Softmax node (module docstring)."""
  name = "fuse_softmax"
  rules = FUSION_RULES[name]


class FuseGelu(RewritePass):
  """Optimize: tanh-form GELU -> one GeluTanh node (module docstring)."""
  name = "fuse_gelu"
  rules = FUSION_RULES[name]


class FuseMatmulBias(RewritePass):
  """Optimize: dot + broadcast bias -> one MatMulBiasAdd node (module docstring).
  Not under a mesh, where CSE is off too (cse.py): a model applied twice kept
  two fused copies of what XLA merges in jax.jit's program, and its SPMD
  partitioner laid them out otherwise ("zero" SGD state off jax.jit's; a
  break-it find)."""
  name = "fuse_matmul_bias"
  rules = FUSION_RULES[name]

  def run(self, graph, ctx):
    if graph.mesh is not None:
      return PassResult(False)
    return super().run(graph, ctx)


class FuseAddN(RewritePass):
  """Optimize: a tree of same-shape adds -> one AddN node (module docstring)."""
  name = "fuse_add_n"
  rules = FUSION_RULES[name]
