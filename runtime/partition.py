"""Partitioning: split the placed node list into runs that execute together.

Proposes partitions in one step (maximal runs of nodes with the same place, in
execution order) and then computes what crosses each boundary. Each partition
remembers why it was split off, for the report and the dump.
"""
import dataclasses
from typing import List, Optional

from jaxsession.graph.divisors import divisor_cone
from jaxsession.graph.ir import Literal
from jaxsession.graph.liveness import partition_index
from jaxsession.graph.op_properties import is_transfer


@dataclasses.dataclass
class Partition:
  index: int
  place: str                       # "device" or "host"
  nodes: list
  reason: str
  stream: Optional[int] = None     # AssignStream
  inputs: List = dataclasses.field(default_factory=list)   # Values read from outside
  outputs: List = dataclasses.field(default_factory=list)  # Values read after it
  may_fail: bool = False           # can raise after it consumed its inputs
  overlaps: List[int] = dataclasses.field(default_factory=list)  # device partitions
  prefetch: List = dataclasses.field(default_factory=list)  # early device->host copies
  # device: scalar inputs its divisors are made of that something outside it
  # reads too, returned by its executable and dropped (`divisor_witnesses`)
  witnesses: List = dataclasses.field(default_factory=list)

  def describe(self):
    overlap = (f" overlaps device partition(s) {self.overlaps}" if self.overlaps else "")
    witness = (f" returns {', '.join(f'%{v.id}' for v in self.witnesses)} (a divisor read "
               "outside it too, as in jax.jit's executable)" if self.witnesses else "")
    return (f"#{self.index} {self.place} nodes={len(self.nodes)} stream={self.stream} "
            f"in={len(self.inputs)} out={len(self.outputs)}"
            f"{' may_fail' if self.may_fail else ''}{overlap}{witness}: {self.reason}")


def node_may_fail(node):
  """Whether running `node` can raise after its inputs were consumed: a host
  kernel, or a node that runs user code (a callback, also inside a scan/cond/
  while body: op_properties looks inside)."""
  return node.place == "host" or node.props.may_fail


def propose_partitions(graph):
  """Maximal runs of same-place nodes, in execution order."""
  partitions = []
  for node in graph.nodes:
    if partitions and partitions[-1].place == node.place:
      partitions[-1].nodes.append(node)
      continue
    partitions.append(Partition(len(partitions), node.place, [node], ""))
  for i, part in enumerate(partitions):
    part.reason = reason_for(part, partitions[i - 1] if i else None)
  return partitions


def reason_for(part, previous):
  """Why `part` starts where it does: the node that opens it (the first that
  is not a transfer), its op, source line and the placement rule."""
  node = next((n for n in part.nodes if not is_transfer(n.op)),
              part.nodes[0])
  where = f" at {node.source}" if node.source else ""
  if previous is None:
    return f"first partition, opened by node {node.id} '{node.label}'{where}"
  why = next((note for note in node.notes if note.startswith("placed on host")),
             "every node runs on the device unless a placement rule moves it")
  return (f"placement changes {previous.place} -> {part.place} at node {node.id} "
          f"'{node.label}'{where}: {why}")


def compute_boundaries(graph, partitions):
  """Fills each partition's inputs (defined outside it) and outputs (read by a
  later partition or by the graph's outputs), in a deterministic order."""
  part_of = partition_index(partitions)
  graph_outs = {v.id for v in graph.outputs if not isinstance(v, Literal)}
  for part in partitions:
    seen = set()
    part.inputs = []
    for node in part.nodes:
      for value in node.inputs:
        if isinstance(value, Literal) or value.id in seen:
          continue
        if value.producer is None or part_of[value.producer.id] != part.index:
          seen.add(value.id)
          part.inputs.append(value)
    part.outputs = [out for node in part.nodes for out in node.outputs
                    if out.id in graph_outs
                    or any(part_of[user.id] != part.index for user in out.users)]
    part.may_fail = any(node_may_fail(n) for n in part.nodes)
    part.witnesses = divisor_witnesses(part, part_of, graph_outs) \
        if part.place == "device" else []
  return partitions


def divisor_witnesses(part, part_of, graph_outs):
  """The scalar inputs of device partition `part` that its divisors are made
  of (graph/divisors.py) and that another partition or the graph's outputs
  read too. XLA rewrites x / broadcast(s) as x * (1 / s) where s has one
  reader: in jax.jit's one executable s has those other readers, in the
  partition's it had one (a break-it find: (x / s, callback(s)) 1 ulp off);
  the executable returns it, and the plan drops it."""
  cone = divisor_cone(part.nodes)[1]  # (through a transfer: a host value moved here)
  return [v for v in part.inputs if v.id in cone and v.aval.shape == () and (
      v.id in graph_outs or any(part_of[u.id] != part.index for u in v.users))]


def partition_graph(graph):
  return compute_boundaries(graph, propose_partitions(graph))
