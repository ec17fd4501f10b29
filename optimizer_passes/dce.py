"""DCE: removes nodes none of whose outputs is used.

Runs first in Optimize: jaxprs of `jax.grad` keep the forward's dead equations.
Nodes that are not pure (op_properties: effects, ordered I/O, io_callback, at
any depth inside control flow) are kept. Const
inputs that nothing reads are dropped too.
Needs nothing before it.
"""
from jaxsession.optimizer_passes.base import Pass, PassResult


class DeadCodeElimination(Pass):
  name = "dce"

  def run(self, graph, ctx):
    live_outputs = {v.id for v in graph.outputs if hasattr(v, "users")}
    dead = set()
    # Walk backwards so a chain of dead nodes goes in one sweep.
    for node in reversed(graph.nodes):
      if not node.props.pure:
        continue
      if any(out.id in live_outputs or any(u not in dead for u in out.users)
             for out in node.outputs):
        continue
      dead.add(node)
    graph.remove_nodes(dead)
    removed = len(dead)
    # Const inputs nobody reads (folded away, or dead) are not worth passing.
    unused = [v for v in graph.inputs_of_kind("const")
              if not v.users and v.id not in live_outputs]
    for value in unused:
      graph.inputs.remove(value)
      del graph.const_values[value.id]
    return PassResult(removed > 0 or bool(unused))
