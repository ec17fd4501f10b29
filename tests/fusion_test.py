"""Fusion passes: each fires on the forms users write (by hand, jax.nn, flax,
optax) and results match jax.jit within 1e-5; each stays away when a value
inside has another reader, the dtype is wrong, or the params do not fit."""
from absl.testing import absltest, parameterized
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsession as js
from jaxsession.examples import cnn_bn, mlp_adam, transformer_decode

RNG = np.random.default_rng(33)


def _x(*shape, dtype=jnp.float32, scale=1.0, shift=0.0):
  return jnp.asarray(RNG.standard_normal(shape) * scale + shift).astype(dtype)


def _fresh_like(tree):
  return jax.tree.map(lambda a: _x(*a.shape, dtype=a.dtype) if jnp.issubdtype(
      a.dtype, jnp.floating) else a, tree)


def compile_and_check(test, fn, *args, rtol=1e-5):
  """Compiles fn, checks a fresh run against jax.jit, returns the node ops."""
  sess = js.Session()
  gid = sess.compile(fn, *args)
  fresh = _fresh_like(args)
  got, want = sess.run(gid, *fresh), jax.jit(fn)(*fresh)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                               rtol=rtol, atol=1e-6)
  return [n.op for n in sess.graph(gid).nodes], sess.graph(gid)


def _ln_hand(x, g, b):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + 1e-5) * g + b


def _ln_rsqrt(x, g):
  mean = x.mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * g


def _rms_hand(x, g):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


_flax_ln, _flax_rms, _flax_dense = nn.LayerNorm(), nn.RMSNorm(), nn.Dense(5)
_flax_bn = nn.BatchNorm(use_running_average=True)


def _flax_vars(module, x):
  return jax.tree.map(lambda a: a + 0.2 * _x(*a.shape), module.init(jax.random.key(0), x))


def _bn_hand(x, mean, var, gamma, beta):
  return jax.nn.relu((x - mean) * jax.lax.rsqrt(var + 1e-5) * gamma + beta)


FIRES = [
    ("softmax_jax_nn", "Softmax", lambda x: jax.nn.softmax(x, axis=-1), lambda: (_x(4, 9),)),
    ("softmax_axis0", "Softmax", lambda x: jax.nn.softmax(x, axis=0), lambda: (_x(4, 9),)),
    ("softmax_hand", "Softmax", lambda x: jnp.exp(x - x.max(-1, keepdims=True)) / jnp.exp(
        x - x.max(-1, keepdims=True)).sum(-1, keepdims=True), lambda: (_x(3, 7),)),
    ("gelu_jax_nn", "GeluTanh", jax.nn.gelu, lambda: (_x(5, 6),)),
    ("gelu_hand", "GeluTanh", lambda x: 0.5 * x * (1 + jnp.tanh(
        jnp.sqrt(2 / jnp.pi) * (x + 0.044715 * x ** 3))), lambda: (_x(5, 6),)),
    ("matmul_bias_hand", "MatMulBiasAdd", lambda x, w, b: x @ w + b,
     lambda: (_x(4, 8), _x(8, 3), _x(3))),
    ("matmul_bias_flax_dense", "MatMulBiasAdd", lambda v, x: _flax_dense.apply(v, x),
     lambda: (_flax_vars(_flax_dense, _x(2, 6)), _x(2, 6))),
    ("add_n_chain", "AddN", lambda a, b, c, d: a + b + c + d, lambda: tuple(_x(3, 4)
                                                                            for _ in range(4))),
    ("add_n_tree", "AddN", lambda a, b, c, d: (a + b) + (c + d), lambda: tuple(_x(5)
                                                                                for _ in range(4))),
    ("layernorm_hand", "LayerNorm", _ln_hand, lambda: (_x(4, 16, scale=2, shift=1), _x(16),
                                                      _x(16))),
    ("layernorm_rsqrt", "LayerNorm", _ln_rsqrt, lambda: (_x(4, 16), _x(16))),
    ("layernorm_flax", "LayerNorm", lambda v, x: _flax_ln.apply(v, x),
     lambda: (_flax_vars(_flax_ln, _x(3, 8)), _x(3, 8))),
    ("rmsnorm_hand", "RMSNorm", _rms_hand, lambda: (_x(4, 16), _x(16))),
    ("rmsnorm_flax", "RMSNorm", lambda v, x: _flax_rms.apply(v, x),
     lambda: (_flax_vars(_flax_rms, _x(3, 8)), _x(3, 8))),
    ("bn_relu_hand", "BatchNormRelu", _bn_hand,
     lambda: (_x(2, 4, 4, 6), _x(6), jnp.abs(_x(6)) + 0.5, _x(6), _x(6))),
    ("bn_relu_flax", "BatchNormRelu", lambda v, x: jax.nn.relu(_flax_bn.apply(v, x)),
     lambda: ({"params": _flax_vars(_flax_bn, _x(2, 3, 3, 4))["params"],
               "batch_stats": {"mean": _x(4), "var": jnp.abs(_x(4)) + 0.5}}, _x(2, 3, 3, 4))),
    ("bn_add_relu_flax", "BatchNormAddRelu",
     lambda v, x, r: jax.nn.relu(_flax_bn.apply(v, x) + r),
     lambda: ({"params": _flax_vars(_flax_bn, _x(2, 3, 3, 4))["params"],
               "batch_stats": {"mean": _x(4), "var": jnp.abs(_x(4)) + 0.5}},
              _x(2, 3, 3, 4), _x(2, 3, 3, 4))),
]


