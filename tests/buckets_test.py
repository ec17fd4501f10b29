"""Shape buckets (issue 8): padded runs equal exact-shape jax.jit runs bit for
bit, unsafe padding is refused at compile naming the node, recompile warnings,
buckets chosen from traffic, and bad bucket specs."""
import collections
import itertools

from absl.testing import absltest
import pytest
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jaxsession.errors import InputError
from jaxsession.runtime import buckets as policy_lib
from exact import assert_equal_signed, count_compiles

RNG = np.random.default_rng(8)
F = 6


def _rows(n, rng=RNG):
  x = rng.standard_normal((n, F)).astype(np.float32)
  if n >= 3:  # special values in real rows; padding must not disturb them
    x[0, 0], x[1, 1], x[2, 2] = -0.0, np.inf, np.nan
  return jnp.asarray(x)


def _params(rng=RNG):
  return {"w1": jnp.asarray(rng.standard_normal((F, 16)) / 4, jnp.float32),
          "b1": jnp.asarray(rng.standard_normal(16), jnp.float32),
          "w2": jnp.asarray(rng.standard_normal((16, 3)) / 4, jnp.float32)}


def mlp(params, x):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return jax.nn.softmax(h @ params["w2"], axis=-1), jnp.sum(params["w2"])


def counted_mlp(params, count, x):
  """State: params read, a counter advanced - neither depends on the rows."""
  out, _ = mlp(params, x)
  return params, count + 1, out


def rowwise(scale, x):
  """No dot: elementwise work and reductions over the feature axis."""
  y = jnp.tanh(x * scale) + jnp.sin(x)
  return jax.nn.softmax(y, axis=-1), jnp.max(y, axis=-1), jnp.sum(scale)


def assert_within_ulp(got, want, ulps, msg=""):
  got, want = np.asarray(got), np.asarray(want)
  assert_equal_signed(np.isnan(got), np.isnan(want), err_msg=msg)
  finite = np.isfinite(want)
  assert_equal_signed(got[~finite & ~np.isnan(want)],
                      want[~finite & ~np.isnan(want)], err_msg=msg)
  bits = lambda a: a[finite].view(np.int32).astype(np.int64)
  diff = np.abs(bits(got) - bits(want)).max() if finite.any() else 0
  assert diff <= ulps, f"{msg}: {diff} ulp apart (allowed {ulps})"


def mean_loss(params, x):
  out, _ = mlp(params, x)
  return jnp.mean(out)


