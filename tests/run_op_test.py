"""Single-op mode (session/run_op.py): results equal the primitive's (and
jax.jit's) bit for bit, the executable cache hits, misses and evicts as an
LRU, effectful ops are never cached, and bad inputs name the op."""
import subprocess
import sys
import textwrap

from absl.testing import absltest
import pytest
import jax
from jax import lax
from jax.experimental import io_callback
import jax.numpy as jnp
import numpy as np

from exact import assert_equal_signed, assert_same_bits
from jaxsession.errors import InputError
from jaxsession.run_op import OpRunner, run_op_passes

I32 = np.iinfo(np.int32)


def _awkward_floats(rng, n, dtype=jnp.float32):
  """Fresh random floats with -0.0, NaN and both infinities among them."""
  x = rng.standard_normal(n).astype(np.float32) * np.exp(rng.uniform(-8, 8, n))
  x[:4] = [-0.0, np.nan, np.inf, -np.inf]
  rng.shuffle(x)
  return jnp.asarray(x, dtype)


def _extreme_ints(rng, n):
  x = rng.integers(I32.min, I32.max, n, dtype=np.int64).astype(np.int32)
  x[:4] = [I32.min, I32.max, 0, -1]
  rng.shuffle(x)
  return jnp.asarray(x)


def _params_of(fn, *args):
  """The primitive and params jax writes for `fn`'s only equation."""
  eqn, = jax.make_jaxpr(fn)(*args).jaxpr.eqns
  if eqn.primitive.name in ("pjit", "jit"):  # cumsum is a jit around its primitive
    eqn, = eqn.params["jaxpr"].jaxpr.eqns
  return eqn.primitive, dict(eqn.params)


