"""Tests of the batch-axis analysis (runtime/batch_axis.py).

It must accept row-independent programs - checked here by real runs - and
refuse every mixing one, naming the node and why. A fuzz of random programs
checks the one promise that matters: no program called safe changes a real
row when padded.

A real run checks two things, bit for bit:
  * no leak: the bucket's executable gives the same real rows whatever the
    padded rows hold (two paddings, NaN and inf among them), for every size;
  * same rows: those real rows equal the exact-size run's, for 2 rows and up.
Exact-size runs use jax.jit with ROW_STABLE compiler options, because XLA on
CPU is not row-stable across batch sizes by default (measured, jax 0.10.2):
its YNNPACK dot fusion is chosen by shape (x @ w, w: f32[4, 6], at 1 row vs
8); its vectorised row reductions round differently at some batch sizes
((x * x).sum(-1) over 5..8 features); and its fusion emitters flush a
subnormal in one size's kernel and keep it in another's (x * iota at 3 rows
vs 8). ROW_STABLE turns off all three; what remains is the one-row dot, which
XLA emits as a matrix-vector product with its own summation order (flax Dense
at 1 row vs 4 rows: 1 ulp), so 1 row is checked for leaks only. On a CPU
without AVX-512 (an AVX2 AMD EPYC, measured) Eigen's GEMM under XLA's dot and
convolution also sums a row in an order that depends on the row count, so a
program with a dot or a convolution is held to GEMM_ULPS of the exact-size run
there, never bit for bit; the no-leak check stays bit for bit everywhere (a
mixing op moves real rows by the 1e4-scale garbage, not by ulps). These are
properties of the kernels, not of the program: no graph analysis sees them,
and bit-exact buckets need the same care.
"""
import dataclasses

from absl.testing import absltest
import pytest
import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jaxsession.graph.importer import import_jaxpr
from jaxsession.graph.ir import KernelGraph
from jaxsession.runtime import batch_axis
from exact import assert_equal_signed, assert_same_bits, ulps_apart, with_specials

ROW_STABLE = {"xla_cpu_experimental_ynn_fusion_type": "", "xla_cpu_prefer_vector_width": 1,
              "xla_cpu_use_fusion_emitters": False}
# Eigen's row-count-dependent GEMM summation on AVX2 (module docstring): the most
# seen here over these tests was 96 ulp (the 4-step RNN of scan_in_rows compounds
# it; a single dot: 10 ulp); 256 bounds that, and a leak or a mixing op moves real
# rows by the 1e4-scale garbage, far beyond it.
GEMM_ULPS = 256
GEMM_OPS = ("stablehlo.dot_general", "stablehlo.convolution")  # in the lowered text
EXAMPLE_ROWS = 7  # the batch size the graphs are traced at: unlike every other size here
F, T, H, V = 6, 4, 5, 11


