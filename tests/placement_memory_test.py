"""Placement rules, the memory plan against measured live bytes, stream
assignment, and loop sink / failures over host partitions - each on a small
program whose results are compared with jax.jit bit for bit."""
import gc
import warnings

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jaxsession.runtime.profiler import Profiler
from jaxsession.graph.ir import Literal, aval_bytes
from jaxsession.kernels import register_kernel, unregister_kernel
from jaxsession.optimizer_passes.base import Pass, PassResult
from jaxsession.runtime.partition import placement_reason

from exact import assert_same_bits
from host_ops import RNG, _cb, _f32, _host_affine

INT_MAX = 2**31 - 1

CALLBACK_NOTE = "placed on host (callback)"
HOST_ONLY_NOTE = "placed on host (host-only kernel)"
SMALL_INT_NOTE = "placed on host (small integer)"


def _host_identity(*xs):
  """Returns its arguments as numpy arrays (one, or a tuple of them)."""
  outs = tuple(np.asarray(x) for x in xs)
  return outs[0] if len(outs) == 1 else outs


def _read_on_host(*xs):
  """A callback that hands its integer arguments back unchanged: whatever
  reaches it is the program's result, bit for bit."""
  return jax.pure_callback(_host_identity,
                           tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs), *xs)


def _node(graph, op):
  found = [n for n in graph.nodes if n.op == op]
  assert len(found) == 1, f"{len(found)} '{op}' nodes in\n{graph.dump()}"
  return found[0]


def _near_int_max(n):
  """int32 values, half of them within 8 of 2**31 - 1 (so +1 and *3 wrap)."""
  near = INT_MAX - RNG.integers(0, 8, n)
  far = RNG.integers(-2**31, 2**31 - 1, n)
  return jnp.asarray(np.where(RNG.random(n) < 0.5, near, far), jnp.int32)


# -- 1. placement rules ------------------------------------------------------

class CallbackRuleTest(absltest.TestCase):

  @staticmethod
  def program(x):
    return jnp.cos(_cb(_host_affine, jnp.sin(x) * 3.0)) + x

  def test_callback_goes_to_the_host(self):
    sess = js.Session()
    x = _f32(16)
    gid = sess.compile(self.program, x)
    node = _node(sess.graph(gid), "pure_callback")
    self.assertEqual(node.place, "host")
    self.assertEqual(node.kernel.name, "host:pure_callback")
    self.assertTrue(placement_reason(node).startswith(CALLBACK_NOTE), node.notes)
    self.assertEqual([p.place for p in sess.report(gid).partitions],
                     ["device", "host", "device"])
    y = _f32(16)
    assert_same_bits(sess.run(gid, y), jax.jit(self.program)(y), "callback on host")

  def test_host_callbacks_off_stays_on_the_device(self):
    sess = js.Session(js.SessionOptions(host_callbacks=False))
    gid = sess.compile(self.program, _f32(16))
    node = _node(sess.graph(gid), "pure_callback")
    self.assertEqual(node.place, "device")
    self.assertIsNone(placement_reason(node))
    self.assertEqual([p.place for p in sess.report(gid).partitions], ["device"])
    y = _f32(16)
    assert_same_bits(sess.run(gid, y), jax.jit(self.program)(y), "callback in executable")


class MulToHostOnlyOp(Pass):
  """Rewrites the first mul of two non-literal values into MyHostOnlyOp, a
  fused op that only a host kernel implements."""
  name = "mul_to_my_host_only_op"

  def run(self, graph, ctx):
    for i, node in enumerate(graph.nodes):
      if node.op == "mul" and not any(isinstance(v, Literal) for v in node.inputs):
        new = graph.make_node("MyHostOnlyOp", None, {}, list(node.inputs),
                              [node.outputs[0].aval])
        graph.insert_node(i, new)
        graph.replace_uses(node.outputs[0], new.outputs[0])
        graph.remove_node(node)
        return PassResult(True)
    return PassResult(False)


class HostOnlyKernelRuleTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.calls = []

    def my_host_only(node, a, b):
      self.calls.append(node.id)
      return [np.multiply(np.asarray(a), np.asarray(b))]  # IEEE mul: the same bits as XLA's
    register_kernel("MyHostOnlyOp", backend="host", name="host:my_host_only")(my_host_only)
    self.addCleanup(unregister_kernel, "host:my_host_only", "MyHostOnlyOp")
    js.register_pass(MulToHostOnlyOp(), stage="Optimize")
    self.addCleanup(js.unregister_pass, MulToHostOnlyOp.name)

  @staticmethod
  def program(x, y):
    a = jnp.tanh(x) + 1.0
    return jnp.maximum(a * y, x) - 0.5

  def test_node_without_a_device_kernel_runs_on_the_host(self):
    sess = js.Session()
    x, y = _f32(32), _f32(32)
    gid = sess.compile(self.program, x, y)
    graph = sess.graph(gid)
    node = _node(graph, "MyHostOnlyOp")
    self.assertEqual(node.place, "host")
    self.assertEqual(node.kernel.name, "host:my_host_only")
    self.assertTrue(placement_reason(node).startswith(HOST_ONLY_NOTE), node.notes)
    self.assertIn("no device kernel", placement_reason(node))
    self.assertNotIn("mul", [n.op for n in graph.nodes])
    self.assertEqual([p.place for p in graph.partitions], ["device", "host", "device"])
    self.assertEqual(self.calls, [])  # compile runs no kernel of a host node
    x, y = _f32(32), _f32(32)
    assert_same_bits(sess.run(gid, x, y), jax.jit(self.program)(x, y), "host-only op")
    self.assertEqual(self.calls, [node.id])


class SmallIntegerRuleTest(absltest.TestCase):

  @staticmethod
  def int_ops(n):
    """Integer arithmetic on a host-made int32[16]: wraps near 2**31 - 1."""
    up = n + 1
    tripled = n * 3
    top = jnp.maximum(up, tripled)
    bigger = (up > tripled).astype(jnp.int8)
    narrow = top.astype(jnp.int16)
    tiled = jnp.broadcast_to(top.reshape(4, 4), (2, 4, 4))
    return up, tripled, top, bigger, narrow, tiled, n != tripled

  def program(self, k):
    return _read_on_host(*self.int_ops(_cb(_host_identity, k)))

  def test_integer_ops_between_callbacks_stay_on_the_host(self):
    sess = js.Session()
    k = _near_int_max(16)
    gid = sess.compile(self.program, k)
    graph = sess.graph(gid)
    computed = [n for n in graph.nodes
                if n.op not in ("pure_callback", "transfer_d2h", "transfer_h2d")]
    self.assertGreaterEqual(len(computed), 8, graph.dump())
    for node in computed:
      self.assertEqual(node.place, "host", f"node {node.id} '{node.op}'\n{graph.dump()}")
      self.assertTrue(placement_reason(node).startswith(SMALL_INT_NOTE), node.notes)
    report = sess.report(gid)
    self.assertEqual([t for t in report.transfers if t.direction == "h2d"], [])
    self.assertEqual([p.place for p in report.partitions], ["host"])
    k = _near_int_max(16)
    self.assertTrue(np.any(np.asarray(k) > INT_MAX - 8))  # the wrap-around is exercised
    assert_same_bits(sess.run(gid, k), jax.jit(self.program)(k), "small integers")

  def test_integer_result_read_on_the_device_stays_there(self):
    def program(k):
      up = _cb(_host_identity, k) + 1
      return _read_on_host(up), jnp.sin(up.astype(jnp.float32))
    sess = js.Session()
    gid = sess.compile(program, _near_int_max(16))
    graph = sess.graph(gid)
    self.assertEqual(_node(graph, "add").place, "device")
    self.assertIsNone(placement_reason(_node(graph, "add")))
    self.assertLen([t for t in sess.report(gid).transfers if t.direction == "h2d"], 1)
    k = _near_int_max(16)
    assert_same_bits(sess.run(gid, k), jax.jit(program)(k), "int read on device")

  def test_float_ops_stay_on_the_device(self):
    def program(x):
      made = _cb(_host_affine, x)
      return _cb(_host_affine, made * 3.0 + made)
    sess = js.Session()
    gid = sess.compile(program, _f32(16))
    graph = sess.graph(gid)
    for op in ("mul", "add"):
      self.assertEqual(_node(graph, op).place, "device", graph.dump())
    x = _f32(16)
    assert_same_bits(sess.run(gid, x), jax.jit(program)(x), "float ops")

  def test_more_than_1024_integers_stay_on_the_device(self):
    def program(k):
      return _read_on_host(_cb(_host_identity, k) * 3 + 1)
    sess = js.Session()
    gid = sess.compile(program, _near_int_max(2048))
    graph = sess.graph(gid)
    for op in ("mul", "add"):
      self.assertEqual(_node(graph, op).place, "device", graph.dump())
    self.assertLen([t for t in sess.report(gid).transfers if t.direction == "h2d"], 1)
    k = _near_int_max(2048)
    assert_same_bits(sess.run(gid, k), jax.jit(program)(k), "large integers")