class RunOpResultsTest(absltest.TestCase):
  """run_op(prim, *args, **params) == prim.bind(...) == jit(bind)(...), bit for bit."""

  def setUp(self):
    super().setUp()
    self.rng = np.random.default_rng()  # fresh inputs every run
    self.ops = OpRunner(jax.default_backend())

  def check(self, prim, *args, **params):
    got = self.ops.run(prim, *args, **params)
    assert_same_bits(got, prim.bind(*args, **params), f"{prim.name} vs bind")
    jitted = jax.jit(lambda *a: prim.bind(*a, **params))(*args)
    assert_same_bits(got, jitted, f"{prim.name} vs jit")
    return got

  def test_sin(self):
    x = _awkward_floats(self.rng, 64)
    prim, params = _params_of(jnp.sin, x)
    self.assertIs(prim, lax.sin_p)
    self.check(prim, x, **params)
    self.check(prim, x.astype(jnp.bfloat16), **params)

  def test_add_floats_ints_and_weak_scalars(self):
    x, y = _awkward_floats(self.rng, 32), _awkward_floats(self.rng, 32)
    self.check(lax.add_p, x, y)
    self.check(lax.add_p, x, -0.0)                   # weak Python float
    self.check(lax.add_p, 1.5, 2.25)                 # both weak
    i, j = _extreme_ints(self.rng, 32), _extreme_ints(self.rng, 32)
    self.check(lax.add_p, i, j)                      # wraps around at the extremes
    self.check(lax.add_p, i, 7)                      # weak Python int
    out = self.ops.run(lax.add_p, 1.5, 2.25)
    self.assertTrue(out.weak_type)                   # as bind keeps it

  def test_dot_general(self):
    a = _awkward_floats(self.rng, 24).reshape(4, 6)
    b = jnp.asarray(self.rng.standard_normal((6, 5)), jnp.float32)
    dims = (((1,), (0,)), ((), ()))
    prim, params = _params_of(lambda p, q: lax.dot_general(p, q, dims), a, b)
    self.assertIs(prim, lax.dot_general_p)
    self.check(prim, a, b, **params)
    prim, params = _params_of(
        lambda p, q: lax.dot_general(p, q, dims, preferred_element_type=jnp.float32),
        a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))
    self.check(prim, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), **params)

  def test_reduce_sum(self):
    x = _awkward_floats(self.rng, 60).reshape(3, 4, 5)
    prim, params = _params_of(lambda v: jnp.sum(v, axis=(0, 2)), x)
    self.assertIs(prim, lax.reduce_sum_p)
    self.check(prim, x, **params)
    ints = _extreme_ints(self.rng, 60).reshape(3, 4, 5)
    prim, params = _params_of(lambda v: jnp.sum(v, axis=1), ints)
    self.check(prim, ints, **params)

  def test_convert_element_type(self):
    x = _awkward_floats(self.rng, 64)
    for dtype in (jnp.bfloat16, jnp.float16, jnp.int32, jnp.uint8, jnp.bool_):
      prim, params = _params_of(lambda v: lax.convert_element_type(v, dtype), x)
      self.assertIs(prim, lax.convert_element_type_p)
      self.check(prim, x, **params)
    ints = _extreme_ints(self.rng, 64)
    prim, params = _params_of(lambda v: v.astype(jnp.float32), ints)
    self.check(prim, ints, **params)

  def test_cumsum(self):
    x = _awkward_floats(self.rng, 48).reshape(6, 8)
    prim, params = _params_of(lambda v: jnp.cumsum(v, axis=1), x)
    self.assertIs(prim, lax.cumsum_p)
    self.check(prim, x, **params)
    self.check(prim, x, **dict(params, reverse=True))

  def test_multiple_results_come_back_as_a_list(self):
    x = _awkward_floats(self.rng, 16)
    got = self.ops.run(lax.sort_p, x, dimension=0, is_stable=True, num_keys=1)
    want = lax.sort_p.bind(x, dimension=0, is_stable=True, num_keys=1)
    self.assertIsInstance(got, list)
    assert_same_bits(got, list(want))

  def test_function_equals_jit(self):
    def f(x, scale, axis):
      return {"y": jnp.cumsum(jnp.tanh(x) * scale, axis=axis), "n": jnp.sum(x > 0)}
    x = _awkward_floats(self.rng, 24).reshape(4, 6)
    for scale in (0.5, np.float32(3.0), jnp.float32(-2.0)):
      got = self.ops.run(f, x, scale, axis=1)
      want = jax.jit(f, static_argnames="axis")(x, scale, axis=1)
      assert_same_bits(got, want, f"scale {scale!r}")

  def test_function_closing_over_a_constant(self):
    table = jnp.asarray(self.rng.standard_normal(8), jnp.float32)

    def f(x):
      return x / table + 1.0
    x = _awkward_floats(self.rng, 8)
    assert_same_bits(self.ops.run(f, x), jax.jit(f)(x))

  def test_pipeline_is_kernel_selection_only(self):
    self.assertEqual([p.name for p in run_op_passes()], ["select_kernels"])

  @pytest.mark.slow
  def test_x64_in_a_subprocess(self):
    script = textwrap.dedent("""
        import jax
        jax.config.update("jax_enable_x64", True)
        import jax.numpy as jnp, numpy as np
        from jax import lax
        from jaxsession.run_op import OpRunner

        def same(a, b):
            a, b = np.asarray(a), np.asarray(b)
            assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype)
            if a.dtype.kind == "f":
                assert (np.isnan(a) == np.isnan(b)).all()
                a, b = np.where(np.isnan(a), 0, a), np.where(np.isnan(b), 0, b)
            assert a.tobytes() == b.tobytes(), (a, b)

        rng = np.random.default_rng()
        ops = OpRunner(jax.default_backend())
        x = rng.standard_normal(16) * np.exp(rng.uniform(-300, 300, 16))
        x[:3] = [-0.0, np.nan, np.inf]
        x = jnp.asarray(x)
        assert x.dtype == jnp.float64
        i64 = np.iinfo(np.int64)
        n = jnp.asarray(np.array([i64.min, i64.max, 0, -1, 2**40], np.int64))
        sin = dict(jax.make_jaxpr(jnp.sin)(x).jaxpr.eqns[0].params)
        same(ops.run(lax.sin_p, x, **sin), lax.sin_p.bind(x, **sin))
        same(ops.run(lax.add_p, n, n), lax.add_p.bind(n, n))
        same(ops.run(lax.add_p, n, 2**40), lax.add_p.bind(n, 2**40))   # weak int64
        same(ops.run(lax.add_p, x, 0.1), lax.add_p.bind(x, 0.1))       # weak float64
        f = lambda a, b: jnp.dot(a, b) + a.sum()
        a, b = x.reshape(4, 4), jnp.asarray(rng.standard_normal((4, 4)))
        same(ops.run(f, a, b), jax.jit(f)(a, b))
        ops.run(lax.add_p, n, n)
        assert ops.cache_info().hits == 1, ops.cache_info()
        print("X64 OK")
        """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300)
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    self.assertIn("X64 OK", result.stdout)


