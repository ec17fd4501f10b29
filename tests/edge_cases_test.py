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


class ManyWeakStateLeavesTest(absltest.TestCase):

  def test_a_program_whose_weak_types_cannot_matter_is_traced_a_few_times(self):
    # every new state leaf is strong where its example was weak; in an
    # all-float32 program that changes nothing, so compile does not trace
    # again per leaf (it did: O(leaves^2), 190 s for 1000 leaves)
    traces = []
    def step(s, x):
      traces.append(1)
      return [a + x for a in s], jnp.sum(x)
    state = [jnp.full((4,), float(i)) for i in range(300)]  # weak: a Python fill
    x = jnp.asarray(np.random.default_rng(8).standard_normal(4), jnp.float32)
    sess = js.Session()
    gid = sess.compile(step, state, x, state_argnums=0)
    self.assertLessEqual(len(traces), 3)
    want_s, want = jax.jit(step)(state, x)
    assert_equal_signed(sess.run(gid, x), want)
    for got, w in zip(sess.get_state(gid)[0], want_s):
      assert_equal_signed(got, w)

  def test_scalar_state_leaves_of_a_mixed_program_are_not_traced_one_by_one(self):
    # each strong float32 scalar times a bfloat16 value: every leaf's weak
    # type changes the program, but compile does not ask it leaf by leaf (a
    # trace each: 300 leaves took 13.5 s against jax.jit's 0.4 s); a value
    # of other weak types is asked about when it comes, all its flips at once
    traces = []
    rng = np.random.default_rng(31)
    def step(p, x):
      traces.append(1)
      h = x
      for a in p:
        h = h + a * jnp.tanh(h).astype(jnp.bfloat16)
      return [a * 0.999 for a in p], h
    state = [jnp.float32(rng.standard_normal()) for _ in range(24)]
    x = jnp.asarray(rng.standard_normal(8), jnp.bfloat16)
    sess = js.Session()
    gid = sess.compile(step, state, x, state_argnums=0)
    self.assertLessEqual(len(traces), 3)
    assert_equal_signed(sess.run(gid, x), jax.jit(step)(state, x)[1])
    traces.clear()
    weak = [float(a) for a in state]  # Python floats: bfloat16 products under jax.jit
    with self.assertRaisesRegex(js.InputError, r"value 0 at path \[0\] is weakly typed.*"
                                r"changes the program.*an array of that dtype"):
      sess.set_state(gid, weak)
    self.assertLessEqual(len(traces), 2)  # all the flips, then the first leaf alone
    traces.clear()
    with self.assertRaisesRegex(js.InputError, "weakly typed"):
      sess.set_state(gid, weak)
    self.assertEqual(traces, [])  # the answer is kept
    strong = [jnp.float32(a) for a in weak]
    sess.set_state(gid, strong)
    assert_equal_signed(sess.run(gid, x), jax.jit(step)(strong, x)[1])

  def test_weak_types_that_change_the_program_only_together_or_later(self):
    rng = np.random.default_rng(32)
    h = jnp.asarray(rng.standard_normal(4), jnp.float32)
    # a weak x or a weak y alone: a strong float32 sum, the program's
    # arithmetic; both weak: a weak sum, whose product with bfloat16 `hb` is
    # bfloat16 under jax.jit (bound as given, the session ran float32)
    hb = h.astype(jnp.bfloat16)
    def add(x, y, h):
      return x, y, (x + y) * h
    x0, y0 = jnp.float32(rng.standard_normal()), jnp.float32(rng.standard_normal())
    sess = js.Session()
    gid = sess.compile(add, x0, y0, hb, state_argnums=(0, 1))
    self.assertEqual(jax.jit(add)(float(x0), float(y0), hb)[2].dtype, jnp.bfloat16)
    with self.assertRaisesRegex(js.InputError, r"value 0 at path \(root\) is weakly typed.*"
                                r"together with .*value 1 at path \(root\)"):
      sess.set_state(gid, float(x0), float(y0))
    for x, y in ((float(x0), y0), (x0, float(y0))):
      sess.set_state(gid, x, y)
      assert_equal_signed(sess.run(gid, hb), jax.jit(add)(x, y, hb)[2])
    # a weak `a` keeps the first step's arithmetic, and hands its weak type
    # on to `b`: from the second step on jax.jit multiplies b * h in bfloat16
    def later(a, b, h):
      return a * 0.5, a * 2.0, b * h
    a0, b0 = jnp.float32(rng.standard_normal()), jnp.float32(rng.standard_normal())
    gid = sess.compile(later, a0, b0, hb, state_argnums=(0, 1))
    got = jax.jit(later)(float(a0), b0, hb)
    self.assertEqual(jax.jit(later)(*got[:2], hb)[2].dtype, jnp.bfloat16)  # jax.jit's step 2
    with self.assertRaisesRegex(js.InputError, r"value 0 at path \(root\) is weakly typed.*"
                                r"from the 2nd run after it on"):
      sess.set_state(gid, float(a0), b0)
    assert_equal_signed(sess.get_state(gid)[0], a0)  # refused: nothing changed
    sess.replace_state(gid, 0, jnp.float32(float(a0) * 2))
    assert_equal_signed(sess.run(gid, hb), jax.jit(later)(jnp.float32(float(a0) * 2), b0, hb)[2])


