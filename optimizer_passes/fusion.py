"""Fusion passes (Optimize): a subgraph becomes one fused node with its own op
name and kernel (kernels/fused.py). Patterns cover the forms users write by
hand, as jax.nn writes them and as flax writes them; `simplify` and
`remove_nops` run before (same fixed-point sweep) to strip what those forms add
(stop_gradient, max with -inf, x**1). A fusion never fires when a value inside
it has a reader outside it (the rule engine checks that).
"""
import numpy as np

from jaxsession.ir import Literal
from jaxsession.optimizer_passes.pattern import Pat, RewritePass, Rule

x = Pat.var("x")


def _close(literal, want, rtol=1e-6):
  return isinstance(literal, Literal) and np.allclose(np.asarray(literal.value, np.float64),
                                                      want, rtol=rtol, atol=0)


def _is_float(value):
  return np.issubdtype(np.dtype(value.aval.dtype), np.floating)


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
           name="e")
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
                 f"fused softmax over axes {axes}")


# -- tanh-GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) -------------------
_cube = Pat.either(Pat("integer_pow", x, params={"y": 3}),
                   Pat("mul", x, Pat("mul", x, x)), Pat("mul", Pat("mul", x, x), x))
_inner = Pat("mul", Pat.lit(name="c1"), Pat("add", x, Pat("mul", Pat.lit(name="c2"), _cube)))
_one_plus_tanh = Pat("add", Pat.lit(1), Pat("tanh", _inner))
GELU_FORMS = [
    Pat("mul", x, Pat("mul", Pat.lit(0.5), _one_plus_tanh)),   # jax.nn.gelu
    Pat("mul", Pat("mul", Pat.lit(0.5), x), _one_plus_tanh),   # 0.5 * x * (1 + tanh(...))
    Pat("mul", Pat.lit(0.5), Pat("mul", x, _one_plus_tanh)),   # 0.5 * (x * (1 + tanh(...)))
]


def fuse_gelu(r, x, c1, c2):
  if not (_close(c1, np.sqrt(2 / np.pi)) and _close(c2, 0.044715)) or not _is_float(x):
    return None
  if r.root.outputs[0].aval.shape != x.aval.shape:
    return None
  return r.fused("GeluTanh", [x], {}, r.root.outputs[0].aval, "fused tanh-GELU")


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
  params = {k: mm.producer.params.get(k) for k in
            ("dimension_numbers", "precision", "preferred_element_type")}
  return r.fused("MatMulBiasAdd", [a, w, bias], params, r.root.outputs[0].aval,
                 "fused dot_general + bias add (MindSpore MatMulBiasAdd)")


# -- AddN: a chain or tree of same-shape adds ------------------------------------
ADDS = ("add", "add_any")


def _same_aval_add(value, aval):
  node = getattr(value, "producer", None)
  return (node is not None and node.op in ADDS and value.aval.shape == aval.shape
          and value.aval.dtype == aval.dtype
          and all(getattr(v, "aval", None) is not None and v.aval.shape == aval.shape
                  for v in node.inputs))


def _leaves(value, aval, graph_outputs, root):
  if isinstance(value, Literal):
    return [value]
  node = value.producer
  if node is not root and (len(value.users) != 1 or id(value) in graph_outputs):
    return [value]
  if not _same_aval_add(value, aval):
    return [value]
  return [leaf for v in node.inputs for leaf in _leaves(v, aval, graph_outputs, root)]


def fuse_add_n(r, a, b):
  out = r.root.outputs[0]
  if not _same_aval_add(out, out.aval):
    return None
  parent = out.users[0] if len(out.users) == 1 else None
  graph_outputs = {id(v) for v in r.graph.outputs}
  if parent is not None and id(out) not in graph_outputs and _same_aval_add(
      parent.outputs[0], out.aval):
    return None  # the parent add will take this one in
  leaves = _leaves(out, out.aval, graph_outputs, r.root)
  if len(leaves) < 3:
    return None
  return r.fused("AddN", leaves, {"n": len(leaves)}, out.aval,
                 f"fused {len(leaves) - 1} adds into one {len(leaves)}-ary add")


FUSION_RULES = {
    "fuse_softmax": [Rule(SOFTMAX, fuse_softmax)],
    "fuse_gelu": [Rule(form, fuse_gelu) for form in GELU_FORMS],
    "fuse_matmul_bias": [Rule(MATMUL_BIAS, fuse_matmul_bias)],
    "fuse_add_n": [Rule(Pat(ADDS, Pat.var("a"), Pat.var("b")), fuse_add_n)],
}


def fusion_passes():
  """One pass per fusion, in the order the Optimize stage runs them."""
  return [RewritePass(name, rules, doc=__doc__) for name, rules in FUSION_RULES.items()]