class RunOpCacheTest(absltest.TestCase):

  def test_second_call_hits_other_avals_miss(self):
    ops = OpRunner("cpu")
    rng = np.random.default_rng()
    x = _awkward_floats(rng, 8)
    ops.run(lax.add_p, x, x)
    self.assertEqual(ops.cache_info(), (0, 1, 1, 128))
    y = _awkward_floats(rng, 8)
    assert_same_bits(ops.run(lax.add_p, y, y), lax.add_p.bind(y, y))
    self.assertEqual(ops.cache_info(), (1, 1, 1, 128))
    ops.run(lax.add_p, x[:4], x[:4])                       # another shape
    ops.run(lax.add_p, x.astype(jnp.bfloat16), x.astype(jnp.bfloat16))  # another dtype
    ops.run(lax.add_p, x[0], 2.0)                          # weak second operand
    ops.run(lax.add_p, x[0], jnp.float32(2.0))             # strong: another program
    self.assertEqual(ops.cache_info(), (1, 5, 5, 128))
    ops.run(lax.add_p, x[1], 3.0)
    self.assertEqual(ops.cache_info().hits, 2)

  def test_params_are_part_of_the_key(self):
    ops = OpRunner("cpu")
    x = _awkward_floats(np.random.default_rng(), 12).reshape(3, 4)
    _, params = _params_of(lambda v: jnp.cumsum(v, axis=0), x)
    forward = ops.run(lax.cumsum_p, x, **params)
    backward = ops.run(lax.cumsum_p, x, **dict(params, reverse=True))
    assert_same_bits(backward, lax.cumsum_p.bind(x, **dict(params, reverse=True)))
    self.assertEqual(ops.cache_info().misses, 2)
    assert_same_bits(ops.run(lax.cumsum_p, x, **params), forward)
    self.assertEqual(ops.cache_info().hits, 1)

  def test_function_params_are_static(self):
    ops = OpRunner("cpu")
    x = jnp.arange(12.0).reshape(3, 4)

    def f(v, axis):
      return jnp.cumsum(v, axis=axis)
    assert_same_bits(ops.run(f, x, axis=0), jnp.cumsum(x, axis=0))
    assert_same_bits(ops.run(f, x, axis=1), jnp.cumsum(x, axis=1))
    ops.run(f, x, axis=1)
    self.assertEqual(ops.cache_info()[:3], (1, 2, 2))
    class Mutable:
      __hash__ = None
    with self.assertRaisesRegex(InputError, r"run_op\(f\).*'axis'.*not hashable"):
      ops.run(f, x, axis=Mutable())

  def test_callables_that_compare_equal_are_told_apart(self):
    """A frozen dataclass Scale(2) == Scale(2.0), yet one traces int and the
    other float arithmetic: run_op(Scale(2.0)) ran Scale(2)'s cached program
    (int32 [0 2 4 6]; a break-it find; jax.jit(Scale(2.0)) after jax.jit(Scale(2))
    does the same, a quirk of its cache this does not copy). Other callables are keyed by identity;
    a function and a bound method by their own equality still hit."""
    import dataclasses  # pylint: disable=import-outside-toplevel

    @dataclasses.dataclass(frozen=True)
    class Scale:
      s: object

      def __call__(self, v):
        return v * self.s

      def twice(self, v):
        return v * self.s * 2
    ops = OpRunner("cpu")
    x = jnp.asarray(np.random.default_rng(8).integers(-9, 9, 4), jnp.int32)
    for scale in (Scale(2), Scale(2.0), Scale(2)):
      # a fresh lambda: jax.jit's own cache conflates equal callables too
      assert_same_bits(ops.run(scale, x), jax.jit(lambda v, f=scale: f(v))(x))
    one = Scale(3)
    ops.run(one.twice, x)
    hits = ops.cache_info()[0]
    assert_same_bits(ops.run(one.twice, x), jax.jit(one.twice)(x))  # a new bound method
    self.assertEqual(ops.cache_info()[0], hits + 1)

  def test_lru_evicts_the_least_recently_used(self):
    ops = OpRunner("cpu", cache_size=2)
    a, b, c = jnp.ones(1), jnp.ones(2), jnp.ones(3)
    ops.run(lax.neg_p, a)
    ops.run(lax.neg_p, b)
    ops.run(lax.neg_p, a)        # a is now the most recent
    ops.run(lax.neg_p, c)        # evicts b
    self.assertEqual(ops.cache_info(), (1, 3, 2, 2))
    ops.run(lax.neg_p, a)        # still there
    self.assertEqual(ops.cache_info().hits, 2)
    ops.run(lax.neg_p, b)        # compiled again
    self.assertEqual(ops.cache_info(), (2, 4, 2, 2))

  def test_cache_size_zero_keeps_nothing(self):
    ops = OpRunner("cpu", cache_size=0)
    x = jnp.ones(3)
    assert_same_bits(ops.run(lax.neg_p, x), -x)
    assert_same_bits(ops.run(lax.neg_p, x), -x)
    self.assertEqual(ops.cache_info(), (0, 2, 0, 0))

  def test_effectful_function_is_never_cached_and_runs_every_time(self):
    ops = OpRunner("cpu")
    seen = []

    def logged(v):
      io_callback(lambda a: seen.append(np.asarray(a).copy()), None, v, ordered=True)
      return v * 2
    x = jnp.arange(4.0)
    for k in range(3):
      assert_same_bits(ops.run(logged, x + k), (x + k) * 2)
    self.assertLen(seen, 3)
    assert_equal_signed(seen[2], x + 2)
    self.assertEqual(ops.cache_info().size, 0)
    self.assertEqual(ops.uncached_runs, 3)

  def test_debug_print_is_never_cached(self):
    ops = OpRunner("cpu")

    def printed(v):
      jax.debug.print("v={v}", v=v)
      return v + 1
    for _ in range(2):
      assert_same_bits(ops.run(printed, jnp.ones(2)), jnp.full(2, 2.0))
    self.assertEqual(ops.cache_info().size, 0)
    self.assertEqual(ops.uncached_runs, 2)

  def test_callback_primitive_is_never_cached(self):
    ops = OpRunner("cpu")
    x = jnp.arange(3.0)
    prim, params = _params_of(
        lambda v: jax.pure_callback(lambda a: a * 3, jax.ShapeDtypeStruct((3,), jnp.float32),
                                    v), x)
    for _ in range(2):
      assert_same_bits(ops.run(prim, x, **params), [x * 3])  # multiple_results, as bind
    self.assertEqual(ops.cache_info().size, 0)
    self.assertEqual(ops.uncached_runs, 2)


class RunOpErrorsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.ops = OpRunner("cpu")

  def test_non_array_arguments(self):
    for bad in ("a", [1.0, 2.0], None, {"x": 1.0}):
      with self.assertRaisesRegex(InputError, r"run_op\(sin\): argument 0 is a"):
        self.ops.run(lax.sin_p, bad, accuracy=None)

  def test_params_the_primitive_rejects(self):
    with self.assertRaisesRegex(InputError, r"run_op\(add\): the primitive rejects "
                                r"\(f32\[3\], f32\[4\]\)"):
      self.ops.run(lax.add_p, jnp.ones(3), jnp.ones(4))
    with self.assertRaisesRegex(InputError, r"run_op\(reduce_sum\)"):
      self.ops.run(lax.reduce_sum_p, jnp.ones(3), axes=(5,), out_sharding=None)
    with self.assertRaisesRegex(InputError, r"run_op\(sin\)"):
      self.ops.run(lax.sin_p, jnp.ones(3))               # accuracy missing
    with self.assertRaisesRegex(InputError, r"run_op\(dot_general\)"):
      self.ops.run(lax.dot_general_p, jnp.ones((2, 3)), jnp.ones((4, 5)),
                   dimension_numbers=(((1,), (0,)), ((), ())), precision=None,
                   preferred_element_type=None, out_sharding=None)

  def test_python_int_out_of_range(self):
    with self.assertRaisesRegex(InputError, r"run_op\(add\): argument 1"):
      self.ops.run(lax.add_p, jnp.ones(2, jnp.int32), 2**40)

  def test_not_an_op(self):
    with self.assertRaisesRegex(InputError, "Primitive or a callable"):
      self.ops.run("sin", jnp.ones(2))

  def test_function_that_does_not_trace(self):
    def bad(v):
      return v @ v.T @ jnp.ones(7)
    with self.assertRaisesRegex(InputError, r"run_op\(bad\): tracing"):
      self.ops.run(bad, jnp.ones((2, 3)))

  def test_bad_cache_size(self):
    with self.assertRaises(InputError):
      OpRunner("cpu", cache_size=-1)


if __name__ == "__main__":
  absltest.main()
