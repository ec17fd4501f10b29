"""Shape buckets over per-row indexing by an arange of the batch size
(`x[jnp.arange(B), labels]`, `x.at[jnp.arange(B), i].set(v)`): each row
reads or writes its own row, so padding is safe; the runs equal jax.jit at
the exact size bit for bit. Programs where the arange reaches another row,
or is read across, stay refused."""
from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jaxsession.errors import InputError
from exact import assert_same_bits
from subproc import run_json

RNG = np.random.default_rng(38)
B, V, K = 12, 7, 3
BUCKETS = {0: [8, 16], 1: [8, 16], 2: [8, 16]}


def _inputs(rng=RNG):
  lp = rng.standard_normal((B, V)).astype(np.float32)
  lp[0, 0], lp[1, 1], lp[2, 2], lp[3, 3] = -0.0, np.inf, np.nan, -np.inf
  labels = rng.integers(-V, V, B).astype(np.int32)  # negative: jnp's normalisation
  top = rng.integers(0, V, (B, K)).astype(np.int32)
  return jnp.asarray(lp), jnp.asarray(labels), jnp.asarray(top)


def _rows(x):
  return jnp.arange(x.shape[0])


ACCEPTED = {
    "gather_label": lambda lp, y, k: lp[_rows(lp), y],
    "nll": lambda lp, y, k: -jax.nn.log_softmax(lp)[_rows(lp), y],
    "gather_top_k": lambda lp, y, k: lp[_rows(lp)[:, None], k],
    "expand_dims": lambda lp, y, k: lp[jnp.expand_dims(_rows(lp), 1), k],
    "uint32_arange": lambda lp, y, k: lp[jnp.arange(lp.shape[0], dtype=jnp.uint32),
                                         jnp.abs(y)],
    "repetition_penalty": lambda lp, y, k: lp.at[_rows(lp)[:, None], k].multiply(0.5),
    "ban_token": lambda lp, y, k: lp.at[_rows(lp), y].set(-jnp.inf),
    "scatter_add": lambda lp, y, k: lp.at[_rows(lp), y].add(1.5),
    "one_hot_from_zeros": lambda lp, y, k: jnp.zeros_like(lp).at[_rows(lp), y].set(1.0),
    "row_value_written": lambda lp, y, k: lp.at[_rows(lp), y].multiply(lp[:, 0]),
    "per_row_grad": lambda lp, y, k: jax.grad(
        lambda l: jnp.sum(-jax.nn.log_softmax(l)[_rows(l), y], axis=-1))(lp),
    "arange_returned": lambda lp, y, k: (lp * 2, _rows(lp)),
    "even_rows_mask": lambda lp, y, k: jnp.where((_rows(lp) % 2 == 0)[:, None], lp, 0.0),
}

