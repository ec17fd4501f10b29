"""AssignStream: the queue of each partition, the order they are launched in,
and which host work overlaps device work.

Two queues: the device queue (0) runs executables in launch order; the host
queue (1) is Python running host partitions. XLA dispatch is asynchronous:
launching an executable returns at once and the device works while Python
goes on. So the launch order puts every device partition as early as its
inputs allow - before a host partition it does not depend on - and a host
partition that reads nothing from a running device partition runs while the
device works. Partitions of one place that end up adjacent are merged (one
executable fewer). A device->host transfer is issued right after the
executable that makes its value (`copy_to_host_async`), so the copy runs while
other work does; it is async when something runs between the two.
"""
from jaxsession.graph.liveness import partition_index
from jaxsession.graph.op_properties import is_transfer
from jaxsession.runtime import partition as partitioning

DEVICE_QUEUE = 0
HOST_QUEUE = 1


def _producers(partitions):
  """partition index -> indices of the partitions it reads from."""
  part_of = partition_index(partitions)
  deps = {}
  for part in partitions:
    deps[part.index] = {part_of[v.producer.id] for v in part.inputs
                        if v.producer is not None and part_of[v.producer.id] != part.index}
  return deps


def launch_order(partitions):
  """Partitions in launch order: the lowest ready device partition first,
  else the lowest ready host partition."""
  deps = _producers(partitions)
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
    part.reason = partitioning.reason_for(part, merged[i - 1] if i else None) + moved[i]
  return partitioning.compute_boundaries(graph, merged)


def _ancestors(partitions):
  deps = _producers(partitions)
  seen = {}
  for part in partitions:  # launch order is topological
    seen[part.index] = set(deps[part.index])
    for dep in deps[part.index]:
      seen[part.index] |= seen[dep]
  return seen


def assign_streams(graph, partitions, platform="cpu"):
  """Reorders the partitions for launch, writes `stream` on every partition
  and node, the overlap on each host partition and the sync flag on each
  transfer; returns whether anything changed."""
  before = [n for p in partitions for n in p.nodes]
  order = launch_order(partitions)
  if [p.index for p in order] != list(range(len(order))):
    partitions = merge_adjacent(graph, order)
  graph.partitions = partitions
  graph.nodes = [n for p in partitions for n in p.nodes]
  ancestors = _ancestors(partitions)
  part_of = partition_index(partitions)
  changed = any(a is not b for a, b in zip(before, graph.nodes))
  for part in partitions:
    part.stream = HOST_QUEUE if part.place == "host" else DEVICE_QUEUE
    part.overlaps = [q.index for q in partitions[:part.index]
                     if part.place == "host" and q.place == "device"
                     and q.index not in ancestors[part.index]]
    part.prefetch = []
    overlap_note = (f"; reads nothing from device partition(s) {part.overlaps}: runs "
                    "while they compute")
    if part.overlaps and overlap_note not in part.reason:
      part.reason += overlap_note
    for node in part.nodes:
      changed |= node.stream != part.stream
      node.stream = part.stream
  for part in partitions:
    for node in part.nodes:
      if not is_transfer(node.op, "d2h"):
        continue
      value = node.inputs[0]
      made_in = part_of.get(value.producer.id) if value.producer is not None else None
      early = made_in is not None and made_in < part.index - 1
      node.params["sync"] = not early
      if made_in is not None and platform != "cpu":  # on CPU there is nothing to copy
        partitions[made_in].prefetch.append(value)
  return changed
