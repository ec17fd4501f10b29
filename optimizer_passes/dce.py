"""DCE: removes nodes none of whose outputs is used.

Runs first in Optimize: jaxprs of `jax.grad` keep the forward's dead equations.
Nodes with side effects (callbacks with effects, ordered I/O) are kept.
Needs nothing before it.
"""
from jaxsession.optimizer_passes.base import Pass, PassResult


class DeadCodeElimination(Pass):
  name = "dce"

  def run(self, graph, ctx):
    live_outputs = {v.id for v in graph.outputs if hasattr(v, "users")}
    removed = 0
    # Walk backwards so a chain of dead nodes goes in one sweep.
    for node in reversed(list(graph.nodes)):
      if node.effects:
        continue
      if any(out.users or out.id in live_outputs for out in node.outputs):
        continue
      graph.remove_node(node)
      removed += 1
    return PassResult(removed > 0)
