"""Shape buckets over loops whose steps are the rows (`lax.map`, a scan that
passes its carry through) and over lookups into a sorted table
(`jnp.searchsorted`, `jnp.histogram`, `jnp.digitize`), and `jnp.tile` along
other axes: each row's result is its own row's, so padding is safe; the
runs equal jax.jit at the exact size bit for bit. Loops that carry one row
into the next, or run as many steps as the batch has rows, stay refused.
Every bucket requests are padded to is checked to be the program the
padding analysis saw (a Python branch on the batch size between the probe
sizes and a bucket made rows mix: refused, at compile where the buckets are
known, else at the run that would pad into it)."""
from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jaxsession.errors import InputError
from exact import assert_same_bits

RNG = np.random.default_rng(39)
B, D = 12, 6
BUCKETS = {0: [8, 16]}
EDGES = jnp.asarray(np.sort(RNG.standard_normal(7)).astype(np.float32))


def _rows():
  x = RNG.standard_normal((B, D)).astype(np.float32)
  x[0, 0], x[1, 1], x[2, 2], x[3, 3], x[4, 4] = -0.0, np.inf, np.nan, -np.inf, 3e38
  return jnp.asarray(x)


ACCEPTED = {
    "map": lambda x: jax.lax.map(lambda r: jnp.sin(r) * r.sum(), x),
    "map_pytree_out": lambda x: jax.lax.map(lambda r: {"s": r.max(), "o": jnp.sort(r)}, x),
    "nested_map": lambda x: jax.lax.map(lambda r: jax.lax.map(lambda e: e * 2.0 - 1.0, r), x),
    "map_with_row_index": lambda x: jax.lax.map(
        lambda a: a[0] * a[1], (x, jnp.arange(x.shape[0], dtype=jnp.float32))),
    "map_reads_a_table": lambda x: jax.lax.map(lambda r: r * jnp.arange(D, dtype=x.dtype), x),
    "carry_passed_through": lambda x: jax.lax.scan(lambda c, r: (c, r * c), 2.5, x)[1],
    "reversed_steps": lambda x: jax.lax.scan(lambda c, r: (c, jnp.cumsum(r)), 0.0, x,
                                             reverse=True)[1],
    "searchsorted": lambda x: jnp.searchsorted(EDGES, x),
    "digitize": lambda x: jnp.digitize(x, EDGES),
    "histogram_per_row": lambda x: jax.vmap(
        lambda r: jnp.histogram(r, bins=4, range=(-2.0, 2.0))[0])(x),
    "tile_columns": lambda x: jnp.tile(x, (1, 3)) - 1.0,
}

REFUSED = {  # name: (fn, words of the refusal)
    "running_sum": (lambda x: jax.lax.scan(lambda c, r: (c + r, c + r), jnp.zeros(D), x)[1],
                    "a carry that changes"),
    "final_carry": (lambda x: jax.lax.scan(lambda c, r: (c + r, r), jnp.zeros(D), x)[0],
                    "a carry that changes"),
    "step_counter": (lambda x: jax.lax.scan(lambda c, r: (c + 1.0, r * c), 0.0, x)[1],
                     "a carry that changes"),
    "map_closes_over_the_batch": (lambda x: jax.lax.map(lambda r: r - x.mean(0), x),
                                  "over the batch axis"),
    "loop_of_batch_size_steps": (lambda x: jax.lax.fori_loop(0, x.shape[0],
                                                             lambda i, c: c * 0.5, x),
                                 "as many steps as the batch has rows"),
    "map_over_a_table_of_batch_length": (lambda x: jax.lax.map(
        lambda a: a[0] * a[1], (x, jnp.linspace(0.0, 1.0, x.shape[0]))), "batch"),
    "tile_rows": (lambda x: jnp.tile(x, (2, 1)), "tiles along the batch axis"),
    "callback_per_row": (lambda x: jax.lax.map(lambda r: jax.pure_callback(
        lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(r.shape, r.dtype), r), x),
                         "running the user's code"),
}


class RowLoopsTest(absltest.TestCase):

  def test_row_wise_loops_and_lookups_run_bucketed_and_equal_jit(self):
    x = _rows()
    sess = js.Session()
    for name, fn in ACCEPTED.items():
      with self.subTest(name):
        gid = sess.compile(fn, x, buckets=BUCKETS)  # refused before this change
        for n in (1, 3, 8, 11, 12):  # padded to 8 or 16; 1 row, and full buckets too
          assert_same_bits(sess.run(gid, x[:n]), jax.jit(fn)(x[:n]), f"{name} at {n} rows")
        self.assertIn("compiled sizes [8, 16]", sess.report(gid).buckets.describe())

  def test_loops_that_carry_rows_or_count_them_stay_refused(self):
    x = _rows()
    sess = js.Session()
    for name, (fn, words) in REFUSED.items():
      with self.subTest(name):
        with self.assertRaises(InputError) as ctx:
          sess.compile(fn, x, buckets=BUCKETS)
        self.assertIn(words, str(ctx.exception))
        gid = sess.compile(fn, x)  # without buckets: runs, equal to jax.jit
        assert_same_bits(sess.run(gid, x), jax.jit(fn)(x), name)



