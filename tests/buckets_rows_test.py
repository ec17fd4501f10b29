"""Shape buckets, the rows' side (split from buckets_test.py): a row count
returned or made the new state as it is (no node computes on it) is refused
as reading the batch size; a program that fails at the analysis' own row
counts is an InputError naming the unbucketed array with the batch's rows;
row-wise stacks run padded, equal to exact-shape jax.jit bit for bit."""
from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jaxsession.errors import InputError


def _rows(n, seed=0):
  x = np.random.default_rng(seed + n).standard_normal((n, 3)).astype(np.float32)
  x[0, :3] = [-0.0, np.nan, np.inf]
  x[-1, 0] = -np.inf
  return x


class RowCountTest(absltest.TestCase):

  def test_a_returned_row_count_is_refused(self):
    # a break-it find: each run returned the bucket's size (4 for 3 rows) and
    # a state set to it held 4 where jax.jit's holds 3
    sess, x = js.Session(), _rows(8)
    for fn in (lambda x: (x * 2, x.shape[0]),
               lambda x: (x, jnp.float32(x.shape[0])),
               lambda x: (x, jnp.float32(x.shape[0] / 2))):
      with self.assertRaisesRegex(InputError, r"depends on the batch size.*outputs"):
        sess.compile(fn, x, buckets={0: [4, 8]})
    with self.assertRaisesRegex(InputError, r"depends on the batch size.*outputs"):
      sess.compile(lambda n, x: (jnp.float32(x.shape[0]), x * 2), jnp.float32(0), x,
                   state_argnums=0, buckets={1: [4, 8]})

  def test_a_literal_output_of_no_row_count_still_runs_padded(self):
    sess, fn = js.Session(), lambda x: (x * 2, 3.0, jnp.int32(7))
    gid = sess.compile(fn, _rows(8), buckets={0: [4, 8]})
    for n in (3, 5, 8):
      for got, want in zip(sess.run(gid, _rows(n)), jax.jit(fn)(_rows(n))):
        np.testing.assert_array_equal(got, want)
        self.assertEqual(got.dtype, want.dtype)
    self.assertEqual(sorted(sess.report(gid).buckets.sizes), [4, 8])

  def test_a_disagreeing_batch_names_each_leaf(self):
    sess, fn = js.Session(), lambda p: p["a"] + p["b"]
    gid = sess.compile(fn, {"a": _rows(8), "b": _rows(8)}, buckets={0: [4, 8]})
    with self.assertRaisesRegex(InputError, r"disagree on the batch size \(axis 0\): 3 rows "
                                r"in argument 0 at path \['a'\], 5 rows in argument 0 at "
                                r"path \['b'\]"):
      sess.run(gid, {"a": _rows(3), "b": _rows(5)})
    got = sess.run(gid, {"a": _rows(5), "b": _rows(5, seed=2)})
    np.testing.assert_array_equal(got, jax.jit(fn)({"a": _rows(5), "b": _rows(5, seed=2)}))


class ProbeFailureTest(absltest.TestCase):

  def test_an_unbucketed_array_with_the_batchs_rows_is_named(self):
    # jax.jit runs these on the examples; the analysis' traces at its own row
    # counts failed with jax's raw TypeError from inside the session
    sess, x = js.Session(), _rows(8)
    cases = [
        (lambda x, y: x + y, (x, x), 0, {}, r"argument 1\)"),
        (lambda s, x: (s, x + s), (x, x), 1, {"state_argnums": 0}, r"state argument 0\)"),
        (lambda x: x + jnp.asarray(_rows(8)), (x,), 0, {}, r"an array fn closes over"),
        (lambda x: x.reshape(2, -1), (x,), 0, {}, r"cannot reshape"),
    ]
    for fn, args, bucketed, kwargs, named in cases:
      with self.assertRaisesRegex(InputError, r"traced with the bucketed arguments at \d+ "
                                  r"rows .* fails: TypeError: .*" + named) as caught:
        sess.compile(fn, *args, buckets={bucketed: [4, 8]}, **kwargs)
      self.assertIsInstance(caught.exception.__cause__, TypeError)
    # bucketed together, the pair runs padded
    gid = sess.compile(lambda x, y: x + y, x, x, buckets={0: [4, 8], 1: [4, 8]})
    a, b = _rows(5), _rows(5, seed=1)
    np.testing.assert_array_equal(sess.run(gid, a, b), jax.jit(lambda x, y: x + y)(a, b))

  def test_a_bucket_too_large_to_pad_is_an_input_error(self):
    # numpy's raw MemoryError before (a judge's find); smaller batches still run
    sess, fn = js.Session(), lambda x: x * 2
    gid = sess.compile(fn, _rows(4), buckets={0: [4, 2**50]})  # (past any address space)
    with self.assertRaisesRegex(InputError, r"bucket of 1125899906842624 rows needs more host "
                                "memory"):
      sess.run(gid, _rows(5))
    np.testing.assert_array_equal(sess.run(gid, _rows(3)), jax.jit(fn)(_rows(3)))


