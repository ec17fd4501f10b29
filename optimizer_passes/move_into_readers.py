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

A node that stays (a callback, or device work before it, reads it too) is
copied into a later device partition where jax.jit's XLA would see through
it to its readers there (`_seen_through`). XLA's simplifier rewrites an op
through its operand's maker whatever else reads that: a division by a
division, an exp or a power, a division of a division, a power of an exp,
a log of an exp or a power, a product of exps (`(a / b) / c` to
`a / (b * c)`, `log(exp(z))` to `z`: 1-3 ulp off, and a nan where exp
underflows). XLA's fusion recomputes cheap arithmetic reading one array (a
subtraction of a broadcast max, `x * x`, `x * 2`) in each elementwise
reader, where a product then contracts with an add into an FMA, and a sum
after it is another loop. The copy reads the node's inputs and computes
what it computes; those readers read the copy (the others the value as
computed before: an exp that a sum reads too is computed once in jax.jit's
executable), so the partition's executable holds the chain as jax.jit's
does. Each copy says so in its notes; the count is in `report.schedule`.
Not copied: a node that divides by a scalar, reads or makes a scalar
divisor, whose rewrite follows how many read the scalar (graph/divisors.py);
a fused op or x ** 3 (XLA computes them once); under a mesh, a fusion's
copy of a value that is not replicated (`_replicated_values`).