REFUSED = {  # name: (fn, words of the refusal)
    "previous_row": (lambda lp, y, k: lp[_rows(lp) - 1, y], "gathers along the batch axis"),
    "reversed_rows": (lambda lp, y, k: lp[lp.shape[0] - 1 - _rows(lp), y],
                      "gathers along the batch axis"),
    "half_row": (lambda lp, y, k: lp[_rows(lp) // 2, y], "gathers along the batch axis"),
    "arange_summed": (lambda lp, y, k: lp + _rows(lp).sum(), "on a value sized by the batch"),
    "last_row_flag": (lambda lp, y, k: jnp.where((_rows(lp) == lp.shape[0] - 1)[:, None], lp, 0.),
                      "depends on the batch size"),
    # an int8 arange wraps past 127 rows: no row index at every bucket size
    "int8_arange": (lambda lp, y, k: lp[jnp.arange(lp.shape[0], dtype=jnp.int8), y],
                    "meets the rows"),
    "scatter_to_previous_row": (lambda lp, y, k: lp.at[_rows(lp) - 1, y].set(0.0),
                                "scatters along the batch axis"),
    # a (B, B) table: the labels' index into its second axis is clipped against
    # a length padding changes (a review's find: accepted, and wrong)
    "square_table_gather": (lambda lp, y, k: jnp.zeros((lp.shape[0],) * 2)[_rows(lp), y],
                            "sized by the batch"),
    "square_table_fill": (lambda lp, y, k: jax.lax.broadcasted_iota(
        jnp.int32, (lp.shape[0],) * 2, 1).at[_rows(lp), y].get(mode="fill", fill_value=-1),
                          "batch"),
    "square_table_scatter": (lambda lp, y, k: jnp.zeros((lp.shape[0],) * 2).at[
        _rows(lp), y].set(1.0), "batch"),
}


class RowPositionTest(absltest.TestCase):

  def test_per_row_indexing_runs_bucketed_and_equals_jit(self):
    lp, y, k = _inputs()
    sess = js.Session()
    for name, fn in ACCEPTED.items():
      with self.subTest(name):
        gid = sess.compile(fn, lp, y, k, buckets=BUCKETS)  # refused before this change
        for n in (1, 3, 8, 11, 12):  # padded to 8 or 16; 1 row, and full buckets too
          got = sess.run(gid, lp[:n], y[:n], k[:n])
          assert_same_bits(got, jax.jit(fn)(lp[:n], y[:n], k[:n]), f"{name} at {n} rows")
        # 3 and 11 rows ran padded, in the 8- and 16-row executables
        self.assertIn("compiled sizes [8, 16]", sess.report(gid).buckets.describe())

  def test_other_rows_or_reads_across_stay_refused(self):
    lp, y, k = _inputs()
    sess = js.Session()
    for name, (fn, words) in REFUSED.items():
      with self.subTest(name):
        with self.assertRaises(InputError) as ctx:
          sess.compile(fn, lp, y, k, buckets=BUCKETS)
        self.assertIn(words, str(ctx.exception))
        # the same program without buckets runs, equal to jax.jit
        gid = sess.compile(fn, lp, y, k)
        assert_same_bits(sess.run(gid, lp, y, k), jax.jit(fn)(lp, y, k), name)

  def test_the_dead_normalisation_goes_only_for_an_arange_that_cannot_be_negative(self):
    x = jnp.asarray(RNG.standard_normal(100).astype(np.float32))
    sess = js.Session()
    for dtype, dropped in ((jnp.int32, True), (jnp.uint8, True), (jnp.int8, False)):
      with self.subTest(str(np.dtype(dtype))):
        # 200 indices into 100 elements (clamped); an int8 arange wraps negative past 127
        fn = lambda x, dtype=dtype: x[jnp.arange(200, dtype=dtype)]
        gid = sess.compile(fn, x)
        ops = [node.op for node in sess.graph(gid).nodes]
        self.assertEqual(ops.count("select_n") == 0, dropped, ops)
        assert_same_bits(sess.run(gid, x), jax.jit(fn)(x), str(dtype))


X64_CHILD = """
import json
import jax, jax.numpy as jnp, numpy as np
import jaxsession as js
rng = np.random.default_rng(5)
lp = jnp.asarray(rng.standard_normal((12, 7)))            # float64
y = jnp.asarray(rng.integers(-7, 7, 12))                   # int64
k = jnp.asarray(rng.integers(0, 7, (12, 3)))
fns = {"label": lambda lp, y, k: lp[jnp.arange(lp.shape[0]), y],
       "top_k": lambda lp, y, k: lp[jnp.arange(lp.shape[0])[:, None], k],
       "ban": lambda lp, y, k: lp.at[jnp.arange(lp.shape[0]), y].set(-jnp.inf)}
sess, out = js.Session(), {}
for name, fn in fns.items():
  gid = sess.compile(fn, lp, y, k, buckets={0: [8, 16], 1: [8, 16], 2: [8, 16]})
  same = True
  for n in (3, 11):
    got, want = sess.run(gid, lp[:n], y[:n], k[:n]), jax.jit(fn)(lp[:n], y[:n], k[:n])
    same &= got.dtype == want.dtype and np.array_equal(np.asarray(got), np.asarray(want),
                                                       equal_nan=True)
  out[name] = [str(got.dtype), bool(same)]
print(json.dumps(out))
"""


class RowPositionX64Test(absltest.TestCase):

  def test_int64_aranges_under_x64(self):
    out = run_json(X64_CHILD, devices=1, x64=True)
    self.assertEqual(out, {"label": ["float64", True], "top_k": ["float64", True],
                           "ban": ["float64", True]})


if __name__ == "__main__":
  absltest.main()
