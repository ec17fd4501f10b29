"""Arithmetic on both sides of a host callback keeps jax.jit's bits.

`t = a * b` written before a `pure_callback` and `t + r` after it: jax.jit's
one executable fuses the multiply with the add and XLA:CPU contracts them
into an FMA (one rounding); the session ran the callback between two
executables, and the product was rounded before the add (a break-it find: a
quarter to a half of the elements off, up to thousands of ulp near zero).
ReorderForPartitions now moves device arithmetic that only a later device
partition reads into that partition (optimizer_passes/reorder.py:
sink_into_readers), so XLA sees the same expression as under jax.jit."""
import itertools

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxsession as js
from exact import assert_same_bits
from subproc import run_json

RNG = np.random.default_rng(41)
N = 2048


def _inputs():
  xs = [RNG.standard_normal(N).astype(np.float32) * 3 for _ in range(3)]
  xs[0][:6] = [-0.0, np.nan, np.inf, -np.inf, 3e38, 1e-40]
  xs[1][:6] = [5.0, 2.0, -0.0, 0.5, 2.0, 1e30]
  return [jnp.asarray(x) for x in xs]


def _const(v):  # the host's result: the same small array every call
  del v
  return np.full((1,), 0.3, np.float32)


def _split(pre, post):
  def fn(a, b, c):
    t = pre(a, b)  # before the callback, which does not read it
    r = jax.pure_callback(_const, jax.ShapeDtypeStruct((1,), jnp.float32), c * 2)
    return post(t, a, b, r)
  return fn


CASES = {
    "multiply_then_add": _split(lambda a, b: a * b, lambda t, a, b, r: t + r),
    "divide_then_add": _split(lambda a, b: a / 7.0, lambda t, a, b, r: t + r),
    "exp_product_then_add": _split(lambda a, b: jnp.exp(a * 0.1),
                                   lambda t, a, b, r: t * jnp.exp(b * 0.1) + r),
    "log_of_exp": _split(lambda a, b: jnp.exp(a * 0.1), lambda t, a, b, r: jnp.log(t) + r),
    "divide_by_sqrt": _split(lambda a, b: jnp.sqrt(jnp.abs(b)), lambda t, a, b, r: a / t + r),
    "product_also_returned": _split(lambda a, b: a * b, lambda t, a, b, r: (t, t + r)),
    "broadcast_product": _split(lambda a, b: (a * b)[None, :],
                                lambda t, a, b, r: jnp.sum(t + r, axis=0)),
    # data movement between the product and the add (XLA fuses through it)
    "split_product": _split(lambda a, b: jnp.split(a * b, 2)[1], lambda t, a, b, r: t + r),
    "transposed_product": _split(lambda a, b: (a * b).reshape(64, 32).T,
                                 lambda t, a, b, r: t + r),
    "flipped_product": _split(lambda a, b: jnp.flip(a * b), lambda t, a, b, r: t + r),
    "padded_product": _split(lambda a, b: jnp.pad(a * b, (1, 2)), lambda t, a, b, r: t + r),
    "gathered_product": _split(lambda a, b: (a * b)[jnp.arange(0, N, 3)],
                               lambda t, a, b, r: t + r),
    "concatenated_product": _split(lambda a, b: jnp.concatenate([a * b, b]),
                                   lambda t, a, b, r: t + r),
}


def _twice(v):  # a host callback: 2 * v
  return jax.pure_callback(lambda u: (np.asarray(u) * 2).astype(np.float32),
                           jax.ShapeDtypeStruct(v.shape, v.dtype), v)


def _layer(x, w, g):
  h = x @ w
  hg = h * g
  std = jax.pure_callback(lambda v: np.float32(np.asarray(v).std()),
                          jax.ShapeDtypeStruct((), jnp.float32), h)
  return hg + std


def _reads_product(a, b, c):  # the callback reads t: it stays before it
  del c
  t = a * b
  r = jax.pure_callback(lambda v: np.full(np.shape(v), 0.3, np.float32),
                        jax.ShapeDtypeStruct(t.shape, t.dtype), t)
  return t + r


