"""move_into_readers (HardwareOptimize): device arithmetic that only a later
device partition reads runs in that partition.

`t = a * b` before a host callback and `t + r` after it: jax.jit's one
executable fuses the multiply with the add, and XLA:CPU contracts them into
an FMA (one rounding); two executables round the product first (a break-it
find: a quarter to a half of the elements off, up to thousands of ulp near
zero; `log(exp(a))`, a division by a square root alike). So each device
node of elementwise arithmetic or of data movement XLA fuses through (a
broadcast, reshape, slice, transpose, pad, concatenate, gather; a nested jit
of those) whose readers all run in one later device partition moves into
that run, at the place its id (the user's order) takes among the run's nodes
where its readers allow; the latest nodes go first, so a chain moves whole.
Its inputs come before its old run, so the order stays valid, and it joins
a run of its own place: no partition is added (one it empties goes). XLA
then sees the chain between a partition's boundary values and its reader as
jax.jit's executable has it (tests/host_split_test.py). Each moved node says
so in its notes; the count is in `report.schedule`. A state leaf updated
there is donated to that partition, after the host work that may fail.

Required: exactness is not optional. Needs place_nodes and the final order
(after reorder_for_partitions), before insert_transfers.
"""
from jaxsession.graph.op_properties import moves_or_maps
from jaxsession.optimizer_passes.base import Pass, PassResult
from jaxsession.optimizer_passes.reorder import (ScheduleDecision, count_partitions,
                                                 order_peak, two_queue_order)


def _sinkable(node):
  """Elementwise arithmetic, or data movement XLA fuses through (a product
  broadcast, sliced, transposed or padded into an add still contracts into
  an FMA), or a nested jit of those alone (op_properties.moves_or_maps)."""
  return (node.place == "device" and not node.props.effects and not node.props.may_fail
          and moves_or_maps(node.op, node.params))


def move_into_readers(order):
  """`order` with each movable device node (`_sinkable`) whose readers all
  run in one later device partition moved into that run (latest nodes first,
  so a chain moves whole); (the new order, the moved nodes). The run and its
  new nodes go in the user's order (node ids) where their reads allow
  (`_merged`)."""
  phase, k = {}, 0
  for i, node in enumerate(order):
    if i and node.place != order[i - 1].place:
      k += 1
    phase[id(node)] = k
  into = {}  # phase -> the nodes moved into it
  for node in reversed(order):
    readers = [user for out in node.outputs for user in out.users]
    if not readers or not _sinkable(node) or any(r.place != "device" for r in readers):
      continue
    targets = {phase[id(user)] for user in readers}
    if len(targets) == 1 and next(iter(targets)) > phase[id(node)]:
      phase[id(node)] = targets.pop()
      into.setdefault(phase[id(node)], []).append(node)
  if not into:
    return order, []
  moved = {id(n) for nodes in into.values() for n in nodes}
  runs = {}  # phase -> its nodes that stay, in order (every target run keeps some)
  for node in order:
    if id(node) not in moved:
      runs.setdefault(phase[id(node)], []).append(node)
  out = []
  for q, run in runs.items():  # (dicts keep the phases' order)
    out.extend(_merged(run, into[q]) if q in into else run)
  return out, [n for n in order if id(n) in moved]


def _merged(run, moved):
  """`run` and the nodes `moved` into it, in a topological order that takes
  the smallest node id (the user's order) first among the ready ones
  (reorder.py's schedule over one place)."""
  return two_queue_order(sorted(run + moved, key=lambda n: n.id), "device")


class MoveIntoReaders(Pass):
  name = "move_into_readers"
  required = True  # jax.jit's bits across a host split

  def run(self, graph, ctx):
    order, moved = move_into_readers(graph.nodes)
    for node in moved:
      node.notes.append("moved into its readers' device partition, after the host work "
                        "before it: XLA fuses it with them as in jax.jit's one executable "
                        "(a multiply and an add contract into an FMA there)")
    if graph.schedule is None:  # reorder_for_partitions disabled: its decision, as kept
      count, peak = count_partitions(graph.nodes), order_peak(graph, graph.nodes)
      graph.schedule = ScheduleDecision("original", count, count, peak, peak,
                                        "reorder_for_partitions is disabled")
    graph.schedule.moved_into_readers = len(moved)
    if moved:
      graph.nodes = order
    return PassResult(bool(moved))
