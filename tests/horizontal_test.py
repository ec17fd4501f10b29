"""Horizontal fusion of packed write-backs (runtime/horizontal.py).

Where every packed leaf's new value is the same elementwise op, the step
runs it once over the whole buffer. It must keep jax.jit's bits wherever
packing does (no multiply feeding an add: docs/numerics.md), for every kind
of operand the rewrite lines up - the leaves' reads, a value every leaf
reads, scalars alike or differing, runs of different ops, leaves swapped or
read early - and say what it did in report.memory.horizontal.
"""
import math

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jaxsession.runtime import horizontal
from exact import assert_same_bits, normal, ulps_apart, with_specials

RNG = np.random.default_rng(1717)
PACK = js.SessionOptions(pack_state_below_bytes=1 << 14)
SHAPES = [(16,), (3, 5), (), (7,), (2, 2, 2), (1,), (33,)]


def leaves(rng, count, dtype=jnp.float32, shapes=SHAPES):
  """`count` small leaves of varied shapes (by default a scalar and a (1,)
  among them), the first with -0.0, NaN and inf, values over many magnitudes."""
  out = {}
  for i in range(count):
    shape = shapes[i % len(shapes)]
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-8, 8, shape))
    out[f"l{i:02d}"] = jnp.asarray(x, dtype)
  out["l00"] = with_specials(out["l00"])
  return out


def run_both(fn, state, xs, options=PACK):
  """(the session's outputs and final state, jax.jit's), one step per x."""
  sess = js.Session(options)
  gid = sess.compile(fn, state, xs[0], state_argnums=0)
  got = [sess.run(gid, x) for x in xs]
  want, ref = [], state
  for x in xs:
    ref, out = jax.jit(fn)(ref, x)
    want.append(out)
  return sess, gid, (got, sess.get_state(gid)[0]), (want, ref)


def kernels(sess, gid):
  """The loop kernels XLA runs in the graph's executable."""
  return sess.executables(gid)[0].as_text().count("kind=kLoop")


