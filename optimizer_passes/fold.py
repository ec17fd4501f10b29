"""fold_constants (Optimize): evaluates, at compile time, nodes whose inputs
are all literals or const inputs, and replaces them by the result - a literal
for a scalar, a new const input otherwise.

A result larger than `SessionOptions.fold_limit_bytes` is not materialised (a
broadcast of a literal to a big shape stays a cheap op in the executable).
Only nodes that op_properties calls foldable are evaluated: never control
flow, callbacks (compile runs no user code), effects or random draws. Needs nothing
before it; DCE afterwards drops the const inputs nobody reads any more.
"""
import jax
import numpy as np

from jaxsession.ir import Literal, aval_bytes
from jaxsession.lowering import kernel_fn
from jaxsession.optimizer_passes.base import Pass, PassResult

def _broadcast_in_dim(x, shape, broadcast_dimensions, **_):
  expanded = np.reshape(x, [x.shape[broadcast_dimensions.index(i)]
                            if i in broadcast_dimensions else 1 for i in range(len(shape))])
  return np.broadcast_to(expanded, shape)


def _float_only(fn):
  """An IEEE-exact (correctly rounded) float op; None defers ints to jax."""
  def fold(*xs, **_):
    return fn(*xs) if all(np.issubdtype(x.dtype, np.floating) for x in xs) else None
  return fold


# Data movement, and the correctly rounded float arithmetic, give the same bits
# in numpy without an eager XLA compile each; everything else (transcendentals,
# integer division) is left to the op's own kernel so folded values equal jax's.
NUMPY_FOLDS = {
    "add": _float_only(np.add), "sub": _float_only(np.subtract),
    "mul": _float_only(np.multiply), "div": _float_only(np.divide),
    "neg": _float_only(np.negative), "max": _float_only(np.maximum),
    "min": _float_only(np.minimum),
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": lambda x, new_sizes, dimensions=None, **_: (
        np.reshape(x, new_sizes) if dimensions is None else None),
    "transpose": lambda x, permutation, **_: np.transpose(x, permutation),
    "squeeze": lambda x, dimensions, **_: np.squeeze(x, tuple(dimensions)),
}

DEFAULT_LIMIT_BYTES = 1 << 16


class FoldConstants(Pass):
  name = "fold_constants"

  def run(self, graph, ctx):
    limit = getattr(ctx.options, "fold_limit_bytes", DEFAULT_LIMIT_BYTES)
    known = {v.id: graph.const_values[v.id] for v in graph.inputs_of_kind("const")}
    folded = []
    for node in graph.nodes:
      if not self._foldable(node, known, limit):
        continue
      args = [v.value if isinstance(v, Literal) else known[v.id] for v in node.inputs]
      outs = self._evaluate(node, args)
      for out, result in zip(node.outputs, outs):
        value = np.asarray(result, dtype=out.aval.dtype)
        if out.aval.shape == ():
          graph.replace_uses(out, Literal(value[()], out.aval))
        else:
          const = graph.add_input(out.aval, kind="const", const_value=value,
                                  name=f"folded {node.op}" + (f" @ {node.source}"
                                                              if node.source else ""))
          known[const.id] = value
          graph.replace_uses(out, const)
      folded.append(node)
    graph.remove_nodes(folded)
    return PassResult(bool(folded))

  @staticmethod
  def _evaluate(node, args):
    numpy_fold = NUMPY_FOLDS.get(node.op)
    if numpy_fold is not None:
      arrays = [np.asarray(a, dtype=v.aval.dtype) for a, v in zip(args, node.inputs)]
      with np.errstate(all="ignore"):  # inf/nan are values like any other here
        out = numpy_fold(*arrays, **node.params)
      if out is not None:
        return [np.asarray(out, dtype=node.outputs[0].aval.dtype)]
    with jax.ensure_compile_time_eval():
      return kernel_fn(node)(node, *args)

  @staticmethod
  def _foldable(node, known, limit):
    if not node.props.foldable or node.prim is None:
      return False
    if any(not (isinstance(v, Literal) or v.id in known) for v in node.inputs):
      return False
    try:
      return all(np.dtype(o.aval.dtype) is not None for o in node.outputs) and sum(
          aval_bytes(o.aval) for o in node.outputs) <= limit
    except TypeError:  # extended dtypes (PRNG keys) have no numpy form
      return False
