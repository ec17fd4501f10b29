"""CSE: merges nodes that compute the same op with the same params on the same
inputs, keeping the first. Only deterministic nodes are merged (op_properties):
two `rng_uniform` draws or two callbacks are two values, not one. Constant
subexpressions (computed from literals and consts alone) and scalars are left
as they are for XLA, which folds and merges them as it does under jax.jit.

Run after DCE (fewer nodes to hash); DCE again afterwards is not needed since
the merged node's outputs are redirected, not left dead.
"""
from jaxsession.graph.ir import Literal, param_key
from jaxsession.optimizer_passes.base import Pass, PassResult


def node_key(node):
  """(op, params, inputs) of `node`, or None when it cannot be hashed."""
  try:
    params = param_key(node.params)
  except TypeError:
    return None
  inputs = tuple(v.key() if isinstance(v, Literal) else v.id for v in node.inputs)
  return (node.op, params, inputs)


class CommonSubexpressionElimination(Pass):
  name = "cse"

  def run(self, graph, ctx):
    seen = {}
    merged = []
    constant = {v.id for v in graph.inputs_of_kind("const")}
    for node in graph.nodes:
      if not node.props.deterministic:
        continue
      if all(isinstance(v, Literal) or v.id in constant for v in node.inputs):
        # A constant subexpression is XLA's to fold, as under jax.jit: merging
        # it changes the structure XLA's simplifier sees, and some of its
        # rewrites (x - x -> 0, x + 0 -> x) are not exact for -0.0 and NaN.
        constant.update(out.id for out in node.outputs)
        continue
      if all(out.aval.shape == () for out in node.outputs):
        # A scalar each use computes again is left so, as under jax.jit: XLA
        # divides by a broadcast scalar through its reciprocal where the
        # scalar has one user, exactly where it has several (p / (lr * lr)
        # per leaf: other bits once merged); merging saves XLA nothing, its
        # own CSE runs after that rewrite.
        continue
      key = node_key(node)
      if key is None:
        continue
      first = seen.setdefault(key, node)
      if first is node:
        continue
      for old, new in zip(node.outputs, first.outputs):
        graph.replace_uses(old, new)
      merged.append(node)
    graph.remove_nodes(merged)
    return PassResult(bool(merged))
