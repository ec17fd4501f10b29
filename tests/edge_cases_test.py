"""Edge cases a new user found: closed-over PRNG keys, namedtuples of jaxprs,
x64 casts, low-precision Python scalars, arrays on another device, release
racing run and compile, late user passes, sunk runs with bad arguments. Each
compares with jax.jit bit for bit where it runs."""
import collections
import os
import subprocess
import sys
import tempfile
import textwrap
import threading

from absl.testing import absltest
import pytest
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

import jaxsession as js
from exact import assert_equal_signed


def run_python(code, **env):
  """Runs `code` in a fresh interpreter (x64 and device counts are global)."""
  result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], text=True,
                          capture_output=True, timeout=240, env={**os.environ, **env})
  if result.returncode != 0:
    raise AssertionError(result.stderr[-3000:])
  return result.stdout


class ProgramsTest(absltest.TestCase):

  def test_constant_subexpressions_are_left_to_xla(self):
    z = lambda: jnp.full((4,), -0.0, jnp.float32)
    fn = lambda x: (z() - z()) + z() + x * 0  # XLA's own rewrites decide the sign
    x = jnp.asarray(np.random.default_rng(3).standard_normal(4), jnp.float32)
    sess = js.Session()
    got = sess.run(sess.compile(fn, x), x)
    assert_equal_signed(np.signbit(got), np.signbit(jax.jit(fn)(x)))
    assert_equal_signed(got, jax.jit(fn)(x))

  def test_many_equal_constant_subexpressions(self):
    c = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)

    def fn(x):
      acc = x
      for i in range(60):
        acc = acc + jnp.tanh(c @ c + i % 3) * 1e-3
      return acc
    x = jnp.asarray(np.random.default_rng(1).standard_normal((16, 16)), jnp.float32)
    sess = js.Session()
    gid = sess.compile(fn, x)
    assert_equal_signed(sess.run(gid, x), jax.jit(fn)(x))

  def test_closed_over_typed_prng_key(self):
    key = jax.random.key(0)
    fn = lambda x: x + jax.random.normal(key, x.shape)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(3), jnp.float32)
    sess = js.Session()
    assert_equal_signed(sess.run(sess.compile(fn, x), x), jax.jit(fn)(x))

  def test_custom_linear_solve_with_a_callback(self):
    calls = collections.Counter()

    def host(v):
      calls["n"] += 1
      if calls["fail"]:
        raise ValueError("solver callback failed")
      return np.asarray(v)

    def step(w, x):
      matvec = lambda v: 2.0 * jax.pure_callback(host, jax.ShapeDtypeStruct(v.shape,
                                                                           v.dtype), v)
      y = lax.custom_linear_solve(matvec, x, lambda mv, b: mv(b) / 4.0, symmetric=True)
      return w + y, jnp.sum(y)
    w = jnp.asarray(np.random.default_rng(1).standard_normal(3), jnp.float32)
    x = jnp.asarray(np.random.default_rng(2).standard_normal(3), jnp.float32)
    sess = js.Session()
    gid = sess.compile(step, w, x, state_argnums=0)
    want_w, want = jax.jit(step)(w, x)
    assert_equal_signed(sess.run(gid, x), want)
    assert_equal_signed(sess.get_state(gid)[0], want_w)
    calls["fail"] = 1
    with self.assertRaises(js.HostOpError) as caught:
      sess.run(gid, x)
    self.assertIsInstance(caught.exception.__cause__, ValueError)
    assert_equal_signed(sess.get_state(gid)[0], want_w)

  @pytest.mark.slow
  def test_int_float64_int_round_trips_under_x64(self):
    out = run_python("""
        import jax, jax.numpy as jnp, numpy as np
        import jaxsession as js
        for dt in (jnp.int8, jnp.uint16, jnp.int32, jnp.uint32, jnp.int64):
          f = lambda a: a.astype(jnp.float64).astype(dt)
          a = jnp.asarray([0, 1, 2**53 + 1 if dt == jnp.int64 else 7, -3 if
                           jnp.issubdtype(dt, jnp.signedinteger) else 9], dt)
          sess = js.Session()
          gid = sess.compile(f, a)
          np.testing.assert_array_equal(sess.run(gid, a), jax.jit(f)(a))
          print(dt.__name__, [n.op for n in sess.graph(gid).nodes])
        """, JAX_ENABLE_X64="1")
    self.assertIn("int64 ['convert_element_type', 'convert_element_type']", out)
    self.assertIn("int32 []", out)  # int32 -> f64 -> int32 is exact: removed

  def test_low_precision_python_scalars_convert_like_jit(self):
    for dtype in (jnp.float16, jnp.bfloat16):
      fn = lambda x, lr: x * lr
      x = jnp.asarray([1.0, 1.5], dtype)
      sess = js.Session()
      gid = sess.compile(fn, x, jnp.asarray(0.5, dtype))
      for lr in (1 + 2**-11 + 2**-30, 0.1, 3.0):
        assert_equal_signed(sess.run(gid, x, lr),
                            jax.jit(fn)(x, jnp.asarray(np.float32(lr), dtype)))

  def test_numpy_scalars_are_strong_where_python_scalars_are_weak(self):
    # np.float64 and np.complex128 subclass float and complex, but jax types
    # them strongly: np.float64(0.1) was converted like the Python float to a
    # compiled bf16 scalar, and the bf16 program ran where jax.jit promotes to
    # float32 (a break-it find). Each must run as jax.jit does, or be refused.
    fn = lambda x, s: x * s + s
    for xd, sd in ((jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float16),
                   (jnp.int32, jnp.bfloat16)):
      x = jnp.asarray([0.3, -1.7, -0.0]).astype(xd)
      sess = js.Session()
      gid = sess.compile(fn, x, jnp.asarray(0.1, sd))
      for s in (np.float64(0.1), np.complex128(1 - 2j), np.float32(-0.0), np.float64(np.nan)):
        with self.assertRaisesRegex(js.InputError, r"argument 1 .* expected"):
          sess.run(gid, x, s)
      if xd == sd:  # a Python float: weak, the compiled bf16 program's
        got, want = sess.run(gid, x, 0.1), jax.jit(fn)(x, 0.1)
        self.assertEqual((got.dtype, got.weak_type), (want.dtype, want.weak_type))
        assert_equal_signed(got, want)


