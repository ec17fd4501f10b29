"""AssignStream and loop sink over host partitions (issue 7): launch order
and overlap, N plan runs all-or-nothing, and failures that leave the state
as it was - bit for bit against jax.jit."""
from absl.testing import absltest
import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np

import jaxsession as js

from exact import assert_same_bits, count_compiles
from host_ops import _cb, _f32, _host_affine


class StreamTest(absltest.TestCase):

  def check_streams(self, graph):
    self.assertEqual([n for p in graph.partitions for n in p.nodes], graph.nodes)
    for part in graph.partitions:
      self.assertEqual(part.stream, 1 if part.place == "host" else 0)
      for node in part.nodes:
        self.assertEqual(node.stream, part.stream, f"node {node.id}")

  def test_independent_host_work_overlaps_the_device(self):
    def program(x, y):
      h = _cb(_host_affine, y)  # written first: the launch order moves the device ahead
      return jnp.tanh(x) * 3.0 + x, h
    sess = js.Session()
    x, y = _f32(64), _f32(64)
    gid = sess.compile(program, x, y)
    graph = sess.graph(gid)
    self.assertEqual([p.place for p in graph.partitions], ["device", "host"])
    self.check_streams(graph)
    host = graph.partitions[1]
    self.assertEqual(host.stream, 1)
    self.assertEqual(host.overlaps, [0])
    self.assertEqual(graph.partitions[0].overlaps, [])
    self.assertIn("launched ahead of host partition", graph.partitions[0].reason)
    self.assertEqual([p.stream for p in sess.report(gid).partitions], [0, 1])
    dump = graph.dump()
    self.assertIn("stream=0", dump)
    self.assertIn("stream=1", dump)
    self.assertIn("overlaps device partition(s) [0]", dump)
    x, y = _f32(64), _f32(64)
    assert_same_bits(sess.run(gid, x, y), jax.jit(program)(x, y), "overlap")

  def test_host_reading_the_device_result_does_not_overlap(self):
    def program(x):
      return _cb(_host_affine, jnp.tanh(x) * 3.0)
    sess = js.Session()
    gid = sess.compile(program, _f32(64))
    graph = sess.graph(gid)
    self.assertEqual([p.place for p in graph.partitions], ["device", "host"])
    self.check_streams(graph)
    self.assertEqual(graph.partitions[1].overlaps, [])
    self.assertNotIn("overlaps", graph.dump())
    x = _f32(64)
    assert_same_bits(sess.run(gid, x), jax.jit(program)(x), "no overlap")


# -- 4. loop sink over host partitions, 5. failures with donated state -------

class InjectedFailure(Exception):
  pass


def _host_mix(s, x, flag):
  """Host op of the stateful step: raises on a non-zero flag."""
  if int(np.asarray(flag)) != 0:
    raise InjectedFailure(f"flag {int(np.asarray(flag))}")
  return (np.asarray(s) * np.float32(0.5) + np.asarray(x)).astype(np.float32)


def stateful_step(w, v, x, flag):
  """d h d: `v` is updated before the callback (partition 0: the callback
  reads it), `w` after it (its last reader is partition 2)."""
  new_v = v * 0.75 + x
  s = jnp.tanh(w) * 2.0 - new_v
  h = _cb(_host_mix, s, x, flag, like=x)
  new_w = w * 0.5 + h
  return new_w, new_v, new_w * x - new_v


def _single_runs(xs, flags, w, v):
  sess = js.Session()
  gid = sess.compile(stateful_step, w, v, xs[0], flags[0], state_argnums=(0, 1))
  outs = [sess.run(gid, xs[t], flags[t]) for t in range(len(xs))]
  return jnp.stack(outs), sess.get_state(gid)


def _jit_runs(xs, flags, w, v):
  step = jax.jit(stateful_step)
  outs = []
  for t in range(len(xs)):
    w, v, out = step(w, v, xs[t], flags[t])
    outs.append(out)
  return jnp.stack(outs), (w, v)


class LoopSinkHostTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.w, self.v = _f32(32), _f32(32)
    self.xs = _f32(4, 32)
    self.sess = js.Session()
    self.gid = self.sess.compile(stateful_step, self.w, self.v, self.xs[0], jnp.int32(0),
                                 state_argnums=(0, 1))

  def test_sunk_steps_equal_single_runs(self):
    self.assertGreater(len(self.sess.report(self.gid).partitions), 1)
    flags = jnp.zeros(4, jnp.int32)
    outs = self.sess.run(self.gid, self.xs, flags, steps=4)
    self.assertEqual(self.sess.report(self.gid).loop_sink, {4: "the plan, once per step"})
    want_outs, want_state = _single_runs(self.xs, flags, self.w, self.v)
    assert_same_bits(outs, want_outs, "sunk outputs")
    assert_same_bits(self.sess.get_state(self.gid), want_state, "sunk state")
    jit_outs, jit_state = _jit_runs(self.xs, flags, self.w, self.v)
    assert_same_bits(outs, jit_outs, "sunk vs jit outputs")
    assert_same_bits(self.sess.get_state(self.gid), jit_state, "sunk vs jit state")

  def test_failure_at_step_two_of_four_keeps_the_state(self):
    self.sess.run(self.gid, self.xs, jnp.zeros(4, jnp.int32), steps=4)  # state moved on
    before = self.sess.get_state(self.gid)
    bad = jnp.asarray([0, 0, 1, 0], jnp.int32)
    with self.assertRaises(js.HostOpError) as caught:
      self.sess.run(self.gid, self.xs, bad, steps=4)
    self.assertIsInstance(caught.exception.__cause__, InjectedFailure)
    self.assertEqual(str(caught.exception.__cause__), "flag 1")  # raised at step 2
    self.assertIn("pure_callback", str(caught.exception))
    assert_same_bits(self.sess.get_state(self.gid), before, "state after failure")
    # and the session goes on from exactly that state
    good = jnp.zeros(4, jnp.int32)
    outs = self.sess.run(self.gid, self.xs, good, steps=4)
    want_outs, want_state = _single_runs(self.xs, good, *before)
    assert_same_bits(outs, want_outs, "after failure")
    assert_same_bits(self.sess.get_state(self.gid), want_state, "state after recovery")

  def test_dead_callback_leaves_one_executable(self):
    def step(w, x):
      _cb(_host_affine, x * 2.0)  # unused: DCE drops it
      return w * 0.5 + x, jnp.tanh(w) - x
    self.check_one_executable(js.Session(), step)

  def test_callback_kept_in_the_executable_leaves_one_executable(self):
    def step(w, x):
      return w * 0.5 + _cb(_host_affine, x), jnp.tanh(w) - x
    self.check_one_executable(js.Session(js.SessionOptions(host_callbacks=False)), step)

  def test_failure_inside_one_sunk_executable_keeps_the_state(self):
    sess = js.Session(js.SessionOptions(host_callbacks=False))
    gid = sess.compile(stateful_step, self.w, self.v, self.xs[0], jnp.int32(0),
                       state_argnums=(0, 1))
    self.assertLen(sess.report(gid).partitions, 1)
    sess.run(gid, self.xs, jnp.zeros(4, jnp.int32), steps=4)
    self.assertEqual(sess.report(gid).loop_sink, {4: "one executable (lax.scan)"})
    before = sess.get_state(gid)
    with self.assertRaises(js.HostOpError) as caught:
      sess.run(gid, self.xs, jnp.asarray([0, 0, 1, 0], jnp.int32), steps=4)
    self.assertIsInstance(caught.exception.__cause__, InjectedFailure)
    assert_same_bits(sess.get_state(gid), before, "state after a failure in the scan")
    good = jnp.zeros(4, jnp.int32)
    outs = sess.run(gid, self.xs, good, steps=4)
    want_outs, want_state = _jit_runs(self.xs, good, *before)
    assert_same_bits(outs, want_outs, "sunk scan after failure")
    assert_same_bits(sess.get_state(gid), want_state, "sunk scan state after failure")

  def check_one_executable(self, sess, step):
    w, xs = _f32(16), _f32(3, 16)
    gid = sess.compile(step, w, xs[0], state_argnums=0)
    self.assertLen(sess.report(gid).partitions, 1)
    self.assertEqual(sess.report(gid).partitions[0].place, "device")
    outs = sess.run(gid, xs, steps=3)
    self.assertEqual(sess.report(gid).loop_sink[3], "one executable (lax.scan)")
    jit_step, want_w, want = jax.jit(step), w, []
    for t in range(3):
      want_w, out = jit_step(want_w, xs[t])
      want.append(out)
    assert_same_bits(outs, jnp.stack(want), "one-executable sunk outputs")
    assert_same_bits(sess.get_state(gid)[0], want_w, "one-executable sunk state")