Required: exactness is not optional. Needs place_nodes and the final order
(after reorder_for_partitions), before insert_transfers.
"""
import numpy as np

from jaxsession.graph.divisors import divisor_cone
from jaxsession.graph.ir import Literal, Value
from jaxsession.graph.op_properties import facts, moves_or_maps
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
  phase = _phases(order)
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


def _phases(order):
  """id(node) -> the index of its run of one place along `order`."""
  phase, k = {}, 0
  for i, node in enumerate(order):
    if i and node.place != order[i - 1].place:
      k += 1
    phase[id(node)] = k
  return phase


def _made_by(value, *ops):
  return isinstance(value, Value) and value.producer is not None and value.producer.op in ops


def _duplicated(node):
  """Whether XLA's fusion copies `node` into each of its readers: cheap
  elementwise arithmetic (not a transcendental XLA:CPU approximates: those
  it computes once) reading at most one array of its own rank that is not a
  broadcast (literals and lower-rank operands become broadcasts), or no
  more bytes than it writes (`x * x`)."""
  fact = facts(node.op)
  if node.prim is None or not fact.elementwise or fact.approximated:
    return False  # (a fused op, GeluTanh: a tanh inside; a review's find)
  out = node.outputs[0].aval
  if node.op == "integer_pow" and (node.params.get("y") != 2 or not
                                   np.issubdtype(out.dtype, np.floating)):
    return False  # x ** 3 is two products, XLA keeps them apart; z ** -1 divides
  full = {id(v): v for v in node.inputs if isinstance(v, Value) and v.aval.ndim == out.ndim
          and not _made_by(v, "broadcast_in_dim", "iota")}
  return len(full) <= 1 or sum(v.aval.size for v in full.values()) <= out.size


def _rewritten(reader, value):
  """Whether jax.jit's XLA simplifier rewrites `reader` through the node that
  makes `value` (algebraic_simplifier's divide/power/log/multiply rules on
  an operand's producer)."""
  op, at = value.producer.op, [i for i, v in enumerate(reader.inputs) if v is value]
  return ((reader.op == "div" and ((1 in at and op in ("div", "exp", "pow"))
                                   or (0 in at and op == "div")))
          or (reader.op == "pow" and 0 in at and op == "exp")
          or (reader.op == "log" and op in ("exp", "pow"))
          or (reader.op == "mul" and op == "exp"
              and all(_made_by(v, "exp") for v in reader.inputs)))


def _seen_through(reader, value):
  """Whether jax.jit's XLA rewrites (`_rewritten`) or fuses `reader` through
  the node that makes `value` (the fusion's copies of cheap arithmetic into
  an elementwise reader, `_duplicated`)."""
  if not np.issubdtype(value.aval.dtype, np.inexact):
    return False
  at = [i for i, v in enumerate(reader.inputs) if v is value]
  if reader.op == "div" and 1 in at and value.producer.op in ("sqrt", "rsqrt"):
    return False  # a / sqrt(b) becomes a * rsqrt(b) only where sqrt(b) has one reader
  return _rewritten(reader, value) or (facts(reader.op).elementwise
                                       and _duplicated(value.producer))


def _divisor_values(graph):
  """The ids of the values a divisor is made of (graph/divisors.py)."""
  nodes, outside = divisor_cone(graph.nodes)
  return outside | {out.id for node in graph.nodes if node.id in nodes for out in node.outputs}


def _copyable(node, readers, divisors):
  """Not a node reading a scalar (a lower-rank value XLA broadcasts) that
  is a divisor or that it divides by, nor one making such a scalar divisor:
  XLA rewrites x / broadcast(s) by how many read s (graph/divisors.py), and
  a copy adds readers on both sides, or leaves the copy one (a review's
  find: exp(sum(x)) divided by and logged)."""
  out = node.outputs[0]
  rank = out.aval.ndim
  if out.id in divisors and any(r.outputs and r.outputs[0].aval.ndim > rank for r in readers):
    return False
  return not any(isinstance(v, Value) and v.aval.ndim < rank
                 and (node.op == "div" or v.id in divisors) for v in node.inputs)


def _replicated_values(graph):
  """Under a mesh, the ids of the values whole on every device: replicated
  inputs and constants, and elementwise arithmetic and data movement of
  such values. jax.jit's SPMD program recomputes such a value in its readers
  as a single device's does; a sharded one it computes once, gathered for
  the callback (a review's find: x * 3 of a sharded x copied into a later
  add was 1 ulp off, of a replicated x not copied too)."""
  known = {v.id for v in graph.inputs if (v.sharding.is_fully_replicated if v.sharding
                                          is not None else v.kind == "const")}
  for node in graph.nodes:
    whole = moves_or_maps(node.op, node.params) and all(
        isinstance(v, Literal) or v.id in known for v in node.inputs)
    for out in node.outputs:
      if out.sharding.is_fully_replicated if out.sharding is not None else whole:
        known.add(out.id)
  return known


def copy_into_readers(graph):
  """Copies each staying device node (`_sinkable`) into every later device
  run where one of its readers sees through it (`_seen_through`), before
  that run's first reader, and points those readers at the copy; the
  latest nodes first, so a copy's own inputs are seen with it as a reader.
  Returns the copies."""
  copies, work = [], list(graph.nodes)
  phase, divisors, replicated = _phases(graph.nodes), None, None
  while work:
    node = work.pop()
    if not _sinkable(node) or len(node.outputs) != 1:
      continue
    value = node.outputs[0]
    later = {}
    for user in value.users:
      if user.place == "device" and phase[id(user)] > phase[id(node)]:
        later.setdefault(phase[id(user)], []).append(user)
    for q, readers in later.items():
      readers = [r for r in readers if _seen_through(r, value)]
      if not readers:
        continue
      if divisors is None:
        divisors = _divisor_values(graph)
      if not _copyable(node, readers, divisors):
        continue
      if graph.mesh is not None and not all(_rewritten(r, value) for r in readers):
        if replicated is None:
          replicated = _replicated_values(graph)
        if value.id not in replicated:  # a fusion's copy: as a single device's only
          continue
      copy = graph.make_node(node.op, node.prim, node.params, node.inputs,
                             [value.aval], node.effects, node.source)
      copy.kernel, copy.place, copy.stream = node.kernel, node.place, node.stream
      copy.notes.append(f"a copy of node {node.id} '{node.op}' (read before the host work "
                        "too) in its readers' device partition: XLA rewrites or fuses them "
                        "through it as in jax.jit's one executable")
      first = min(graph.nodes.index(r) for r in readers)
      graph.insert_node(first, copy)
      phase[id(copy)] = q
      for reader in readers:
        reader.inputs = [copy.outputs[0] if v is value else v for v in reader.inputs]
        copy.outputs[0].users.append(reader)
      value.users = [u for u in value.users if u not in readers]
      copies.append(copy)  # (its inputs' makers come later in `work`: seen with it)
    if not value.users and not any(o is value for o in graph.outputs):
      graph.remove_node(node)  # read by later runs alone, each now by its copy
  return copies


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
    copies = copy_into_readers(graph)
    graph.schedule.copied_into_readers = len(copies)
    return PassResult(bool(moved or copies))