def weights(seed, *shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def floats(rng, n, *shape):
  """Fresh rows; in about half the batches -0.0, NaN, +-inf, a big value and a
  subnormal among them (only half: a NaN in a real row would hide a mixing op,
  which spreads it to both sides of the comparison)."""
  x = jnp.asarray(rng.standard_normal((n,) + shape), jnp.float32)
  return with_specials(x) if rng.random() < 0.5 else x


def pad_rows(a, b, rng):
  """`a` padded to b rows with garbage (NaN and inf included) that must not leak."""
  a = np.asarray(a)
  extra = (b - a.shape[0],) + a.shape[1:]
  if np.issubdtype(a.dtype, np.floating):
    junk = rng.standard_normal(extra) * 1e4
    junk.reshape(-1)[::5] = np.nan
    junk.reshape(-1)[1::7] = -np.inf
  else:
    junk = rng.integers(-3, 1000, extra)
  return jnp.asarray(np.concatenate([a, junk.astype(a.dtype)]))


def graph_of(f, args, dynamic_argnums, kinds=None):
  """f's KernelGraph at `args`, and {input id: 0} for every leaf of the dynamic args."""
  graph = import_jaxpr(jax.make_jaxpr(f)(*args), "f", input_kinds=kinds)
  counts = np.cumsum([0] + [len(jax.tree.leaves(a)) for a in args])
  argnums = [i % len(args) for i in dynamic_argnums]
  dynamic = {graph.inputs[j].id: 0 for i in argnums for j in range(counts[i], counts[i + 1])}
  return graph, dynamic


def analyze(f, *args, dynamic_argnums=(-1,)):
  return batch_axis.analyze(*graph_of(f, args, dynamic_argnums))


def real_rows(out, axes, n):
  """The first n rows of each output along its row axis (all of it when None)."""
  return [x if a is None else np.take(np.asarray(x), np.arange(n), axis=a)
          for x, a in zip(jax.tree.leaves(out), axes)]


def has_gemm(jitted, *args):
  """Whether a jitted function's program holds a dot or a convolution."""
  text = jitted.lower(*args).as_text()
  return any(op in text for op in GEMM_OPS)


def assert_same_rows(got, want, gemm, msg):
  """The padded run's real rows against the exact-size run's: bit for bit, or
  within GEMM_ULPS (NaN and inf where the exact run has them) for a program
  with a GEMM (module docstring)."""
  if not gemm:
    assert_same_bits(got, want, msg)
    return
  g, w = np.asarray(got), np.asarray(want)
  assert g.dtype == w.dtype and g.shape == w.shape, f"{msg}: {g.dtype}{g.shape} != {w.dtype}{w.shape}"
  if not jnp.issubdtype(g.dtype, jnp.floating) or g.dtype != np.float32:
    assert_same_bits(g, w, msg)
    return
  assert_equal_signed(np.isnan(g), np.isnan(w), err_msg=msg)
  finite = ~np.isnan(w)
  assert_equal_signed(np.isinf(g[finite]), np.isinf(w[finite]), err_msg=msg)
  far = ulps_apart(g[finite], w[finite])
  assert far <= GEMM_ULPS, f"{msg}: {far} ulp from the exact-size run (bound {GEMM_ULPS})"


def check_real_rows(run, fixed, make_rows, axes, sizes, rng):
  """For each (n, b): n fresh rows padded to b twice, with different garbage.
  The real rows of both padded runs agree bit for bit (no leak), and from 2
  rows up equal the exact-size run's (see the module docstring for 1 row and
  for GEMMs)."""
  gemm = None
  for n, b in sizes:
    rows = make_rows(rng, n)
    if gemm is None:
      gemm = has_gemm(run, *fixed, *rows)
    got = [real_rows(run(*fixed, *(pad_rows(a, b, rng) for a in rows)), axes, n)
           for _ in range(2)]
    for k, (g, w) in enumerate(zip(got[1], got[0])):
      assert_same_bits(g, w, f"output {k} with {n} rows padded to {b}: a leak")
    if n > 1:
      exact = jax.tree.leaves(run(*fixed, *rows))
      for k, (g, w) in enumerate(zip(got[1], exact)):
        assert_same_rows(g, w, gemm, f"output {k} with {n} rows padded to {b}")


@dataclasses.dataclass
class Program:
  f: object
  fixed: tuple      # arguments that are not padded (weights), first
  rows: object      # (rng, n) -> the padded arguments, last

  def args(self, rng, n):
    return self.fixed + self.rows(rng, n)

  def dynamic(self):
    """Positions of the padded arguments."""
    count = len(self.rows(np.random.default_rng(0), 1))
    return tuple(range(len(self.fixed), len(self.fixed) + count))


# -- accepted programs --------------------------------------------------------------
def mlp(w1, b1, w2, x):
  return jnp.tanh(x @ w1 + b1) @ w2


def layernorm(g, x):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * lax.rsqrt(var + 1e-5) * g


def attention(wq, wk, wv, x):
  """Causal self-attention inside each row of x: [B, T, D]."""
  q, k, v = x @ wq, x @ wk, x @ wv
  s = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(F).astype(np.float32)
  s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -1e9)
  return jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, -1), v)


def embed(table, w, ids):
  return jnp.tanh(table[ids] @ w)


def scan_in_rows(w, x):
  """An RNN over the time axis of each row: x: [B, T, D]."""
  def cell(h, xt):
    h = jnp.tanh(h @ w + xt)
    return h, h * 2
  h, ys = lax.scan(cell, jnp.zeros((x.shape[0], F)), jnp.swapaxes(x, 0, 1))
  return h, jnp.swapaxes(ys, 0, 1)