class HostFailureWithDonationTest(absltest.TestCase):

  def test_failed_host_op_leaves_donated_state_intact(self):
    w, v, x = _f32(32), _f32(32), _f32(32)
    sess = js.Session()
    gid = sess.compile(stateful_step, w, v, x, jnp.int32(0), state_argnums=(0, 1))
    graph = sess.graph(gid)
    self.assertEqual([p.place for p in graph.partitions], ["device", "host", "device"])
    donated = {d.state.name: d for d in sess.report(gid).donations}
    # w dies in the last partition, after the callback: donated to it;
    # v is updated before the callback, which could fail: kept
    w_decision, = [d for name, d in donated.items() if "state 0" in name]
    v_decision, = [d for name, d in donated.items() if "state 1" in name]
    self.assertTrue(w_decision.donated, w_decision.reason)
    self.assertEqual(w_decision.partition, 2)
    self.assertFalse(v_decision.donated, v_decision.reason)
    self.assertIn("can fail", v_decision.reason)

    sess.run(gid, x, jnp.int32(0))  # a good run first: the slots hold session buffers
    before = sess.get_state(gid)
    with self.assertRaises(js.HostOpError) as caught:
      sess.run(gid, _f32(32), jnp.int32(3))
    self.assertIsInstance(caught.exception.__cause__, InjectedFailure)
    assert_same_bits(sess.get_state(gid), before, "state after the failed run")

    x2 = _f32(32)
    got = sess.run(gid, x2, jnp.int32(0))
    want_w, want_v, want = jax.jit(stateful_step)(*before, x2, jnp.int32(0))
    assert_same_bits(got, want, "the next good run")
    assert_same_bits(sess.get_state(gid), (want_w, want_v), "state after the next run")