class DeepChainTest(absltest.TestCase):

  def test_a_deep_chain_of_nested_jits_compiles(self):
    # jnp.where is a nested jit: deciding whether its operands are constants
    # walked the chain recursively (RecursionError past ~500 values)
    def f(x, w):
      for _ in range(700):
        x = jnp.where(x > 0, x, 0.5 * x) - w
      return x
    rng = np.random.default_rng(31)
    x, w = (rng.standard_normal((4, 3)).astype(np.float32) * 0.01 for _ in range(2))
    x[0, :2] = [-0.0, np.nan]
    sess = js.Session()
    gid = sess.compile(f, x, w)
    assert_equal_signed(sess.run(gid, x, w), jax.jit(f)(x, w))


class GcPauseTest(absltest.TestCase):

  def test_compile_pauses_the_collector_and_puts_its_state_back(self):
    import gc  # pylint: disable=import-outside-toplevel
    seen = []
    def step(x):
      seen.append(gc.isenabled())  # traced inside the compile
      return jnp.sin(x) * 2.0
    x = np.random.default_rng(2).standard_normal(3).astype(np.float32)
    sess = js.Session()
    self.assertTrue(gc.isenabled())
    sess.compile(step, x)
    with self.assertRaises(js.InputError):  # a failed compile too
      sess.compile(lambda a: (a[:1], 1.0), x, state_argnums=0)
    self.assertEqual((seen, gc.isenabled()), ([False], True))
    gc.disable()
    try:
      sess.compile(step, x)  # a user who turned it off keeps it off
      self.assertFalse(gc.isenabled())
    finally:
      gc.enable()
    threads = [threading.Thread(target=sess.compile, args=(step, x)) for _ in range(3)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    self.assertTrue(gc.isenabled())


class DevicesTest(absltest.TestCase):

  @pytest.mark.slow
  def test_arrays_on_another_device_are_moved(self):
    out = run_python("""
        import jax, jax.numpy as jnp, numpy as np
        import jaxsession as js
        d1 = jax.devices()[1]
        w = jax.device_put(jnp.arange(3.0), d1)
        x = jax.device_put(jnp.ones(3), d1)
        step = lambda w, x: (w + x, jnp.sum(w * x))
        sess = js.Session()
        gid = sess.compile(step, w, x, state_argnums=0)
        np.testing.assert_array_equal(sess.run(gid, x), 3.0)
        sess.set_state(gid, w)
        np.testing.assert_array_equal(sess.run(gid, x), 3.0)
        np.testing.assert_array_equal(sess.get_state(gid)[0], [1.0, 2.0, 3.0])
        print("ok", sess.get_state(gid)[0].devices() == {jax.devices()[0]})
        """, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    self.assertIn("ok True", out)


class ReleaseRaceTest(absltest.TestCase):

  def test_release_while_running_or_compiling(self):
    w = jnp.arange(4.0)
    for plan in (False, True):
      sess = js.Session()
      host = lambda a: np.asarray(a)
      step = ((lambda w, x: (w + jax.pure_callback(host, jax.ShapeDtypeStruct((4,),
                                                                            jnp.float32), x),
                             jnp.sum(w))) if plan else (lambda w, x: (w + x, jnp.sum(w))))
      gid = sess.compile(step, w, w, state_argnums=0)
      errors, readers = [], []

      def runner():
        for _ in range(100):
          try:
            sess.run(gid, w)
          except js.UnknownGraphError:
            pass
          except Exception as exc:  # anything else is the bug this test is about
            errors.append(exc)

      def compiler():
        for _ in range(5):
          try:
            readers.append(sess.compile(lambda w: jnp.sum(w), w, state_argnums=0,
                                        state_from=gid, updates_state=False))
          except js.UnknownGraphError:
            pass
          except Exception as exc:
            errors.append(exc)
      threads = [threading.Thread(target=runner), threading.Thread(target=compiler)]
      for t in threads:
        t.start()
      sess.release(gid)
      for t in threads:
        t.join()
      self.assertEqual(errors, [], f"plan={plan}")
      for other in readers:  # readers compiled before the release share
        self.assertTrue(np.isfinite(float(sess.run(other))))  # a slot that lives on


class PipelineEdgesTest(absltest.TestCase):

  def test_node_made_after_placement_is_placed(self):
    from jaxsession.optimizer_passes import FunctionPass

    def add_neg(graph, ctx):
      out = graph.outputs[0]
      node = graph.make_node("neg", lax.neg_p, {}, [out], [out.aval])
      graph.insert_node(len(graph.nodes), node)
      graph.outputs = [node.outputs[0] if v is out else v for v in graph.outputs]
      return True
    js.register_pass(FunctionPass("add_neg", add_neg), stage="HardwareOptimize",
                     after="place_nodes")
    try:
      sess = js.Session()
      gid = sess.compile(lambda a: jnp.sin(a) * 2, jnp.arange(3.0))
    finally:
      js.unregister_pass("add_neg")
    self.assertEqual([p.place for p in sess.report(gid).partitions], ["device"])
    assert_equal_signed(sess.run(gid, jnp.arange(3.0)),
                        -(jnp.sin(jnp.arange(3.0)) * 2))

  def test_sunk_run_with_bad_args_builds_nothing(self):
    sess = js.Session()
    gid = sess.compile(lambda w, x: (w + x, jnp.sum(w)), jnp.zeros(3), jnp.ones(3),
                       state_argnums=0)
    for steps in (5, 2**40):
      with self.assertRaisesRegex(js.InputError, "steps="):
        sess.run(gid, jnp.ones((2, 3)), steps=steps)
    self.assertEqual(sess.report(gid).loop_sink, {})

  def test_argnums_of_the_wrong_type(self):
    sess = js.Session()
    f = lambda a, b: (a, b)
    with self.assertRaisesRegex(js.InputError, "must be an int or a sequence"):
      sess.compile(f, jnp.ones(2), jnp.ones(2), state_argnums=1.0)
    gid = sess.compile(f, jnp.ones(2), jnp.ones(2), state_argnums=np.array([0]))
    self.assertLen(sess.get_state(gid), 1)

  def test_small_input_errors_name_where(self):
    sess = js.Session()
    with self.assertRaisesRegex(js.InputError, "example argument at position 1"):
      sess.compile(lambda x, t: x, jnp.ones(2), "abc")
    gid = sess.compile(lambda w, x: (w + x, x), jnp.ones(2), jnp.ones(2), state_argnums=0)
    with self.assertRaisesRegex(js.InputError, r"set_state\(graph 0 .*value 0 at path"):
      sess.set_state(gid, "abc")
    host = sess.compile(lambda x: jax.pure_callback(np.sin, jax.ShapeDtypeStruct(
        (2,), jnp.float32), x), jnp.ones(2))
    gone = jnp.ones(2)
    gone.delete()
    with self.assertRaisesRegex(js.InputError, "has been deleted"):
      sess.run(host, gone)

  def test_a_kernel_that_raises_or_returns_a_bare_array(self):
    from jaxsession.kernels import register_kernel, unregister_kernel
    for name, body in (("xla:raising_cos", lambda node, x: 1 / 0),
                       ("xla:bare_cos", lambda node, x: jnp.cos(x))):
      register_kernel("cos", backend="xla", priority=50, name=name)(body)
      try:
        with self.assertRaisesRegex(js.KernelSelectError, name):
          js.Session().compile(jnp.cos, jnp.ones(3))
      finally:
        unregister_kernel(name)

  def test_save_graphs_must_be_a_folder(self):
    path = os.path.join(tempfile.mkdtemp(), "a_file")
    with open(path, "w") as f:
      f.write("x")
    with self.assertRaisesRegex(js.InputError, "is a file, not a folder"):
      js.Session(js.SessionOptions(save_graphs=path))


class DisableJitTest(absltest.TestCase):
  """Under `jax.disable_jit()` jax.jit runs its function op by op; so does
  Session.run (an ahead-of-time executable refuses to run there): single,
  stateful, loop-sunk and multi-partition graphs, bit for bit with jax.jit
  under the same flag, and the state committed once per run."""

  def test_runs_op_by_op(self):
    rng = np.random.default_rng(21)
    w = jnp.asarray(rng.standard_normal(6), jnp.float32)
    x = jnp.asarray(rng.standard_normal(6), jnp.float32)
    xs = jnp.asarray(rng.standard_normal((3, 6)), jnp.float32)

    def step(w, x):
      return w * 0.5 + jnp.tanh(x), jnp.sum(w * x)

    def plan(x):
      y = jax.pure_callback(lambda a: np.asarray(a) * np.float32(3), jax.ShapeDtypeStruct(
          x.shape, x.dtype), x)
      return jnp.exp(y) - x
    sess = js.Session()
    sid = sess.compile(step, w, x, state_argnums=0)
    pid = sess.compile(plan, x)
    self.assertGreater(len(sess.report(pid).partitions), 1)
    with jax.disable_jit():
      w1, want = jax.jit(step)(w, x)
      assert_equal_signed(sess.run(sid, x), want)
      assert_equal_signed(sess.get_state(sid)[0], w1)
      wants, wn = [], w1
      for t in range(3):
        wn, out = jax.jit(step)(wn, xs[t])
        wants.append(out)
      assert_equal_signed(sess.run(sid, xs, steps=3), jnp.stack(wants))
      assert_equal_signed(sess.get_state(sid)[0], wn)
      assert_equal_signed(sess.run(pid, x), jax.jit(plan)(x))
      with self.assertRaises(js.InputError):  # bad input: still named, nothing changed
        sess.run(sid, jnp.ones(5))
      assert_equal_signed(sess.get_state(sid)[0], wn)
    assert_equal_signed(sess.run(sid, x), jax.jit(step)(wn, x)[1])  # compiled again


if __name__ == "__main__":
  absltest.main()
