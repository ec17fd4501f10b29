"""AssignStream: the queue of each partition and which host work overlaps
device work (the partitions' launch order is partition_nodes'; runtime/partition.py).

Two queues: the device queue (0) runs executables in launch order; the host
queue (1) is Python running host partitions. XLA dispatch is asynchronous, so
a host partition that reads nothing from a device partition launched before
it runs while the device works (`overlaps`). A device->host transfer is issued
right after the executable that makes its value (`copy_to_host_async`), so the
copy runs while other work does; it is async when something runs between the
two.
"""
from jaxsession.graph.liveness import partition_index
from jaxsession.graph.op_properties import is_transfer
from jaxsession.runtime import partition as partitioning

DEVICE_QUEUE = 0
HOST_QUEUE = 1


def _ancestors(partitions):
  deps = partitioning.producers(partitions)
  seen = {}
  for part in partitions:  # launch order is topological
    seen[part.index] = set(deps[part.index])
    for dep in deps[part.index]:
      seen[part.index] |= seen[dep]
  return seen


def assign_streams(graph, partitions, platform="cpu"):
  """Writes `stream` on every partition (in launch order since
  partition_nodes: runtime/partition.py) and node, the overlap on each host
  partition and the sync flag on each transfer; returns whether anything
  changed."""
  ancestors = _ancestors(partitions)
  part_of = partition_index(partitions)
  changed = False
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
