"""DCE: removes nodes none of whose outputs is used, and the dead outputs of
nodes whose op has a DCE rule.

Runs first in Optimize: jaxprs of `jax.grad` keep the forward's dead equations.
Nodes that are not pure (op_properties: effects, ordered I/O, io_callback, at
any depth inside control flow) are kept. A kept node with unused outputs goes
to its op's DCE rule (op_properties `dce`: JAX's own `pe.dce_rules` for scan
and cond, op_properties' own for while): a scan's unused `ys` (and carries no
used output needs), a cond's unused outputs and a while's carries that
neither a used output nor its condition needs are dropped, with what only
they computed inside; effectful equations inside stay, and so does what they
read. The inputs it no longer reads are released, so their producers die in
the same sweep. Const inputs that nothing reads are dropped too. Needs
nothing before it.
"""
from jaxsession.graph import op_properties
from jaxsession.optimizer_passes.base import Pass, PassResult


def drop_dead_outputs(node, live_outputs, dead):
  """Applies the DCE rule of `node`'s op to its unused outputs; True if the
  node changed. Its dropped inputs stop listing it as a user."""
  rule = op_properties.facts(node.op).dce
  if rule is None or node.prim is None:
    return False
  used = [out.id in live_outputs or any(u not in dead for u in out.users)
          for out in node.outputs]
  if all(used):
    return False
  result = rule(node, used)
  if result is None or (all(result.used_inputs) and all(result.kept_outputs)):
    return False
  for value, keep in zip(node.inputs, result.used_inputs):
    if not keep and hasattr(value, "users"):
      value.users.remove(node)
  node.inputs = [v for v, keep in zip(node.inputs, result.used_inputs) if keep]
  node.outputs = [o for o, keep in zip(node.outputs, result.kept_outputs) if keep]
  for index, out in enumerate(node.outputs):
    out.index = index
  node.params = result.params
  node.effects = result.effects
  node.invalidate_props()
  return True


class DeadCodeElimination(Pass):
  name = "dce"

  def run(self, graph, ctx):
    live_outputs = {v.id for v in graph.outputs if hasattr(v, "users")}
    dead = set()
    pruned = False
    # Walk backwards so a chain of dead nodes goes in one sweep.
    for node in reversed(graph.nodes):
      if any(out.id in live_outputs or any(u not in dead for u in out.users)
             for out in node.outputs) or not node.props.pure:
        pruned |= drop_dead_outputs(node, live_outputs, dead)
        continue
      dead.add(node)
      graph.record_removed(self.name, node, "nothing reads its results")
    graph.remove_nodes(dead)
    removed = len(dead)
    # Const inputs nobody reads (folded away, or dead) are not worth passing.
    unused = [v for v in graph.inputs_of_kind("const")
              if not v.users and v.id not in live_outputs]
    for value in unused:
      graph.inputs.remove(value)
      del graph.const_values[value.id]
    return PassResult(removed > 0 or bool(unused) or pruned)
