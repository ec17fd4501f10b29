"""The run paths of stateless graphs and plans (Session.run's direct call,
the plan's generated function, the host ops between executables) against
jax.jit: bad, weak, deleted and other-device arguments, raising callbacks,
disable_jit, debug_nans, literal outputs, and a failure's effect on the
state."""
from absl.testing import absltest
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from subproc import run_json
from exact import assert_equal_signed


class DisableJitCallbackCountTest(absltest.TestCase):

  def test_a_plans_callback_runs_once_per_step(self):
    # a plan that starts with a host op, started under disable_jit, ran the
    # callback, then its executable refused: the retry and the op-by-op run
    # called the callback again (3 calls a run, jax.jit: 1)
    calls = []

    def host(a):
      calls.append(1)
      if np.isnan(np.asarray(a)).any():
        raise ValueError("no nan here")
      return (np.asarray(a) * 2).astype(np.float32)

    def step(w, x):
      h = jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
      return w + h, jnp.sum(h * w)
    rng = np.random.default_rng(41)
    w = jnp.asarray(rng.standard_normal(4), jnp.float32)
    xs = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)
    sess = js.Session()
    sid = sess.compile(step, w, xs[0], state_argnums=0)
    pid = sess.compile(lambda x: step(x, x)[1], xs[0])
    self.assertGreater(len(sess.report(sid).partitions), 1)
    with jax.disable_jit():
      calls.clear()
      want_w, want = jax.jit(step)(w, xs[0])
      self.assertEqual(len(calls), 1)
      calls.clear()
      assert_equal_signed(sess.run(sid, xs[0]), want)
      assert_equal_signed(sess.get_state(sid)[0], want_w)
      self.assertEqual(len(calls), 1)
      calls.clear()
      sess.run(sid, xs, steps=3)
      self.assertEqual(len(calls), 3)
      calls.clear()
      assert_equal_signed(sess.run(pid, xs[1]), jax.jit(lambda x: step(x, x)[1])(xs[1]))
      self.assertEqual(len(calls), 2)  # the session's run, then jax.jit's
      # a callback that raises there is a HostOpError naming the node, as
      # outside disable_jit (it was the raw exception), and the state stays
      before = np.asarray(sess.get_state(sid)[0])
      with self.assertRaisesRegex(js.HostOpError, r"pure_callback.*ValueError"):
        sess.run(sid, xs[0].at[0].set(np.nan))
      assert_equal_signed(sess.get_state(sid)[0], before)


class StatelessRunTest(absltest.TestCase):
  """A stateless graph (one executable or a plan): Session.run calls its
  program's run itself (Entry.direct, dispatch.py's fast path) and recovers a refusal as
  Runner.call does - conformed and run, an InputError naming the argument,
  op by op under jax.disable_jit()."""

  def test_the_direct_call_equals_jit_and_recovers(self):
    def f(x, y):
      return jnp.where(x > y, x * y, x - y), jnp.sum(x)
    rng = np.random.default_rng(31)
    x = rng.standard_normal(6).astype(np.float32)
    x[:3] = [-0.0, np.nan, np.inf]
    y = jnp.asarray(rng.standard_normal(6), jnp.float32)
    sess = js.Session()
    gid = sess.compile(f, jnp.asarray(x), y)
    for got, want in ((sess.run(gid, jnp.asarray(x), y), jax.jit(f)(jnp.asarray(x), y)),
                      (sess.run(gid, x, y), jax.jit(f)(x, y)),   # numpy: conformed
                      (sess.run(gid, x, np.asarray(y)), jax.jit(f)(x, np.asarray(y)))):
      for g, w in zip(got, want):
        assert_equal_signed(g, w)
    with self.assertRaisesRegex(js.InputError, r"argument 1 .*expected f32\[6\], got f32\[5\]"):
      sess.run(gid, x, jnp.ones(5))
    dead = jnp.asarray(x)
    dead.delete()
    with self.assertRaisesRegex(js.InputError, r"argument 0 .*deleted"):
      sess.run(gid, dead, y)
    with jax.disable_jit():
      got, want = sess.run(gid, x, y), jax.jit(f)(x, y)
    for g, w in zip(got, want):
      assert_equal_signed(g, w)
    sess.release(gid)
    with self.assertRaises(js.UnknownGraphError):
      sess.run(gid, x, y)

  def test_a_stateless_plan_is_called_directly_too(self):
    def host(a):
      if np.any(np.asarray(a) > 100):
        raise RuntimeError("host refuses")
      return np.cos(np.asarray(a)).astype(np.float32)

    def f(x, w):
      y = jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x * w)
      return y * w, x - w
    rng = np.random.default_rng(32)
    x = jnp.asarray(rng.standard_normal(4), jnp.float32)
    w = jnp.asarray(rng.standard_normal(4), jnp.float32)
    sess = js.Session()
    gid = sess.compile(f, x, w)
    self.assertGreater(len(sess.report(gid).partitions), 1)
    for args in ((x, w), (np.asarray(x), w)):
      for g, want in zip(sess.run(gid, *args), jax.jit(f)(*args)):
        assert_equal_signed(g, want)
    with self.assertRaisesRegex(js.InputError, r"argument 1 .*expected f32\[4\]"):
      sess.run(gid, x, jnp.ones(3))
    with self.assertRaisesRegex(js.HostOpError, r"host refuses"):
      sess.run(gid, x + 1000, w * 0 + 1)
    with self.assertRaisesRegex(js.InputError, r"expected 2 positional argument"):
      sess.run(gid, x)
    dead = x + 0
    dead.delete()
    with self.assertRaisesRegex(js.InputError, r"argument 0 .*deleted"):
      sess.run(gid, dead, w)
    with jax.disable_jit():
      for g, want in zip(sess.run(gid, x, w), jax.jit(f)(x, w)):
        assert_equal_signed(g, want)
    one = sess.compile(lambda x, w: f(x, w)[0], x, w)  # one output: one generated function
    for args in ((x, w), (np.asarray(x), np.asarray(w)), (x, np.asarray(w))):
      assert_equal_signed(sess.run(one, *args), jax.jit(lambda x, w: f(x, w)[0])(*args))
    with self.assertRaisesRegex(js.HostOpError, r"host refuses"):
      sess.run(one, x + 1000, w * 0 + 1)
    with self.assertRaisesRegex(js.InputError, r"argument 1 .*expected f32\[4\]"):
      sess.run(one, x, jnp.ones(3))