class FusionFiresTest(parameterized.TestCase):

  @parameterized.named_parameters(*FIRES)
  def test_fires_and_matches_jit(self, op, fn, make):
    ops, graph = compile_and_check(self, fn, *make())
    self.assertIn(op, ops)
    node = next(n for n in graph.nodes if n.op == op)
    self.assertIsNone(node.prim)
    self.assertTrue(node.kernel.name.startswith("xla:"))
    self.assertTrue(node.notes)  # the decision is written on the IR
    self.assertIn(op, graph.dump())


class FusionRefusesTest(absltest.TestCase):

  def test_softmax_with_an_outside_reader_of_exp(self):
    def fn(x):
      e = jnp.exp(x - x.max(-1, keepdims=True))
      return e / e.sum(-1, keepdims=True), e
    ops, _ = compile_and_check(self, fn, _x(3, 5))
    self.assertNotIn("Softmax", ops)

  def test_softmax_over_mismatched_axes(self):
    fn = lambda x: jnp.exp(x - x.max(0, keepdims=True)) / jnp.exp(
        x - x.max(0, keepdims=True)).sum(1, keepdims=True)
    ops, _ = compile_and_check(self, fn, _x(4, 4))
    self.assertNotIn("Softmax", ops)

  def test_matmul_bias_when_the_product_has_another_reader(self):
    ops, _ = compile_and_check(self, lambda x, w, b: (x @ w + b, (x @ w).sum()),
                               _x(4, 8), _x(8, 3), _x(3))
    self.assertNotIn("MatMulBiasAdd", ops)

  def test_matmul_plus_full_matrix_is_not_a_bias(self):
    ops, _ = compile_and_check(self, lambda x, w, c: x @ w + c, _x(4, 8), _x(8, 3), _x(4, 3))
    self.assertNotIn("MatMulBiasAdd", ops)

  def test_gelu_with_other_constants(self):
    ops, _ = compile_and_check(self, lambda x: 0.5 * x * (1 + jnp.tanh(
        0.7 * (x + 0.044715 * x ** 3))), _x(6))
    self.assertNotIn("GeluTanh", ops)

  def test_two_adds_or_broadcasting_adds(self):
    ops, _ = compile_and_check(self, lambda a, b: a + b, _x(3), _x(3))
    self.assertNotIn("AddN", ops)
    ops, _ = compile_and_check(self, lambda a, b, s: a + b + s, _x(3), _x(3), _x())
    self.assertNotIn("AddN", ops)  # the scalar broadcasts: not a same-shape n-ary add

  def test_add_n_when_an_inner_sum_is_read_elsewhere(self):
    ops, _ = compile_and_check(self, lambda a, b, c: ((a + b) + c, a + b), _x(3), _x(3), _x(3))
    self.assertNotIn("AddN", ops)

  def test_layernorm_with_wrong_count(self):
    def fn(x):  # divides the sum by 7 while reducing 8 elements: not a mean
      mean = x.sum(-1, keepdims=True) / 7.0
      var = ((x - mean) ** 2).sum(-1, keepdims=True) / 7.0
      return (x - mean) * jax.lax.rsqrt(var + 1e-5)
    ops, _ = compile_and_check(self, fn, _x(3, 8))
    self.assertNotIn("LayerNorm", ops)

  def test_layernorm_on_integers_is_left_alone(self):
    x = jnp.asarray(RNG.integers(-5, 5, (3, 8)), jnp.int32)
    sess = js.Session()
    gid = sess.compile(lambda x: x - x.sum(-1, keepdims=True) // 8, x)
    self.assertNotIn("LayerNorm", [n.op for n in sess.graph(gid).nodes])

  def test_bn_relu_with_non_channel_operands(self):
    fn = lambda x, m: jax.nn.relu((x - m) * 0.5 + 1.0)
    ops, _ = compile_and_check(self, fn, _x(2, 3, 4), _x(2, 3, 4))
    self.assertNotIn("BatchNormRelu", ops)

  def test_adam_shaped_update_that_is_not_an_ema(self):
    def fn(p, m, v, g):
      m = 0.9 * m + 0.5 * g  # 0.9 + 0.5 != 1
      v = 0.999 * v + 0.001 * g * g
      return p - 0.01 * m / (jnp.sqrt(v) + 1e-8), m, v
    ops, _ = compile_and_check(self, fn, _x(4), _x(4), jnp.abs(_x(4)), _x(4))
    self.assertNotIn("Adam", ops)

  def test_disabled_fusion(self):
    sess = js.Session(js.SessionOptions(disabled_passes=["fuse_softmax"]))
    gid = sess.compile(lambda x: jax.nn.softmax(x), _x(3, 4))
    self.assertNotIn("Softmax", [n.op for n in sess.graph(gid).nodes])


class RealProgramsTest(absltest.TestCase):

  def _train(self, step, params, opt_state, data, steps=4):
    sess = js.Session()
    at = lambda i: jax.tree.map(lambda a: a[i], data)
    gid = sess.compile(step, params, opt_state, at(0), state_argnums=(0, 1))
    p, o = params, opt_state
    for i in range(steps):
      got = sess.run(gid, at(i))
      p, o, want = jax.jit(step)(p, o, at(i))
      np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(sess.get_state(gid)), jax.tree.leaves((p, o))):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    return [n.op for n in sess.graph(gid).nodes]

  def test_mlp_adam_has_one_fused_adam_per_parameter(self):
    params = mlp_adam.init_params(jax.random.key(1), (8, 16, 16, 1))
    data = mlp_adam.make_data(jax.random.key(2), 4, 16, 8)
    ops = self._train(mlp_adam.train_step, params, mlp_adam.adam_init(params), data)
    self.assertEqual(ops.count("Adam"), len(jax.tree.leaves(params)))

  def test_optax_adam_and_adamw(self):
    params = mlp_adam.init_params(jax.random.key(3), (8, 16, 1))
    data = mlp_adam.make_data(jax.random.key(4), 4, 16, 8)
    for opt in (optax.adam(1e-2), optax.adamw(1e-2, weight_decay=1e-2)):
      def step(p, st, batch, opt=opt):
        loss, grads = jax.value_and_grad(mlp_adam.loss_fn)(p, batch)
        updates, st = opt.update(grads, st, p)
        return optax.apply_updates(p, updates), st, loss
      ops = self._train(step, params, opt.init(params), data)
      self.assertEqual(ops.count("Adam"), len(jax.tree.leaves(params)))

  def test_transformer_block_fuses_layernorm_softmax_gelu(self):
    params = transformer_decode.init_params(jax.random.key(5))
    cache = transformer_decode.init_cache(params)
    sess = js.Session()
    gid = sess.compile(transformer_decode.decode_step, params, cache, jnp.array([1, 2]), 3)
    ops = [n.op for n in sess.graph(gid).nodes]
    layers = len(params["layers"])
    self.assertEqual(ops.count("LayerNorm"), 2 * layers)
    self.assertEqual(ops.count("Softmax"), layers)
    self.assertEqual(ops.count("GeluTanh"), layers)
    got = sess.run(gid, params, cache, jnp.array([3, 4]), 5)
    want = jax.jit(transformer_decode.decode_step)(params, cache, jnp.array([3, 4]), 5)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

  def test_cnn_inference_fuses_batchnorm_relu(self):
    params = cnn_bn.init_params(jax.random.key(6))
    images = _x(2, 8, 8, 3)
    ops, _ = compile_and_check(self, cnn_bn.infer, params, images)
    self.assertEqual(ops.count("BatchNormRelu"), len(params["blocks"]))
    frozen = lambda im: cnn_bn.infer(params, im)  # params as constants: folded first
    ops, _ = compile_and_check(self, frozen, images)
    self.assertEqual(ops.count("BatchNormRelu"), len(params["blocks"]))


if __name__ == "__main__":
  absltest.main()
