"""fold_constants (Optimize): evaluates, at compile time, nodes whose inputs
are all literals or const inputs, and replaces them by the result - a literal
for a scalar, a new const input otherwise.

A result larger than `SessionOptions.fold_limit_bytes` is not materialised (a
broadcast of a literal to a big shape stays a cheap op in the executable).
Control flow, callbacks and effectful nodes are never folded. Needs nothing
before it; DCE afterwards drops the const inputs nobody reads any more.
"""
import jax
import numpy as np

from jaxsession.ir import Literal, aval_bytes
from jaxsession.lowering import kernel_fn
from jaxsession.optimizer_passes.base import Pass, PassResult

NEVER_FOLD = frozenset({"scan", "while", "cond", "pure_callback", "io_callback",
                        "debug_callback", "custom_jvp_call", "custom_vjp_call"})
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
      with jax.ensure_compile_time_eval():
        outs = kernel_fn(node)(node, *args)
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
    for node in folded:
      graph.remove_node(node)
    return PassResult(bool(folded))

  @staticmethod
  def _foldable(node, known, limit):
    if node.effects or node.op in NEVER_FOLD or node.prim is None:
      return False
    if any(not (isinstance(v, Literal) or v.id in known) for v in node.inputs):
      return False
    try:
      return all(np.dtype(o.aval.dtype) is not None for o in node.outputs) and sum(
          aval_bytes(o.aval) for o in node.outputs) <= limit
    except TypeError:  # extended dtypes (PRNG keys) have no numpy form
      return False