class StepsValuesTest(absltest.TestCase):
  """A new steps value does not compile its own executable: after the first,
  every steps value runs as chunks of power-of-two steps executables."""

  @staticmethod
  def step(w, x):
    w = w * 0.9 + jnp.tanh(x)
    return w, {"s": jnp.sum(w), "m": w.max()}

  def test_other_steps_values_reuse_power_of_two_chunks(self):
    rng = np.random.default_rng(22)
    w = rng.standard_normal(8).astype(np.float32)
    xs = rng.standard_normal((100, 8)).astype(np.float32)
    xs[3, :2] = [-0.0, np.inf]
    compiles = count_compiles(self)
    sess = js.Session()
    gid = sess.compile(self.step, w, xs[0], state_argnums=0)
    scan = jax.jit(lambda w, xs: jax.lax.scan(self.step, w, xs))
    plan = [100, 37, 100, 5, 69, 3, 38]
    wants, ref = [], w
    for n in plan:  # jax.jit's side first: its compiles are not counted
      ref, out = scan(ref, xs[:n])
      wants.append((ref, out))
    del compiles[:]
    counts = []
    for n, (want_w, want) in zip(plan, wants):
      got = sess.run(gid, xs[:n], steps=n)
      assert_same_bits(got, want, f"steps={n}")
      assert_same_bits(sess.get_state(gid)[0], want_w, f"state after steps={n}")
      counts.append(len(compiles))
    # 100 exact (1); 37 = 32 + 4 + 1: three step executables plus the split of
    # its arguments and the join of its outputs (5); 100 again: nothing; 5 =
    # 4 + 1: split and join only (2); 69 = 64 + 4 + 1: 64, split, join (3);
    # 3 = 2 + 1: 2, split, join (3); 38 = 32 + 4 + 2: split, join (2)
    self.assertEqual(counts, [1, 6, 6, 8, 11, 14, 16])
    self.assertEqual(sorted(k for k, _ in sess._entry(gid).chunks), [1, 2, 4, 32, 64, 100])
    self.assertIn("chunks of 32 + 4 + 1 steps", sess.report(gid).loop_sink[37])

  def test_the_first_steps_value_under_another_in_axes_is_one_scan(self):
    # a break-it find: it ran as chunks of 4 + 1, 1 ulp off jax.jit's one scan
    rng = np.random.default_rng(0)
    def step(w, m, x, lr, tbl):
      y = jnp.tanh(x @ w) * lr + tbl[m % 4]
      return w - lr * (x.T @ y), m + 1, (jnp.sum(y), y)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    w, m, xs, tbl = f32(3, 3), np.int32(0), f32(5, 2, 3), jnp.asarray(f32(4))
    lr = np.float32(0.1)
    scan = jax.jit(lambda w, m, xs: jax.lax.scan(
        lambda c, x: (lambda w, m, o: ((w, m), o))(*step(*c, x, lr, tbl)), (w, m), xs))
    sess = js.Session()
    gid = sess.compile(step, w, m, xs[0], lr, tbl, state_argnums=(0, 1))
    sess.run(gid, xs, f32(5) * 0.1, tbl, steps=5, in_axes=(0, 0, None))
    sess.set_state(gid, w, m)
    got = sess.run(gid, xs, lr, tbl, steps=5, in_axes=(0, None, None))
    state, want = scan(w, m, xs)
    self.assertEqual(sess.report(gid).loop_sink[5], "one executable (lax.scan)")
    assert_same_bits(got, want, "outputs")
    assert_same_bits(sess.get_state(gid), state, "state")

  def test_a_chunked_run_gives_the_bits_of_its_chunks_scans_in_sequence(self):
    # what docs/numerics.md promises for a chunked run: jax.jit(lax.scan) over
    # 8 steps, then over 1, bit for bit (a single scan over 9 steps may differ
    # in the last bits: XLA compiles a 1-step loop otherwise)
    rng = np.random.default_rng(24)
    T = 8
    def step(params, cache, pos, count, x):
      h = jnp.tanh(x @ params["w"] + params["b"])
      cache = {"k": cache["k"].at[pos % T].set(h), "v": cache["v"].at[pos % T].set(h * 2.0)}
      out = (cache["k"] * h).sum(-1).sum() + cache["v"].sum() * 0.5 + jnp.max(cache["k"])
      return params, cache, pos + 1, count + jnp.int32(7), out
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    params = {"w": f32(16, 32), "b": f32(32)}
    params["b"][:2] = [-0.0, 3e38]
    cache = {"k": f32(T, 32), "v": f32(T, 32)}
    pos, count, xs = np.int32(5), np.int32(2**31 - 40), f32(9, 16)
    @jax.jit
    def scan(params, cache, pos, count, xs):
      def body(c, x):
        *s, o = step(*c, x)
        return tuple(s), o
      return jax.lax.scan(body, (params, cache, pos, count), xs)
    s8, o8 = scan(params, cache, pos, count, xs[:8])
    s9, o1 = scan(*s8, xs[8:])
    sess = js.Session()
    gid = sess.compile(step, params, cache, pos, count, xs[0], state_argnums=(0, 1, 2, 3))
    sess.run(gid, xs[:8], steps=8)
    sess.set_state(gid, params, cache, pos, count)
    got = sess.run(gid, xs, steps=9)
    self.assertIn("chunks of 8 + 1 steps", sess.report(gid).loop_sink[9])
    assert_same_bits(got, np.concatenate([o8, o1]), "outputs of steps=9")
    assert_same_bits(sess.get_state(gid), s9, "state after steps=9")

  def test_a_failing_chunk_leaves_the_state_as_it_was(self):
    rng = np.random.default_rng(23)
    w = rng.standard_normal(8).astype(np.float32)
    xs = rng.standard_normal((40, 8)).astype(np.float32)
    calls = []
    def host(a):
      calls.append(1)
      if len(calls) == 30:  # step 30 of 37: in the second chunk (32 + 4 + 1)
        raise ValueError("boom at step 30")
      return np.float32(np.abs(a).max())
    def step(w, x):
      m = jax.pure_callback(host, jax.ShapeDtypeStruct((), np.float32), x)
      return w * 0.5 + x, m
    sess = js.Session()
    gid = sess.compile(step, w, xs[0], state_argnums=0)
    sess.run(gid, xs[:2], steps=2)
    before = np.asarray(sess.get_state(gid)[0]).tobytes()
    del calls[:]
    calls.extend([1] * 2)  # so that the 30th call of the 37-step run fails
    with self.assertRaises(js.HostOpError):
      sess.run(gid, xs[:37], steps=37)
    self.assertEqual(np.asarray(sess.get_state(gid)[0]).tobytes(), before)


  def test_a_chunked_run_with_an_ordered_effect(self):
    # the chunks' output types were read from Compiled.out_info, which jax
    # refuses for an executable with ordered effects: every steps value after
    # the first was a bare AssertionError (a break-it find)
    seen = []
    def step(s, x):
      jax.experimental.io_callback(lambda v: seen.append(float(v)), None, x[0], ordered=True)
      return s + x, s
    rng = np.random.default_rng(25)
    s0, xs = rng.standard_normal(4).astype(np.float32), rng.standard_normal((7, 4)).astype(
        np.float32)
    sess = js.Session()
    gid = sess.compile(step, s0, xs[0], state_argnums=0)
    sess.run(gid, xs[:5], steps=5)
    sess.set_state(gid, s0)
    del seen[:]
    got = sess.run(gid, xs, steps=7)
    self.assertIn("chunks of 4 + 2 + 1 steps", sess.report(gid).loop_sink[7])
    state, want = jax.jit(lambda s, xs: jax.lax.scan(step, s, xs))(s0, xs)
    assert_same_bits(got, want, "outputs of steps=7")
    assert_same_bits(sess.get_state(gid)[0], state, "state after steps=7")
    self.assertEqual(seen, [float(x) for x in xs[:, 0]] * 2)  # the session's, then jit's

  def test_weak_types_as_a_scan_keeps_them(self):
    # a state leaf bound from a Python scalar stays weak through sunk runs (it
    # came back strong, and set_state(get_state()) was refused where the weak
    # type changes the program); a chunked run's outputs keep theirs, a weak
    # bool's too
    step = lambda lr, w, x: (lr * 0.5, w - lr * x, (lr * 2.0, w.sum(), lr > 0.01))  # noqa: E731
    w = jnp.asarray(np.random.default_rng(26).standard_normal(4), jnp.bfloat16)
    xs = jnp.asarray(np.random.default_rng(27).standard_normal((7, 4)), jnp.bfloat16)
    sess = js.Session()
    gid = sess.compile(step, 0.1, w, xs[0], state_argnums=(0, 1))
    scan = jax.jit(lambda lr, w, xs: jax.lax.scan(lambda c, x: (step(*c, x)[:2], step(
        *c, x)[2]), (lr, w), xs))
    for n in (5, 7):  # 7: chunks of 4 + 2 + 1
      sess.set_state(gid, 0.1, w)
      got = sess.run(gid, xs[:n], steps=n)
      (lr, new_w), want = scan(0.1, w, xs[:n])
      assert_same_bits(got, want, f"outputs of steps={n}")
      self.assertTrue(got[0].weak_type and want[0].weak_type)
      self.assertTrue(got[2].weak_type and want[2].weak_type)  # a bool: joins made it strong
      state = sess.get_state(gid)
      self.assertTrue(state[0].weak_type and lr.weak_type)
      assert_same_bits(state, (lr, new_w), f"state after steps={n}")
      sess.set_state(gid, *state)  # the round trip is accepted


  def test_stacked_steps_weak_typed_otherwise_are_refused(self):
    # compiled for a Python-scalar x beside a bfloat16 state, the program is
    # bf16; strongly typed f32 steps make jax.jit's scan another program (f32),
    # so they are refused as a single run's strong scalar is (they ran the bf16
    # program: a break-it find)
    step = lambda w, x: (w + x, w * x)  # noqa: E731
    w = jnp.asarray(np.random.default_rng(28).standard_normal(4), jnp.bfloat16)
    sess = js.Session()
    gid = sess.compile(step, w, 1.5, state_argnums=0)
    strong = jnp.asarray([1.5, 2.5, -0.0, 4.5], jnp.float32)
    for steps in (strong, np.asarray(strong, np.float64)):  # float64: f32 to jax, strong
      with self.assertRaisesRegex(js.InputError, r"stacked steps\) is strongly typed.*weak "
                                  r"type changes the program"):
        sess.run(gid, steps, steps=4)
    assert_same_bits(sess.get_state(gid)[0], w, "state after the refused run")
    weak = jnp.full((4,), 2.5)  # a Python scalar's steps: weakly typed
    self.assertTrue(weak.weak_type)
    got = sess.run(gid, weak, steps=4)
    state, want = jax.jit(lambda w, xs: jax.lax.scan(step, w, xs))(w, weak)
    assert_same_bits(got, want, "outputs over weak steps")
    assert_same_bits(sess.get_state(gid)[0], state, "state over weak steps")


  def test_a_captured_constant_folds_as_jax_jit_folds_it(self):
    # XLA folds sign(-0.0) of a constant to +0.0 in a straight-line program,
    # where jax.jit's scan computes -0.0 at run time (it passes a captured jax
    # array in). The fold leaves a float zero to XLA (optimizer_passes/fold.py),
    # so a single run equals jax.jit and a sunk run equals jax.jit's scan, for
    # a captured jax array and a NumPy scalar (which the scan embeds) alike;
    # the sunk run folded it as the single run did before
    s0 = jnp.asarray([1.5, -2.0], jnp.float32)
    xs = jnp.ones(3, jnp.float32)
    for c in (jnp.float32(-0.0), np.float32(-0.0)):
      with self.subTest(c=type(c).__name__):
        step = lambda s, x, c=c: (s * jnp.sign(c), x)  # noqa: E731
        sess = js.Session()
        gid = sess.compile(step, s0, jnp.float32(1.0), state_argnums=0)
        sess.run(gid, jnp.float32(1.0))
        assert_same_bits(sess.get_state(gid)[0], jax.jit(step)(s0, jnp.float32(1.0))[0],
                         "single run vs jax.jit")
        sess.set_state(gid, s0)
        sess.run(gid, xs, steps=3)
        want, _ = jax.jit(lambda s, xs, step=step: jax.lax.scan(step, s, xs))(s0, xs)
        assert_same_bits(sess.get_state(gid)[0], want, "sunk run vs jax.jit's scan")

  def test_a_captured_arrays_exp_folds_as_in_a_single_run(self):
    # docs/numerics.md: the loop body embeds the graph's constants, so XLA
    # folds exp(c) there (its evaluator, libm) as in a single run and a
    # straight-line jax.jit, where jax.jit's scan passes a captured jax array
    # in and computes it at run time (XLA's own exp: differs in some ulps)
    s0 = jnp.asarray([1.5, -2.0], jnp.float32)
    xs = jnp.ones(3, jnp.float32)
    rng = np.random.default_rng(30)
    scan_differs = 0
    for c in rng.uniform(-5, 5, 40).astype(np.float32):
      c = jnp.float32(c)
      step = lambda s, x, c=c: (s * jnp.exp(c) * jnp.tanh(c), x)  # noqa: E731
      sess = js.Session()
      gid = sess.compile(step, s0, jnp.float32(1.0), state_argnums=0)
      sess.run(gid, xs, steps=3)
      sunk = sess.get_state(gid)[0]
      sess.set_state(gid, s0)
      one = jax.jit(step)
      want = s0
      for x in xs:  # three single runs, each equal to a jax.jit step
        sess.run(gid, x)
        want = one(want, x)[0]
        assert_same_bits(sess.get_state(gid)[0], want, "single run vs jax.jit")
      assert_same_bits(sunk, want, "sunk run vs three single runs")
      want, _ = jax.jit(lambda s, xs, step=step: jax.lax.scan(step, s, xs))(s0, xs)
      scan_differs += not np.array_equal(np.asarray(sunk), np.asarray(want))
    self.assertGreater(scan_differs, 0)  # the documented difference is real


  def test_output_weak_types_follow_the_steps(self):
    # where the weak type does not change the program (float32 throughout),
    # a sunk run's outputs are typed as jax.jit's scan types them for the
    # steps it is given, as a single run's follow its scalars (they kept the
    # compiled example's: a break-it find)
    step = lambda s, x: (s + x, (x * 2.0, x > 1.0))  # noqa: E731
    s0 = jnp.asarray(np.random.default_rng(29).standard_normal(3), jnp.float32)
    scan = jax.jit(lambda s, xs: jax.lax.scan(step, s, xs))
    for example, steps in ((1.5, jnp.asarray([1.5, -0.0, 2.5], jnp.float32)),
                           (jnp.float32(1.5), jnp.full((3,), 2.5))):
      sess = js.Session()
      gid = sess.compile(step, s0, example, state_argnums=0)
      for n in (3, 2):  # 2 after 3: chunks of 2
        with self.subTest(example=type(example).__name__, steps=n):
          sess.set_state(gid, s0)
          got = sess.run(gid, steps[:n], steps=n)
          state, want = scan(s0, steps[:n])
          assert_same_bits(got, want, "outputs")
          assert_same_bits(sess.get_state(gid)[0], state, "state")
          self.assertEqual([x.weak_type for x in jax.tree.leaves(got)],
                           [x.weak_type for x in jax.tree.leaves(want)])


  def test_a_plan_passing_a_python_scalar_through_keeps_it_weak(self):
    # a plan (host callback) run with in_axes None returns the scalar it was
    # given: stacked as jax.jit's scan stacks it, weakly typed (it came back
    # strong: a break-it find)
    def step(s, a):
      y = jax.pure_callback(lambda v: np.asarray(v) * np.float32(0.5),
                            jax.ShapeDtypeStruct((), np.float32), s)
      return s + a * y, (a, a * 2)
    s0 = jnp.float32(1.25)
    sess = js.Session()
    gid = sess.compile(step, s0, 1.5, state_argnums=0)
    got = sess.run(gid, 1.5, steps=4, in_axes=(None,))
    state, want = jax.jit(lambda s: jax.lax.scan(lambda c, _: step(c, 1.5), s, None,
                                                 length=4))(s0)
    assert_same_bits(got, want, "outputs")
    assert_same_bits(sess.get_state(gid)[0], state, "state")
    self.assertEqual([x.weak_type for x in got], [x.weak_type for x in want])
    self.assertTrue(got[0].weak_type)


if __name__ == "__main__":
  absltest.main()