def cross_entropy(w, x, labels):
  """Per-example loss: logits and labels both carry the rows."""
  logp = jax.nn.log_softmax(x @ w)
  return -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]


def conv_pool(k, x):
  """1-D convolution over x: [B, C, W] (NCW) and a max pool along W."""
  y = lax.conv_general_dilated(x, k, (1,), "SAME")
  return lax.reduce_window(y, -jnp.inf, lax.max, (1, 1, 2), (1, 1, 2), "VALID")


def per_example_grads(w, x):
  loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) ** 2)
  return jax.vmap(jax.grad(loss), in_axes=(None, 0))(w, x)


def control_flow(w, x):
  """cond and while on a weight and a counter, never on the rows."""
  y = lax.cond(w[0, 0] > 0, lambda v: jnp.sin(v @ w), lambda v: v @ w * 2, x)
  return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1])), (0, y))[1]


def scatter_in_rows(x):
  return x.at[:, 1].add(x[:, 0]).at[:, 0].set(-1.0)


class FlaxMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(H)(x))
    x = nn.gelu(nn.LayerNorm()(x))
    return nn.Dense(3)(x)


FLAX_MLP = FlaxMLP()
FLAX_VARS = FLAX_MLP.init(jax.random.key(0), jnp.ones((2, F)))

ACCEPTED = {
    "mlp": Program(mlp, (weights(1, F, H), weights(2, H), weights(3, H, 3)),
                   lambda rng, n: (floats(rng, n, F),)),
    "layernorm": Program(layernorm, (weights(4, F),), lambda rng, n: (floats(rng, n, F),)),
    "flax_layernorm": Program(nn.LayerNorm().apply, (nn.LayerNorm().init(
        jax.random.key(1), jnp.ones((2, F))),), lambda rng, n: (floats(rng, n, T, F),)),
    "attention": Program(attention, (weights(5, F, F), weights(6, F, F), weights(7, F, F)),
                         lambda rng, n: (floats(rng, n, T, F),)),
    "embedding": Program(embed, (weights(8, V, F), weights(9, F, H)),
                         lambda rng, n: (jnp.asarray(rng.integers(0, V, n), jnp.int32),)),
    "flax_mlp": Program(FLAX_MLP.apply, (FLAX_VARS,), lambda rng, n: (floats(rng, n, F),)),
    "scan_in_rows": Program(scan_in_rows, (weights(10, F, F),),
                            lambda rng, n: (floats(rng, n, T, F),)),
    "cross_entropy": Program(cross_entropy, (weights(11, F, H),), lambda rng, n: (
        floats(rng, n, F), jnp.asarray(rng.integers(0, H, n), jnp.int32))),
    "conv_pool": Program(conv_pool, (weights(12, 3, 2, 3),),
                         lambda rng, n: (floats(rng, n, 2, 8),)),
    "control_flow": Program(control_flow, (weights(14, F, F),),
                            lambda rng, n: (floats(rng, n, F),)),
    "scatter_in_rows": Program(scatter_in_rows, (), lambda rng, n: (floats(rng, n, F),)),
    "per_example_grads": Program(per_example_grads, (weights(13, F, H),),
                                 lambda rng, n: (floats(rng, n, F),)),
    # the same along the batch axis, through a nested jit's cumsum and an any()
    # (Hugging Face's position ids and mask check: refused until a review's find)
    "position_ids": Program(lambda ids: ids + jnp.cumsum(jnp.ones_like(ids), -1), (),
                            lambda rng, n: (jnp.asarray(rng.integers(0, V, (n, T)), jnp.int32),)),
    "mask_check": Program(lambda x: jnp.where(jnp.any(jnp.ones_like(x) == 0), 0.0, x * 2), (),
                          lambda rng, n: (floats(rng, n, F),)),
}
# (real rows, bucket) pairs: 1..17 rows, each padded to a bigger bucket
SIZES = ((1, 4), (2, 8), (3, 4), (5, 8), (8, 16), (13, 16), (17, 32))