class BucketedRunTest(absltest.TestCase):

  def sweep(self, fn, state, check):
    """Every batch size 1..20 and the edges of the larger buckets through
    buckets of powers of two (each size both sides of every bucket), each
    output set compared by `check(got, want, n)` with exact-shape jax.jit."""
    sess = js.Session()
    gid = sess.compile(fn, state, _rows(5), state_argnums=0, updates_state=False,
                       buckets={1: [1, 2, 4, 8, 16, 32, 64]})
    jitted = jax.jit(fn)
    for n in [*range(1, 21), 31, 32, 33, 47, 63, 64]:
      x = _rows(n)
      got = sess.run(gid, x)
      check(got, jitted(state, x), n)
      self.assertEqual(got[0].shape[0], n)
    self.assertEqual(sorted(sess.report(gid).buckets.sizes), [1, 2, 4, 8, 16, 32, 64])

  @pytest.mark.slow
  def test_every_size_equals_exact_jit_on_a_program_without_dots(self):
    """Elementwise work and reductions over features: bit for bit."""
    def exact(got, want, n):
      for g, w in zip(got, want):
        assert_equal_signed(g, w, err_msg=f"n={n}")
    self.sweep(rowwise, jnp.asarray(RNG.standard_normal(F), jnp.float32), exact)

  @pytest.mark.slow
  def test_every_size_matches_exact_jit_on_an_mlp(self):
    """XLA:CPU's dot accumulates a row in another order for another row count
    (jax.jit itself: x[:n] @ w differs from (x @ w)[:n] in the last bits for
    most n), so the padded MLP matches the exact-shape one within 8 ulp
    (measured: at most 4) and NaN/inf land on the same elements."""
    def close(got, want, n):
      assert_within_ulp(got[0], want[0], 8, f"n={n}")
      assert_equal_signed(got[1], want[1], err_msg=f"n={n}")
    self.sweep(mlp, _params(), close)

  def test_state_advances_from_real_rows_only(self):
    sess = js.Session()
    params = _params()
    gid = sess.compile(counted_mlp, params, jnp.int32(0), _rows(4), state_argnums=(0, 1),
                       buckets={2: [4, 16]})
    count = 0
    for n in (3, 4, 9, 16, 2):
      x = _rows(n)
      got = sess.run(gid, x)
      _, count, want = jax.jit(counted_mlp)(params, count, x)
      assert_within_ulp(got, want, 8, f"n={n}")  # the dot's row count: see above
    state = sess.get_state(gid)
    self.assertEqual(int(state[1]), 5)
    assert_equal_signed(state[0]["w1"], params["w1"])

  def test_state_with_non_array_leaves(self):
    """A function and a str in the state (an equinox model's activation) stay
    static under buckets too: found by a break-it round as a raw TypeError of
    the padding analysis' trace."""
    state = {"scale": jnp.asarray(RNG.standard_normal(F), jnp.float32), "act": jnp.tanh,
             "tag": "abc"}
    fn = lambda s, x: s["act"](x * s["scale"]) + jnp.sin(x)  # noqa: E731
    sess = js.Session()
    gid = sess.compile(fn, state, _rows(4), state_argnums=0, updates_state=False,
                       buckets={1: [4, 8]})
    ref = jax.jit(lambda scale, x: fn({**state, "scale": scale}, x))  # the rest static
    for n in (1, 3, 4, 5, 8, 11):
      x = _rows(n)
      assert_equal_signed(sess.run(gid, x), ref(state["scale"], x), err_msg=f"n={n}")
    (got,) = sess.get_state(gid)
    self.assertIs(got["act"], jnp.tanh)
    self.assertEqual(got["tag"], "abc")
    self.assertEqual(sorted(sess.report(gid).buckets.sizes), [4, 8, 11])
    self.assertIn("3 compiled sizes [4, 8, 11]", repr(sess.report(gid).buckets))

  def test_sizes_above_the_largest_bucket_compile_exactly(self):
    sess = js.Session()
    params = _params()
    gid = sess.compile(mlp, params, _rows(2), state_argnums=0, updates_state=False,
                       buckets={1: [2, 4]})
    x = _rows(7)  # exact shape: bit for bit
    assert_equal_signed(sess.run(gid, x)[0], jax.jit(mlp)(params, x)[0])
    self.assertIn(7, sess.report(gid).buckets.sizes)
    self.assertEqual(sess.report(gid).buckets.policy.padded, 0)

  def test_loop_sink_on_a_bucket(self):
    sess = js.Session()
    params = _params()
    gid = sess.compile(mlp, params, _rows(4), state_argnums=0, updates_state=False,
                       buckets={1: [4, 8]})
    xs = jnp.stack([_rows(5) for _ in range(3)])  # steps=3 of 5 rows -> bucket 8
    got = sess.run(gid, xs, steps=3)
    for t in range(3):
      assert_within_ulp(got[0][t], jax.jit(mlp)(params, xs[t])[0], 8)
    self.assertEqual(got[0].shape, (3, 5, 3))

  def test_precompile_buckets_compiles_every_bucket_at_compile(self):
    sess = js.Session(js.SessionOptions(precompile_buckets=True))
    gid = sess.compile(mlp, _params(), _rows(2), state_argnums=0, updates_state=False,
                       buckets={1: [2, 4, 8]})
    self.assertEqual(sorted(sess.report(gid).buckets.sizes), [2, 4, 8])
    self.assertIn("compiled sizes [2, 4, 8]", str(sess.report(gid)))

  def test_release_frees_every_bucket(self):
    sess = js.Session()
    gid = sess.compile(mlp, _params(), _rows(2), state_argnums=0, updates_state=False,
                       buckets={1: [2, 4]})
    sess.run(gid, _rows(3))
    subs = list(sess.report(gid).buckets.sizes.values())
    sess.release(gid)
    for sub in [gid] + subs:
      with self.assertRaises(js.errors.UnknownGraphError):
        sess.run(sub, _rows(2))


