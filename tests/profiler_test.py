"""The profiler (runtime/profiler.py): records of runs, partitions, transfers
and compiles, the summary tables, the Chrome trace, and the op wrapping -
on small programs whose results still match jax.jit bit for bit, profiled
or not. No timing is asserted: these machines are shared and noisy."""
import json
import os
import re
import tempfile
import time

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsession as js
from jaxsession.errors import HostOpError
from jaxsession.runtime import profiler as profiler_lib
from jaxsession.runtime.profiler import Profiler

from exact import assert_same_bits
from subproc import run_json

RNG = np.random.default_rng(8)


def _f32(*shape):
  return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


def _host_affine(a):
  return (np.asarray(a) * np.float32(0.5) - np.float32(1.25)).astype(np.float32)


def _cb(fn, x):
  return jax.pure_callback(fn, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def chain(x):
  """device -> host -> device: three partitions, a d2h and an h2d."""
  return jnp.cos(_cb(_host_affine, jnp.sin(x) * 3.0)) + x


def single(x):
  return jnp.tanh(x) * 2.0 + 1.0


def stateful_step(w, x):
  new = w * 0.9 + x
  return new, jnp.sum(new * x)


def stateful_chain(w, x):
  """A training step with a callback: several partitions and state."""
  h = _cb(_host_affine, jnp.sin(w * x))
  new = w - 0.1 * jnp.cos(h)
  return new, jnp.sum(new)


def host_made_state(w, x):
  """The new state is a callback's result with no device reader: a
  host-placed h2d (jax.device_put), a transfer that runs as a step of its own."""
  return _cb(_host_affine, w), x * 2.0


def _hlo(exe):
  """An executable's HLO instructions, without source metadata."""
  text = exe.as_text().split("\nFileNames")[0]
  return re.sub(r", metadata=\{[^}]*\}", "", text)


def profiled(prof=None):
  """(a Session whose graphs report to `prof`, prof): a Profiler given as
  `sess.profiler` before compile is the one the graphs' ops are wrapped for."""
  sess, prof = js.Session(), prof or Profiler(enabled=True)
  sess.profiler = prof
  return sess, prof


def profiled_runs(fn, x, runs):
  """A fresh profiler over `runs` runs of fn(x) compiled in a fresh Session."""
  sess, prof = profiled()
  gid = sess.compile(fn, x)
  for _ in range(runs):
    sess.run(gid, x)
  return prof


class RecordsTest(absltest.TestCase):

  def test_partition_and_transfer_counts_match_the_graph(self):
    sess, prof = profiled()
    x = _f32(16)
    gid = sess.compile(chain, x)
    runs = 5
    for _ in range(runs):
      sess.run(gid, x)
    graph, report = sess.graph(gid), sess.report(gid)
    self.assertLen(prof.runs(), runs)
    self.assertEqual({(r.graph_id, r.name, r.steps) for r in prof.runs()},
                     {(gid, "chain", None)})
    parts = prof.partitions()
    self.assertLen(parts, len(graph.partitions) * runs)
    for p in graph.partitions:
      mine = [r for r in parts if r.partition == p.index]
      self.assertLen(mine, runs)
      self.assertEqual({(r.place, r.stream) for r in mine}, {(p.place, p.stream)})
    moves = prof.transfers()
    self.assertNotEmpty(report.transfers)
    self.assertLen(moves, len(report.transfers) * runs)
    for t in report.transfers:
      mine = [m for m in moves if (m.direction, m.value, m.caused_by) ==
              (t.direction, t.value, t.caused_by)]
      self.assertLen(mine, runs)
      self.assertEqual({m.bytes for m in mine}, {t.bytes})
    for r in parts + prof.runs():
      self.assertLessEqual(r.start_ns, r.end_ns)

  def test_runs_contain_their_partitions(self):
    prof = profiled_runs(chain, _f32(16), 3)
    runs = prof.runs()
    for p in prof.partitions():
      self.assertTrue(any(r.start_ns <= p.start_ns <= p.end_ns <= r.end_ns for r in runs))
    total = sum(r.end_ns - r.start_ns for r in runs)
    self.assertGreaterEqual(total, sum(p.end_ns - p.start_ns for p in prof.partitions()))

  def test_single_partition_graph(self):
    prof = profiled_runs(single, _f32(8), 4)
    self.assertLen(prof.runs(), 4)
    self.assertEqual([(p.partition, p.place) for p in prof.partitions()],
                     [(0, "device")] * 4)
    self.assertEmpty(prof.transfers())

  def test_stateful_steps_one_event_per_sunk_run(self):
    sess, prof = profiled()
    w, xs = _f32(8), _f32(6, 8)
    gid = sess.compile(stateful_step, w, xs[0], state_argnums=0)
    sess.run(gid, xs[0])
    out = sess.run(gid, xs, steps=6)
    self.assertEqual([r.steps for r in prof.runs()], [None, 6])
    self.assertLen(prof.partitions(), 2)  # a sunk run is one executable
    plain = js.Session()
    pid = plain.compile(stateful_step, w, xs[0], state_argnums=0)
    plain.run(pid, xs[0])
    assert_same_bits(out, plain.run(pid, xs, steps=6), "sunk run")
    assert_same_bits(sess.get_state(gid), plain.get_state(pid), "state after the sunk run")

  def test_stepped_plan_records_each_step(self):
    sess, prof = profiled()
    w, xs = _f32(8), _f32(4, 8)
    gid = sess.compile(stateful_chain, w, xs[0], state_argnums=0)
    graph, report = sess.graph(gid), sess.report(gid)
    self.assertGreater(len(graph.partitions), 1)
    sess.run(gid, xs, steps=4)  # the stepped program runs the plan's timed ops
    self.assertEqual(sess.report(gid).loop_sink, {4: "the plan, once per step"})
    self.assertEqual([r.steps for r in prof.runs()], [4])
    self.assertLen(prof.partitions(), len(graph.partitions) * 4)
    self.assertLen(prof.transfers(), len(report.transfers) * 4)

  def test_transfer_run_as_its_own_step_is_timed(self):
    sess, prof = profiled()
    w, x = _f32(8), _f32(8)
    gid = sess.compile(host_made_state, w, x, state_argnums=0)
    report = sess.report(gid)
    self.assertIn("host:h2d", [n.kernel.name for n in sess.graph(gid).nodes])
    for _ in range(3):
      sess.run(gid, x)
    moves = prof.transfers()
    self.assertLen(moves, len(report.transfers) * 3)
    h2d = [m for m in moves if m.direction == "h2d"]
    self.assertLen(h2d, 3)
    for m in h2d:  # a jax.device_put step: timed, and inside its partition
      self.assertIsNotNone(m.start_ns)
      self.assertLessEqual(m.start_ns, m.end_ns)
    for m in moves:
      if m.direction == "d2h":  # zero-copy on CPU: counted, no time of its own
        self.assertIsNone(m.start_ns)

  def test_memory_samples(self):
    (sess, prof), x = profiled(), _f32(64)
    gid = sess.compile(chain, x)
    sess.run(gid, x)
    live = [p.live_bytes for p in prof.partitions()]
    self.assertTrue(all(isinstance(b, int) and b >= x.nbytes for b in live), live)
    sess, quiet = profiled(Profiler(enabled=True, sample_memory=False))
    gid = sess.compile(chain, x)
    sess.run(gid, x)
    self.assertEqual({p.live_bytes for p in quiet.partitions()}, {None})

  @pytest.mark.slow
  def test_memory_samples_under_a_mesh_count_one_device(self):
    # the plan's bytes after a partition, as one device holds them (a shard
    # of each sharded value, as report.memory counts): the whole arrays were
    # summed (a review's find), 141312 B on 4 devices as on one
    out = run_json("""
import json, numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh
import jaxsession as js
rng = np.random.default_rng(8)
w = jnp.asarray(rng.standard_normal((256, 64)), jnp.float32)
x = jnp.asarray(rng.standard_normal((8, 256)), jnp.float32)
step = lambda w, x: (w * 0.5 + 1.0, jnp.tanh(x @ w))
got = {}
for name, opts in (("one", {}), ("mesh", {"mesh": Mesh(np.array(jax.devices()), ("data",))})):
  sess = js.Session(js.SessionOptions(enable_profiling=True, **opts))
  gid = sess.compile(step, w, x, state_argnums=0, **({"state_specs": "zero"} if opts else {}))
  sess.run(gid, x)
  got[name] = [p.live_bytes for p in sess.profiler.partitions()]
print(json.dumps(got))
""", devices=4)
    (one,), (mesh,) = out["one"], out["mesh"]
    # one device: w (64 KiB) and its update, x (8 KiB), the output (2 KiB)
    self.assertEqual(one, 2 * 65536 + 8192 + 2048)
    # a device of 4: a quarter of w ("zero") and of x (its rows, the default
    # in_specs); the values XLA's partitioner lays out (w's update, the
    # output) at their whole size, as the plan counts them (report.memory)
    self.assertEqual(mesh, 65536 // 4 + 8192 // 4 + 65536 + 2048)

  def test_failed_run_is_recorded_and_raises_as_before(self):
    def boom(a):
      raise ValueError("no")

    def failing(w, x):
      return w + _cb(boom, x), jnp.sum(x)
    sess, prof = profiled()
    w, x = _f32(4), _f32(4)
    gid = sess.compile(failing, w, x, state_argnums=0)
    before = sess.get_state(gid)
    with self.assertRaises(HostOpError):
      sess.run(gid, x)
    assert_same_bits(sess.get_state(gid), before, "state after a failed run")
    self.assertLen(prof.runs(), 1)

  def test_reset_and_disabled(self):
    sess, prof = profiled()
    x = _f32(8)
    gid = sess.compile(single, x)
    sess.run(gid, x)
    prof.reset()
    self.assertEqual((prof.runs(), prof.partitions(), prof.compiles()), ([], [], []))
    sess.run(gid, x)  # the hooks append to the same lists after a reset
    self.assertLen(prof.runs(), 1)
    off = Profiler(enabled=False)
    self.assertIsNone(off.graph_hooks(gid, "single", sess.graph(gid)))
    off.record_compile(gid, "single", sess.report(gid).passes, 0.01, 0.1)
    self.assertEmpty(off.compiles())


class HooksTest(absltest.TestCase):

  def graphs(self, sess, w=None, x=None):
    w = _f32(8) if w is None else w
    x = _f32(8) if x is None else x
    return {
        "single bare": sess.compile(single, x),
        "single slotwise": sess.compile(stateful_step, w, x, state_argnums=0),
        "single general": sess.compile(stateful_step, w, x, state_argnums=0,
                                       updates_state=False),
        "plan stateless": sess.compile(chain, x),
        "plan stateful": sess.compile(stateful_chain, w, x, state_argnums=0),
    }

  def test_profiling_wraps_the_ops_not_the_executables(self):
    """Profiling wraps each op's function at build: the graphs compile to the
    same executables, profiled or not, and only the profiled ones record."""
    plain, (profiled_sess, prof) = js.Session(), profiled()
    w, x = _f32(8), _f32(8)
    plain_ids, prof_ids = self.graphs(plain, w, x), self.graphs(profiled_sess, w, x)
    for what, gid in plain_ids.items():
      self.assertEqual([_hlo(e) for e in plain.executables(gid)],
                       [_hlo(e) for e in profiled_sess.executables(prof_ids[what])], what)
      self.assertNotEmpty(plain.executables(gid), what)
      plain.run(gid, x)
      profiled_sess.run(prof_ids[what], x)
    self.assertEmpty(plain.profiler.runs())
    self.assertLen(prof.runs(), len(prof_ids))

  def test_results_equal_unprofiled_and_jit(self):
    fns = {"single bare": single, "single slotwise": stateful_step,
           "single general": stateful_step, "plan stateless": chain,
           "plan stateful": stateful_chain}
    plain, (profiled_sess, prof) = js.Session(), profiled()
    w, x = _f32(8), _f32(8)
    plain_ids, prof_ids = self.graphs(plain, w, x), self.graphs(profiled_sess, w, x)
    for what, fn in fns.items():
      state = plain.get_state(plain_ids[what])
      for step in range(3):
        x = _f32(8)
        want = plain.run(plain_ids[what], x)
        got = profiled_sess.run(prof_ids[what], x)
        assert_same_bits(got, want, f"{what} step {step}")
        if not state:
          assert_same_bits(got, jax.jit(fn)(x), f"{what} vs jit")
          continue
        jit_out = jax.jit(fn)(state[0], x)
        if what != "single general":
          state = (jit_out[0],)
          jit_out = jit_out[1]
        assert_same_bits(got, jit_out, f"{what} vs jit, step {step}")
      assert_same_bits(profiled_sess.get_state(prof_ids[what]), plain.get_state(plain_ids[what]),
                       f"{what} state")
    self.assertLen(prof.runs(), 3 * len(fns))

  def test_partitions_run_under_trace_annotations(self):
    """While JAX's profiler traces, every partition runs under its
    annotation; while it does not, none is entered (it would record
    nothing, and costs ~0.3 µs a partition)."""
    names = []
    real, real_active = jax.profiler.TraceAnnotation, profiler_lib.trace_active
    tracing = [True]

    class Recording(real):
      def __init__(self, name, **kwargs):
        names.append(name)
        super().__init__(name, **kwargs)
    sess, prof = profiled()
    x = _f32(8)
    chain_id, single_id = sess.compile(chain, x), sess.compile(single, x)
    jax.profiler.TraceAnnotation = Recording
    profiler_lib.trace_active = lambda: tracing[0]
    try:
      sess.run(chain_id, x)
      sess.run(single_id, x)
      count = len(sess.graph(chain_id).partitions)
      self.assertEqual(names, [f"jaxsession graph {chain_id} partition {k}"
                               for k in range(count)]
                       + [f"jaxsession graph {single_id} partition 0"])
      tracing[0] = False
      sess.run(chain_id, x)
      sess.run(single_id, x)
      self.assertLen(names, count + 1)  # nothing more annotated
      self.assertLen(prof.partitions(), 2 * (count + 1))  # yet every partition timed
    finally:
      jax.profiler.TraceAnnotation = real
      profiler_lib.trace_active = real_active

  def test_jax_profiler_shows_the_partitions(self):
    sess, prof = profiled()
    x = _f32(8)
    gid = sess.compile(chain, x)
    single_id = sess.compile(single, x)
    folder = tempfile.mkdtemp()
    with jax.profiler.trace(folder):
      sess.run(gid, x)
      sess.run(single_id, x)
    data = b""
    for root, _, files in os.walk(folder):
      for name in files:
        if name.endswith(".xplane.pb"):
          with open(os.path.join(root, name), "rb") as f:
            data += f.read()
    for p in sess.graph(gid).partitions:
      self.assertIn(f"jaxsession graph {gid} partition {p.index}".encode(), data)
    self.assertIn(f"jaxsession graph {single_id} partition 0".encode(), data)


class PresentationTest(absltest.TestCase):

  def profiled(self, runs=4):
    sess, prof = profiled()
    x = _f32(16)
    gid = sess.compile(chain, x)
    report = sess.report(gid)
    prof.record_compile(gid, "chain", report.passes, 0.002, report.compile_seconds)
    for _ in range(runs):
      sess.run(gid, x)
    return sess, gid, prof

  def test_summary_tables(self):
    sess, gid, prof = self.profiled()
    text = prof.summary(echo=False)
    for title in ("Overhead summary", "Transfer summary", "Event summary"):
      self.assertIn(title, text)
    ratios = [float(r) for r in re.findall(r"(-?\d+\.\d)%", text)]
    self.assertNotEmpty(ratios)
    for ratio in ratios:
      self.assertBetween(ratio, 0.0, 100.0)
    overhead = text.split("\n\n")[0]
    micros = {what: float(re.search(rf"{what}\s+(?:\d+\s+)?(-?[\d.]+)", overhead).group(1))
              for what in ("total run time", "device compute", "host compute",
                           "framework overhead")}
    self.assertGreaterEqual(micros["total run time"],
                            micros["device compute"] + micros["host compute"] - 0.2)
    self.assertGreater(micros["device compute"], 0)
    transfers = text.split("\n\n")[1]
    n = len(sess.report(gid).transfers)
    d2h = sum(1 for t in sess.report(gid).transfers if t.direction == "d2h")
    self.assertRegex(transfers, rf"d2h\s+{d2h * 4}\s")
    self.assertRegex(transfers, rf"h2d\s+{(n - d2h) * 4}\s")
    events = text.split("\n\n")[2]
    for p in sess.graph(gid).partitions:
      self.assertRegex(events, rf"graph {gid} 'chain' / partition {p.index} .*\s4\s")
    for stage in ("Optimize", "SelectKernel", "HardwareOptimize", "Build"):
      self.assertIn(f"compile / {stage}", events)

  def test_chrome_trace(self):
    sess, gid, prof = self.profiled(runs=3)
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
      trace = json.load(f)
    events = trace["traceEvents"]
    self.assertTrue({ev["ph"] for ev in events} >= {"M", "X", "C"})
    tracks = {ev["tid"]: ev["args"]["name"] for ev in events
              if ev["ph"] == "M" and ev["name"] == "thread_name"}
    self.assertEqual(tracks[0], "device queue")
    self.assertEqual(tracks[1], "host queue")
    self.assertIn("runs", tracks.values())
    self.assertIn("compile", tracks.values())
    graph = sess.graph(gid)
    slices = [ev for ev in events if ev["ph"] == "X"]
    for p in graph.partitions:
      mine = [ev for ev in slices if ev["name"] ==  # as the summary names it
          f"graph {gid} 'chain' / partition {p.index}"]
      self.assertLen(mine, 3)
      for ev in mine:
        self.assertEqual(ev["tid"], p.stream)
        self.assertEqual(ev["args"]["nodes"], [n.id for n in p.nodes])
        self.assertGreaterEqual(ev["dur"], 0)
    self.assertLen([ev for ev in slices if ev["name"] == f"graph {gid} run"], 3)
    self.assertIn(f"graph {gid} compile / Optimize", {ev["name"] for ev in slices})
    counters = [ev for ev in events if ev["ph"] == "C"]
    self.assertLen(counters, 3 * len(graph.partitions))
    for ev in counters:
      self.assertEqual(ev["name"], "live device bytes")
      self.assertIsInstance(ev["args"]["bytes"], int)
    self.assertGreaterEqual(min(ev["ts"] for ev in events if "ts" in ev), 0)

  def test_describe_graph_numbers_transfers_as_the_report(self):
    sess, gid, _ = self.profiled(runs=1)
    parts = profiler_lib.describe_graph(sess.graph(gid))
    moves = sorted((m for p in parts.values() for m in p.transfers), key=lambda m: m.index)
    self.assertEqual([(m.direction, m.bytes, m.value, m.caused_by) for m in moves],
                     [(t.direction, t.bytes, t.value, t.caused_by)
                      for t in sess.report(gid).transfers])


class SessionWiringTest(absltest.TestCase):
  """The public switch: SessionOptions(enable_profiling=True) and sess.profiler."""

  def test_enable_profiling_records_runs_sunk_runs_and_compiles(self):
    sess = js.Session(js.SessionOptions(enable_profiling=True))
    x, w = _f32(16), _f32(16)
    gid = sess.compile(chain, x)
    step = sess.compile(stateful_step, w, x, state_argnums=0)
    for _ in range(3):
      np.testing.assert_array_equal(sess.run(gid, x), jax.jit(chain)(x))
    sess.run(step, jnp.stack([x, x]), steps=2)
    runs = sess.profiler.runs()
    self.assertEqual([r.graph_id for r in runs].count(gid), 3)
    self.assertEqual([(r.graph_id, r.steps) for r in runs if r.graph_id == step], [(step, 2)])
    self.assertEqual(sorted({c.graph_id for c in sess.profiler.compiles()}), [gid, step])
    self.assertLen([p for p in sess.profiler.partitions() if p.graph_id == gid],
                   3 * len(sess.report(gid).partitions))
    text = sess.profiler.summary(echo=False)
    self.assertIn("compile / Build", text)
    self.assertIn("framework overhead", text)

  def test_a_runs_own_compile_is_recorded(self):
    """The executable a new steps value compiles at run time is a compile
    (it was missing: 240 ms of wall time, none of it in any table)."""
    sess = js.Session(js.SessionOptions(enable_profiling=True))
    x, w = _f32(16), _f32(16)
    step = sess.compile(stateful_step, w, x, state_argnums=0)
    sess.run(step, jnp.stack([x] * 3), steps=3)
    sess.run(step, jnp.stack([x] * 3), steps=3)
    names = [c.name for c in sess.profiler.compiles() if c.graph_id == step]
    self.assertEqual(names, ["stateful_step", "stateful_step run(steps=3)"])
    self.assertGreater(sess.profiler.compiles()[-1].build_seconds, 0)
    self.assertIn("compile / Build", sess.profiler.summary(echo=False))

  def test_no_compile_inside_a_plans_first_sunk_run(self):
    # a graph with a host partition compiled its steps' stacking executable
    # inside its first sunk run, which booked that XLA compile as the run's
    # framework overhead (95% of the run; a break-it find)
    compiled_at = []
    def listen(event, duration, **kwargs):
      if event.endswith("backend_compile_duration"):
        compiled_at.append(time.perf_counter_ns())
    jax.monitoring.register_event_duration_secs_listener(listen)
    self.addCleanup(jax.monitoring.unregister_event_duration_listener, listen)
    def step(s, x):
      z = jax.pure_callback(lambda v: np.asarray(v) * 2,
                            jax.ShapeDtypeStruct(x.shape, x.dtype), x * 3.0)
      return s + z.sum(), (z[0], x * z)
    sess = js.Session(js.SessionOptions(enable_profiling=True))
    x = _f32(16)
    gid = sess.compile(step, jnp.float32(0.5), x, state_argnums=0)
    xs = jnp.stack([x, x * 2.0, x - 1.0, x + 0.5, -x])
    jax.block_until_ready(xs)
    got = sess.run(gid, xs, steps=5)
    run = sess.profiler.runs()[-1]
    self.assertEqual([t for t in compiled_at if run.start_ns <= t <= run.end_ns], [])
    self.assertIn("step run(steps=5)", [c.name for c in sess.profiler.compiles()])
    want = jax.jit(lambda s, xs: jax.lax.scan(lambda c, x: step(c, x), s, xs))(
        jnp.float32(0.5), xs)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want[1])):
      np.testing.assert_array_equal(a, b)

  def test_runs_of_several_threads_get_tracks_of_their_own(self):
    """Concurrent runs on one track overlapped without nesting, which
    Perfetto cannot draw (a break-it find)."""
    import threading  # pylint: disable=import-outside-toplevel
    sess = js.Session(js.SessionOptions(enable_profiling=True))
    x = _f32(16)
    gid = sess.compile(chain, x)

    together = threading.Barrier(3)  # alive at once: three thread idents

    def work():
      together.wait()
      for _ in range(30):
        sess.run(gid, x)
      together.wait()
    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    sess.profiler.export_chrome_trace(path)
    with open(path) as f:
      events = json.load(f)["traceEvents"]
    tracks = {ev["tid"]: ev["args"]["name"] for ev in events
              if ev["ph"] == "M" and ev["name"] == "thread_name"}
    self.assertLen([n for n in tracks.values() if n.startswith("runs")], 3)
    by_track = {}
    for ev in events:
      if ev["ph"] == "X":
        by_track.setdefault(ev["tid"], []).append((ev["ts"], ev["ts"] + ev["dur"]))
    for tid, spans in by_track.items():  # nested or apart, never partly overlapping
      spans.sort(key=lambda span: (span[0], -span[1]))
      for (s1, e1), (s2, e2) in zip(spans, spans[1:]):
        self.assertTrue(s2 >= e1 or e2 <= e1, (tracks.get(tid), (s1, e1), (s2, e2)))
    self.assertEqual(sum(1 for ev in events if ev["ph"] == "X" and ev["cat"] == "run"), 90)

  def test_a_trace_path_that_cannot_be_written(self):
    sess = js.Session(js.SessionOptions(enable_profiling=True))
    sess.run(sess.compile(chain, _f32(8)), _f32(8))
    folder = tempfile.mkdtemp()
    for bad in (1, None, "", folder, os.path.join(folder, "missing", "t.json")):
      with self.assertRaises(js.InputError):
        sess.profiler.export_chrome_trace(bad)
    self.assertEqual(os.listdir(folder), [])

  def test_profiling_off_leaves_no_hooks_and_no_records(self):
    sess = js.Session()
    gid = sess.compile(chain, _f32(8))
    sess.run(gid, _f32(8))
    self.assertEmpty(sess.profiler.partitions())
    self.assertEmpty(sess.profiler.runs())
    self.assertEmpty(sess.profiler.compiles())


if __name__ == "__main__":
  absltest.main()