def _batch_mean_when_small(x):  # reads the batch size: mixes rows up to 16
  return x - x.mean(0) if x.shape[0] <= 16 else x * 1.0


def _parity(x):
  return x * (2.0 if x.shape[0] % 2 == 0 else 3.0)


def _batch_mean_when_large(x):
  return x - x.mean(0) if x.shape[0] >= 8 else x * 1.0


KEY = jax.random.key(3)  # a typed key closed over: a constant of the program


class BucketProgramTest(absltest.TestCase):

  def test_a_branch_on_the_batch_size_at_a_bucket_is_refused_at_compile(self):
    sess = js.Session()
    for fn in (_batch_mean_when_small, _parity):
      with self.subTest(fn.__name__):
        with self.assertRaisesRegex(InputError, "is another program than at the probe"):
          sess.compile(fn, _rows(), buckets={0: [2, 4, 8, 16]})
        x = _rows()[:3]  # without buckets: runs, as jax.jit
        assert_same_bits(sess.run(sess.compile(fn, x), x), jax.jit(fn)(x))

  def test_auto_buckets_refuse_a_run_that_would_pad_into_another_program(self):
    x = _rows()
    sess = js.Session()
    gid = sess.compile(_batch_mean_when_large, x[:3], buckets={0: "auto"})  # probes < 8
    policy = sess.report(gid).buckets.policy
    for n in range(1, 13):
      want = jax.jit(_batch_mean_when_large)(x[:n])
      counted = policy.rows
      try:
        got = sess.run(gid, x[:n])
      except InputError as exc:  # never a wrong row: refused, naming the bucket
        self.assertIn("is another program than at the probe", str(exc))
        self.assertGreaterEqual(n, 5)
        self.assertEqual(policy.rows, counted)  # a refused run is not traffic
        continue
      assert_same_bits(got, want, f"{n} rows")
    assert_same_bits(sess.run(gid, x[:3]), jax.jit(_batch_mean_when_large)(x[:3]))

  def test_numpy_int64_and_float64_rows_as_jit_takes_them(self):
    # without x64 jax.jit takes them as int32 and float32; refused before
    ids = np.random.default_rng(5).integers(-2**31, 2**31 - 1, (12, 4))  # int64
    feats = np.random.default_rng(6).standard_normal((12, 4))  # float64
    fn = lambda i, f: (i ^ 7, f * 2.5)  # noqa: E731
    sess = js.Session()
    gid = sess.compile(fn, ids, feats, buckets={0: [8, 16], 1: [8, 16]})
    for n in (3, 12):
      assert_same_bits(sess.run(gid, ids[:n], feats[:n]), jax.jit(fn)(ids[:n], feats[:n]))
    with self.assertRaisesRegex(InputError, r"expected int32\[n, 4\]"):
      sess.run(gid, ids[:3, :2], feats[:3])

  def test_padded_row_indices_raise_no_nan_jit_would_not(self):
    # a pad row copies the last row, not its index: sqrt(4 - i) is nan at i
    # > 4 only in pad rows; under the debug flags the run is exact
    fn = lambda x: x * jnp.sqrt(4.0 - jnp.arange(x.shape[0], dtype=x.dtype))[:, None]  # noqa: E731
    x = jnp.asarray(RNG.uniform(0.5, 2.0, (B, D)), jnp.float32)  # (no nan of its own)
    sess = js.Session()
    gid = sess.compile(fn, x, buckets=BUCKETS)
    with jax.debug_nans(True):
      for n in (3, 5):
        assert_same_bits(sess.run(gid, x[:n]), jax.jit(fn)(x[:n]), f"{n} rows")
      with self.assertRaises(FloatingPointError):  # a real row's nan, as jax.jit raises
        sess.run(gid, x[:6])
    self.assertEqual(sess.report(gid).buckets.policy.rows, 0)  # exact runs: no padding

  def test_a_closed_over_key_and_a_map_inside_a_cond(self):
    x = _rows()
    sess = js.Session()
    for name, fn in {
        "typed_key": lambda x: x + jax.random.normal(KEY, (D,)),
        "map_in_cond": lambda x: jax.lax.cond(True, lambda v: jax.lax.map(jnp.sin, v),
                                              lambda v: v, x),
        "map_in_a_nested_jit": jax.jit(lambda x: jax.lax.map(lambda r: r * r.max(), x)),
    }.items():
      with self.subTest(name):
        gid = sess.compile(fn, x, buckets=BUCKETS)  # refused (a crash, a signature) before
        for n in (3, 11):
          assert_same_bits(sess.run(gid, x[:n]), jax.jit(fn)(x[:n]), f"{name} at {n} rows")


if __name__ == "__main__":
  absltest.main()