class PaddingRefusedTest(absltest.TestCase):

  def test_mean_loss_is_refused_naming_the_reduction(self):
    sess = js.Session()
    with self.assertRaisesRegex(InputError, r"(?s)not safe.*reduce_sum.*without buckets"):
      sess.compile(mean_loss, _params(), _rows(4), state_argnums=0, updates_state=False,
                   buckets={1: [4, 8]})
    with self.assertRaises(js.UnknownGraphError):  # nothing compiled, nothing kept
      sess.graph(0)

  def test_state_from_a_batch_reduction_is_refused(self):
    def step(w, x):
      return w + x.sum(axis=0), x * 2
    with self.assertRaisesRegex(InputError, "not safe"):
      js.Session().compile(step, jnp.zeros(F), _rows(4), state_argnums=0,
                           buckets={1: [4, 8]})


class PaddingDtypesTest(absltest.TestCase):
  """The batch-size check reads shapes, not text: a row count of 32 is not
  the "32" of f32 or i32 (nor 16 of f16, 8 of i8); ml_dtypes pad."""

  @pytest.mark.slow
  def test_row_counts_that_spell_a_dtype_and_bf16(self):
    rng = np.random.default_rng(5)
    for dtype, rows in ((jnp.float32, 32), (jnp.int32, 32), (jnp.float16, 16),
                        (jnp.int8, 8), (jnp.bfloat16, 32), (jnp.float8_e4m3fn, 16),
                        (jnp.float64 if jax.config.jax_enable_x64 else jnp.uint8, 64)):
      example = jnp.asarray(rng.standard_normal((rows, 8)) * 4).astype(dtype)
      fn = lambda x: (x * 2, x.astype(jnp.float32) + 1)  # noqa: E731
      sess = js.Session()
      gid = sess.compile(fn, example, buckets={0: [rows // 4, rows // 2, rows]})
      for n in (1, 3, rows // 2 + 1):
        got, want = sess.run(gid, example[:n]), jax.jit(fn)(example[:n])
        for g, w in zip(got, want):
          self.assertEqual(g.dtype, w.dtype)
          assert_equal_signed(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))

  def test_reading_the_row_count_is_still_refused(self):
    with self.assertRaisesRegex(InputError, "depends on the batch size"):
      js.Session().compile(lambda x: x / x.shape[0], jnp.ones((32, 8)), buckets={0: [8, 32]})


class RecompileWarningTest(absltest.TestCase):

  def test_warns_at_the_limit_and_at_every_new_size(self):
    sess = js.Session(js.SessionOptions(recompile_warn_limit=3))
    params = _params()
    gid = sess.compile(mlp, params, _rows(1), state_argnums=0, updates_state=False,
                       buckets={1: [1]})  # every larger size compiles exactly
    sess.run(gid, _rows(2))  # 2 sizes: no warning yet
    with self.assertLogs("absl", level="WARNING") as logs:
      sess.run(gid, _rows(3))  # the 3rd size: at the limit
      sess.run(gid, _rows(3))  # known: nothing new
      sess.run(gid, _rows(4))  # a new size after the limit
    self.assertLen(logs.records, 2)
    self.assertIn("position(s) [1]", logs.output[0])
    self.assertIn("[1, 2, 3]", logs.output[0])


class AutoBucketsTest(absltest.TestCase):

  def traffic(self, kind, rng):
    if kind == "uniform":
      return rng.integers(1, 65, 4000)
    if kind == "small":
      return np.minimum(64, rng.geometric(0.12, 4000))
    return np.concatenate([rng.integers(1, 9, 2000), rng.integers(48, 65, 2000)])

  def test_dynamic_program_meets_the_waste_target(self):
    rng = np.random.default_rng(3)
    uniform = collections.Counter(range(1, 65))
    chosen = policy_lib.choose_buckets(uniform, 7)
    self.assertLessEqual(policy_lib.padding_waste(uniform, chosen), 0.13)
    self.assertAlmostEqual(policy_lib.padding_waste(uniform, [1, 2, 4, 8, 16, 32, 64]),
                           0.31, delta=0.01)  # the powers of two, for comparison
    for kind in ("uniform", "small", "bimodal"):
      hist = collections.Counter(self.traffic(kind, rng).tolist())
      chosen = policy_lib.choose_buckets(hist, 7)
      self.assertLessEqual(len(chosen), 7)
      self.assertEqual(chosen[-1], max(hist))
      self.assertLessEqual(policy_lib.padding_waste(hist, chosen),
                           policy_lib.padding_waste(hist, [1, 2, 4, 8, 16, 32, 64]), kind)
      if kind == "uniform":
        self.assertLessEqual(policy_lib.padding_waste(hist, chosen), 0.13)

  @pytest.mark.slow
  def test_auto_learns_then_pads_and_reports_waste(self):
    sess = js.Session(js.SessionOptions(recompile_warn_limit=0))
    params = _params()
    gid = sess.compile(mlp, params, _rows(3), state_argnums=0, updates_state=False,
                       buckets={1: "auto"}, max_buckets=4)
    self.assertEqual(sorted(sess.report(gid).buckets.sizes), [4])  # the learning bucket
    self.assertIn("learning the traffic", str(sess.report(gid)))
    rng = np.random.default_rng(4)
    for n in rng.integers(1, 33, 120):
      x = _rows(int(n), rng)
      assert_within_ulp(sess.run(gid, x)[0], jax.jit(mlp)(params, x)[0], 8)
    dispatcher = sess.report(gid).buckets
    policy = dispatcher.policy
    self.assertIsNotNone(policy.sizes)
    self.assertLessEqual(len(policy.sizes), 4)
    self.assertLessEqual(len(dispatcher.sizes), 4)  # learning included
    self.assertTrue(set(dispatcher.sizes) <= set(policy.sizes))
    self.assertGreater(policy.measured_waste(), 0)
    self.assertGreater(policy.learning_padded, 0)
    self.assertIn("measured waste", str(sess.report(gid)))
    self.assertIn("learning phase", str(sess.report(gid)))

  @pytest.mark.slow
  def test_learning_and_chosen_buckets_compile_at_most_max_buckets(self):
    """Uniform traffic in 1..64, no hint: the learning phase pads to one
    learning bucket instead of compiling exact sizes, and the chosen buckets
    keep it, so everything compiled fits in max_buckets; the waste reported
    is what was padded (the learning phase included)."""
    sess = js.Session(js.SessionOptions(recompile_warn_limit=0))
    params = _params()
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 65, 200).tolist()
    gid = sess.compile(mlp, params, _rows(sizes[0], rng), state_argnums=0,
                       updates_state=False, buckets={1: "auto"}, max_buckets=7)
    padded = real = 0
    for i, n in enumerate(sizes):
      x = _rows(n, rng)
      got = sess.run(gid, x)
      self.assertEqual(got[0].shape, (n, 3))
      if i % 8 == 0:  # the comparison is slow: a sample of the sizes
        assert_within_ulp(got[0], jax.jit(mlp)(params, x)[0], 8, f"n={n}")
      dispatcher = sess.report(gid).buckets
      size = min(b for b in dispatcher.sizes if b >= n)
      padded, real = padded + size - n, real + n
    self.assertLessEqual(len(dispatcher.sizes), 7)
    self.assertEqual(sorted(dispatcher.sizes), dispatcher.policy.sizes)
    self.assertAlmostEqual(dispatcher.policy.measured_waste(), padded / real)
    self.assertLessEqual(dispatcher.policy.expected_waste, 0.13)
    self.assertEqual(dispatcher.policy.expected_waste, policy_lib.padding_waste(
        collections.Counter(sizes[:dispatcher.policy.chosen_from]), dispatcher.policy.sizes))

  def test_policy_alone_stays_within_max_buckets_on_uniform_and_bimodal_traffic(self):
    """The policy without a session, over many traffic samples: the sizes it
    sends to executables (the example's learning bucket included) number at
    most max_buckets."""
    for seed in range(30):
      rng = np.random.default_rng(seed)
      for traffic, k in ((rng.integers(1, 65, 300), 7), (rng.integers(1, 200, 300), 5),
                         (rng.permutation(np.concatenate([rng.integers(1, 9, 150),
                                                          rng.integers(48, 65, 150)])), 7)):
        policy = policy_lib.BucketPolicy.make("auto", k, None)
        compiled = {policy.first_size(int(traffic[0]))}
        for n in traffic.tolist():
          size = policy.target(n, compiled)
          self.assertGreaterEqual(size, n)
          compiled.add(size)
        self.assertLessEqual(len(compiled), k, f"seed {seed}: {sorted(compiled)}")
        self.assertTrue(compiled <= set(policy.sizes))

  def test_choose_buckets_keeps_fixed_sizes_and_stays_exact(self):
    """With sizes already compiled (`fixed`), the dynamic program equals a
    brute force over every bucket set that keeps them."""
    rng = np.random.default_rng(5)
    for _ in range(300):
      hist = collections.Counter(rng.integers(1, 16, rng.integers(1, 12)).tolist())
      k = int(rng.integers(1, 6))
      fixed = set(rng.choice(np.arange(1, 20), rng.integers(0, 4), replace=False).tolist())
      got = policy_lib.choose_buckets(hist, k, fixed=fixed)
      self.assertTrue(fixed <= set(got))
      self.assertGreaterEqual(got[-1], max(hist))
      top = max(set(hist) | fixed)
      others = sorted((set(hist) | fixed) - fixed - {top})
      limit = max(k, len(fixed | {top}))
      best = min(
          policy_lib.padding_waste(hist, sorted(fixed | {top} | set(extra)))
          for r in range(len(others) + 1) for extra in itertools.combinations(others, r)
          if len(fixed | {top} | set(extra)) <= limit)
      self.assertLessEqual(len(got), limit)
      self.assertAlmostEqual(policy_lib.padding_waste(hist, got), best)
    self.assertEqual(policy_lib.choose_buckets(collections.Counter(range(1, 65)), 7),
                     policy_lib.choose_buckets(collections.Counter(range(1, 65)), 7, ()))

  def test_hint_chooses_at_compile(self):
    sess = js.Session()
    gid = sess.compile(mlp, _params(), _rows(3), state_argnums=0, updates_state=False,
                       buckets={1: "auto"}, max_buckets=3, bucket_sizes_hint=[1, 2, 3, 9, 10])
    self.assertEqual(sess.report(gid).buckets.policy.sizes,
                     policy_lib.choose_buckets(collections.Counter([1, 2, 3, 9, 10]), 3))
    self.assertIsNotNone(sess.report(gid).buckets.policy.expected_waste)


class BadBucketSpecTest(absltest.TestCase):

  def test_bad_specs_name_what_is_wrong(self):
    sess = js.Session()
    args = (_params(), _rows(4))
    kw = dict(state_argnums=0, updates_state=False)
    for buckets, pattern in (({0: [4]}, "not a run argument"),
                             ({1: []}, "non-empty list"),
                             ({1: [0, 4]}, "positive ints"),
                             ({1: "some"}, "'auto'"),
                             ([4, 8], "must be a dict")):
      with self.assertRaisesRegex(InputError, pattern):
        sess.compile(mlp, *args, buckets=buckets, **kw)
    with self.assertRaisesRegex(InputError, "max_buckets"):
      sess.compile(mlp, *args, buckets={1: "auto"}, max_buckets=0, **kw)
    with self.assertRaisesRegex(InputError, "without buckets"):
      sess.compile(mlp, *args, bucket_sizes_hint=[1, 2], **kw)
    gid = sess.compile(mlp, *args, buckets={1: [4, 8]}, **kw)
    with self.assertRaisesRegex(InputError, r"float32\[\]; expected float32\[n, 6\]"):
      sess.run(gid, jnp.float32(1.0))
    with self.assertRaisesRegex(InputError, "expected float32"):  # before any compile
      sess.run(gid, jnp.ones((100, F), jnp.int32))
    self.assertNotIn(100, sess.report(gid).buckets.sizes)


class BatchSizeReadByTheProgramTest(absltest.TestCase):
  """Found by review: a program that reads the batch size itself is not a
  row-mixing program, yet padding changes its result; two probe traces
  catch it."""

  def test_programs_reading_the_batch_size_are_refused(self):
    sess = js.Session()
    x = jnp.ones((8, 3))
    for fn in (lambda x: jnp.sum(x * x, axis=1) / x.shape[0],
               lambda x: (x * 2, jnp.arange(2 * x.shape[0])),
               lambda x: x - x.mean(0) if x.shape[0] <= 64 else x * 2):
      with self.assertRaisesRegex(InputError, "depends on the batch size|not safe"):
        sess.compile(fn, x, buckets={0: [4, 8]})
    with self.assertRaisesRegex(InputError, "depends on the batch size"):
      sess.compile(lambda n, x: (n + x.shape[0], x * 2), jnp.int32(0), x, state_argnums=0,
                   buckets={1: [4, 8]})
    # made from the batch size by an array, not a literal: the same program at
    # every size, yet padded rows counted (a break-it find: state 4, jax.jit's 3)
    for buckets in ([4, 8], "auto"):
      with self.assertRaisesRegex(InputError, "'reduce_sum'.*sized by the batch"):
        sess.compile(lambda n, x: (n + jnp.sum(jnp.ones(x.shape[0], jnp.int32)), x * 2),
                     jnp.int32(0), x, state_argnums=0, buckets={1: buckets})

  def test_an_axis_the_model_makes_of_a_bucket_size_is_not_the_batch(self):
    # heads of width 64 with buckets up to 64: the probe trace at 64 rows took
    # the head axis for a second batch axis and refused (a review's find)
    def heads(x):
      h = x.reshape(x.shape[0], 2, 64)
      return (jax.nn.softmax(h, axis=-1) * h).reshape(x.shape[0], 128)
    sess = js.Session()
    x = np.random.default_rng(5).standard_normal((24, 128)).astype(np.float32)
    gid = sess.compile(heads, x[:8], buckets={0: [8, 16, 32, 64]})
    np.testing.assert_array_equal(sess.run(gid, x[:5]), jax.jit(heads)(x[:5]))
    # position embeddings gathered by ids broadcast over the batch, from a
    # closed-over table of 11 rows: the probe at 11 rows took it for the batch
    table = jnp.asarray(x[:11, :6])
    def embed(ids):
      return table[ids] + table[jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)]
    ids = np.random.default_rng(6).integers(0, 11, (9, 5)).astype(np.int32)
    gid = sess.compile(embed, ids[:3], buckets={0: [4, 8]})
    for n in (1, 3, 6):
      np.testing.assert_array_equal(sess.run(gid, ids[:n]), jax.jit(embed)(ids[:n]))

  def test_one_row_runs_exactly_where_fn_treats_it_otherwise(self):
    # review finds: squeeze() drops the batch axis of one row alone ((1,) came
    # back where jax.jit returns ()); a probe equal to a param (x[:, 17:] with
    # probes 17 and 19) was taken for the row count
    sess = js.Session()
    x = np.random.default_rng(8).standard_normal((9, 32)).astype(np.float32)
    w = jnp.asarray(x[0, :4, None])
    for fn in (lambda x: (x[:, :4] @ w).squeeze(), lambda x: x[:, 17:] * 2):
      gid = sess.compile(fn, x[:4], buckets={0: [4, 8, 16]})
      for n in (1, 3, 9):
        got, want = sess.run(gid, x[:n]), jax.jit(fn)(x[:n])
        self.assertEqual(got.shape, want.shape)
        assert_within_ulp(got, want, 8, f"n={n}")  # a dot's rows: numerics.md

  def test_an_empty_batch_runs_exactly(self):
    # padded, a max or any over a value made from the batch size saw rows (a review's find)
    fn = lambda x: (x * 2, jnp.max(jnp.ones(x.shape[0]), initial=-5.0),  # noqa: E731
                    jnp.any(jnp.ones(x.shape[0], bool)))
    sess = js.Session()
    gid = sess.compile(fn, jnp.ones((4, 3)), buckets={0: [2, 4, 8]})
    for n in (0, 3):
      x = jnp.full((n, 3), -0.0)
      for got, want in zip(sess.run(gid, x), jax.jit(fn)(x)):
        np.testing.assert_array_equal(got, want)
        self.assertEqual(got.shape, want.shape)

  def test_row_wise_primitives_without_rules_before(self):
    # a review's finds, refused as "no batch rule": an rfft per row,
    # checkpoint_name in a model, approx_max_k over classes
    from jax.ad_checkpoint import checkpoint_name  # pylint: disable=import-outside-toplevel
    x = np.random.default_rng(9).standard_normal((7, 16)).astype(np.float32)
    for fn in (lambda x: jnp.abs(jnp.fft.rfft(x, axis=-1)),
               lambda x: checkpoint_name(jax.nn.relu(x), "hidden") * 2,
               lambda x: jax.lax.approx_max_k(x, 3)[1]):
      sess = js.Session()
      gid = sess.compile(fn, x[:4], buckets={0: [4, 8]})
      for n in (1, 3, 7):
        # an FFT's rows may round otherwise at another row count (numerics.md)
        assert_within_ulp(sess.run(gid, x[:n]), jax.jit(fn)(x[:n]), 8, f"n={n}")

  def test_a_callback_defined_in_fn_is_the_same_program_at_every_size(self):
    """A lambda made inside fn is another object at each probe trace: it was
    taken for a program that reads the batch size (a break-it find). One that
    closes over the row count still is."""
    sess = js.Session()
    rng = np.random.default_rng(31)
    w = jnp.asarray(rng.standard_normal(3), jnp.float32)

    def fn(x, w):
      doubled = jax.pure_callback(lambda v: (np.asarray(v) * 2).astype(np.float32),
                                  jax.ShapeDtypeStruct(w.shape, w.dtype), w)
      return x * doubled
    gid = sess.compile(fn, jnp.ones((8, 3)), w, buckets={0: [4, 8]})
    for n in (3, 5):
      x = jnp.asarray(rng.standard_normal((n, 3)), jnp.float32)
      np.testing.assert_array_equal(sess.run(gid, x, w), jax.jit(fn)(x, w))

    def reads_rows(x, w):
      rows = x.shape[0]
      scaled = jax.pure_callback(lambda v: (np.asarray(v) * rows).astype(np.float32),
                                 jax.ShapeDtypeStruct(w.shape, w.dtype), w)
      return x * scaled
    with self.assertRaisesRegex(InputError, "depends on the batch size"):
      sess.compile(reads_rows, jnp.ones((8, 3)), w, buckets={0: [4, 8]})

  def test_padded_outputs_keep_the_weak_type(self):
    sess = js.Session()
    gid = sess.compile(lambda x: x * 2, jnp.full((8, 3), 1.0), buckets={0: [4, 8]})
    for n in (3, 4):
      out = sess.run(gid, jnp.full((n, 3), 1.0))
      want = jax.jit(lambda x: x * 2)(jnp.full((n, 3), 1.0))
      self.assertEqual(out.weak_type, want.weak_type)
      self.assertEqual((out + jnp.ones(3, jnp.bfloat16)).dtype, jnp.bfloat16)

  def test_pad_rows_raise_no_nan_jit_would_not(self):
    # zero pad rows made 0 * log(0) = nan (and 1/0 = inf) in rows jax.jit
    # never computes: under the debug flags the run raised
    cases = ((lambda x: x * jnp.log(x), jax.debug_nans), (lambda x: 1.0 / x, jax.debug_infs),
             (lambda x: x / x, jax.debug_nans))
    rng = np.random.default_rng(31)
    for fn, flag in cases:
      sess = js.Session()
      gid = sess.compile(fn, jnp.full((8, 4), 2.0), buckets={0: [8, 16]})
      for n in (1, 3, 9):
        x = jnp.asarray(rng.uniform(0.5, 2.0, (n, 4)), jnp.float32)
        with flag(True):
          got = sess.run(gid, x)
        assert_equal_signed(got, jax.jit(fn)(x))
      with flag(True):  # a real row's nan is still reported, as jax.jit reports it
        with self.assertRaises(FloatingPointError):
          sess.run(gid, jnp.zeros((3, 4), jnp.float32))

  def test_padding_compiles_nothing_per_request(self):
    """Over many batch sizes each bucket compiles one executable and the
    padding and slicing compile nothing (XLA compiles counted from jax's own
    backend_compile event), weak-typed outputs included."""
    compiles = count_compiles(self)
    strong = lambda x: (rowwise(jnp.float32(0.5), x)[0], x.sum(1))
    for fn, make in ((strong, _rows), (lambda x: x * 2, lambda n: jnp.full((n, F), 1.5))):
      sess = js.Session()
      gid = sess.compile(fn, make(16), buckets={0: [4, 8, 16]})
      sizes = list(range(1, 17)) + list(range(16, 0, -3))
      xs = [make(n) for n in sizes]
      wants = [jax.jit(fn)(x) for x in xs]  # before counting: one compile per size
      del compiles[:]
      for x, want in zip(xs, wants):
        got = sess.run(gid, x)
        jax.tree.map(lambda g, w: self.assertEqual((g.shape, g.dtype, g.weak_type),
                                                   (w.shape, w.dtype, w.weak_type)), got, want)
      self.assertLessEqual(len(compiles), 3)  # the three buckets, at first use

class FailedRunTest(absltest.TestCase):
  """A bucketed run that fails changes nothing: no traffic counted, no
  bucket compiled, errors naming the graph the user compiled."""

  def test_failed_runs_leave_the_policy_and_the_buckets(self):
    sess = js.Session()
    scale = jnp.asarray(RNG.standard_normal(F), jnp.float32)
    gid = sess.compile(lambda s, c, x: (s, c + 1, rowwise(s, x)[0]), scale, jnp.int32(0),
                       _rows(5), state_argnums=(0, 1), buckets={2: "auto"})
    sess.run(gid, _rows(5))
    dispatcher = sess.report(gid).buckets
    before = (dispatcher.describe(), sorted(dispatcher.sizes), sess.get_state(gid)[1])
    bad = [(_rows(100), 1.0), (), (_rows(100).astype(jnp.int32),), ({"x": _rows(3)},)]
    for args in bad:
      with self.assertRaises(InputError) as caught:
        sess.run(gid, *args)
      self.assertIn(f"run(graph {gid} ", str(caught.exception))
      self.assertNotIn("[batch", str(caught.exception))
    after = (dispatcher.describe(), sorted(dispatcher.sizes), sess.get_state(gid)[1])
    self.assertEqual(before[:2], after[:2])
    self.assertEqual(int(before[2]), int(after[2]))

  def test_a_weak_type_refusal_names_the_graph_the_user_compiled(self):
    sess = js.Session()
    x = jnp.asarray(RNG.standard_normal((5, F)), jnp.float16)
    gid = sess.compile(lambda x, s: x * s, x, 2.0, buckets={0: "auto"})
    scale = float(RNG.standard_normal())
    assert_equal_signed(sess.run(gid, x, scale), jax.jit(lambda x, s: x * s)(x, scale))
    with self.assertRaisesRegex(InputError, "strongly typed") as caught:
      sess.run(gid, x, jnp.float32(scale))
    self.assertIn(f"run(graph {gid} ", str(caught.exception))
    self.assertNotIn("[batch", str(caught.exception))

  def test_empty_batches_take_no_bucket(self):
    policy = policy_lib.BucketPolicy.make("auto", 3, [8, 16, 16])
    self.assertEqual(policy.target(0), 8)
    self.assertNotIn(0, policy.seen)

  def test_bad_hints(self):
    sess = js.Session()
    for hint, text in (("64", "list of int sizes"), ([3.7, 9.2], "list of int sizes"),
                       ({8: 1}, "list of int sizes"), ([True, 2], "list of int sizes")):
      with self.assertRaisesRegex(InputError, text):
        sess.compile(rowwise, jnp.ones(F), _rows(5), buckets={1: "auto"},
                     bucket_sizes_hint=hint)
    with self.assertRaisesRegex(InputError, "for buckets='auto'"):
      sess.compile(rowwise, jnp.ones(F), _rows(5), buckets={1: [8, 16]},
                   bucket_sizes_hint=[8])


if __name__ == "__main__":
  absltest.main()
