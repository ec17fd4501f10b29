"""partition_nodes (HardwareOptimize): splits the placed nodes into partitions
and puts them in launch order (runtime/partition.py: maximal runs of one
place, each device partition as early as its inputs allow, adjacent ones of
one place merged, and what crosses each boundary), and writes them on the
graph (`graph.partitions`, graph.nodes in their order).

With `SessionOptions(partition_or_error=True)` a graph that needs more than
one device partition, so launched, is a PartitionError naming each host node
and its rule. Needs place_nodes, the final node order and insert_transfers
before it.
"""
from jaxsession.errors import PartitionError
from jaxsession.graph.op_properties import is_transfer
from jaxsession.graph.text import node_where
from jaxsession.optimizer_passes.base import Pass, PassResult
from jaxsession.runtime.partition import placement_reason
from jaxsession.runtime import partition


class PartitionNodes(Pass):
  name = "partition_nodes"
  required = True  # every graph is run as partitions

  def run(self, graph, ctx):
    parts = partition.partition_graph(graph)
    device = [p for p in parts if p.place == "device"]
    if len(device) > 1 and ctx.options.partition_or_error:
      host = [n for n in graph.nodes if n.place == "host" and not is_transfer(n.op, "d2h")]
      raise PartitionError(
          f"graph {graph.name} needs {len(device)} device partitions "
          f"(partition_or_error is set); {len(host)} node(s) run on the host:\n"
          + "\n".join(f"  {node_where(n)}: "
                      f"{placement_reason(n)}" for n in host)
          + "\npartitions:\n" + "\n".join(f"  {p.describe()}" for p in parts))
    graph.partitions = parts
    if graph.schedule is not None:
      graph.schedule.launched = len(parts)
    return PassResult(len(parts) > 1)
