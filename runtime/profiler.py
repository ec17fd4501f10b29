"""The profiler: where every microsecond of a run goes.

Paddle's profiler found the seed issue's 73% framework overhead with two
tables; this one records the same things for a Session:
  * every run: the graph, its steps (None or N), start and end;
  * every partition execution: start and end of the host-side call, which
    waits for the partition's outputs (`block_until_ready`), so a device
    partition's time includes its device work - measured only here, since
    blocking serialises what would otherwise overlap;
  * every transfer: one per run of the partition it belongs to (a d2h on CPU
    is elided from the plan, yet still counted: it happens logically), and
    its time where it runs as a step of its own;
  * every compile: the time of each stage and pass, Build, and the rest;
  * at each partition boundary, the live device bytes: the allocator's
    `bytes_in_use` where the device reports it (the overhead table shows
    that time as the profiler's), else - on CPU - the memory plan's bytes
    after that partition, which the executor holds (read at no cost).
Partitions run under `jax.profiler.TraceAnnotation("jaxsession graph G
partition K")`, so JAX's own profiler shows them by name.

Wiring: with `SessionOptions(enable_profiling=True)` (or a Profiler given
as `sess.profiler` before compile), Build wraps each op's function in its
timing once (`GraphHooks.timed`) and the Session wraps the runner's call in
a run record; a graph compiled unprofiled runs exactly the code it ran
before. The hot path appends plain tuples to lists; names, tables and
traces are made when asked.

    sess = Session(SessionOptions(enable_profiling=True))
    gid = sess.compile(step, ...)
    ...
    sess.profiler.summary()
    sess.profiler.export_chrome_trace("trace.json")  # open in https://ui.perfetto.dev
"""
import collections
import json
import os
import threading
import time
from typing import NamedTuple, Optional

import jax

from jaxsession.errors import InputError
from jaxsession.graph import op_properties
from jaxsession.graph.ir import aval_bytes
from jaxsession.runtime import memory

now = time.perf_counter_ns
thread_of = threading.get_ident
QUEUE_NAMES = {0: "device queue", 1: "host queue"}  # runtime/streams.py's queues
RUN_TRACK, COMPILE_TRACK = 100, 101                 # trace tids besides the queues
THREAD_TRACKS = 1000  # another thread's runs and queues: tids offset by this per thread


class TransferInfo(NamedTuple):
  """A transfer node of a graph (the row `report.transfers` lists)."""
  index: int           # position among the graph's transfers, in node order
  direction: str       # "d2h" or "h2d"
  bytes: int
  value: str           # the value moved, as the dump names it ("%12")
  caused_by: int       # the node id that made it necessary
  node: int            # the transfer node's id


class PartitionInfo(NamedTuple):
  index: int
  place: str           # "device" or "host"
  stream: int          # the queue it runs on
  nodes: tuple         # node ids
  transfers: tuple     # TransferInfo of its transfer nodes


class RunRecord(NamedTuple):
  graph_id: int
  name: str
  steps: Optional[int]  # None: one step; N: a loop-sunk run
  start_ns: int
  end_ns: int


class PartitionRecord(NamedTuple):
  graph_id: int
  partition: int
  place: str
  stream: int
  start_ns: int
  end_ns: int           # after its outputs were ready
  live_bytes: Optional[int]  # live device bytes after it (None: not sampled)


class TransferRecord(NamedTuple):
  graph_id: int
  partition: int
  direction: str
  bytes: int
  value: str
  caused_by: int
  start_ns: Optional[int]  # None: no time of its own (zero-copy, or copied
  end_ns: Optional[int]    # in by the executable's call)


class CompileRecord(NamedTuple):
  graph_id: int
  name: str
  passes: tuple         # (stage, pass name, seconds), in the order they ran
  build_seconds: float
  total_seconds: float
  end_ns: int


class GraphInfo(NamedTuple):
  name: str
  partitions: dict      # index -> PartitionInfo
  timed: set            # indices of transfers timed as steps of their own


