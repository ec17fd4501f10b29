"""Partitioning: split the placed node list into runs that execute together,
in the order they are launched.

Proposes partitions in one step (maximal runs of nodes with the same place, in
execution order), puts them in launch order and computes what crosses each
boundary. Each partition remembers why it was split off, for the report and
the dump.

The launch order: XLA dispatch is asynchronous - launching an executable
returns at once and the device works while Python goes on - so every device
partition goes as early as its inputs allow, before a host partition it does
not depend on (a host partition that reads nothing from it then runs while the
device works: runtime/streams.py). Partitions of one place that end up
adjacent are merged (one executable fewer). Decided here, in HardwareOptimize,
so that `partition_or_error` and every later stage see the final partitions
(AssignStream merged them after the check had counted the unmerged ones: a
review's find).
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


HOST_NOTE = "placed on host"  # how placement (optimizer_passes/placement.py) starts its notes


def placement_reason(node):
  """The rule that placed `node` on the host (its note), or None."""
  return next((note for note in node.notes if note.startswith(HOST_NOTE)), None)


def reason_for(part, previous):
  """Why `part` starts where it does: the node that opens it (the first that
  is not a transfer), its op, source line and the placement rule."""
  node = next((n for n in part.nodes if not is_transfer(n.op)),
              part.nodes[0])
  where = f" at {node.source}" if node.source else ""
  if previous is None:
    return f"first partition, opened by node {node.id} '{node.label}'{where}"
  why = (placement_reason(node)
         or "every node runs on the device unless a placement rule moves it")
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


def producers(partitions):
  """partition index -> indices of the partitions it reads from."""
  part_of = partition_index(partitions)
  return {part.index: {part_of[v.producer.id] for v in part.inputs
                       if v.producer is not None and part_of[v.producer.id] != part.index}
          for part in partitions}


def launch_order(partitions):
  """Partitions in launch order: the lowest ready device partition first,
  else the lowest ready host partition."""
  deps = producers(partitions)
  done, order = set(), []
  pending = list(partitions)
  while pending:
    ready = [p for p in pending if deps[p.index] <= done]
    device = [p for p in ready if p.place == "device"]
    chosen = (device or ready)[0]
    order.append(chosen)
    done.add(chosen.index)
    pending.remove(chosen)
  return order


def merge_adjacent(graph, order):
  """Partitions in launch order, adjacent ones of one place merged, each
  with its reason restated for its new position."""
  merged, moved = [], []
  for position, part in enumerate(order):
    if merged and merged[-1].place == part.place:
      merged[-1].nodes.extend(part.nodes)
      moved[-1] += f"; merged with {part.place} partition #{part.index} (launch order)"
    else:
      merged.append(part)
      moved.append("; launched ahead of host partition(s) it does not read from"
                   if part.index > position else "")
  for i, part in enumerate(merged):
    part.index = i
    part.reason = reason_for(part, merged[i - 1] if i else None) + moved[i]
  return compute_boundaries(graph, merged)


def partition_graph(graph):
  """The graph's partitions in launch order; graph.nodes follows it."""
  parts = compute_boundaries(graph, propose_partitions(graph))
  order = launch_order(parts)
  if [p.index for p in order] != list(range(len(order))):
    parts = merge_adjacent(graph, order)
    graph.nodes = [n for p in parts for n in p.nodes]
  return parts