class RowWiseStackTest(absltest.TestCase):

  def test_stacks_run_padded_as_exact_jit(self):
    # refused before as "no batch rule for stack" (jax's stack primitive),
    # where the concatenate it equals was accepted
    w = jnp.asarray(np.random.default_rng(3).standard_normal(3).astype(np.float32))
    fns = {
        "axis 1": lambda x: jnp.stack([x, -x], 1),
        "axis -1": lambda x: jnp.stack([x, x * 2], -1),
        "axis 0": lambda x: jnp.stack([x, jnp.tanh(x)]),
        "columns": lambda x: jnp.stack([x[:, 0], x[:, 1] * w[0]], -1),
        "beside a row-free operand": lambda x: jnp.stack([x, jnp.broadcast_to(w, x.shape)], 2),
        "then reduced over the stack": lambda x: jnp.stack([x, x * w], 1).sum(1),
    }
    sess = js.Session()
    for what, fn in fns.items():
      with self.subTest(what):
        gid = sess.compile(fn, _rows(8), buckets={0: [4, 8, 16]})
        for n in (3, 5, 8, 11):
          got, want = sess.run(gid, _rows(n)), jax.jit(fn)(_rows(n))
          self.assertEqual(got.shape, want.shape)
          np.testing.assert_array_equal(got, want)
        self.assertIn(16, sess.report(gid).buckets.sizes)

  def test_a_stack_whose_rows_meet_is_refused(self):
    sess = js.Session()
    with self.assertRaisesRegex(InputError, r"'reduce_sum'.*over the batch axis"):
      sess.compile(lambda x: jnp.stack([x, -x], 1).sum(0), _rows(8), buckets={0: [4, 8]})


class KeyPerRowTest(absltest.TestCase):

  def test_a_key_per_row_pads_as_its_data(self):
    # refused before ("only numeric or bool arrays"): a request's own key,
    # as a server samples each request with
    from jaxsession.runtime import buckets as policy_lib  # pylint: disable=import-outside-toplevel

    def sample(req, x):
      noise = jax.vmap(lambda k, x: jax.random.normal(k, x.shape))(req["key"], x)
      return x + noise * req["scale"], jax.vmap(lambda k: jax.random.split(k)[0])(req["key"])
    keys = jax.random.split(jax.random.key(5), 8)
    scale = np.random.default_rng(4).standard_normal(8).astype(np.float32)[:, None]
    sess = js.Session()
    gid = sess.compile(sample, {"key": keys, "scale": scale}, _rows(8),
                       buckets={0: [4, 8], 1: [4, 8]})
    for n in (2, 3, 5, 8):
      req, x = {"key": keys[:n], "scale": scale[:n]}, _rows(n)
      got, new_keys = sess.run(gid, req, x)
      size = 4 if n <= 4 else 8
      padded = jax.tree.map(lambda a: policy_lib.pad_rows(a, size, 0), (req, x))
      want, want_keys = jax.jit(sample)(*padded)
      # a transcendental's bits are the bucket's (numerics.md): jax.jit there, sliced
      np.testing.assert_array_equal(got, want[:n])
      exact_keys = jax.jit(sample)(req, x)[1]
      self.assertEqual((new_keys.dtype, new_keys.shape), (exact_keys.dtype, exact_keys.shape))
      np.testing.assert_array_equal(jax.random.key_data(new_keys),
                                    jax.random.key_data(exact_keys))
      np.testing.assert_array_equal(jax.random.key_data(new_keys),
                                    jax.random.key_data(want_keys)[:n])


  def test_the_executables_listed_are_the_examples_buckets(self):
    sess = js.Session()
    gid = sess.compile(lambda x: x * 2, _rows(3), buckets={0: [2, 4, 8]})
    (exe,) = sess.executables(gid)
    self.assertEqual(jax.tree.leaves(exe.in_avals)[0].shape, (4, 3))

  def test_no_numbers_to_pad_are_refused(self):
    with self.assertRaisesRegex(InputError, r"float0\[4\]: only numeric, bool or PRNG key "
                                "arrays"):
      js.Session().compile(lambda s, v: v * 2, np.zeros(4, jax.dtypes.float0), jnp.ones(4),
                           buckets={0: [4, 8]})


if __name__ == "__main__":
  absltest.main()
