"""Weak types, as jax.jit compiles for them: a weak Python scalar or array
where the program has a strong one (or the other way round) in the run's
arguments, in the state a step hands on, in a value set_state or restore
binds (session/state_typing.py), and the outputs' weak types. Each compares
with jax.jit bit for bit where the session runs."""
import gc
import weakref

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsession as js
from exact import assert_equal_signed, assert_same_bits
from subproc import run_json


class JitTracesOnceTest(absltest.TestCase):
  """js.jit keys its graphs by every leaf's type and weak type, as jax.jit's
  cache does: compile's weak-type check, which traces the function again per
  numeric leaf for Session.run's guard, has nothing to guard there."""

  def test_an_adam_step_under_jit_traces_once(self):
    # float32 leaves and optax's int32 count: 3 traces per leaf before
    import optax  # pylint: disable=import-outside-toplevel
    rng = np.random.default_rng(17)
    params = {f"w{i}": jnp.asarray(rng.standard_normal(3), jnp.float32) for i in range(20)}
    tx = optax.adam(1e-2)
    traces = []

    def step(p, o, x):
      traces.append(1)
      g = jax.grad(lambda p: sum(jnp.sum(jnp.tanh(v * x)) for v in p.values()))(p)
      u, o = tx.update(g, o, p)
      return optax.apply_updates(p, u), o
    opt = tx.init(params)
    f = js.jit(step, session=js.Session())
    got = f(params, opt, jnp.float32(0.7))
    self.assertLen(traces, 1)
    assert_same_bits(got, jax.jit(step)(params, opt, jnp.float32(0.7)))
    # a Python float where a strong float32 was: another signature, its own graph
    assert_same_bits(f(params, opt, 0.7), jax.jit(step)(params, opt, 0.7))
    self.assertLen(f.graph_ids, 2)

  def test_a_mixed_precision_step_keeps_each_typing_apart(self):
    # bf16 times a scalar: a weak and a strong float32 scalar trace other programs
    x = jnp.asarray(np.random.default_rng(5).standard_normal(7), jnp.bfloat16)
    f = js.jit(lambda x, s: x * s + 1, session=js.Session())
    for s in (0.3, jnp.float32(0.3), 0.3, jnp.float32(0.3)):
      got, want = f(x, s), jax.jit(lambda x, s: x * s + 1)(x, s)
      assert_same_bits(got, want)
      self.assertEqual(got.weak_type, want.weak_type)
    self.assertLen(f.graph_ids, 2)


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


class PassedThroughArgumentTest(absltest.TestCase):

  def test_a_weak_argument_returned_beside_a_host_callback_stays_weak(self):
    # a plan returned the argument as conformed (strong): a fuzzer's find
    cb = lambda x: jax.pure_callback(  # noqa: E731
        lambda b: np.asarray(b).sum().astype(np.float32), jax.ShapeDtypeStruct((), jnp.float32), x)
    fn = lambda x, a: (cb(x), a, a * 1)  # noqa: E731
    x = jnp.float32([0.5, -0.0, 3.0])
    sess = js.Session()
    gid = sess.compile(fn, x, 2.5)
    for a in (2.5, jnp.float32(2.5), -0.0):
      got, want = sess.run(gid, x, a), jax.jit(fn)(x, a)
      self.assertEqual([g.weak_type for g in got], [w.weak_type for w in want])
      for g, w in zip(got, want):
        assert_equal_signed(g, w)