def three_callbacks(x, k):
  """Three callbacks (one returning int32) and a small-integer add between two."""
  a = _cb(_host_affine, jnp.sin(x))
  n = _cb(_host_identity, k)
  return _cb(lambda u, v: (np.asarray(u) * np.asarray(v).astype(np.float32)).astype(
      np.float32), a * 2.0, n + 1, like=x)


def _host_nodes(graph):
  """{node id: (op, placement note)} of the nodes placement sent to the host."""
  return {n.id: (n.op, placement_reason(n)) for n in graph.nodes
          if n.place == "host" and not n.op.startswith("transfer_")}


class PlacementOptionsTest(absltest.TestCase):

  def test_place_all_on_device_names_every_host_node(self):
    x, k = _f32(8), jnp.asarray(RNG.integers(-50, 50, 8), jnp.int32)
    reference = js.Session()
    host = _host_nodes(reference.graph(reference.compile(three_callbacks, x, k)))
    rules = {note.split(":")[0] for _, note in host.values()}
    self.assertEqual(rules, {CALLBACK_NOTE, SMALL_INT_NOTE})
    self.assertEqual([op for op, _ in host.values()].count("pure_callback"), 3)
    self.assertIn("add", [op for op, _ in host.values()])
    sess = js.Session(js.SessionOptions(place_all_on_device=True))
    with self.assertRaises(js.PartitionError) as caught:
      sess.compile(three_callbacks, x, k)
    message = str(caught.exception)
    self.assertIn(f"{len(host)} node(s)", message)
    lines = message.splitlines()
    for nid, (op, note) in host.items():
      line = [l for l in lines if l.strip().startswith(f"node {nid} '{op}'")]
      self.assertLen(line, 1, f"node {nid} not named in:\n{message}")
      self.assertIn(note.split(":")[0], line[0])  # the rule, e.g. "(small integer)"
    with self.assertRaises(js.UnknownGraphError):  # the refused compile kept nothing
      sess.graph(0)

  def test_place_all_on_device_must_be_a_bool(self):
    with self.assertRaisesRegex(js.InputError, "place_all_on_device"):
      js.SessionOptions(place_all_on_device="yes")
    self.assertTrue(issubclass(js.InputError, ValueError))

  def test_partition_or_error_names_every_host_node(self):
    def program(x):
      a = _cb(_host_affine, jnp.sin(x) * 2.0)
      b = _cb(_host_affine, jnp.cos(a) + x)
      return jnp.tanh(b) - a
    x = _f32(8)
    reference = js.Session()
    graph = reference.graph(reference.compile(program, x))
    self.assertEqual([p.place for p in graph.partitions],
                     ["device", "host", "device", "host", "device"])
    host = _host_nodes(graph)
    self.assertLen(host, 2)
    sess = js.Session(js.SessionOptions(partition_or_error=True))
    with self.assertRaises(js.PartitionError) as caught:
      sess.compile(program, x)
    message = str(caught.exception)
    for nid, (op, _) in host.items():
      self.assertIn(f"node {nid} '{op}'", message)
    self.assertIn("3 device partitions", message)
    # one callback with no device work after it needs one device partition: no error
    gid = sess.compile(lambda x: _cb(_host_affine, jnp.sin(x)), x)
    y = _f32(8)
    assert_same_bits(sess.run(gid, y), jax.jit(lambda x: _cb(_host_affine, jnp.sin(x)))(y))