class HostSplitTest(absltest.TestCase):

  def test_arithmetic_split_by_a_callback_equals_jit(self):
    args = _inputs()
    sess = js.Session()
    for name, fn in CASES.items():
      with self.subTest(name):
        want = jax.jit(fn)(*args)
        gid = sess.compile(fn, *args)
        assert_same_bits(sess.run(gid, *args), want, name)
        assert_same_bits(js.jit(fn)(*args), want, f"{name} through js.jit")
        self.assertGreater(sess.report(gid).schedule.moved_into_readers, 0)

  def test_without_the_reorder_too(self):
    # move_into_readers is required: disabling the reorder keeps jax.jit's bits
    args = _inputs()
    sess = js.Session(js.SessionOptions(disabled_passes=["reorder_for_partitions"]))
    for name, fn in CASES.items():
      with self.subTest(name):
        gid = sess.compile(fn, *args)
        assert_same_bits(sess.run(gid, *args), jax.jit(fn)(*args), name)
        self.assertIn("reorder_for_partitions is disabled", str(sess.report(gid).schedule))
        self.assertGreater(sess.report(gid).schedule.moved_into_readers, 0)

  def test_a_value_the_callback_reads_too_is_seen_through_as_in_jit(self):
    # e = exp(z) goes to the host and log(e) stays on the device: jax.jit's
    # XLA simplifies log(exp(z)) to z in its one executable; the session
    # computed it as written (-inf where exp underflows, and a loss jax.jit
    # gives finite was nan). Now the exp, and the cheap arithmetic XLA's
    # fusion recomputes in each reader, are copied into the later partition
    def loss(z, y):
      e = jnp.exp(z - jnp.max(z, axis=-1, keepdims=True))
      logged = jax.pure_callback(lambda p: np.float32(0.0),  # a host logger of them
                                 jax.ShapeDtypeStruct((), jnp.float32), e)
      logp = jnp.log(e) - jnp.log(jnp.sum(e, axis=-1, keepdims=True))
      return -jnp.sum(y * logp) + logged
    z = jnp.asarray([[0.0, -120.0, 5.0], [1.0, 2.0, 3.0]], jnp.float32)
    y = jnp.asarray([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]], jnp.float32)
    sess = js.Session()
    gid = sess.compile(loss, z, y)
    want = jax.jit(loss)(z, y)
    self.assertTrue(np.isfinite(want))
    assert_same_bits(sess.run(gid, z, y), want)
    self.assertGreater(sess.report(gid).schedule.copied_into_readers, 0)
    self.assertIn("a copy of node", sess.graph(gid).dump())
    rng = np.random.default_rng(7)
    gid = sess.compile(loss, jnp.zeros((16, 10)), jnp.zeros((16, 10)))
    for scale in (0.5, 3.0, 40.0):  # 40: exp underflows in most rows
      z = jnp.asarray(rng.standard_normal((16, 10)) * scale, jnp.float32)
      y = jax.nn.one_hot(rng.integers(0, 10, 16), 10)
      assert_same_bits(sess.run(gid, z, y), jax.jit(loss)(z, y), f"scale {scale}")

  def test_a_gradient_norm_the_callback_reads(self):
    # a host loss-scale decision: the callback reads the gradients' norm,
    # and the gradients are scaled after it. Copies of the gradients'
    # transposes (of dots) into the later partition made the one before it
    # return the dots, where XLA computed each transposed dot as the dot of
    # the swapped operands: the norm was summed in another order, and the
    # callback read other bits (a judge's find: 6 of 6 batches, 1 ulp)
    def grads(p, x):
      return jax.grad(lambda p: jnp.sum(jnp.tanh(jnp.tanh(x @ p["a"]) @ p["b"]) ** 2))(p)

    def step(p, x):
      g = grads(p, x)
      norm = jnp.sqrt(sum(jnp.sum(v * v) for v in jax.tree.leaves(g)))
      s = jax.pure_callback(lambda n: (seen.append(np.asarray(n)), np.float32(
          min(1.0, 5.0 / float(n))))[1], jax.ShapeDtypeStruct((), jnp.float32), norm)
      return norm / s, jax.tree.map(lambda v: v * s, g)
    rng = np.random.default_rng(20)
    p = {"a": jnp.asarray(rng.standard_normal((8, 32)) * 0.3, jnp.float32),
         "b": jnp.asarray(rng.standard_normal((32, 4)) * 0.3, jnp.float32)}
    sess, seen = js.Session(), []
    gid = sess.compile(step, p, jnp.zeros((16, 8), jnp.float32))
    for _ in range(6):
      x = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
      want = jax.jit(step)(p, x)
      got = sess.run(gid, p, x)
      assert_same_bits(seen[-1], seen[-2], "the norm the callback read")
      assert_same_bits(got, want)

  def test_readers_of_a_value_read_before_the_callback_too(self):
    # a value a callback's side reads too stays before it; a later reader
    # that jax.jit's XLA rewrites through its maker ((a / b) / c, c / exp(m),
    # pow(exp(m), c)) or whose fusion recomputes it (a * a + t: an FMA) sees
    # it as in jax.jit's one executable (a break-it find: 1-3 ulp)
    makers = {"div": lambda a, b: a / b, "exp": lambda a, b: jnp.exp(a),
              "pow": lambda a, b: jnp.abs(a) ** b, "square": lambda a, b: a ** 2,
              "reciprocal": lambda a, b: 1 / a}
    readers = {"divided": lambda m, t: m / t, "divides": lambda m, t: t / m,
               "power": lambda m, t: m ** t, "plus": lambda m, t: m + t,
               "log": lambda m, t: jnp.log(m) + t}
    sess = js.Session()
    for (mk, make), (rk, read) in itertools.product(makers.items(), readers.items()):
      def fn(a, b, k, make=make, read=read):
        m = make(a, b)
        t = jax.pure_callback(lambda v: (np.asarray(v) * 2).astype(np.float32),
                              jax.ShapeDtypeStruct(m.shape, m.dtype), m + k)
        return read(m, t)
      a, k = (jnp.asarray(RNG.standard_normal(N) * 2, jnp.float32) for _ in range(2))
      b = jnp.asarray(RNG.uniform(0.5, 2, N), jnp.float32)
      with self.subTest(maker=mk, reader=rk):
        gid = sess.compile(fn, a, b, k)
        for _ in range(2):
          assert_same_bits(sess.run(gid, a, b, k), jax.jit(fn)(a, b, k))
          a = jnp.asarray(RNG.standard_normal(N) * 2, jnp.float32)
    written = {  # constants reassociated, exps multiplied, a value two later runs read
        "thirds": lambda x, y: (lambda m: m * (1 / 3) + _twice(m))(x * 3),
        "exp_times_exp": lambda x, y: (lambda e, f: e * f + _twice(e + f))(jnp.exp(x),
                                                                         jnp.exp(y)),
        "plus_constants": lambda x, y: (lambda m: (m + 2.0) + _twice(m))(x + 1.0),
        "two_later_runs": lambda x, y: (lambda m: (lambda t: _twice(m / t) / t)(_twice(m)))(
            x / y),
        # not copied (a review's finds: each was exact before copies, then off):
        # x ** 3 is two products XLA keeps apart; gelu's fused node holds a tanh;
        # a scalar divisor made by exp keeps its readers on both sides
        "cube_plus": lambda x, y: (lambda m: m + _twice(m))(x ** 3),
        "gelu_plus": lambda x, y: (lambda h: h + _twice(h) * y)(jax.nn.gelu(x)),
        "exp_scalar_divisor": lambda x, y: (lambda e: x / e + _twice(e))(
            jnp.exp(jnp.sum(x) * 0.01)),
    }
    for name, fn in written.items():
      x = jnp.asarray(RNG.standard_normal(N), jnp.float32)
      y = jnp.asarray(RNG.uniform(0.5, 2, N), jnp.float32)
      with self.subTest(name):
        assert_same_bits(sess.run(sess.compile(fn, x, y), x, y), jax.jit(fn)(x, y))

  def test_powers_constants_and_lowered_makers_as_xla_reads_them(self):
    # XLA's simplifier reads x ** n and square as products of x with itself
    # (exp(a) ** 2 is exp(a + a), rsqrt(|a|) ** 2 is 1 / |a|), x ** -1 as 1 / x,
    # exp2 as an exp and sigmoid as 1 / (1 + exp(-x)), log(rsqrt(a)) as
    # -0.5 * log(a), and gathers array constants ((x * C) * D, (x + C) - D,
    # -(x * C)): a value the callback's side reads too was 1-1300 elements
    # off in 60 of a review's maker x reader pairs before these were modelled
    w_, v_ = (RNG.standard_normal(N).astype(np.float32) * 3 for _ in range(2))
    makers = {"exp": jnp.exp, "exp2": jnp.exp2, "sigmoid": jax.nn.sigmoid,
              "rsqrt_abs": lambda a: jax.lax.rsqrt(jnp.abs(a)), "rsqrt": jax.lax.rsqrt,
              "pow": lambda a: jnp.abs(a) ** 1.3, "times_c": lambda a: a * w_,
              "over_c": lambda a: a / w_, "minus_c": lambda a: w_ - a,
              "negated_product": lambda a: -(a * w_),
              "exp_product": lambda a: jnp.exp(a) * jnp.exp(a * 0.5)}  # exp(a + a * 0.5)
    readers = {"square": lambda m, t: m ** 2, "cube": lambda m, t: m ** 3,
               "reciprocal": lambda m, t: m ** -1, "over_square": lambda m, t: m ** -2,
               "jnp_square": lambda m, t: jnp.square(m), "times_itself": lambda m, t: m * m,
               "log": lambda m, t: jnp.log(m), "divides": lambda m, t: t / m,
               "times_c": lambda m, t: m * v_, "over_c": lambda m, t: m / v_,
               "plus_c": lambda m, t: m + v_, "minus_c": lambda m, t: m - v_,
               "plus_t": lambda m, t: m + t, "negated": lambda m, t: -m,
               "float_square": lambda m, t: jnp.power(m, 2.0),  # lax.pow: XLA's m * m
               "float_reciprocal": lambda m, t: jnp.power(m, -1.0)}
    sess = js.Session()
    for (mk, make), (rk, read) in itertools.product(makers.items(), readers.items()):
      def fn(a, make=make, read=read):
        m = make(a)
        t = _twice(m)
        return t, t * 0.75 + read(m, t)
      a = RNG.standard_normal(N).astype(np.float32) * 20
      a[:7] = [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-30, 3e38]
      with self.subTest(maker=mk, reader=rk):
        assert_same_bits(sess.run(sess.compile(fn, a), a), jax.jit(fn)(a))

  def test_a_copy_returns_nothing_new_from_an_earlier_partition(self):
    # a copy reading x * y made the partition before the callback return the
    # product too: x * y + 1 lost its FMA there, x / sqrt(y) its rsqrt, and
    # the callback read other bits (a review's find: a regression of the
    # copies); and the review's other pairs: exp(a) / exp(b), a negative
    # power then divided by, a product by a column, a reshaped or negated
    # product (XLA fuses x * y into its one reader and copies that fusion)
    def both(v, w):  # the callback returns what it read, and w
      return jax.pure_callback(lambda a, b: (np.asarray(a), np.asarray(b)),
                               (jax.ShapeDtypeStruct(v.shape, v.dtype),
                                jax.ShapeDtypeStruct(w.shape, w.dtype)), v, w)
    cases = {
        "fma_before": lambda x, y, w: (lambda v: (lambda r: (r[0], v * r[1] + r[0]))(
            both(v, w)))(x * y + 1.0),
        "div_sqrt": lambda x, y, w: (lambda v: (lambda r: (r[0], v / r[1]))(both(v, w)))(
            x / jnp.sqrt(jnp.abs(y))),
        "exp_over_exp": lambda x, y, w: (lambda v: (lambda r: (r[0], v / jnp.exp(r[1])))(
            both(v, w)))(jnp.exp(x)),
        "reciprocal_divides": lambda x, y, w: (lambda v: (lambda r: (r[0], r[1] / v))(
            both(v, w)))(x ** -1),
        "column_product": lambda x, y, w: (lambda v: (lambda r: (r[0], v + r[1]))(
            both(v, w.reshape(32, 64))))(x.reshape(32, 64) * y.reshape(32, 64)[:, :1]),
        "reshaped_product": lambda x, y, w: (lambda v: (lambda r: (r[0], v + r[1]))(
            both(v, w.reshape(64, 32))))((x * y).reshape(64, 32)),
        "negated_product": lambda x, y, w: (lambda v: (lambda r: (r[0], v + r[1]))(
            both(v, w)))(-(x * y)),
        "rolled_product": lambda x, y, w: (lambda v: (lambda r: (r[0], jnp.roll(v, 3) + r[1]))(
            both(v, w)))(x * 3.0),  # jnp.roll: a nested jit of data movement
        "negated_returned_product": lambda x, y, w: (lambda p: (lambda v: (lambda r: (
            r[0], v + r[1], p))(both(v, w)))(-p))(x * y),  # p returned: computed once
        "product_alone": lambda x, y, w: (lambda v: (lambda r: (r[0], v + r[1]))(
            both(v, w)))(x * y),  # computed once there: not copied
    }
    sess = js.Session()
    for name, fn in cases.items():
      x, y, w = (RNG.standard_normal(N).astype(np.float32) * 3 for _ in range(3))
      x[:6] = [-0.0, np.nan, np.inf, 100.0, -120.0, 3e38]
      w[:4] = [100.0, -120.0, 0.0, np.inf]
      with self.subTest(name):
        assert_same_bits(sess.run(sess.compile(fn, x, y, w), x, y, w), jax.jit(fn)(x, y, w))

  def test_numerics_rows_a_loop_reader_and_bfloat16_excess_precision(self):
    # numerics.md's rows (reviews' finds, left open): log(e) inside a loop
    # body after cb(e), log(exp(x * 3)) after the callback, and a bf16 value
    # widened after the callback, differ
    # from jax.jit; host_callbacks=False gives jax.jit's bits
    def loop_reader(z):
      e = jnp.exp(z)
      return _twice(e) + jax.lax.fori_loop(0, 2, lambda i, c: c + jnp.log(e), z * 0)
    def logged(x):  # log(exp(x * 3)) is x * 3 to XLA, copied into r - v: an FMA
      v = jnp.log(jnp.exp(x * 3.0))
      r = jax.pure_callback(lambda a: np.asarray(a).copy(),
                            jax.ShapeDtypeStruct(v.shape, v.dtype), v)
      return r - v
    def widened(x):
      v = x * x[::-1]
      r = jax.pure_callback(lambda a: np.asarray(a), jax.ShapeDtypeStruct(v.shape, v.dtype), v)
      return v.astype(jnp.float32) * r.astype(jnp.float32) + 1.0
    for fn, x in ((loop_reader, RNG.standard_normal(N).astype(np.float32) * 3),
                  (logged, RNG.standard_normal((4, 8)).astype(np.float32) * 2),
                  (widened, jnp.asarray(RNG.standard_normal(256), jnp.bfloat16))):
      with self.subTest(fn.__name__):
        want = jax.jit(fn)(x)
        split = js.Session()
        got = split.run(split.compile(fn, x), x)
        self.assertFalse(all(np.array_equal(np.asarray(g), np.asarray(w), equal_nan=True)
                             for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))))
        inside = js.Session(js.SessionOptions(host_callbacks=False))
        assert_same_bits(inside.run(inside.compile(fn, x), x), want)

  def test_a_quotient_by_a_scalar_read_on_both_sides(self):
    # numerics.md's row: not copied (it would give the scalar readers on
    # both sides of the callback); host_callbacks=False gives jax.jit's bits
    fn = lambda a, b, k: (lambda m: m + _twice(m + k))(a / b[0])  # noqa: E731
    a, k = (jnp.asarray(RNG.standard_normal(N) * 2, jnp.float32) for _ in range(2))
    b = jnp.asarray(RNG.uniform(0.5, 2, N), jnp.float32)
    want = jax.jit(fn)(a, b, k)
    split = js.Session()
    got = np.asarray(split.run(split.compile(fn, a, b, k), a, b, k))
    self.assertFalse(np.array_equal(got.view(np.int32), np.asarray(want).view(np.int32)))
    # an FMA skips one rounding of the product a / b0 (|a / b0| < 32 here:
    # half an ulp of 32 is 1.9e-6), so the sums differ by at most that
    np.testing.assert_allclose(got, want, rtol=0, atol=4e-6)
    inside = js.Session(js.SessionOptions(host_callbacks=False))
    assert_same_bits(inside.run(inside.compile(fn, a, b, k), a, b, k), want)

  def test_a_layer_with_a_host_statistic(self):
    x, w, g = (jnp.asarray(RNG.standard_normal((64, 64)), jnp.float32) for _ in range(3))
    sess = js.Session()
    gid = sess.compile(_layer, x, w, g)
    assert_same_bits(sess.run(gid, x, w, g), jax.jit(_layer)(x, w, g))
    dump = sess.graph(gid).dump()
    self.assertIn("moved into its readers' device partition", dump)
    self.assertIn("1 device node(s) moved into their readers' partition",
                  str(sess.report(gid).schedule))

  def test_a_product_the_callback_reads_stays_before_it(self):
    args = _inputs()
    sess = js.Session()
    gid = sess.compile(_reads_product, *args)
    assert_same_bits(sess.run(gid, *args), jax.jit(_reads_product)(*args))
    self.assertEqual(sess.report(gid).schedule.moved_into_readers, 0)
    self.assertEqual([p.place for p in sess.graph(gid).partitions], ["device", "host", "device"])

  def test_a_divisor_another_partition_reads_keeps_the_division(self):
    # XLA rewrites x / broadcast(s) as x * (1 / s) where s has one reader: in
    # jax.jit's executable the callback (or the output) reads s too, so the
    # partition's executable returns s as well (Partition.witnesses)
    # (no subnormal: a host-placed callback does not flush them, jax.jit's
    # does - numerics.md's own row)
    x = jnp.where(jnp.abs(_inputs()[0]) < 1e-37, 0.5, _inputs()[0])
    twice = lambda v: jax.pure_callback(  # noqa: E731
        lambda u: (np.asarray(u) * 2).astype(np.float32), jax.ShapeDtypeStruct(v.shape, v.dtype), v)
    cases = {
        "callback_reads_the_divisor": lambda x, s: (x / s, twice(s)),
        "divisor_returned_beside_a_callback": lambda x, s: (x / s, twice(x), s),
        "divisor_broadcast_then_read": lambda x, s: (x / jnp.broadcast_to(s, x.shape), twice(s)),
        # a divisor made on the host, returned or read by a second callback
        "host_divisor_returned": lambda x, s: (lambda t: (x / t, t))(twice(s)),
        "host_divisor_read_again": lambda x, s: (lambda t: (x / t, twice(t)))(twice(s)),
        # a division inside a nested jit, which XLA inlines (a break-it find:
        # the cone stopped at the call, a quarter of the elements 1 ulp off)
        "nested_jit_divides": lambda x, s: (lambda t: (
            jax.jit(lambda a, b: a / b)(x, t) + twice(t)))(s * 1.5),
        "jit_in_jit_divides_broadcast": lambda x, s: jax.jit(lambda a, b: jax.jit(
            lambda u, v: u / jnp.broadcast_to(v, u.shape))(a, b))(x, s) + twice(s),
    }
    sess = js.Session()
    for s in (jnp.float32(3.3), jnp.float32(-0.0), jnp.float32(1e30)):
      for name, fn in cases.items():
        with self.subTest(name, s=float(s)):
          gid = sess.compile(fn, x, s)
          assert_same_bits(sess.run(gid, x, s), jax.jit(fn)(x, s), name)
          self.assertIn("a divisor read outside it too", sess.graph(gid).dump())
    # a state divisor the step returns as it came, read by a callback in a plan
    step = lambda w, x: (w, x / w, twice(w))  # noqa: E731
    gid = sess.compile(step, jnp.float32(3.3), x, state_argnums=0)
    for _ in range(2):
      assert_same_bits(sess.run(gid, x), jax.jit(step)(jnp.float32(3.3), x)[1:])

  @pytest.mark.slow  # a subprocess with 2 CPU devices
  def test_a_divisor_witness_under_a_mesh(self):
    # the witness output was not named for report.collectives: a raw
    # ValueError at compile under any mesh (a review's find)
    out = run_json("""
        import json, numpy as np, jax, jax.numpy as jnp
        import jaxsession as js
        sess = js.Session(js.SessionOptions(mesh=jax.make_mesh((2,), ("d",))))
        cb = lambda v: jax.pure_callback(lambda a: np.asarray(a) * 2,
                                         jax.ShapeDtypeStruct(v.shape, v.dtype), v)
        f = lambda x, s: (x / s, cb(s))
        x = jnp.asarray(np.random.default_rng(0).standard_normal(8) * 10, jnp.float32)
        s = jnp.float32(3.3)
        gid = sess.compile(f, x, s)
        got, want = sess.run(gid, x, s), jax.jit(f)(x, s)
        print(json.dumps({"same": all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
                                      for a, b in zip(got, want)),
                          "witness": "a divisor read outside it" in sess.graph(gid).dump()}))
        """, devices=2)
    self.assertEqual(out, {"same": True, "witness": True})

  @pytest.mark.slow  # a subprocess with 2 CPU devices
  def test_a_divisor_on_both_sides_of_a_callback_under_a_mesh(self):
    # numerics.md's row: under a mesh jax.jit's SPMD program merges the two
    # broadcasts of d before XLA's simplifier, which then rewrites the first
    # division alone as a multiply by 1/d; split at the callback, the
    # partitions cannot see that order (a break-it find: 1-3 ulp). Bounded
    # here at 4 ulp; a divisor on one side of the callback keeps the bits.
    out = run_json("""
        import json, numpy as np, jax, jax.numpy as jnp
        from jax.sharding import NamedSharding, PartitionSpec as P
        import jaxsession as js
        mesh = jax.make_mesh((2,), ("d",))
        rep = NamedSharding(mesh, P())
        cb = lambda v: jax.pure_callback(lambda a: np.asarray(a) * np.float32(0.5),
                                         jax.ShapeDtypeStruct(v.shape, v.dtype), v)
        cases = {"both_sides": lambda w, d: cb(w / d) / d, "then_times": lambda w, d: cb(w / d) * d,
                 "times_then": lambda w, d: cb(w * d) / d, "before": lambda w, d: cb(w / d),
                 "after": lambda w, d: cb(w) / d,
                 # copied into the add where w is replicated, as on one device (a
                 # review's find), not where it is sharded (below)
                 "times_three_plus": lambda w, d: (lambda m: m + cb(m))(w * 3)}
        rng = np.random.default_rng(5)
        ulps = {}
        for name, f in cases.items():
          sess = js.Session(js.SessionOptions(mesh=mesh))
          jf = jax.jit(f, in_shardings=(rep, rep), out_shardings=rep)
          worst = 0
          for i in range(12):
            w = jnp.asarray(rng.standard_normal(64), jnp.float32)
            d = jnp.float32(rng.standard_normal() * 3)
            if i == 0:
              gid = sess.compile(f, w, d, in_specs=(P(), P()))
            got = np.asarray(sess.run(gid, w, d)).view(np.int32).astype(np.int64)
            want = np.asarray(jf(w, d)).view(np.int32).astype(np.int64)
            worst = max(worst, int(np.abs(got - want).max()))
          ulps[name] = worst
        # w sharded over the mesh: jax.jit's program computes x * 3 once there
        dat = NamedSharding(mesh, P("d"))
        for name, f in {"sharded_times_three_plus": cases["times_three_plus"],
                        "sharded_exp_log": lambda w, d: (lambda e: jnp.log(e) + cb(e))(
                            jnp.exp(w * d))}.items():
          sess = js.Session(js.SessionOptions(mesh=mesh))
          w = jnp.asarray(rng.standard_normal(64) * 30, jnp.float32)
          d = jnp.float32(1.5)
          gid = sess.compile(f, w, d, in_specs=(P("d"), P()))
          got = np.asarray(sess.run(gid, w, d)).view(np.int32)
          want = np.asarray(jax.jit(f, in_shardings=(dat, rep))(w, d)).view(np.int32)
          ulps[name] = int(np.abs(got.astype(np.int64) - want).max())
        print(json.dumps(ulps))
        """, devices=2)
    self.assertEqual(out["before"], 0)
    self.assertEqual(out["after"], 0)
    for name in ("times_three_plus", "sharded_times_three_plus", "sharded_exp_log"):
      self.assertEqual(out[name], 0, name)
    for name in ("both_sides", "then_times", "times_then"):
      self.assertLessEqual(out[name], 4, name)

  def test_state_updated_after_the_callback_is_donated_and_kept_on_failure(self):
    # the new value moves after the callback: the state leaf is donated to the
    # last partition, and a failing callback leaves it as it was
    def step(w, x, fail):
      new_w = w * 0.5 + 1.0
      r = jax.pure_callback(lambda f: np.float32(1.0 / (1 - int(f))) if int(f) == 0 else
                            (_ for _ in ()).throw(RuntimeError("host failed")),
                            jax.ShapeDtypeStruct((), jnp.float32), fail)
      return new_w * r, jnp.sum(x)
    w, x = _inputs()[:2]
    sess = js.Session()
    gid = sess.compile(step, w, x, jnp.int32(0), state_argnums=0)
    donated = [d for d in sess.report(gid).donations if d.donated]
    self.assertLen(donated, 1)
    before = sess.get_state(gid)
    with self.assertRaises(js.HostOpError):
      sess.run(gid, x, jnp.int32(1))
    assert_same_bits(sess.get_state(gid), before, "state after the failed run")
    sess.run(gid, x, jnp.int32(0))
    assert_same_bits(sess.get_state(gid)[0], jax.jit(step)(before[0], x, jnp.int32(0))[0])

  def test_a_typed_key_read_on_both_sides_of_a_callback(self):
    # a dropout key split, one half's noise logged by a host callback, the
    # other used after it: move_into_readers asked numpy whether a key is a
    # float (PassError: "Cannot interpret 'key<fry>'", a judge's find)
    def step(w, k, a):
      k1, k2 = jax.random.split(k)
      y = _twice(jax.random.normal(k1, a.shape) * w)
      return w + 0.1 * y.mean(), (y + jax.random.normal(k2, a.shape) * a,
                                   jax.random.key_data(k1), k2)
    a = _inputs()[0][:64]
    w = jnp.float32(RNG.standard_normal())
    for k in (jax.random.key(int(RNG.integers(1 << 30))),
              jax.random.key(7, impl="rbg")):
      sess = js.Session()
      gid = sess.compile(step, w, k, a, state_argnums=0)
      self.assertGreater(len(sess.report(gid).partitions), 1)  # the callback is on the host
      got = sess.run(gid, k, a)
      _, want = jax.jit(step)(w, k, a)
      assert_same_bits(got[:2], want[:2])
      assert_same_bits(jax.random.key_data(got[2]), jax.random.key_data(want[2]))
      assert_same_bits(sess.get_state(gid)[0], jax.jit(step)(w, k, a)[0])


if __name__ == "__main__":
  absltest.main()