class WeakRunScalarsTogetherTest(absltest.TestCase):

  def test_two_weak_scalars_that_change_the_program_only_together(self):
    # compiled with strong float32 a, b: (a + b) * x is float32. One weak
    # scalar keeps it so; both weak make a weak sum, and jax.jit's product
    # with the bfloat16 x is bfloat16 - the session ran float32 (a review's
    # find): refused now, before the run
    rng = np.random.default_rng(61)
    x = jnp.asarray(rng.standard_normal(8), jnp.bfloat16)
    g = lambda a, b, x: (a + b) * x
    a, b = jnp.float32(0.4), jnp.float32(0.71)
    sess = js.Session()
    gid = sess.compile(g, a, b, x)
    self.assertEqual(jax.jit(g)(0.4, 0.71, x).dtype, jnp.bfloat16)
    with self.assertRaisesRegex(js.InputError, r"argument 0 .*; .*argument 1 .*together they "
                                "change the program"):
      sess.run(gid, 0.4, 0.71, x)
    for args in ((0.4, b, x), (a, 0.71, x), (a, b, x)):  # one weak: the same program
      got, want = sess.run(gid, *args), jax.jit(g)(*args)
      assert_equal_signed(got, want)
      self.assertEqual(got.weak_type, want.weak_type)
    # a weak scalar and a weakly typed array together (the array was not
    # watched: accepted with float32 bits, a review's find)
    v = jnp.asarray(rng.standard_normal(8), jnp.float32)
    gv = sess.compile(g, a, v, x)
    weak_v = jnp.broadcast_to(0.3, (8,))
    self.assertTrue(weak_v.weak_type)
    self.assertEqual(jax.jit(g)(0.4, weak_v, x).dtype, jnp.bfloat16)
    with self.assertRaisesRegex(js.InputError, "together they change the program"):
      sess.run(gv, 0.4, weak_v, x)
    for args in ((0.4, v, x), (a, weak_v, x)):
      assert_equal_signed(sess.run(gv, *args), jax.jit(g)(*args))


class GraphKeepsNoModelTest(absltest.TestCase):

  def test_a_bound_methods_object_goes_when_dropped(self):
    # a mixed-precision graph keeps its function to trace again on other
    # weak types: it kept a bound method's object (a model holding 64 MiB)
    # alive until release (a review's find); held weakly, that check then
    # refuses a value of other weak types, saying why
    import gc  # pylint: disable=import-outside-toplevel
    import weakref  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(51)

    class Model:
      def __init__(self):
        self.big = np.zeros((1024, 1024), np.float32)

      def step(self, scale, x):
        return scale * 0.5, (x * scale).astype(jnp.bfloat16)

      def scaled(self, scale, a, x):
        return scale + 1.0, (x * (scale + a)).astype(jnp.bfloat16)
    model = Model()
    x = jnp.asarray(rng.standard_normal(4), jnp.bfloat16)
    sess = js.Session()
    gid = sess.compile(model.step, jnp.float32(1.5), x, state_argnums=0)
    gone = weakref.ref(model)
    del model
    gc.collect()
    self.assertIsNone(gone())
    step = jax.jit(Model.step, static_argnums=0)
    assert_equal_signed(sess.run(gid, x), step(Model, jnp.float32(1.5), x)[1])
    with self.assertRaisesRegex(js.InputError, "weakly typed.*cannot be checked: the graph's "
                                "function, a method of an object since collected"):
      sess.set_state(gid, 2.0)
    sess.set_state(gid, jnp.float32(2.0))
    assert_equal_signed(sess.run(gid, x), step(Model, jnp.float32(2.0), x)[1])
    # the run's scalars typed otherwise cannot be checked either: refused
    # (accepted with the compiled program's bits, and the state advanced)
    model = Model()
    gid = sess.compile(model.scaled, jnp.float32(1.5), jnp.float32(0.5), x, state_argnums=0)
    del model
    gc.collect()
    before = sess.get_state(gid)[0]
    with self.assertRaisesRegex(js.InputError, "cannot be checked: the graph's function"):
      sess.run(gid, 0.5, x)
    assert_equal_signed(sess.get_state(gid)[0], before)
    assert_equal_signed(sess.run(gid, jnp.float32(0.5), x),
                        jax.jit(Model.scaled, static_argnums=0)(Model, before,
                                                                jnp.float32(0.5), x)[1])


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