# -- 2. memory ---------------------------------------------------------------

def _scale_on_host(s):
  return (np.asarray(s) * np.float32(0.25) + np.float32(1.0)).astype(np.float32)


def device_host_chain(x):
  """d h d h ... (10 partitions): each device partition makes 256x256
  values; each callback reads only a column sum. The big `a` made in
  partition 2i lives across the host partition and dies in partition 2i+2,
  which makes a new `a` of the same shape (intermediate donation)."""
  a = jnp.sin(x) * 2.0
  for i in range(5):
    s = _cb(_scale_on_host, jnp.sum(a, axis=0, keepdims=True))
    if i == 4:
      return s
    a = jnp.cos(a) * s + a


class MemoryTest(absltest.TestCase):

  def compile_chain(self, sess=None):
    sess = sess or js.Session()
    x = _f32(256, 256)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      gid = sess.compile(device_host_chain, x)
      out = sess.run(gid, x)
    self.assertEqual([str(w.message) for w in caught
                      if "donated buffers were not usable" in str(w.message)], [])
    assert_same_bits(out, jax.jit(device_host_chain)(x), "chain")
    graph = sess.graph(gid)
    self.assertEqual([p.place for p in graph.partitions], ["device", "host"] * 5)
    return sess, gid, graph

  def test_measured_peak_within_plan_and_below_keep_everything(self):
    x = _f32(256, 256)
    inputs, before_ids = x.nbytes, set()

    def observe():  # the live bytes of the run (what was live before excluded)
      new = sum(a.nbytes for a in jax.live_arrays() if id(a) not in before_ids)
      return new + inputs
    # the profiler samples after each partition; a Profiler set before compile
    # is the one the graph's ops report to
    sess = js.Session()
    sess.profiler = Profiler(enabled=True, sample_memory=observe)
    sess, gid, graph = self.compile_chain(sess)
    gc.collect()
    # Bytes live before the run belong to other tests, jax's caches and `x`.
    # Only the run's input is part of the plan (a graph input lives
    # throughout): count it, and count nothing else that was live before.
    # Holding `before` keeps those arrays alive, so no new array can reuse
    # an id of theirs; the test is the same whether they die or not.
    before = jax.live_arrays()
    before_ids.update(id(a) for a in before)
    sess.profiler.reset()
    out = sess.run(gid, x)
    del before
    samples = {p.partition: p.live_bytes for p in sess.profiler.partitions()}
    self.assertEqual(sorted(samples), list(range(10)))
    assert_same_bits(out, jax.jit(device_host_chain)(x), "observed chain")
    measured = max(samples.values())
    planned = sess.report(gid).memory
    self.assertEqual(planned[0], planned.peak_bytes)
    self.assertLessEqual(measured, planned.peak_bytes, samples)
    # An executor that kept every device value to the end: the graph inputs
    # and every output of a device-placed node.
    keep_all = sum(aval_bytes(v.aval) for v in graph.inputs) + sum(
        aval_bytes(o.aval) for n in graph.nodes if n.place == "device" for o in n.outputs)
    self.assertLessEqual(measured, 0.6 * keep_all, (measured, keep_all))
    # the samples see the run's values: x and the big `a` that crosses each
    # host partition
    for i in range(0, 8):
      self.assertGreaterEqual(samples[i], 2 * x.nbytes, samples)

  def test_partition_rows_and_bounds(self):
    sess, gid, graph = self.compile_chain()
    memory = sess.report(gid).memory
    self.assertLen(memory.partitions, len(graph.partitions))
    for row, part in zip(memory.partitions, graph.partitions):
      self.assertEqual((row.index, row.place), (part.index, part.place))
      # a device partition's figure is XLA's (raised to its largest node's
      # operands and results where XLA reports less), a host partition's ours
      self.assertTrue(row.source.startswith("xla memory_analysis" if part.place == "device"
                                            else "session estimate"), row.source)
      self.assertLessEqual(row.bytes + row.live_across, memory.peak_bytes)
    self.assertLessEqual(memory.lower_bound_bytes, memory.peak_bytes)
    self.assertGreaterEqual(memory.lower_bound_bytes, 2 * 256 * 256 * 4)  # x and sin(x)

  def test_intermediates_donated_two_partitions_later(self):
    sess, gid, graph = self.compile_chain()
    part_of = {n.id: p.index for p in graph.partitions for n in p.nodes}
    decided = graph.memory.intermediate_donations  # kept ones too, each with its reason
    donations = [d for d in decided if d.donated]
    self.assertNotEmpty(donations)
    for d in decided:
      self.assertTrue(d.reason)
    for d in donations:
      self.assertEqual(tuple(d.state.aval.shape), (256, 256))
      self.assertEqual(d.partition - part_of[d.state.producer.id], 2, d)
      self.assertEqual(graph.partitions[d.partition].place, "device")
      self.assertEqual(graph.memory.live_ranges[d.state.id][1], d.partition)  # dies there
    self.assertEqual(sorted(d.partition for d in donations), [2, 4, 6])
    self.assertGreaterEqual(sess.report(gid).memory.donated_bytes, 3 * 256 * 256 * 4)
    x = _f32(256, 256)  # runs again on fresh buffers: nothing stale was donated
    assert_same_bits(sess.run(gid, x), jax.jit(device_host_chain)(x), "second run")

  def test_lower_bound_never_exceeds_planned_peak(self):
    programs = [
        ("chain", device_host_chain, (_f32(256, 256),)),
        ("three callbacks", three_callbacks,
         (_f32(8), jnp.asarray(RNG.integers(-50, 50, 8), jnp.int32))),
        ("small integers", SmallIntegerRuleTest().program, (_near_int_max(16),)),
    ]
    for name, fn, args in programs:
      sess = js.Session()
      memory = sess.report(sess.compile(fn, *args)).memory
      self.assertLessEqual(memory.lower_bound_bytes, memory.peak_bytes,
                           f"{name}: lower bound above the planned peak")


# -- 3. AssignStream ---------------------------------------------------------

class XlaFigureFloorTest(absltest.TestCase):
  """XLA:CPU reports no temporaries for a chain of matmuls; the plan never
  goes below one node's operands and results (found by the review)."""

  def test_planned_peak_is_never_below_the_lower_bound(self):
    def step(w, x):
      a = x
      for _ in range(4):
        a = jnp.tanh(a @ w)
      return w + a.mean(), a.sum()
    n = 256
    rng = np.random.default_rng(11)
    w = jnp.asarray(rng.standard_normal((n, n)) / n, jnp.float32)
    x = jnp.asarray(rng.standard_normal((n, n)), jnp.float32)
    sess = js.Session()
    gid = sess.compile(step, w, x, state_argnums=0)
    memory = sess.report(gid).memory
    self.assertGreaterEqual(memory.peak_bytes, memory.lower_bound_bytes)
    self.assertTrue(all(row.source.startswith("xla memory_analysis")
                        for row in memory.partitions))


if __name__ == "__main__":
  absltest.main()
