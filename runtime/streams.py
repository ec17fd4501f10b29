"""AssignStream: which queue each partition (and each node) runs on.

One device queue today: XLA orders the work inside an executable, and the
executor dispatches partitions in order, so a second queue would only pay for
host partitions that overlap device work, which the executor does not do yet.
"""

DEVICE_QUEUE = 0
HOST_QUEUE = 1


def assign_streams(graph, partitions):
  """Writes `stream` on every partition and node; returns whether any changed."""
  changed = False
  for part in partitions:
    part.stream = HOST_QUEUE if part.place == "host" else DEVICE_QUEUE
    for node in part.nodes:
      changed |= node.stream != part.stream
      node.stream = part.stream
  return changed