class WeakTypesTest(absltest.TestCase):
  """A weak type that changes the program is refused (jax.jit would compile
  another program); one that changes nothing runs on the same executable."""

  def test_scalar_argument(self):
    fn = lambda x, lr: x * lr
    x = jnp.asarray([1.1, 2.3], jnp.bfloat16)
    sess = js.Session()
    gid = sess.compile(fn, x, 0.1)  # weak: bf16 * weak f32 stays bf16
    assert_equal_signed(sess.run(gid, x, 0.25), jax.jit(fn)(x, 0.25))
    with self.assertRaisesRegex(js.InputError, "strongly typed.*Pass a Python scalar"):
      sess.run(gid, x, jnp.float32(0.25))  # jax.jit: a float32 result
    strong = sess.compile(fn, x, jnp.float32(0.1))
    with self.assertRaisesRegex(js.InputError, "weakly typed.*an array of that dtype"):
      sess.run(strong, x, 0.25)
    f32 = sess.compile(fn, jnp.ones(2), 0.1)  # all float32: the weak type is moot
    assert_equal_signed(sess.run(f32, jnp.ones(2), jnp.float32(0.25)),
                        jax.jit(fn)(jnp.ones(2), jnp.float32(0.25)))

  def test_unstacked_scalar_of_a_sunk_run(self):
    # in_axes None passes the scalar as a single run does: it was accepted
    # strong where the program was traced weak (int8 state * weak int stays
    # int8; jax.jit would promote a strong int32), found by the break-it review
    step = lambda s, k: (s * k, s.astype(jnp.int32).sum())
    s0 = jnp.asarray(np.random.default_rng(7).integers(-9, 9, 3), jnp.int8)
    sess = js.Session()
    gid = sess.compile(step, s0, 3, state_argnums=0)
    for steps in (2, 3):  # the first steps value, then chunks of 2 + 1
      with self.assertRaisesRegex(js.InputError, "strongly typed.*Pass a Python scalar"):
        sess.run(gid, jnp.int32(3), steps=steps, in_axes=(None,))
      assert_equal_signed(sess.get_state(gid)[0], s0)
    got = sess.run(gid, 3, steps=3, in_axes=(None,))
    ref, want = s0, []
    for _ in range(3):
      ref, out = jax.jit(step)(ref, 3)
      want.append(out)
    assert_equal_signed(got, want)
    assert_equal_signed(sess.get_state(gid)[0], ref)

  def test_numpy_scalars_many_scalars_arrays_and_set_state(self):
    fn = lambda x, s: x * s
    x = jnp.linspace(-3, 3, 11).astype(jnp.bfloat16)
    sess = js.Session()
    gid = sess.compile(fn, x, 0.1)
    with self.assertRaises(js.InputError):  # np.float64 subclasses float, yet is strong
      sess.run(gid, x, np.float64(0.3))
    nine = sess.compile(lambda x, *s: sum((x * si for si in s), x), x, *(0.5,) * 9)
    with self.assertRaises(js.InputError):  # past the first eight scalars too
      sess.run(nine, x, *(0.5,) * 8, jnp.float32(0.3))
    weak_vec = jnp.broadcast_to(jnp.asarray(0.3), (11,))
    strong = sess.compile(fn, x, jnp.full((11,), 0.3, jnp.float32))
    with self.assertRaises(js.InputError):
      sess.run(strong, x, weak_vec)
    step = lambda c, x: (c * 0.5 + 1.0, x * (c * 0.5 + 1.0))
    stateful = sess.compile(step, jnp.asarray(1.0), x, state_argnums=0)
    with self.assertRaisesRegex(js.InputError, "strongly typed"):
      sess.set_state(stateful, jnp.float32(2.0))
    sess.set_state(stateful, jnp.asarray(2.0))
    assert_equal_signed(sess.run(stateful, x), jax.jit(step)(jnp.asarray(2.0), x)[1])

  def test_state_whose_weak_type_changes(self):
    sess = js.Session()
    x16 = jnp.asarray([1.5, 2.5], jnp.bfloat16)
    with self.assertRaisesRegex(js.InputError, "strongly typed, the arg is weakly typed"):
      sess.compile(lambda w, x: (w + jnp.float32(0), w * x), jnp.asarray(1.1), x16,
                   state_argnums=0)
    gid = sess.compile(lambda w, x: (w + jnp.float32(1), w * x), jnp.asarray(1.5),
                       jnp.ones(2), state_argnums=0)
    sess.run(gid, jnp.ones(2))
    assert_equal_signed(sess.run(gid, jnp.ones(2)), [2.5, 2.5])

  def test_a_weak_type_change_handed_on_to_another_state_leaf(self):
    """`a` turns strong after one step, `b * 0.5 + a` one step later, and
    from the third step on jax.jit's program multiplies `b * h` in float32,
    not bfloat16: refused at compile, naming `b` (the session ran its first
    program, and from the third step on other bits: a break-it find)."""
    rng = np.random.default_rng(23)
    c = jnp.asarray(rng.standard_normal(8), jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal(8), jnp.bfloat16)

    def step(a, b, c, x, h):
      c2 = (c + b * h).astype(jnp.bfloat16)
      return a + x, b * 0.5 + a, c2, c2
    sess = js.Session()
    with self.assertRaisesRegex(js.InputError, r"the value step 2 returns for state arg 1 "
                                r"\(position 1\).* strongly typed.*from step 3 on"):
      sess.compile(step, jnp.asarray(0.5), jnp.asarray(1.3), c, jnp.float32(0.1), h,
                   state_argnums=(0, 1, 2))
    # strong from the start: one program for every step, as under jax.jit
    a, b = jnp.float32(0.5), jnp.float32(1.3)
    gid = sess.compile(step, a, b, c, jnp.float32(0.1), h, state_argnums=(0, 1, 2))
    state = (a, b, c)
    for _ in range(4):
      x = jnp.float32(rng.standard_normal())
      h = jnp.asarray(rng.standard_normal(8), jnp.bfloat16)
      *state, want = jax.jit(step)(*state, x, h)
      assert_equal_signed(sess.run(gid, x, h), want)
    # handed on along ten leaves: the arithmetic changes at step 11
    def along(ls, c, x, h):
      c2 = (c + ls[-1] * h).astype(jnp.bfloat16)
      return [ls[0] + x] + [ls[i] * 0.5 + ls[i - 1] for i in range(1, len(ls))], c2, c2
    with self.assertRaisesRegex(js.InputError, "step 10 returns for state arg 0 .* step 11"):
      sess.compile(along, [jnp.asarray(0.5)] * 10, c, jnp.float32(0.1), h,
                   state_argnums=(0, 1))
    # and along forty, past the steps compile follows (32): refused, not passed
    with self.assertRaisesRegex(js.InputError, "still change after 32 steps"):
      sess.compile(along, [jnp.asarray(0.5)] * 40, c, jnp.float32(0.1), h,
                   state_argnums=(0, 1))
    # weak types handed on without changing the arithmetic: compiled
    same_math = lambda a, b, x: (a + x, b * 0.5 + a, b * 2.0)  # noqa: E731
    sess.compile(same_math, jnp.asarray(0.5), jnp.asarray(1.3), jnp.float32(0.1),
                 state_argnums=(0, 1))

  def test_output_weak_types_follow_the_scalars(self):
    """Compiled with a Python float and run with a strong float32 (or the
    other way round), the outputs carry the weak types jax.jit gives them,
    so `out * bf16` promotes as under jax.jit."""
    rng = np.random.default_rng(33)
    x = jnp.asarray(rng.standard_normal(4), jnp.float32)
    params = jnp.asarray(rng.standard_normal(4), jnp.bfloat16)
    fns = (lambda s: s * 2, lambda s, x: (s * 3, x * s, s > 0), lambda s: {"a": -s, "b": s})
    examples = ((2.0,), (1.5, x), (0.5,))
    for fn, example in zip(fns, examples):
      for compiled_weak in (True, False):
        sess = js.Session()
        first = example[0] if compiled_weak else jnp.float32(example[0])
        gid = sess.compile(fn, first, *example[1:])
        for value in (-0.0, jnp.float32(2.5), np.float32(np.inf), 7.25):
          got = sess.run(gid, value, *example[1:])
          want = jax.jit(fn)(value, *example[1:])
          for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            self.assertEqual((g.dtype, g.weak_type), (w.dtype, w.weak_type), (fn, value))
            assert_equal_signed(np.asarray(g), np.asarray(w))
            if g.dtype == jnp.float32 and g.shape == ():
              self.assertEqual((g * params).dtype, (w * params).dtype)


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