def describe_graph(graph):
  """{partition index: PartitionInfo} from a built KernelGraph; transfers
  are numbered in node order, as `list_transfers` lists them."""
  parts, count = {}, 0
  for part in graph.partitions:
    moves = []
    for node in part.nodes:
      if op_properties.is_transfer(node.op):
        moves.append(TransferInfo(count, op_properties.facts(node.op).transfer, aval_bytes(node.inputs[0].aval),
                                  repr(node.inputs[0]), node.params["caused_by"], node.id))
        count += 1
    stream = 0 if part.stream is None else part.stream
    parts[part.index] = PartitionInfo(part.index, part.place, stream,
                                      tuple(n.id for n in part.nodes), tuple(moves))
  return parts


class GraphHooks:
  """What Build wraps a profiled graph's ops in, once (runtime/build.py):
  `timed(fn, k, ...)` times op function `fn` of partition k, and
  `run_call(call, steps)` wraps a runner's call in a run record. The graph
  id comes after Build, with `bind(graph_id)`."""

  def __init__(self, profiler, graph_id, name, graph):
    self.profiler = profiler
    self.graph_id = graph_id
    self.name = name
    self.info = GraphInfo(name, describe_graph(graph), set())
    self.transfer_index = {m.node: m.index for p in self.info.partitions.values()
                           for m in p.transfers}
    planned = (memory.bytes_live_after(graph, profiler.platform) if profiler.planned_memory
               else None)
    self.live = lambda k: planned[k] if planned and k < len(planned) else None
    self._open = _Open()  # this thread's running partition
    if graph_id is not None:
      self.bind(graph_id)

  def bind(self, graph_id):
    self.graph_id = graph_id
    self.profiler.graphs[graph_id] = self.info

  def annotation(self, k):
    """The TraceAnnotation name of partition k, as JAX's profiler shows it."""
    return f"jaxsession graph {self.graph_id} partition {k}"

  def run_call(self, call, steps):
    """`call` (a runner's) with a run record around it, failed runs too."""
    runs = self.profiler.raw_runs

    def profiled_run(args):
      start = now()
      try:
        return call(args)
      finally:  # a failed run took its time too
        runs.append((self.graph_id, steps, start, now(), thread_of()))
    return profiled_run

  def timed(self, fn, k, first, last, device, transfer=None):
    """Op function `fn` of partition k, timed: the first op of the partition
    notes its start and enters its annotation (only while JAX's profiler
    traces: outside a trace it would record nothing and costs ~0.3 µs); a
    device op waits for its outputs (one of them: an execution makes them
    ready together), so its time includes the device work; a transfer node
    (`transfer`: its node id) that runs as an op of its own is timed on its
    own; the last op records the partition, with the live device bytes
    after it (the allocator's, or the memory plan's)."""
    if k not in self.info.partitions:  # a graph without nodes: nothing to time
      return fn
    profiler, hooks, state = self.profiler, self, self._open
    parts, moves, sample = profiler.raw_partitions, profiler.raw_transfers, profiler.live_bytes
    live, first_out = self.live(k), [None]
    move = self.transfer_index.get(transfer)
    if move is not None:
      self.info.timed.add(move)

    def close(own):
      annotation, state.annotation = own or state.annotation, None
      if annotation is not None:
        annotation.__exit__(None, None, None)

    # the partition's start and annotation: locals where one op is the whole
    # partition (the usual case), else this thread's _Open (~0.4 µs more)
    def timed_op(*args):  # wait and close inlined where they do nothing: ~0.2 µs a partition
      annotation = None
      if first:
        begun = now()
        if trace_active():
          annotation = jax.profiler.TraceAnnotation(hooks.annotation(k))
          annotation.__enter__()
        if not last:
          state.start, state.annotation = begun, annotation
      try:
        if move is None:
          outs = fn(*args)
          if device:
            if first_out[0] is _ITSELF:
              outs.block_until_ready()
            else:
              wait(outs, first_out)
        else:
          start = now()
          outs = fn(*args)
          wait(outs, first_out)
          moves.append((hooks.graph_id, move, start, now(), thread_of()))
      except BaseException:
        close(annotation)
        raise
      if last:
        if not first:
          begun, annotation, state.annotation = state.start, state.annotation, None
        if annotation is not None:
          annotation.__exit__(None, None, None)
        end = now()
        if sample is None:
          parts.append((hooks.graph_id, k, begun, end, live, 0, thread_of()))
        else:  # the sample's own time is the profiler's
          parts.append((hooks.graph_id, k, begun, end, sample(), now() - end, thread_of()))
      return outs
    return timed_op


