"""Constant expressions and the small float types: what the Optimize passes
may fold, simplify or merge, against jax.jit bit for bit (break-it finds).

XLA folds a float expression of constants whole under jax.jit, and not by
IEEE rules everywhere, so the passes leave such an expression to it where a
zero's sign could differ; the float8/float4 types lack zeros, signs, -0.0 or
inf, which the rules must respect; fused ops' params are told apart by their
bits and keep the root's weak type.
"""
from absl.testing import absltest
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jaxsession as js
from exact import assert_equal_signed

RNG = np.random.default_rng(31)


def _same(test, fn, *args):
  """fn in a Session equals jax.jit(fn), bit for bit, the sign of zeros,
  dtypes and weak types included; the session and graph for more checks."""
  sess = js.Session()
  gid = sess.compile(fn, *args)
  got, want = sess.run(gid, *args), jax.jit(fn)(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    test.assertEqual(g.dtype, w.dtype)
    test.assertEqual(jax.typeof(g).weak_type, jax.typeof(w).weak_type)
    if g.dtype.itemsize == 1 and jnp.issubdtype(g.dtype, jnp.floating):  # float8/4: by bits
      np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
    else:
      assert_equal_signed(g, w)
  return sess, gid


class ConstantExpressionsTest(absltest.TestCase):

  def test_a_zero_of_a_constant_expression_keeps_its_sign(self):
    """XLA gives -0.0 for (c * 2.0) + 0.0 with c holding -0.0 (it removes the
    + 0 of an expression it then folds), where folding node by node, or
    simplifying d - 0 and -(-d) first, gave +0.0."""
    c = np.asarray(np.concatenate([[-0.0], RNG.uniform(1, 2, 3)]), np.float32)
    d = np.asarray(np.concatenate([[-0.0], RNG.uniform(1, 2, 2), [np.inf]]), np.float32)
    scalar = jnp.float32(-0.0)
    x = jnp.asarray(RNG.standard_normal(4), jnp.float32)
    cases = {
        "sum": lambda x: (sum([jnp.asarray(c) * 2.0, jnp.asarray(c) * 3.0]), x),
        "times then plus zero": lambda x: ((jnp.asarray(c) * 2.0) + 0.0, x),
        "minus zero then plus zero": lambda x: ((jnp.asarray(d) - 0.0) + 0.0, x),
        "double negation then plus zero": lambda x: (-(-jnp.asarray(d)) + 0.0, x),
        "scalar": lambda x: ((scalar * 2.0) + 0.0, x),
        "plus zero": lambda x: (jnp.asarray(c) + 0.0, x),
    }
    for name, fn in cases.items():
      with self.subTest(name):
        _same(self, fn, x)

  def test_float4_division_by_zero(self):
    """float4 has no inf: numpy saturates 1/0 to 6, XLA's folder gives 0."""
    a = np.array([1.0, 1.0, 2.0], np.float32).astype(ml_dtypes.float4_e2m1fn)
    b = np.array([0.0, -0.0, 4.0], np.float32).astype(ml_dtypes.float4_e2m1fn)
    _same(self, lambda x: (jnp.asarray(a) / jnp.asarray(b), x), jnp.float32(1.5))

  def test_convert_round_trips_through_small_floats(self):
    """A -> B -> A is x only where B holds every value of A: zero, the
    sign, -0.0 and inf too (e8m0fnu has no zero and no sign, e4m3fn no inf,
    the fnuz types no -0.0)."""
    cases = [
        (jnp.bool_, ml_dtypes.float8_e8m0fnu, np.array([False, True])),
        (ml_dtypes.int2, ml_dtypes.float8_e8m0fnu, np.array([-2, -1, 0, 1])),
        (ml_dtypes.float8_e4m3, ml_dtypes.float8_e4m3fn, np.array([np.inf, -np.inf, 1.0])),
        (ml_dtypes.float8_e4m3, ml_dtypes.float8_e4m3fnuz, np.array([np.inf, -0.0, 1.0])),
        (ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz, np.array([np.inf, -0.0, 1.0])),
        (jnp.float16, jnp.float32, np.array([np.inf, -0.0, np.nan, 1.5])),  # an identity
    ]
    for a, b, values in cases:
      with self.subTest(a=np.dtype(a).name, b=np.dtype(b).name):
        x = jnp.asarray(values.astype(a))
        sess, gid = _same(self, lambda x, a=a, b=b: x.astype(b).astype(a), x)
        kept = [] if np.dtype(b) == np.float32 else ["convert_element_type"] * 2
        self.assertEqual([n.op for n in sess.graph(gid).nodes], kept)

  def test_double_negation_without_a_sign(self):
    x = jnp.asarray(np.array([1.0, 2.0, 0.5], np.float32).astype(ml_dtypes.float8_e8m0fnu))
    sess, gid = _same(self, lambda x: -(-x), x)
    self.assertEqual([n.op for n in sess.graph(gid).nodes], ["neg", "neg"])
    y = jnp.asarray(RNG.standard_normal(4), jnp.float32).at[0].set(-0.0)
    sess, gid = _same(self, lambda y: -(-y), y)  # with a sign: still simplified
    self.assertEqual([n.op for n in sess.graph(gid).nodes], [])


class FusedParamsTest(absltest.TestCase):

  def test_adam_updates_whose_decay_differs_in_the_sign_of_zero(self):
    """Two Adam updates of one p, g, m, v with b1 = +0.0 and -0.0: each fuses,
    and CSE merged the two fused nodes (their params compared equal)."""
    c = np.float32(0.9999999)

    def f(p, g, m, v, bc1, bc2):
      m_a = 0.0 * m + c * g
      v_a = 0.999 * v + 0.001 * (g * g)
      p_a = p + (-0.001) * ((m_a / bc1) / (jnp.sqrt(v_a / bc2) + 1e-8))
      m_b = -0.0 * m + g * c
      v_b = v * 0.999 + 0.001 * g ** 2
      p_b = p + (-0.001) * ((m_b / bc1) / (jnp.sqrt(v_b / bc2) + 1e-8))
      return (p_a, m_a, v_a), (p_b, m_b, v_b)
    p, m = (jnp.asarray(RNG.uniform(1, 2, 3), jnp.float32) for _ in range(2))
    v = jnp.asarray(RNG.uniform(0.5, 1, 3), jnp.float32)
    g = jnp.asarray([-0.0, -0.0, 0.5], jnp.float32)
    sess, gid = _same(self, f, p, g, m, v, jnp.float32(0.1), jnp.float32(0.001))
    self.assertEqual([n.op for n in sess.graph(gid).nodes].count("Adam"), 2)

  def test_a_fused_adam_keeps_the_roots_weak_type(self):
    """p a Python float (weak), the update strong: jax.jit's new p is strong
    (it promotes otherwise in the caller's code)."""
    def step(p, g, m, v, bc1, bc2):
      m_new = 0.9 * m + 0.1 * g
      v_new = 0.999 * v + 0.001 * (g * g)
      u = (m_new / bc1) / (jnp.sqrt(v_new / bc2) + 1e-8)
      return jax.lax.add(p, (-0.001) * u), m_new, v_new
    args = [float(RNG.uniform(1, 2))] + [jnp.float32(RNG.uniform(0.1, 1)) for _ in range(5)]
    sess, gid = _same(self, step, *args)
    self.assertIn("Adam", [n.op for n in sess.graph(gid).nodes])


if __name__ == "__main__":
  absltest.main()


class BroadcastConstantsTest(absltest.TestCase):

  def test_a_broadcast_constant_stays_unfolded_as_xlas_folder_leaves_it(self):
    """XLA folds no broadcast that grows a constant, so a reduction of one runs
    at run time under jax.jit, and so does a division by it; folded here, XLA
    folded the reduction and divided by a constant otherwise (JAX's
    scipy_signal_test: istft's overlap-add normalisation, 1 ulp apart)."""
    w = jnp.asarray(RNG.random(8).astype(np.float32) + 0.5)  # closed over

    def overlap_add(y):  # 5 frames of 8, hop 4
      y = y.T.reshape(5, 2, 4).transpose(1, 0, 2)
      y = jnp.pad(y, ((0, 0), (0, 1), (0, 0)))
      return y.reshape(2, 24)[:, :22].sum(0)

    def normalised(x):
      window = jnp.broadcast_to(w[:, None] * w[:, None], (8, 5))
      return overlap_add(x * w[:, None]) / overlap_add(window), window.mean(axis=1)
    for seed in range(4):
      x = np.random.default_rng(seed).standard_normal((8, 5)).astype(np.float32)
      x[0, :3] = (-0.0, np.inf, np.nan)
      _same(self, normalised, x)