class NarrowScalarArgumentTest(absltest.TestCase):

  def test_a_python_scalar_where_a_narrow_scalar_was_compiled(self):
    # a fuzzer's find: 0.1 for a bfloat16 s was rounded to bfloat16 first,
    # where jax.jit adds the weak float32 to x in float32
    xb, xf = jnp.bfloat16([1.0, -0.0]), jnp.float32([1.0, -0.0])
    cases = [(lambda x, s: x * s, (xb, jnp.bfloat16(1)), 0.1, True),
             (lambda x, s: x + s, (xf, jnp.bfloat16(1)), 0.1, False),
             (lambda x, s: x + s, (jnp.int8([1, -128]), jnp.int8(1)), 3, True),
             (lambda x, s: (x, s), (jnp.int8([1, 2]), jnp.int8(1)), 3, False),
             # a review's: read twice (jax.jit converts at each use), an int
             # widened again, a float returned as it came
             (lambda x, s: x * s + s, (xb, jnp.bfloat16(1)), 0.1, True),
             (lambda x, s: x + s, (jnp.int32([1, -7]), jnp.int8(1)), 3, True),
             (lambda x, s: x * s, (xf, jnp.int8(1)), -3, True),
             (lambda x, s: (x * s, s), (xb, jnp.bfloat16(1)), 0.1, False),
             # a literal beside it (compile raised TypeError), a scan body
             (lambda x, s: x * s + 1, (xb, jnp.bfloat16(1)), 0.1, True),
             (lambda x, s: jax.lax.scan(lambda c, _: (c * s, None), x, None, length=2)[0],
              (xb, jnp.bfloat16(1)), 0.1, True),
             # a while whose cond and body take one const each: told apart
             (lambda x, s: jax.lax.while_loop(lambda c: c[0] < (x[0] > 5).astype(int) + 2,
                                              lambda c: (c[0] + 1, c[1] * s), (0, x))[1],
              (xb, jnp.bfloat16(1)), 0.1, True),
             # a scatter's update body, of other arity than its operands: a raw
             # NameError at compile (a lint's find)
             (lambda x, s: x.at[jnp.array([1, 0])].add(s) * s, (xb, jnp.bfloat16(1)), 0.1, True)]
    for fn, examples, scalar, exact in cases:
      sess = js.Session()
      gid = sess.compile(fn, *examples)
      if exact:
        got, want = sess.run(gid, examples[0], scalar), jax.jit(fn)(examples[0], scalar)
        assert_equal_signed(got, want)
        self.assertEqual(got.dtype, want.dtype)
      else:
        with self.assertRaisesRegex(js.InputError, "Python scalar .*jax.jit would compile"):
          sess.run(gid, examples[0], scalar)
      for got, want in zip(jax.tree.leaves(sess.run(gid, *examples)),
                           jax.tree.leaves(jax.jit(fn)(*examples))):
        assert_equal_signed(got, want)


  @pytest.mark.slow  # a fresh interpreter with x64
  def test_a_python_float_converts_as_xla_converts_a_float64(self):
    # XLA converts a float64 to bfloat16 or float16 through float32: two
    # roundings, where numpy's one gave the next value up (a fuzzer's find)
    out = run_json("""
      import json
      import jax.numpy as jnp, numpy as np
      import jaxsession as js
      f = lambda x, s: x * s
      result = []
      for dt, v in ((jnp.bfloat16, 1 + 2**-8 + 2**-30), (jnp.float16, 1 + 2**-11 + 2**-30)):
        x = jnp.asarray([1.0, -2.0], dt)
        sess = js.Session()
        gid = sess.compile(f, x, jnp.asarray(1, dt))
        result.append([np.asarray(sess.run(gid, x, v)).astype(float).tolist(),
                       np.asarray(jax.jit(f)(x, v)).astype(float).tolist()])
      print(json.dumps(result))
      """, devices=1, x64=True)
    for got, want in out:
      self.assertEqual(got, want)


  def test_xla_is_asked_how_it_narrows_in_a_context_of_its_own(self):
    # the machine's answer is asked of XLA at the first such run: under the
    # caller's context mesh, a default device named by a string, or inside
    # an outer jit's trace that first run failed (a review's finds)
    out = run_json("""
      import json
      import numpy as np, jax, jax.numpy as jnp
      import jaxsession as js
      from jaxsession import inputs
      f = lambda x, s: x * s
      v = 1 + 2**-8 + 2**-30  # rounds apart once or through float32
      x = np.asarray(np.random.default_rng(4).standard_normal(4), jnp.bfloat16)
      want = np.asarray(jax.jit(f)(x, v)).astype(float).tolist()
      sess = js.Session()
      gid = sess.compile(f, x, jnp.bfloat16(2))
      mesh = jax.make_mesh((2,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
      got = {}
      inputs._THROUGH_F32.clear()
      with jax.set_mesh(mesh):
        got["context mesh"] = np.asarray(sess.run(gid, x, v)).astype(float).tolist()
      inputs._THROUGH_F32.clear()
      jax.config.update("jax_default_device", "cpu")
      got["default device 'cpu'"] = np.asarray(sess.run(gid, x, v)).astype(float).tolist()
      jax.config.update("jax_default_device", None)
      inputs._THROUGH_F32.clear()
      xs = jax.device_put(x)
      @jax.jit
      def outer(y):
        got["inside a trace"] = np.asarray(sess.run(gid, xs, v)).astype(float).tolist()
        return y + 1
      outer(1.0)
      print(json.dumps([want, got]))
      """, devices=2, x64=True)
    want, got = out
    self.assertLen(got, 3)
    for where, values in got.items():
      self.assertEqual(values, want, msg=where)


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


class TracedAgainTest(absltest.TestCase):

  def test_a_trace_again_asks_only(self):
    # a step with an int32 counter traces again (concepts.md says so); a
    # constant drawn at trace time is the first trace's in the graph
    rng = np.random.default_rng(21)
    draws = []

    def step(count, w, x):
      draws.append(rng.standard_normal((4, 4)).astype(np.float32))
      return count + 1, w + x @ draws[-1], jnp.sum(w)
    w = rng.standard_normal(4).astype(np.float32)
    x = rng.standard_normal(4).astype(np.float32)
    sess = js.Session()
    gid = sess.compile(step, jnp.int32(0), w, x, state_argnums=(0, 1))
    self.assertGreater(len(draws), 1)
    first = draws[0]
    sess.run(gid, x)
    want = jax.jit(lambda count, w, x: (count + 1, w + x @ first))(jnp.int32(0), w, x)
    count, new_w = sess.get_state(gid)
    np.testing.assert_array_equal(count, want[0])
    np.testing.assert_array_equal(new_w, want[1])


if __name__ == "__main__":
  absltest.main()