try:  # whether JAX's profiler is tracing now (TraceAnnotation records only then)
  from jax._src.profiler import _profiler as _xla_profiler  # pylint: disable=g-import-not-at-top
  trace_active = _xla_profiler.TraceMe.is_enabled  # a C++ call, ~0.04 µs
except (ImportError, AttributeError):  # an internal API: always annotate
  def trace_active():
    return True

class _Open(threading.local):
  """A thread's running partition of several ops: its start and its
  TraceAnnotation. The class attributes are every thread's defaults, read
  without the exception a getattr default costs (~0.5 µs, profiler.py)."""
  start = 0
  annotation = None


_ITSELF, _NONE = object(), object()  # getters: the outputs are one array; none is


def _one_array(outs):
  """A getter of one jax.Array among an executable's outputs (a pytree of
  tuples and lists, the same every call): _ITSELF when `outs` is one,
  _NONE when it has none."""
  stack = [((), outs)]
  while stack:
    where, x = stack.pop(0)
    if isinstance(x, jax.Array):
      if not where:
        return _ITSELF
      # o[i][j]...: one expression, no loop (the indices are ints)
      index = "".join(f"[{int(i)}]" for i in where)
      return eval(f"lambda o: o{index}")  # pylint: disable=eval-used
    if isinstance(x, (tuple, list)):
      stack[:0] = [(where + (i,), y) for i, y in enumerate(x)]
  return _NONE


def wait(outs, first):
  """Blocks until an executable's outputs are ready. One execution makes
  them, and they are ready together, so one array is waited for (on ready
  outputs jax.block_until_ready of the whole pytree costs ~2 µs, one array's
  own block_until_ready ~0.8). `first` ([getter]) caches which array."""
  get = first[0]
  if get is None:
    get = first[0] = _one_array(outs)
  if get is _ITSELF:
    outs.block_until_ready()
  elif get is not _NONE:
    try:
      x = get(outs)
    except (IndexError, TypeError, KeyError):  # not the structure seen first
      jax.block_until_ready(outs)
    else:
      x.block_until_ready()


def _allocator_bytes_fn(platform):
  """fn() -> live device bytes from the allocator (GPU, TPU: O(1)), or None
  where the device keeps no such count (CPU)."""
  device = jax.devices(platform)[0] if platform else jax.devices()[0]
  try:
    stats = device.memory_stats()
  except Exception:  # a backend without it
    stats = None
  if stats and "bytes_in_use" in stats:
    memory_stats = device.memory_stats
    return lambda: memory_stats()["bytes_in_use"]
  return None