class PlanUnreadArgumentTest(absltest.TestCase):

  def test_an_argument_nothing_reads_is_checked_as_in_one_executable(self):
    # a plan checked only the leaves an op reads: f32[7], i32[4] or a string
    # for an unread f32[4] argument ran, where one executable refuses them
    def f(x, unused, w):
      h = jax.pure_callback(lambda a: np.tanh(np.asarray(a)).astype(np.float32),
                            jax.ShapeDtypeStruct(x.shape, x.dtype), x * w)
      return h + w
    rng = np.random.default_rng(14)
    x, u, w = (jnp.asarray(rng.standard_normal(4), jnp.float32) for _ in range(3))
    sess = js.Session()
    gid = sess.compile(f, x, u, w)
    self.assertGreater(len(sess.report(gid).partitions), 1)
    assert_equal_signed(sess.run(gid, x, u * 2, w), jax.jit(f)(x, u * 2, w))
    for bad in (jnp.ones(7), jnp.ones(4, jnp.int32), "abc"):
      with self.assertRaisesRegex(js.InputError, r"argument 1 \(position 1"):
        sess.run(gid, x, bad, w)


class DeferredCallbackFailureTest(absltest.TestCase):
  """A callback inside an executable whose input is still being computed
  runs after the call returned: its failure showed only when the outputs
  were read, after a stateful run had committed them as the state (10 of 10
  runs here). A stateful graph's partitions with callbacks are waited for."""

  def test_the_failure_is_a_host_op_error_and_the_state_stays(self):
    def bad(v):
      if np.any(np.asarray(v) > 10):
        raise ValueError("host says no")
      return np.asarray(v)

    def inside(w, x):  # the callback in the one executable
      y = jax.pure_callback(bad, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
      return w + jnp.log(y), jnp.sum(w)

    def in_a_plan(w, x):  # in a cond, on the device, beside a host partition
      y = lax.cond(x[0] > 0,
                   lambda v: jax.pure_callback(bad, jax.ShapeDtypeStruct(v.shape, v.dtype), v),
                   lambda v: v, x)
      z = jax.pure_callback(lambda a: np.asarray(a) * np.float32(2),
                            jax.ShapeDtypeStruct(x.shape, x.dtype), y)
      return w + jnp.log(z), jnp.sum(w)

    @jax.jit
    def slow(a):  # tens of ms of work: its result is not ready when run is called
      for _ in range(8):
        a = jnp.tanh(a @ a)
      return a[0, :4] * 0 + 100.0
    rng = np.random.default_rng(16)
    big = jnp.asarray(rng.standard_normal((512, 512)) / 30, jnp.float32)
    slow(big).block_until_ready()
    w0 = jnp.asarray(rng.uniform(1, 2, 4), jnp.float32)
    x0 = jnp.asarray(rng.uniform(1, 2, 4), jnp.float32)
    for fn, options in ((inside, js.SessionOptions(host_callbacks=False)),
                        (in_a_plan, js.SessionOptions())):
      sess = js.Session(options)
      gid = sess.compile(fn, w0, x0, state_argnums=0)
      for _ in range(3):
        with self.assertRaisesRegex(js.HostOpError, r"host says no"):
          sess.run(gid, slow(big))
        assert_equal_signed(sess.get_state(gid)[0], w0)
      want_w, want = jax.jit(fn)(w0, x0)
      assert_equal_signed(sess.run(gid, x0), want)
      assert_equal_signed(sess.get_state(gid)[0], want_w)


class ReleasedDuringRunTest(absltest.TestCase):

  def test_the_runs_own_error_is_reported(self):
    # a callback that fails while its graph is released: the run's error (a
    # HostOpError naming the callback) was hidden behind UnknownGraphError
    sess, box = js.Session(), {}

    def cb(a):
      sess.release(box["gid"])
      raise ValueError("after release")
    f = lambda x: jax.pure_callback(cb, jax.ShapeDtypeStruct(x.shape, x.dtype), x * 2) + 1  # noqa: E731
    box["gid"] = sess.compile(f, jnp.ones(4))
    with self.assertRaisesRegex(js.HostOpError, r"after release"):
      sess.run(box["gid"], jnp.ones(4))
    with self.assertRaises(js.UnknownGraphError):
      sess.run(box["gid"], jnp.ones(4))


class HostMemoryArgumentTest(absltest.TestCase):

  def test_an_argument_in_host_memory_is_moved_to_the_device(self):
    # an argument with memory_kind pinned_host / unpinned_host was a raw
    # ValueError from the executable's check (the retry refused it again)
    def plan(x):
      y = jax.pure_callback(lambda a: np.asarray(a) + np.float32(1),
                            jax.ShapeDtypeStruct(x.shape, x.dtype), jnp.sin(x))
      return jnp.cos(y) * 2
    single = lambda x: jnp.cos(jnp.sin(x)) * 2  # noqa: E731
    x = jnp.asarray(np.random.default_rng(15).standard_normal(4), jnp.float32)
    sess = js.Session()
    for f in (plan, single):
      gid = sess.compile(f, x)
      for kind in ("pinned_host", "unpinned_host"):
        xm = jax.device_put(x, jax.sharding.SingleDeviceSharding(jax.devices()[0],
                                                                 memory_kind=kind))
        assert_equal_signed(sess.run(gid, xm), jax.jit(f)(xm))


class PlanLiteralOutputTest(absltest.TestCase):

  def test_a_plans_literal_outputs_are_typed_as_jits(self):
    # a literal output of a multi-partition plan was made strong (np.asarray
    # then jnp.asarray); jax.jit returns 2.0 as a weak f32
    def f(x):
      h = jax.pure_callback(lambda a: np.sin(np.asarray(a)).astype(np.float32),
                            jax.ShapeDtypeStruct(x.shape, x.dtype), x * 2)
      return h * x, 2.0, 3, jnp.float32(-0.0), True
    x = jnp.asarray(np.random.default_rng(8).standard_normal(4), jnp.float32)
    sess = js.Session()
    gid = sess.compile(f, x)
    self.assertGreater(len(sess.report(gid).partitions), 1)
    got, want = sess.run(gid, x), jax.jit(f)(x)
    for g, w in zip(got, want):
      self.assertEqual((g.dtype, g.weak_type), (w.dtype, w.weak_type))
      assert_equal_signed(g, w)
      assert_equal_signed(np.signbit(g), np.signbit(w))


class RetriedRunFailureTest(absltest.TestCase):
  """An argument the executable refuses (on another device) is conformed and
  the call retried; a failure of the retry is named as the first call's
  would be: HostOpError for a raising callback, FloatingPointError for a nan
  under jax_debug_nans (not jax's raw errors), and the state unchanged."""

  def test_a_failed_retry_is_named_and_loses_nothing(self):
    got = run_json("""
        import json
        import jax, jax.numpy as jnp, numpy as np
        import jaxsession as js

        def bad(v):
          if np.any(np.asarray(v) > 10):
            raise ValueError("host says no")
          return np.asarray(v)

        def step(w, x):
          y = jax.pure_callback(bad, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
          return w + jnp.log(y), jnp.sum(w)
        out = {}
        w0 = jnp.asarray(np.random.default_rng(5).uniform(1, 2, 4), jnp.float32)
        x0 = jnp.asarray([1.5, 2.5, 3.5, 4.5], jnp.float32)
        on1 = lambda a: jax.device_put(a, jax.devices()[1])
        sess = js.Session(js.SessionOptions(host_callbacks=False))
        gid = sess.compile(step, w0, x0, state_argnums=0)
        for label, x in (("dev0", x0 * 10), ("dev1", on1(x0 * 10))):
          try:
            sess.run(gid, x)
          except Exception as e:
            out[label] = type(e).__name__
        out["state_kept"] = bool(np.array_equal(sess.get_state(gid)[0], w0))
        jax.config.update("jax_debug_nans", True)
        sess2 = js.Session()
        gid2 = sess2.compile(lambda x: jnp.log(x) * 2, x0)
        for label, x in (("nan_dev0", -x0), ("nan_dev1", on1(-x0))):
          try:
            sess2.run(gid2, x)
          except Exception as e:
            out[label] = [type(e).__name__, isinstance(e, FloatingPointError)]
        print(json.dumps(out))
        """, devices=2)
    self.assertEqual(got["dev0"], "HostOpError")
    self.assertEqual(got["dev1"], "HostOpError")
    self.assertTrue(got["state_kept"])
    self.assertEqual(got["nan_dev0"], ["FloatingPointError", True])
    self.assertEqual(got["nan_dev1"], ["FloatingPointError", True])


if __name__ == "__main__":
  absltest.main()