class AcceptedTest(absltest.TestCase):

  def check_padding(self, program, verdict, seed=0):
    check_real_rows(jax.jit(program.f, compiler_options=ROW_STABLE), program.fixed,
                    program.rows, verdict.output_axes, SIZES, np.random.default_rng(seed))

  @pytest.mark.slow
  def test_accepts_and_padding_keeps_real_rows(self):
    for name, program in ACCEPTED.items():
      with self.subTest(name):
        args = program.args(np.random.default_rng(0), EXAMPLE_ROWS)
        verdict = analyze(program.f, *args, dynamic_argnums=program.dynamic())
        self.assertTrue(verdict.safe, f"{name}:\n{verdict.describe()}")
        self.assertNotIn(None, verdict.output_axes, name)
        self.check_padding(program, verdict)

  def test_scan_outputs_keep_their_axes(self):
    program = ACCEPTED["scan_in_rows"]
    verdict = analyze(program.f, *program.args(np.random.default_rng(0), EXAMPLE_ROWS))
    self.assertEqual(verdict.output_axes, [0, 0])

  def test_fused_graph_of_the_session(self):
    """After the Optimize stage: MatMulBiasAdd, GeluTanh, LayerNorm, Softmax."""
    def f(w1, b1, g, w2, x):
      h = jax.nn.gelu(x @ w1 + b1)
      h = layernorm(g, h)
      return jax.nn.softmax(h @ w2, -1)
    fixed = (weights(20, F, H), weights(21, H), weights(22, H), weights(23, H, 4))
    x = floats(np.random.default_rng(1), EXAMPLE_ROWS, F)
    sess = js.Session()
    graph = sess.graph(sess.compile(f, *fixed, x))
    ops = {node.op for node in graph.nodes}
    self.assertTrue({"MatMulBiasAdd", "GeluTanh", "LayerNorm", "Softmax"} <= ops, ops)
    verdict = batch_axis.analyze(graph, {graph.inputs_of_kind("input")[-1].id: 0})
    self.assertTrue(verdict.safe, verdict.describe())
    self.assertEqual(verdict.output_axes, [0])
    self.check_padding(Program(f, fixed, lambda rng, n: (floats(rng, n, F),)), verdict)

  @pytest.mark.slow
  def test_fused_cnn_with_inference_batchnorm(self):
    """BatchNormRelu (HardwareOptimize) after a convolution: running statistics."""
    class CNN(nn.Module):
      @nn.compact
      def __call__(self, x):
        return nn.relu(nn.BatchNorm(use_running_average=True)(nn.Conv(4, (3,))(x)))
    cnn = CNN()
    variables = jax.tree.map(lambda a: a + 0.5, cnn.init(jax.random.key(2), jnp.ones((2, 8, 3))))
    sess = js.Session()
    graph = sess.graph(sess.compile(cnn.apply, variables, jnp.ones((EXAMPLE_ROWS, 8, 3))))
    self.assertIn("BatchNormRelu", [node.op for node in graph.nodes])
    verdict = batch_axis.analyze(graph, {graph.inputs_of_kind("input")[-1].id: 0})
    self.assertTrue(verdict.safe, verdict.describe())
    self.check_padding(Program(cnn.apply, (variables,), lambda rng, n: (floats(rng, n, 8, 3),)),
                       verdict)

  def test_state_that_does_not_see_the_rows(self):
    def step(count, x):
      return count + 1, x * 2
    graph, dynamic = graph_of(step, (jnp.zeros(()), jnp.ones((EXAMPLE_ROWS, F))), (1,),
                              kinds=["state", "input"])
    graph.updates_state = True
    verdict = batch_axis.analyze(graph, dynamic)
    self.assertTrue(verdict.safe, verdict.describe())
    self.assertEqual(verdict.output_axes, [None, 0])

  def test_describe_when_safe(self):
    verdict = analyze(lambda x: x * 2, jnp.ones((EXAMPLE_ROWS, F)))
    self.assertIn("safe", verdict.describe())