class Profiler:
  """Records runs, partitions, transfers and compiles of the graphs whose
  runners carry its hooks; `summary()` and `export_chrome_trace(path)`
  present them.

  enabled: `graph_hooks` returns None and `record_compile` records nothing
    when False, so a Session wires the same way whether it profiles or not.
  sample_memory: a live device bytes counter at each partition boundary
    (the trace's counter track): the allocator's count where the device has
    one, the memory plan's figure on CPU; or a function () -> bytes, called
    after each partition.
  platform: the backend whose memory is sampled (default: jax's).
  """

  def __init__(self, enabled=False, sample_memory=True, platform=None):
    self.enabled = enabled
    # The counter track: the allocator's count where the device keeps one;
    # on CPU the memory plan's bytes after each partition (a sum over
    # jax.live_arrays() would cost ~0.1 µs per live array per partition).
    self.live_bytes = (sample_memory if callable(sample_memory) else
                       _allocator_bytes_fn(platform) if sample_memory else None)
    self.planned_memory = sample_memory and self.live_bytes is None
    self.platform = platform or jax.default_backend()
    self.graphs = {}          # graph id -> GraphInfo
    self.raw_runs = []        # (gid, steps, start, end, thread)
    self.raw_partitions = []  # (gid, partition, start, end, live bytes, sampling ns, thread)
    self.raw_transfers = []   # (gid, transfer index, start, end, thread): timed ones
    self.raw_compiles = []    # CompileRecord

  def graph_hooks(self, graph_id, name, graph):
    """The hooks Build wraps this graph's ops in (None when the profiler is
    off); `graph_id` may come later, by `bind`."""
    if not self.enabled:
      return None
    return GraphHooks(self, graph_id, name, graph)

  def record_compile(self, graph_id, name, pass_records, build_seconds, total_seconds):
    """One compile: its passes (PassRecord: .stage, .name, .seconds),
    Build's seconds and the whole compile's, recorded as it ends."""
    if not self.enabled:
      return
    passes = tuple((r.stage, r.name, r.seconds) for r in pass_records)
    self.raw_compiles.append(CompileRecord(graph_id, name, passes, build_seconds,
                                           total_seconds, now()))

  def reset(self):
    """Forgets every record (the graphs' descriptions stay: their ops keep
    their timing)."""
    for records in (self.raw_runs, self.raw_partitions, self.raw_transfers,
                    self.raw_compiles):
      records.clear()  # in place: the hooks append to these lists

  # -- records, named ------------------------------------------------------
  def _name(self, gid):
    info = self.graphs.get(gid)
    return info.name if info else "?"

  def runs(self):
    return [RunRecord(gid, self._name(gid), steps, s, e)
            for gid, steps, s, e, _ in list(self.raw_runs)]

  def partitions(self):
    out = []
    for gid, k, s, e, live, *_ in list(self.raw_partitions):
      part = self.graphs[gid].partitions[k]
      out.append(PartitionRecord(gid, k, part.place, part.stream, s, e, live))
    return out

  def transfers(self):
    """Every transfer executed: the timed ones with their times, the others
    once per execution of their partition, without a time of their own."""
    where = {(gid, m.index): (part.index, m) for gid, info in self.graphs.items()
             for part in info.partitions.values() for m in part.transfers}
    out = []
    for gid, i, s, e, _ in list(self.raw_transfers):
      k, m = where[gid, i]
      out.append(TransferRecord(gid, k, m.direction, m.bytes, m.value, m.caused_by, s, e))
    for gid, k, *_ in list(self.raw_partitions):
      info = self.graphs[gid]
      for m in info.partitions[k].transfers:
        if m.index not in info.timed:
          out.append(TransferRecord(gid, k, m.direction, m.bytes, m.value, m.caused_by,
                                    None, None))
    return out

  def compiles(self):
    return list(self.raw_compiles)

  # -- presentation ---------------------------------------------------------
  def summary(self, echo=True):
    """Paddle-style tables - overhead, transfers, events - as a string,
    also printed (to stdout) unless `echo` is False."""
    text = "\n\n".join([self._overhead_table(), self._transfer_table(),
                        self._event_table()])
    if echo:
      print(text)
    return text

  def _overhead_table(self):
    runs = self.runs()
    total = sum(r.end_ns - r.start_ns for r in runs)
    by_place = collections.Counter()
    for p in self.partitions():
      by_place[p.place] += p.end_ns - p.start_ns
    device, host = by_place["device"], by_place["host"]
    sampling = sum(p[5] for p in list(self.raw_partitions))
    rows = [("total run time", len(runs), total),
            ("  device compute", None, device),
            ("  host compute", None, host),
            ("  framework overhead", None, total - device - host - sampling)]
    if sampling:  # not the framework's: the profiler's own cost
      rows.append(("  profiler: live-bytes samples", None, sampling))
    body = [(what, "" if n is None else n, _us(t), _pct(t, total)) for what, n, t in rows]
    steps = sum(r.steps or 1 for r in runs)
    return _table(f"Overhead summary ({len(runs)} runs, {steps} steps, "
                  f"{len({r.graph_id for r in runs})} graphs; device time includes "
                  "waiting for each device partition's outputs)",
                  ["what", "runs", "total µs", "ratio"], body)

  def _transfer_table(self):
    rows = []
    moves = self.transfers()
    for direction in ("d2h", "h2d"):
      picked = [m for m in moves if m.direction == direction]
      timed = [m.end_ns - m.start_ns for m in picked if m.start_ns is not None]
      rows.append((direction, len(picked), sum(m.bytes for m in picked), len(timed),
                   _us(sum(timed)), _us(sum(timed) / len(timed)) if timed else "-"))
    return _table("Transfer summary (a transfer without a time of its own is zero-copy "
                  "(d2h on CPU) or copied in by the executable's call (h2d))",
                  ["direction", "count", "bytes", "timed", "time µs", "mean µs"], rows)

  def _event_table(self):
    runs_total = sum(r.end_ns - r.start_ns for r in self.runs())
    events = collections.defaultdict(list)
    for p in self.partitions():
      key = (f"graph {p.graph_id} '{self._name(p.graph_id)}' / partition {p.partition} "
             f"({p.place}, {QUEUE_NAMES.get(p.stream, p.stream)})")
      events[key].append(p.end_ns - p.start_ns)
    rows = [_event_row(k, ts, runs_total) for k, ts in events.items()]
    stages = collections.defaultdict(list)
    compile_total = 0
    for c in self.raw_compiles:
      compile_total += int(c.total_seconds * 1e9)
      for stage, seconds in _stage_seconds(c):
        stages[stage].append(int(seconds * 1e9))
    rows += [_event_row(f"compile / {stage}", ts, compile_total)
             for stage, ts in stages.items()]
    return _table("Event summary (partition ratios: of the total run time; compile "
                  "stages: of the total compile time)",
                  ["event", "calls", "total µs", "min µs", "max µs", "mean µs", "ratio"],
                  rows)

  def export_chrome_trace(self, path):
    """Writes the records as Chrome trace-event JSON (Perfetto opens it):
    runs, partitions on their queue's track, timed transfers, compile stages
    and passes, and a counter track of live device bytes. Runs from several
    threads get tracks of their own (the first thread's are "runs" and the
    queues'), so concurrent runs never overlap on one track. `path`: a file
    name; one that cannot be written is an InputError, and nothing is
    written then."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
      raise InputError(f"export_chrome_trace: path must be a file name (str or "
                       f"os.PathLike), got {path!r}")
    threads = {}  # thread ident -> track group, in order of first record

    def group(thread):
      return threads.setdefault(thread, len(threads)) * THREAD_TRACKS
    runs = list(self.raw_runs)
    for *_, thread in sorted(runs, key=lambda r: r[2]):
      group(thread)
    events = []
    for gid, k, s, e, live, _, thread in list(self.raw_partitions):
      part = self.graphs[gid].partitions[k]
      events.append(_slice(f"graph {gid} '{self._name(gid)}' / partition {k}", "partition",
                           group(thread) + part.stream, s, e, {
          "graph": gid, "name": self._name(gid), "place": part.place, "nodes": part.nodes,
          "transfers": [f"{m.direction} {m.value} {m.bytes} B (node {m.node}, caused by "
                        f"node {m.caused_by})" for m in part.transfers]}))
      if live is not None:
        events.append({"ph": "C", "name": "live device bytes", "pid": 1, "ts": e,
                       "args": {"bytes": live}})
    for gid, steps, s, e, thread in runs:
      events.append(_slice(f"graph {gid} run", "run", group(thread) + RUN_TRACK, s, e,
                           {"graph": gid, "name": self._name(gid), "steps": steps}))
    where = {(gid, m.index): (part.stream, m) for gid, info in self.graphs.items()
             for part in info.partitions.values() for m in part.transfers}
    for gid, i, s, e, thread in list(self.raw_transfers):
      stream, m = where[gid, i]
      events.append(_slice(f"graph {gid} / transfer {m.direction} {m.value}", "transfer",
                           group(thread) + stream, s, e,
                           {"bytes": m.bytes, "caused_by": m.caused_by}))
    for c in self.raw_compiles:
      events.extend(_compile_slices(c))
    origin = min((ev["ts"] for ev in events), default=0)
    for ev in events:  # ns -> the format's µs; a slice's end rebased alike, so slices
      ev["ts"] = (ev["ts"] - origin) / 1e3  # laid end to end share their boundary exactly
      if "dur" in ev:
        ev["dur"] = (ev["dur"] - origin) / 1e3 - ev["ts"]
    tracks = [(RUN_TRACK, "runs"), *QUEUE_NAMES.items()]
    named = [(g * THREAD_TRACKS + tid, name if g == 0 else f"{name} (thread {g + 1})")
             for g in sorted(threads.values()) for tid, name in tracks] or tracks
    named.append((COMPILE_TRACK, "compile"))
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "jaxsession"}}]
    for order, (tid, name) in enumerate(named):
      meta.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid,
                   "args": {"name": name}})
      meta.append({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": tid,
                   "args": {"sort_index": order}})
    text = json.dumps({"traceEvents": meta + events, "displayTimeUnit": "ns"})
    try:
      with open(path, "w") as f:
        f.write(text)
    except OSError as exc:
      raise InputError(f"export_chrome_trace: cannot write {os.fspath(path)!r}: "
                       f"{type(exc).__name__}: {exc.strerror or exc}") from None


def _slice(name, cat, tid, start_ns, end_ns, args):
  """A complete ("X") event; ts and dur hold the start and end in ns until
  export rebases them to µs (dur then the duration)."""
  return {"ph": "X", "name": name, "cat": cat, "pid": 1, "tid": tid, "ts": start_ns,
          "dur": end_ns, "args": args}


def _stage_seconds(record):
  """[(stage, seconds)] of one compile: its pipeline stages in order, Build,
  and the rest (tracing, import, the report)."""
  stages = {}
  for stage, _, seconds in record.passes:
    stages[stage] = stages.get(stage, 0.0) + seconds
  stages["Build"] = record.build_seconds
  rest = record.total_seconds - sum(stages.values())
  return [("trace, import and the rest", max(rest, 0.0))] + list(stages.items())


def _compile_slices(record):
  """The compile's slices on the compile track, laid end to end from its
  durations (only the durations are recorded): the compile, each stage,
  each pass inside its stage."""
  end = record.end_ns
  start = end - int(record.total_seconds * 1e9)
  gid = record.graph_id
  out = [_slice(f"graph {gid} compile", "compile", COMPILE_TRACK, start, end,
                {"graph": gid, "name": record.name})]
  at = start
  passes = collections.defaultdict(list)
  for stage, name, seconds in record.passes:
    passes[stage].append((name, seconds))
  for stage, seconds in _stage_seconds(record):
    length = int(seconds * 1e9)
    out.append(_slice(f"graph {gid} compile / {stage}", "compile", COMPILE_TRACK, at,
                      at + length, {}))
    inner = at
    for name, pass_seconds in passes.get(stage, ()):
      out.append(_slice(f"graph {gid} {stage} / {name}", "pass", COMPILE_TRACK, inner,
                        inner + int(pass_seconds * 1e9), {}))
      inner += int(pass_seconds * 1e9)
    at += length
  return out


def _event_row(name, times, whole):
  total = sum(times)
  return (name, len(times), _us(total), _us(min(times)), _us(max(times)),
          _us(total / len(times)), _pct(total, whole))


def _us(ns):
  return f"{ns / 1e3:.1f}"


def _pct(part, whole):
  return f"{part / whole:.1%}" if whole else "-"


def _table(title, headers, rows):
  rows = [[str(c) for c in row] for row in rows]
  widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
  rule = "-" * (sum(widths) + 2 * (len(widths) - 1))

  def line(cells):
    return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                     for i, (c, w) in enumerate(zip(cells, widths)))
  return "\n".join([title, rule, line(headers), rule] + [line(r) for r in rows] + [rule])