class MergedTest(absltest.TestCase):

  def test_one_op_over_the_buffer_keeps_jits_bits(self):
    # correctly rounded ops: one kernel over the buffer or one a leaf, the same
    # bits. (XLA:CPU's exp, log, tanh round by the kernel's size, so they are
    # never merged: TranscendentalsTest below.)
    funcs = {"sqrt_div": lambda p: p / (jnp.sqrt(jnp.abs(p)) + 1e-8),
             "max": lambda p: jnp.maximum(p, -1.0), "abs_sub": lambda p: jnp.abs(p) - 1.5,
             "halve": lambda p: (p - 0.25) * 0.5, "sqrt": lambda p: jnp.sqrt(jnp.abs(p))}
    # no one-element leaf: over the buffer its scalar operand x would be
    # spread (SimplifiedScalarsTest), so such a leaf keeps its own op
    state = leaves(RNG, 30, shapes=[s for s in SHAPES if math.prod(s) > 1])
    xs = [normal(RNG) for _ in range(3)]
    for name, f in funcs.items():
      with self.subTest(name):
        fn = lambda s, x, f=f: (jax.tree.map(lambda p: f(p) - x, s), x)  # noqa: E731
        sess, gid, got, want = run_both(fn, state, xs)
        assert_same_bits(got, want, name)
        notes = sess.report(gid).memory.horizontal
        self.assertLen(notes, 1)
        self.assertRegex(notes[0], r"packed buffer .*30 leaves\): \d+ elementwise ops over the "
                         r"whole buffer in place of \d+ per-leaf ones$")
        # one kernel for the buffer (XLA keeps the loop the output reads)
        self.assertLessEqual(kernels(sess, gid), 3, name)
        self.assertIn(notes[0], sess.graph(gid).dump())

  def test_every_kind_of_operand(self):
    state = {**leaves(RNG, 12), **{f"v{i}": normal(RNG, 16) for i in range(4)},
             "count": jnp.asarray(np.iinfo(np.int32).max - 1, jnp.int32),
             "ids": jnp.asarray([np.iinfo(np.int32).min, -1, 7], jnp.int32),
             "flag": jnp.asarray([True, False, True])}
    shared = normal(RNG, 16)

    def fn(s, lr):
      new = {}
      for i in range(12):  # runs of one op each, joined
        k, p = f"l{i:02d}", s[f"l{i:02d}"]
        # lr: one traced scalar; a literal per pair of leaves (runs cut where it changes)
        new[k] = -(p - lr) if i < 6 else jnp.abs(p) * (i // 2 + 1.5)
      for i in range(4):  # one (traced) value every such leaf reads: tiled
        new[f"v{i}"] = s[f"v{i}"] - shared * lr
      new["count"] = s["count"] + 1  # wraps past int32 max
      new["ids"] = s["ids"] ^ 5
      new["flag"] = ~s["flag"]
      return new, new["l01"] * 2.0  # a reader of a merged value
    xs = [jnp.float32(0.25), jnp.float32(-3.5), jnp.float32(np.inf)]
    sess, gid, got, want = run_both(fn, state, xs)
    assert_same_bits(got, want, "operands")
    self.assertTrue(any("elementwise ops over the whole buffer" in line
                        for line in sess.report(gid).memory.horizontal))
    # a Python scalar (weakly typed) for lr: the same bits
    _, _, got, want = run_both(fn, state, [0.5, -1.25])
    assert_same_bits(got, want, "weak lr")

  def test_swapped_and_returned_leaves(self):
    state = {"a": normal(RNG, 8), "b": normal(RNG, 8), "c": normal(RNG, 3), "d": normal(RNG, 5)}
    fn = lambda s, x: ({"a": s["b"], "b": s["a"], "c": s["c"] - x,  # noqa: E731
                        "d": s["d"] - x}, (s["a"], s["c"] - x))
    sess, gid, got, want = run_both(fn, state, [normal(RNG) for _ in range(3)])
    assert_same_bits(got, want, "swapped")
    self.assertLen(sess.report(gid).memory.horizontal, 1)

  def test_x64_leaves(self):
    with jax.enable_x64(True):
      state = {**{k: v.astype(jnp.float64) for k, v in leaves(RNG, 9).items()},
               "i": jnp.asarray([2**62, -2**63], jnp.int64), "j": jnp.asarray(2**40, jnp.int64)}
      fn = lambda s, x: ({**jax.tree.map(lambda p: jnp.sqrt(jnp.abs(p)) - x, {  # noqa: E731
          k: v for k, v in s.items() if k.startswith("l")}), "i": s["i"] + 3,
                          "j": s["j"] - 1}, x)
      sess, gid, got, want = run_both(fn, state, [normal(RNG, dtype=jnp.float64)] * 2)
      assert_same_bits(got, want, "x64")
      self.assertTrue(any("float64" not in line and "whole buffer" in line
                          for line in sess.report(gid).memory.horizontal))

  def test_sunk_runs_state_calls_and_a_cached_executable(self):
    state = leaves(RNG, 20)
    xs = [normal(RNG) for _ in range(5)]
    fn = lambda s, x: (jax.tree.map(lambda p: jnp.sqrt(jnp.abs(p)) - x, s), x)  # noqa: E731
    sess = js.Session(PACK)
    gid = sess.compile(fn, state, xs[0], state_argnums=0)
    sess.run(gid, xs[0])
    sess.run(gid, jnp.stack(xs[1:4]), steps=3)
    sess.run(gid, xs[4])
    ref = state
    for x in xs:
      ref = jax.jit(fn)(ref, x)[0]
    assert_same_bits(sess.get_state(gid)[0], ref, "single and sunk runs")
    fresh = leaves(np.random.default_rng(3), 20)
    sess.replace_state(gid, 0, fresh)
    sess.run(gid, xs[0])
    assert_same_bits(sess.get_state(gid)[0], jax.jit(fn)(fresh, xs[0])[0], "replaced")
    again = sess.compile(fn, state, xs[0], state_argnums=0)  # the same program: cached
    self.assertEqual(sess.report(again).memory.horizontal, sess.report(gid).memory.horizontal)
    self.assertNotEmpty(sess.report(again).memory.horizontal)


class SimplifiedScalarsTest(absltest.TestCase):
  """XLA rewrites an op by the scalar or constant it takes (drops x + 0,
  turns pow(x, 2) into x * x, x / s into x * (1 / s), folds (x * a) * b):
  leaves merge only where those operands are the same, so each leaf keeps
  the rewrite jax.jit gives it (found by a break-it round)."""

  def test_per_leaf_scalars_and_constants_keep_jits_bits(self):
    rng = np.random.default_rng(8)
    vec = lambda: with_specials(normal(rng, 16) * 1e-3)  # noqa: E731
    const = normal(rng, 16)
    cases = {
        "add 0 / add 1": lambda s, lr: {"a": s["a"] + 0.0, "b": s["b"] + 1.0, "c": s["c"] + 1.0},
        "pow 3 / pow 2": lambda s, lr: {"a": jnp.abs(s["a"]) ** 3.0, "b": jnp.abs(s["b"]) ** 2.0,
                                        "c": jnp.abs(s["c"]) ** 2.0},
        "mul chains": lambda s, lr: {"a": s["a"] * 3.0 * 0.1, "b": s["b"] * -1.0,
                                     "c": s["c"] * 7.0 * 1e8},
        "divide by each leaf's max": lambda s, lr: {k: v / jnp.max(jnp.abs(v))
                                                    for k, v in s.items()},
        "divide by a shared traced scalar": lambda s, lr: {k: v / lr for k, v in s.items()},
        "divide by a constant array": lambda s, lr: {k: v / const for k, v in s.items()},
        "rem by a literal": lambda s, lr: {k: jax.lax.rem(v, 0.7) for k, v in s.items()},
    }
    for name, update in cases.items():
      with self.subTest(name):
        state = {"a": vec(), "b": vec(), "c": vec()}
        _, _, got, want = run_both(lambda s, lr, u=update: (u(s, lr), lr), state,
                                   [jnp.float32(0.3), jnp.float32(-7.0)])
        assert_same_bits(got, want, name)

  def test_a_constant_of_zeros_of_both_signs(self):
    # equal by value, not by bits: spread as one 0.0 it lost the -0.0s (a
    # break-it find; at 16 elements XLA itself makes the constant one 0.0)
    signed_zeros = np.array([0.0, -0.0, 0.0, -0.0], np.float32)
    state = {k: jnp.asarray(RNG.uniform(1, 2, 4), jnp.float32) for k in "abc"}
    fn = lambda s, x: ({k: v * signed_zeros for k, v in s.items()}, x)  # noqa: E731
    _, _, got, want = run_both(fn, state, [jnp.float32(0.5)])
    assert_same_bits(got, want, "times [0, -0, 0, -0]")
    self.assertTrue(np.signbit(np.asarray(got[1]["a"]))[1])

  def test_scalar_leaves(self):
    state = {f"s{i}": jnp.float32(v) for i, v in enumerate([-0.0, 1e-40, 3.5, -2.25])}
    for name, update in {"divide by 3": lambda p, lr: p / 3.0,
                         "divide by lr": lambda p, lr: p / lr,
                         "add 0": lambda p, lr: p + 0.0}.items():
      with self.subTest(name):
        fn = lambda s, lr, u=update: (jax.tree.map(lambda p: u(p, lr), s), lr)  # noqa: E731
        _, _, got, want = run_both(fn, state, [jnp.float32(0.3)])
        assert_same_bits(got, want, name)


class ThirdReviewTest(absltest.TestCase):
  """A third break-it round: a new value made of scalars alone (the merged op
  was one scalar, written back as the buffer: the state lost its shape);
  scalars a select or clamp takes at the op's shape (the rewrite passed them
  bare, and the compile failed); a divisor also read elsewhere (XLA turns
  a / sqrt(b) into a * rsqrt(b) only where the sqrt has one reader)."""

  def test_cases(self):
    rng = np.random.default_rng(33)
    cases = {
        "scalars alone": lambda s, x: {k: jnp.full_like(p, x) * 2.0 for k, p in s.items()},
        "sqrt of a scalar spread": lambda s, x: {k: jnp.sqrt(jnp.full_like(p, x * x))
                                                 for k, p in s.items()},
        "select of a spread scalar": lambda s, x: {k: jax.lax.select(p > 0, p, jnp.full_like(
            p, x)) for k, p in s.items()},
        "clamp of a spread scalar": lambda s, x: {k: jax.lax.clamp(p - 1.0, jnp.full_like(
            p, x), p + 1.0) for k, p in s.items()},
    }
    for name, update in cases.items():
      with self.subTest(name):
        state = {f"w{i}": normal(rng, 7) for i in range(4)}
        sess, gid, got, want = run_both(lambda s, x, u=update: (u(s, x), x), state,
                                        [jnp.float32(0.7), jnp.float32(-0.2)])
        assert_same_bits(got, want, name)
        sess.run(gid, jnp.float32(0.3))  # the state still has its shapes

  def test_a_divisor_read_elsewhere_too(self):
    rng = np.random.default_rng(34)
    state = {f"w{i}": normal(rng, 6) for i in range(4)}

    def step(s, x):
      roots = {k: jnp.sqrt(jnp.abs(p) + x) for k, p in s.items()}
      return {k: p / roots[k] for k, p in s.items()}, roots["w1"]
    _, _, got, want = run_both(step, state, [jnp.float32(0.5), jnp.float32(2.0)])
    assert_same_bits(got, want, "sqrt read twice")


class TranscendentalsTest(absltest.TestCase):

  def test_approximated_ops_are_not_merged(self):
    # XLA:CPU's exp, log, tanh, atan, erf are polynomials rounded by the
    # kernel's size (jax.jit itself gives other bits for a 7- and a
    # 56-element array: 1 ulp for exp, 2 for atan), so a run of leaves is
    # never merged over them. Packing alone still moves them: each leaf's
    # value is computed into the buffer's write-back, whose multiply-adds
    # XLA contracts otherwise (measured here: exp 1 ulp, erf 4, over leaves
    # of 3-33 elements; docs/numerics.md)
    state = leaves(RNG, 30, shapes=[s for s in SHAPES if math.prod(s) > 1])
    for name, f in {"tanh": jnp.tanh, "exp": lambda p: jnp.exp(p * 1e-3),
                    "log": lambda p: jnp.log(jnp.abs(p) + 1.0), "atan": jnp.arctan,
                    "erf": jax.scipy.special.erf,
                    "atan then add": lambda p: jnp.arctan(p) + 1.0}.items():
      with self.subTest(name):
        fn = lambda s, x, f=f: (jax.tree.map(f, s), x)  # noqa: E731
        sess, gid, (_, got), (_, want) = run_both(fn, state, [normal(RNG)])
        self.assertNotIn("whole buffer", sess.report(gid).memory.horizontal[0])
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
          finite = np.isfinite(np.asarray(w))
          self.assertLessEqual(ulps_apart(np.asarray(g)[finite], np.asarray(w)[finite]), 4)

  def test_exact_ops_still_merge(self):
    # abs and mul round exactly in any kernel: one op each over the buffer
    state = {f"w{i}": normal(RNG, 7) for i in range(8)}
    fn = lambda s, x: ({k: jnp.abs(p) * x for k, p in s.items()}, x)  # noqa: E731
    sess, gid, got, want = run_both(fn, state, [normal(RNG)])
    assert_same_bits(got, want, "abs * x")
    self.assertIn("2 elementwise ops over the whole buffer",
                  sess.report(gid).memory.horizontal[0])


class NotMergedTest(absltest.TestCase):

  def test_big_leaves_keep_their_own_kernels(self):
    # 2048 elements a leaf: one kernel over them all would run on one thread
    state = {f"l{i}": normal(RNG, 2048) for i in range(6)}
    fn = lambda s, x: (jax.tree.map(lambda p: jnp.sqrt(jnp.abs(p)) - x, s), x)  # noqa: E731
    sess, gid, got, want = run_both(fn, state, [normal(RNG)] * 2)
    assert_same_bits(got, want, "big leaves")
    notes = sess.report(gid).memory.horizontal
    self.assertLen(notes, 1)
    self.assertIn("written back leaf by leaf", notes[0])

  def test_a_chain_deeper_than_python_recurses(self):
    state = {f"k{i}": normal(RNG, 8) for i in range(2)}

    def step(s, x):
      def chain(p):
        for _ in range(400):
          p = jnp.abs(p - x)
        return p
      return jax.tree.map(chain, s), x
    sess, gid, got, want = run_both(step, state, [jnp.float32(0.001)])
    assert_same_bits(got, want, "deep chain")
    self.assertIn("too deep to plan", sess.report(gid).memory.horizontal[0])

  def test_traced_again_only_where_something_merges(self):
    # the rewrite plans on jax.jit's own trace of the step: where nothing
    # merges, that trace is lowered as it is (it was evaluated again, ~0.3 s
    # of the transformer's compile); where something does, once
    evaluated = []
    real = horizontal._evaluate

    def counting(*args):
      evaluated.append(1)
      return real(*args)
    state = {f"w{i}": normal(RNG, 7) for i in range(4)}
    cases = {"merged": (lambda s, x: (jax.tree.map(lambda p: p - x, s), x), 1),
             "approximated": (lambda s, x: (jax.tree.map(jnp.exp, s), x), 0)}
    horizontal._evaluate = counting
    try:
      for name, (fn, traces) in cases.items():
        with self.subTest(name):
          del evaluated[:]
          run_both(fn, state, [normal(RNG)])
          self.assertLen(evaluated, traces)
    finally:
      horizontal._evaluate = real

  def test_packing_off_notes_nothing(self):
    state = leaves(RNG, 5)
    fn = lambda s, x: (jax.tree.map(lambda p: p - x, s), x)  # noqa: E731
    sess, gid, got, want = run_both(fn, state, [normal(RNG)], js.SessionOptions())
    assert_same_bits(got, want, "unpacked")
    self.assertEqual(sess.report(gid).memory.horizontal, [])


if __name__ == "__main__":
  absltest.main()
