"""Pallas kernels: on the CPU in interpret mode they equal their XLA twins;
SelectKernel takes them only on GPU and only for shapes they can tile."""
from absl.testing import absltest, parameterized
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jaxsession.examples import mlp_adam
from jaxsession.kernels import fused, pallas, registry

RNG = np.random.default_rng(44)


def _x(*shape):
  return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


def _ln(x, g, b):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * g + b


def _rms(x, g):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def _fused_node(fn, args, op):
  sess = js.Session()
  gid = sess.compile(fn, *args)
  graph = sess.graph(gid)
  return next(n for n in graph.nodes if n.op == op), graph


CASES = [
    ("softmax", "Softmax", lambda x: jax.nn.softmax(x, -1), lambda: (_x(16, 64),)),
    ("softmax_3d_odd_rows", "Softmax", lambda x: jax.nn.softmax(x, -1), lambda: (_x(3, 5, 32),)),
    ("layernorm", "LayerNorm", _ln, lambda: (_x(24, 128), _x(128), _x(128))),
    ("rmsnorm", "RMSNorm", _rms, lambda: (_x(8, 256), _x(256))),
]


class InterpretTest(parameterized.TestCase):

  @parameterized.named_parameters(*CASES)
  def test_equals_xla_kernel(self, op, fn, make):
    args = make()
    node, _ = _fused_node(fn, args, op)
    inputs = list(args) if op != "Softmax" else [args[0]]
    want = registry.select_kernel(node, "cpu").fn(node, *inputs)
    got = jax.jit(lambda *a: pallas.INTERPRETED[op](node, *a))(*inputs)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    self.assertIsNone(pallas.rows_fit(node))

  def test_adam_equals_xla_kernel(self):
    params = mlp_adam.init_params(jax.random.key(0), (32, 64, 1))
    opt = mlp_adam.adam_init(params)
    batch = jax.tree.map(lambda a: a[0], mlp_adam.make_data(jax.random.key(1), 1, 8, 32))
    sess = js.Session()
    gid = sess.compile(mlp_adam.train_step, params, opt, batch, state_argnums=(0, 1))
    node = next(n for n in sess.graph(gid).nodes
                if n.op == "Adam" and n.inputs[0].aval.shape == (32, 64))
    p, g, m, v = _x(32, 64), _x(32, 64), _x(32, 64), jnp.abs(_x(32, 64))
    step = jnp.float32(0.003)
    want = fused.adam_math(node.params, p, g, m, v, [step])
    got = jax.jit(lambda *a: pallas.INTERPRETED["Adam"](node, *a))(p, g, m, v, step)
    for a, b in zip(got, want):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


class SelectionTest(absltest.TestCase):

  def test_pallas_only_on_gpu(self):
    node, _ = _fused_node(lambda x: jax.nn.softmax(x, -1), (_x(8, 64),), "Softmax")
    self.assertEqual(registry.select_kernel(node, "gpu", backends=("xla", "pallas")).name,
                     "pallas:softmax")
    self.assertEqual(registry.select_kernel(node, "cpu", backends=("xla", "pallas")).name,
                     "xla:softmax")

  def test_untileable_shapes_fall_back_to_xla(self):
    node, _ = _fused_node(lambda x: jax.nn.softmax(x, -1), (_x(8, 33),), "Softmax")
    self.assertIn("not a power of two", pallas.rows_fit(node))
    self.assertEqual(registry.select_kernel(node, "gpu", backends=("xla", "pallas")).name,
                     "xla:softmax")
    node, _ = _fused_node(lambda x: jax.nn.softmax(x, 0), (_x(8, 32),), "Softmax")
    self.assertIn("not just the last axis", pallas.rows_fit(node))


if __name__ == "__main__":
  absltest.main()