# -- refused programs -----------------------------------------------------------------
class FlaxBN(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.BatchNorm(use_running_average=False)(x)


BN_VARS = FlaxBN().init(jax.random.key(0), jnp.ones((2, F)))
X = jnp.ones((EXAMPLE_ROWS, F))
XT = jnp.ones((EXAMPLE_ROWS, T, F))
PERM = np.arange(EXAMPLE_ROWS)[::-1].copy()
ONES_SUM = lambda x: jnp.ones(x.shape[0]).sum()  # noqa: E731  (made from the batch size)
REFUSED = {  # name: (f, args, op named, words of the reason)
    "mean_loss": (lambda w, x: jnp.mean((x @ w - 1.0) ** 2), (weights(1, F, H), X),
                  "reduce_sum", "sums over the batch axis 0"),
    "batchnorm_statistics": (lambda v, x: FlaxBN().apply(v, x, mutable=["batch_stats"]),
                             (BN_VARS, X), "reduce_sum", "sums over the batch axis 0"),
    "x_transpose_x": (lambda x: x.T @ x, (X,), "dot_general", "contracts over the batch axis"),
    "outer_over_rows": (lambda x: x @ x.T, (X,), "dot_general", "every row of one operand"),
    # jnp.cumsum and jnp.sort are nested jits, kept as calls: the call is named
    "cumsum": (lambda x: jnp.cumsum(x, 0), (X,), "jit",
               "in its body (jit cumsum): 'cumsum' accumulates (cumsum) along the batch axis 0"),
    "sort": (lambda x: jnp.sort(x, 0), (X,), "jit",
             "in its body (jit sort): 'sort' sorts along the batch axis 0"),
    "reshape_b_times_t": (lambda x: jnp.tanh(x.reshape(-1, F)), (XT,), "reshape",
                          "merges or splits the batch axis 0"),
    "concatenate": (lambda x: jnp.concatenate([x, x * 2]), (X,), "concatenate",
                    "concatenates along the batch axis 0"),
    "pure_callback": (lambda x: jax.pure_callback(np.sin, jax.ShapeDtypeStruct(X.shape, X.dtype),
                                                  x), (X,), "pure_callback", "host callback"),
    "gather_along_rows": (lambda x: x[PERM], (X,), "gather", "gathers along the batch axis 0"),
    "scan_over_rows": (lambda x: lax.scan(lambda c, r: (c + r, c), jnp.zeros(F), x), (X,),
                       "scan", "the rows become loop steps"),
    "while_on_rows": (lambda x: lax.while_loop(lambda v: v.sum() < 1e3, lambda v: v * 2, x),
                      (X,), "while", "in its condition: 'reduce_sum'"),
    "cond_on_a_row": (lambda x: lax.cond(x[0, 0] > 0, jnp.sin, jnp.cos, x), (X,), "slice",
                     "slices along the batch axis 0"),
    "dropout_mask": (lambda x: x * jax.random.bernoulli(jax.random.key(0), 0.5, x.shape),
                     (X,), "mul", "spans the batch axis"),
    "batch_shaped_output": (lambda x: (x, jnp.ones_like(x)), (X,), "broadcast_in_dim",
                            "padding may change its shape"),
    "scatter_to_chosen_rows": (lambda x: x.at[jnp.array([0, 0, 1])].add(1.0), (X,), "scatter-add",
                               "scatters along the batch axis"),
    # made from the batch size, not from the rows (a break-it find: padded rows counted)
    "count_of_rows": (lambda x: (x * 2, jnp.sum(jnp.ones(x.shape[0], jnp.int32))), (X,),
                      "reduce_sum", "on a value sized by the batch"),
    "last_row_index": (lambda x: (x + 1, jnp.max(jnp.arange(x.shape[0]))), (X,),
                       "reduce_max", "on a value sized by the batch"),
    "ones_summed_in_a_cond": (lambda x: (x * 2, lax.cond(True, lambda: ONES_SUM(x), lambda: 0.)),
                              (X,), "cond", "on a value sized by the batch"),
    "ones_summed_in_a_loop": (lambda x: (x * 2, lax.fori_loop(0, 3, lambda i, c: c + ONES_SUM(x),
                                                              0.0)), (X,), "scan", "sized by"),
    "ones_summed_in_a_jit": (lambda x: (x * 2, jax.jit(lambda n=x.shape[0]: jnp.ones(n).sum(),
                                                       static_argnums=0)()), (X,), "jit", "sized by"),
    "gather_from_a_batch_sized_table": (lambda i: (jnp.arange(i.shape[0]) * 10)[i],
                                        (jnp.arange(EXAMPLE_ROWS, dtype=jnp.uint32),), "gather",
                                        "from a value sized by the batch"),
    "second_axis_of_ones": (lambda x: (x[:, :1] * jnp.ones((1, x.shape[0]))).sum(1), (X,), "mul",
                            "second axis of the batch's extent"),
    "mean_inside_scan_body": (lambda x: lax.scan(lambda c, t: (c + t.mean(), None), 0.0,
                                                 jnp.swapaxes(x, 0, 1))[0], (XT,), "scan",
                              "in its body: 'reduce_sum'"),
}


class RefusedTest(absltest.TestCase):

  def test_refuses_each_mixing_program_naming_the_node(self):
    for name, (f, args, op, words) in REFUSED.items():
      with self.subTest(name):
        graph, dynamic = graph_of(f, args, (-1,))
        verdict = batch_axis.analyze(graph, dynamic)
        self.assertFalse(verdict.safe, name)
        hits = [p for p in verdict.problems if p.op == op and words in p.reason]
        self.assertTrue(hits, f"{name}: no '{op}' problem saying '{words}':\n"
                              f"{verdict.describe()}")
        node = {n.id: n for n in graph.nodes}[hits[0].node_id]
        self.assertEqual(node.op, op)
        self.assertIn(f"node {node.id} '{op}'", verdict.describe())

  def test_describe_names_node_source_and_reason(self):
    verdict = analyze(lambda x: jnp.sum(x * 2), X)
    self.assertRegex(verdict.describe(), r"^node \d+ 'reduce_sum' at batch_axis_test\.py:\d+ "
                                         r"\(.*\): sums over the batch axis 0$")

  def test_new_state_from_a_batch_reduction(self):
    def step(running_mean, x):
      return 0.9 * running_mean + 0.1 * x.mean(0), x - running_mean
    graph, dynamic = graph_of(step, (jnp.zeros(F), X), (1,), kinds=["state", "input"])
    graph.updates_state = True
    verdict = batch_axis.analyze(graph, dynamic)
    self.assertFalse(verdict.safe)
    ops = [(p.op, p.reason) for p in verdict.problems]
    self.assertIn(("reduce_sum", "sums over the batch axis 0"), ops)
    state = [p for p in verdict.problems if "the new value of state 0" in p.reason]
    self.assertLen(state, 1)
    self.assertEqual(graph.outputs[0].producer.id, state[0].node_id)
    self.assertEqual(verdict.output_axes, [None, 0])

  def test_state_that_keeps_rows(self):
    def step(buffer, x):
      return buffer + x, x
    graph, dynamic = graph_of(step, (X, X), (1,), kinds=["state", "input"])
    graph.updates_state = True
    verdict = batch_axis.analyze(graph, dynamic)
    self.assertIn("the new value of state 0 depends on the padded rows", verdict.describe())

  def test_primitive_without_a_rule_mixes(self):
    graph = KernelGraph("g")
    x = graph.add_input(jax.typeof(X))
    graph.outputs = graph.add_node("mystery_op", None, {}, [x], [x.aval]).outputs
    verdict = batch_axis.analyze(graph, {x.id: 0})
    self.assertEqual([p.reason for p in verdict.problems], ["no batch rule for mystery_op"])

  def test_one_row_cannot_tell(self):
    """At 1 row, rev(iota(B)) looks like a broadcast: it is not, at 8 rows."""
    verdict = analyze(lambda x: x * lax.rev(jnp.arange(x.shape[0]), (0,))[:, None], X[:1])
    self.assertFalse(verdict.safe)
    self.assertIn("traced with 1 row", verdict.describe())
    self.assertIn("'rev'", analyze(lambda x: x * lax.rev(jnp.arange(x.shape[0]), (0,))[:, None],
                                   X).describe())

  def test_only_inputs_carry_rows(self):
    graph, _ = graph_of(lambda s, x: (s, x), (X, X), (1,), kinds=["state", "input"])
    with self.assertRaisesRegex(ValueError, "state and constants never do"):
      batch_axis.analyze(graph, {graph.inputs[0].id: 0})


# -- fuzz -------------------------------------------------------------------------------
FUZZ_PROGRAMS, FUZZ_GROUP, FUZZ_BUCKET, FUZZ_SIZES = 100, 25, 8, (1, 3, 5)
FZ, FT = 5, 3  # feature and time sizes: no fuzz shape reaches the bucket size 8


def _axis(rng, last_bias=0.6):
  """An axis as an offset from the last: usually a late axis, sometimes any."""
  return 0 if rng.random() < last_bias else int(rng.integers(1, 4))


def _op(rng, seed):
  """One random op: v -> v, its parameters drawn now, its shapes read at trace time."""
  k = _axis(rng)
  ax = lambda v: v.ndim - 1 - min(k, v.ndim - 1)
  const = lambda *shape: np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  kind = rng.choice(["unary", "unary", "bias", "matmul", "matmul", "reduce", "transpose",
                     "reshape", "cumsum", "sort", "broadcast", "concat", "slice", "flip",
                     "center", "softmax", "take", "gram", "iota", "where", "linspace", "roll",
                     "permute", "scan", "loop", "outer"])
  along = lambda v, u: u.reshape([-1 if d == ax(v) else 1 for d in range(v.ndim)])
  fn = {
      "unary": lambda v: [jnp.tanh, jnp.abs, jnp.sin, lambda u: u * 2 + 1][seed % 4](v),
      "bias": lambda v: v + const(v.shape[-1]),
      "matmul": lambda v: v @ const(v.shape[-1], (3, 6)[seed % 2]),
      "reduce": lambda v: [jnp.sum, jnp.max, jnp.mean][seed % 3](v, ax(v), keepdims=True),
      "transpose": lambda v: jnp.swapaxes(v, ax(v), (ax(v) + 1) % v.ndim),
      "reshape": lambda v: (v.reshape(v.shape[:ax(v)] + (-1,) + v.shape[ax(v) + 2:])
                            if ax(v) + 1 < v.ndim else v.reshape(v.shape[:-1] + (1, -1))),
      "cumsum": lambda v: jnp.cumsum(v, ax(v)),
      "sort": lambda v: jnp.sort(v, ax(v)),
      "broadcast": lambda v: jnp.broadcast_to(v[..., None], v.shape + (2,)) if v.ndim < 4 else v,
      "concat": lambda v: jnp.concatenate([v, jnp.tanh(v)], ax(v)),
      "slice": lambda v: v[(slice(None),) * ax(v) + (slice(None, 2),)],  # never empty
      "flip": lambda v: jnp.flip(v, ax(v)),
      "center": lambda v: v - v.mean(ax(v), keepdims=True),
      "softmax": lambda v: jax.nn.softmax(v, ax(v)),
      "take": lambda v: jnp.take(v, jnp.array([1, 0]), axis=ax(v), mode="clip"),
      "gram": lambda v: jnp.tensordot(v, v, axes=([ax(v)], [ax(v)])) if v.ndim < 3 else v,
      "iota": lambda v: v * lax.broadcasted_iota(jnp.float32, v.shape, ax(v)),
      "where": lambda v: jnp.where(v > 0, v, 0.0),
      # a value built from the axis's size: along the rows, padding changes it
      "linspace": lambda v: v * along(v, jnp.linspace(0.0, 1.0, v.shape[ax(v)])),
      "roll": lambda v: jnp.roll(v, 1, ax(v)),
      "permute": lambda v: jnp.take(v, (jnp.arange(v.shape[ax(v)]) + 1) % v.shape[ax(v)],
                                    axis=ax(v)),
      "scan": lambda v: jnp.moveaxis(lax.scan(lambda c, t: (jnp.tanh(c + t), c * t),
                                              jnp.zeros_like(jnp.moveaxis(v, ax(v), 0)[0]),
                                              jnp.moveaxis(v, ax(v), 0), unroll=True)[1],
                                     0, ax(v)),  # unrolled: XLA compiles loops slowly
      "outer": lambda v: (jnp.expand_dims(v, ax(v)) * jnp.expand_dims(v, ax(v) + 1)
                          if v.ndim < 4 else v),
      "loop": lambda v: lax.fori_loop(0, 2, lambda i, u: jnp.sin(u) * 2, v, unroll=True),
  }[kind]
  return f"{kind}@-{k + 1}", fn


def random_program(seed):
  """(f, row shape, text): 1-4 random ops on x: [B, F] or [B, T, F]; some
  intermediate values are outputs too."""
  rng = np.random.default_rng(seed)
  ops = [_op(rng, seed * 10 + i) for i in range(int(rng.integers(1, 5)))]
  shown = [rng.random() < 0.2 for _ in ops[:-1]] + [True]
  shape = (FZ,) if rng.random() < 0.5 else (FT, FZ)
  def f(x):
    outs = []
    for (_, fn), show in zip(ops, shown):
      x = fn(x) if x.ndim else x  # a scalar (after a gram of vectors) has no axis to use
      outs += [x] if show else []
    return tuple(outs)
  return f, shape, " ".join(name for name, _ in ops)


def same_real_rows(got, want, n, b):
  """Whether some axis of `got` (b long where `want` is n long) gives `want`."""
  got, want = np.asarray(got), np.asarray(want)
  candidates = [got] if got.shape == want.shape else []
  candidates += [np.take(got, np.arange(n), axis=a) for a in range(got.ndim)
                 if got.shape[a] == b and want.shape[a] == n]
  for cut in candidates:
    try:
      assert_same_bits(cut, want)
      return True
    except AssertionError:
      continue
  return False


def padded_runs(group, sizes, seed):
  """Runs a group of programs under one jit - one compile per size for the
  group, not per program: the fuzz's time is XLA's. Yields, per program and
  size n: (position in group, n, exact-size outputs, two padded runs' outputs)."""
  run = jax.jit(lambda *xs: [f(x) for (f, _, _), x in zip(group, xs)],
                compiler_options=ROW_STABLE)
  rng = np.random.default_rng(seed)
  for n in sizes:
    xs = [floats(rng, n, *shape) for _, shape, _ in group]
    outs = [run(*xs)] + [run(*(pad_rows(x, FUZZ_BUCKET, rng) for x in xs)) for _ in range(2)]
    for k in range(len(group)):
      yield (k, n) + tuple(jax.tree.leaves(out[k]) for out in outs)


def chunks(items, size):
  return [items[i:i + size] for i in range(0, len(items), size)]


@pytest.mark.slow
class FuzzTest(absltest.TestCase):

  def test_no_program_called_safe_changes_a_real_row(self):
    programs = [random_program(seed) for seed in range(FUZZ_PROGRAMS)]
    verdicts = [analyze(f, jnp.ones((FUZZ_BUCKET,) + shape)) for f, shape, _ in programs]
    safe = [k for k, v in enumerate(verdicts) if v.safe]
    for ids in chunks(safe, FUZZ_GROUP):
      for k, n, want, got, again in padded_runs([programs[i] for i in ids], FUZZ_SIZES, ids[0]):
        axes, what = verdicts[ids[k]].output_axes, f"program {ids[k]} ({programs[ids[k]][2]})"
        for i, (g, a) in enumerate(zip(real_rows(got, axes, n), real_rows(again, axes, n))):
          assert_same_bits(g, a, f"{what}, called safe: the padded rows leak into output {i}")
          if n > 1:  # 1 row: see the module docstring
            gemm = "matmul" in programs[ids[k]][2]
            assert_same_rows(g, want[i], gemm, f"{what}, called safe: output {i}, {n} rows "
                                               f"padded to {FUZZ_BUCKET}, against the "
                                               "exact-size run")
    # refused programs: how many were harmless after all (3 rows; allowed, but counted)
    refused = [k for k, v in enumerate(verdicts) if not v.safe]
    harmless = set(refused)
    for ids in chunks(refused, FUZZ_GROUP):
      for k, n, want, got, _ in padded_runs([programs[i] for i in ids], (3,), ids[0]):
        if not all(same_real_rows(g, w, n, FUZZ_BUCKET) for g, w in zip(got, want)):
          harmless.discard(ids[k])
    summary = (f"{len(safe)} of {FUZZ_PROGRAMS} programs called safe; of {len(refused)} refused, "
               f"{len(harmless)} were harmless in the real runs (allowed: the analysis may "
               "refuse a harmless program, never accept a mixing one)")
    print(summary)
    self.assertGreaterEqual(len(safe), 0.3 * FUZZ_PROGRAMS, summary)
    self.assertGreater(len(refused) - len(harmless), 0.2 * FUZZ_PROGRAMS, summary)


if __name__ == "__main__":
  absltest.main()
