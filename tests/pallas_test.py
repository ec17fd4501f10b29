"""Pallas kernels: on the CPU in interpret mode they equal their XLA twins bit
for bit at these shapes (the same `*_math` functions on row blocks; with many
more rows XLA:CPU reduces the twin's input in another order, kernels/pallas.py);
SelectKernel takes them only on GPU and only for shapes they can tile. On a
GPU, Triton reduces a row in its own order, which this CPU suite cannot
check: see kernels/pallas.py."""
from absl.testing import absltest, parameterized
import pytest
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jaxsession.examples import mlp_adam
from jaxsession.kernels import fused, pallas, registry
from exact import assert_same_bits, with_specials

RNG = np.random.default_rng(44)


def _x(*shape):
  return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


def _ln(x, g, b):  # by hand: the scale multiplies the normalised value
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * g + b


def _rms(x, g):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


_flax_ln = nn.LayerNorm()


def _fused_node(fn, args, op):
  sess = js.Session()
  gid = sess.compile(fn, *args)
  graph = sess.graph(gid)
  return next(n for n in graph.nodes if n.op == op), graph


CASES = [  # (name, op, fn, example args, the fused node's inputs from those args)
    ("softmax", "Softmax", lambda x: jax.nn.softmax(x, -1), lambda: (_x(16, 64),),
     lambda x: [x]),
    ("softmax_3d_odd_rows", "Softmax", lambda x: jax.nn.softmax(x, -1),
     lambda: (_x(3, 5, 32),), lambda x: [x]),
    ("layernorm", "LayerNorm", _ln, lambda: (_x(24, 128), _x(128), _x(128)),
     lambda x, g, b: [x, g, b]),
    ("layernorm_flax", "LayerNorm", lambda v, x: _flax_ln.apply(v, x),
     lambda: (_flax_ln.init(jax.random.key(0), _x(8, 64)), _x(8, 64)),
     lambda v, x: [x, v["params"]["scale"], v["params"]["bias"]]),
    ("rmsnorm", "RMSNorm", _rms, lambda: (_x(8, 256), _x(256)), lambda x, g: [x, g]),
]


class InterpretTest(parameterized.TestCase):

  @parameterized.named_parameters(*CASES)
  def test_equals_xla_kernel(self, op, fn, make, inputs_of):
    args = make()
    node, _ = _fused_node(fn, args, op)
    inputs = inputs_of(*args)
    inputs[0] = with_specials(inputs[0])
    want = jax.jit(lambda *a: registry.select_kernel(node, "cpu").fn(node, *a))(*inputs)
    got = jax.jit(lambda *a: pallas.INTERPRETED[op](node, *a))(*inputs)
    assert_same_bits(got, want, f"pallas {op} (interpreted) vs its XLA twin")
    self.assertIsNone(pallas.rows_fit(node))

  @pytest.mark.slow
  def test_adam_equals_xla_kernel(self):
    params = mlp_adam.init_params(jax.random.key(0), (32, 64, 1))
    opt = mlp_adam.adam_init(params)
    batch = jax.tree.map(lambda a: a[0], mlp_adam.make_data(jax.random.key(1), 1, 8, 32))
    sess = js.Session()
    gid = sess.compile(mlp_adam.train_step, params, opt, batch, state_argnums=(0, 1))
    node = next(n for n in sess.graph(gid).nodes
                if n.op == "Adam" and n.inputs[0].aval.shape == (32, 64))
    p, g, m, v = with_specials(_x(32, 64)), _x(32, 64), _x(32, 64), jnp.abs(_x(32, 64))
    step = jnp.float32(0.003)
    want = jax.jit(lambda *a: fused.adam_math(node.params, *a[:4], a[4:]))(p, g, m, v, step)
    got = jax.jit(lambda *a: pallas.INTERPRETED["Adam"](node, *a))(p, g, m, v, step)
    assert_same_bits(tuple(got[1:]), tuple(want[1:]), "new moments")
    # Not bit-identical on CPU: interpreted, the block body is compiled inside a
    # loop, and XLA's fusion there recomputes m_new for the parameter update and
    # contracts the other product of b1*m + (1-b1)*g into the multiply-add. So
    # u = step*m_new/(sqrt(v_new)+eps) can round one ulp apart, and p_new is
    # within 2*(ulp(u) + ulp(p_new)) (seen: 1.996 over 60 random draws).
    p_new, m_new, v_new = (np.asarray(a, np.float64) for a in want)
    u = np.float32(step) * m_new / (np.sqrt(v_new) + 1e-8)
    bound = 2 * (np.spacing(np.abs(u).astype(np.float32)) +
                 np.spacing(np.abs(p_new).astype(np.float32)))
    finite = np.isfinite(p_new)
    got_p = np.asarray(got[0], np.float64)
    np.testing.assert_array_equal(np.isfinite(got_p), finite)
    self.assertTrue(np.all(np.abs(got_p[finite] - p_new[finite]) <= bound[finite]))


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
