"""AllocateMemory: liveness of every value, state donation, peak estimate.

Liveness is measured in node positions (execution order). The peak is the
largest total of live bytes at any node; the lower bound is what any schedule
must hold at once (all graph inputs, or one node's operands and results).
Donation decisions are made per state leaf and each carries its reason.
"""
import dataclasses
from typing import Dict, List, Tuple

from jaxsession.ir import Literal, aval_bytes, aval_str


@dataclasses.dataclass
class DonationDecision:
  state: object          # the state input Value
  donated: bool
  partition: int         # the partition it is passed to (last reader), -1 if none
  reason: str


@dataclasses.dataclass
class MemoryPlan:
  live_ranges: Dict[int, Tuple[int, int]]   # value id -> (defined at, last used at)
  peak_bytes: int
  lower_bound_bytes: int
  donated_bytes: int
  donations: List[DonationDecision]

  def donated_ids(self):
    return {d.state.id for d in self.donations if d.donated}

  def describe(self):
    lines = [f"peak {self.peak_bytes} B (lower bound {self.lower_bound_bytes} B), "
             f"donated {self.donated_bytes} B"]
    for d in self.donations:
      lines.append(f"{d.state} ({d.state.name}, {aval_str(d.state.aval)}): "
                   f"{'donated' if d.donated else 'kept'} - {d.reason}")
    return lines


class MemoryReport(tuple):
  """`report.memory`: (peak bytes, donated bytes, lower bound), with names."""
  __slots__ = ()

  def __new__(cls, plan):
    return super().__new__(cls, (plan.peak_bytes, plan.donated_bytes,
                                 plan.lower_bound_bytes))

  peak_bytes = property(lambda self: self[0])
  donated_bytes = property(lambda self: self[1])
  lower_bound_bytes = property(lambda self: self[2])


def live_ranges(graph):
  """value id -> (position defined, last position used); inputs are defined at
  -1 and graph outputs live to len(nodes)."""
  end = len(graph.nodes)
  ranges = {v.id: (-1, -1) for v in graph.inputs}
  for pos, node in enumerate(graph.nodes):
    for value in node.inputs:
      if not isinstance(value, Literal):
        ranges[value.id] = (ranges[value.id][0], pos)
    for out in node.outputs:
      ranges[out.id] = (pos, pos)
  for value in graph.outputs:
    if not isinstance(value, Literal):
      ranges[value.id] = (ranges[value.id][0], end)
  return ranges


def peak_bytes(graph, ranges):
  """Largest sum of live bytes over the execution order (a sweep over events)."""
  size = {v.id: aval_bytes(v.aval) for v in graph.values()}
  delta = [0] * (len(graph.nodes) + 3)
  for vid, (start, stop) in ranges.items():
    stop = max(stop, start)  # a value nobody reads still occupies its slot once
    delta[start + 1] += size[vid]
    delta[stop + 2] -= size[vid]
  peak = live = 0
  for step in delta:
    live += step
    peak = max(peak, live)
  return peak


def lower_bound(graph):
  bound = sum(aval_bytes(v.aval) for v in graph.inputs)
  for node in graph.nodes:
    touched = {v.id: v for v in node.inputs if not isinstance(v, Literal)}
    touched.update((o.id, o) for o in node.outputs)
    bound = max(bound, sum(aval_bytes(v.aval) for v in touched.values()))
  return bound


def decide_donations(graph, partitions, allow=True):
  """For each state leaf: donate it to the last partition reading it, unless
  that would lose it on a failure or buys nothing. The reason is recorded."""
  part_of = {n.id: p.index for p in partitions for n in p.nodes}
  decisions = []
  updates = dict((s.id, new) for s, new in graph.state_updates())
  one_executable = len(partitions) == 1 and partitions[0].place == "device"
  for state in graph.inputs_of_kind("state"):
    new_value = updates.get(state.id, state)
    readers = sorted({part_of[u.id] for u in state.users})
    last = readers[-1] if readers else -1
    returned = _returned_as(graph, state, new_value)
    if not graph.updates_state:
      reason, donate = "the graph only reads the state (no new value returned)", False
    elif new_value is state:
      reason, donate = "read-only: the step returns it unchanged, no copy is made", False
    elif not allow:
      reason, donate = "donation switched off (SessionOptions.donate_state=False)", False
    elif not readers:
      reason, donate = "not read by any node: replaced by its new value", False
    elif returned and not one_executable:
      reason = (f"its old value is also returned ({returned}): between partitions a "
                "donated buffer would be handed out after it was consumed")
      donate = False
    elif any(p.may_fail for p in partitions[last:]):
      failing = next(p for p in partitions[last:] if p.may_fail)
      reason = (f"partition #{failing.index} can fail after the buffer is consumed "
                "(callback or host op); a failed run must leave the state as it was")
      donate = False
    else:
      reason = f"session-owned, updated in place by partition #{last}" + (
          f" (also returned {returned}: XLA copies it before the update)" if returned else "")
      donate = True
    decisions.append(DonationDecision(state, donate, last, reason))
  return decisions


def _returned_as(graph, state, new_value):
  """Where a state's old value is a graph output other than its own (unchanged)
  new value: as a user output or as another slot's new value."""
  num_updates = len(graph.state_updates())
  places = []
  for i, value in enumerate(graph.outputs):
    if value is state and not (value is new_value and i < num_updates):
      places.append(f"as the new value of state {i}" if i < num_updates
                    else f"as output {i - num_updates}")
  return ", ".join(places)


def plan_memory(graph, partitions, allow_donation=True):
  ranges = live_ranges(graph)
  donations = decide_donations(graph, partitions, allow_donation)
  return MemoryPlan(
      live_ranges=ranges,
      peak_bytes=peak_bytes(graph, ranges),
      lower_bound_bytes=lower_bound(graph),
      donated_bytes=sum(aval_bytes(d.state.aval) for d in donations if d.donated),
      donations=donations)
