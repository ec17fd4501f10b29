"""The conformance corpus: every program through Session.run equals jax.jit."""
import zlib

from absl.testing import absltest, parameterized
import jax
import numpy as np

import jaxsession as js
from corpus import CASES


def assert_tree_matches(test, got, want, rtol=1e-6):
  """Exact for ints, bools and keys; floats within rtol. Same pytree."""
  test.assertEqual(jax.tree.structure(got), jax.tree.structure(want))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    if jax.dtypes.issubdtype(w.dtype, jax.dtypes.extended):
      g, w = jax.random.key_data(g), jax.random.key_data(w)
    g, w = np.asarray(g), np.asarray(w)
    test.assertEqual(g.shape, w.shape)
    test.assertEqual(g.dtype, w.dtype)
    if np.issubdtype(w.dtype, np.inexact) or w.dtype.name == "bfloat16":
      np.testing.assert_allclose(g.astype(np.complex128 if np.iscomplexobj(w) else np.float64),
                                 w.astype(np.complex128 if np.iscomplexobj(w) else np.float64),
                                 rtol=rtol, atol=1e-6)
    else:
      np.testing.assert_array_equal(g, w)


class ConformanceTest(parameterized.TestCase):

  def test_corpus_is_large_enough(self):
    self.assertGreaterEqual(len(CASES), 40)
    self.assertEqual(len({name for name, _, _ in CASES}), len(CASES))

  @parameterized.named_parameters(*[(name, fn, make) for name, fn, make in CASES])
  def test_matches_jit(self, fn, make):
    rng = np.random.default_rng(zlib.crc32(self.id().encode()))
    sess = js.Session()
    gid = sess.compile(fn, *make(rng))
    self.assertTrue(sess.graph(gid).verify())
    for _ in range(2):  # fresh inputs on every run, not the example args
      args = make(rng)
      assert_tree_matches(self, sess.run(gid, *args), jax.jit(fn)(*args))


if __name__ == "__main__":
  absltest.main()
