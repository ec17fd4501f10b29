"""plan_memory (AllocateMemory): liveness per partition, donation of
session-owned state and of intermediates, which small state leaves are
packed (runtime/packing.py), and the planned peak, as `graph.memory`
(runtime/memory.py). Changes no node: it reports a change (its decisions,
written on the graph), so report.passes and the save_graphs dumps show them.

Needs assign_streams before it (the partitions in their launch order).
"""
from jaxsession.optimizer_passes.base import Pass, PassResult
from jaxsession.runtime import memory


class PlanMemory(Pass):
  name = "plan_memory"
  required = True  # Build reads the plan
  touches_nodes = False  # a decision on the graph (graph.memory), no node

  def run(self, graph, ctx):
    graph.memory = memory.plan_memory(graph, graph.partitions,
                                      ctx.options.donate_state, ctx.platform,
                                      ctx.options.pack_state_below_bytes, ctx.slot_leaves)
    return PassResult(True)
