"""assign_streams (AssignStream): the queue of every partition and node,
which host partitions overlap device work, and the sync flag of each transfer
(runtime/streams.py). The partitions' launch order is partition_nodes'.

Needs partition_nodes before it.
"""
from jaxsession.optimizer_passes.base import Pass, PassResult
from jaxsession.runtime import streams


class AssignStreams(Pass):
  name = "assign_streams"
  required = True  # every node needs a queue
  annotates = True

  def run(self, graph, ctx):
    return PassResult(streams.assign_streams(graph, graph.partitions, ctx.platform))
