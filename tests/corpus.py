"""A corpus of JAX programs with fresh random inputs, shared by the tests.

Each case: (name, fn, make_args(rng) -> tuple of args). Inputs are random
(never all zeros or ones); each test draws them from its own seed.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def normal(rng, *shape, dtype=np.float32):
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def ints(rng, *shape, low=-50, high=50, dtype=np.int32):
  return jnp.asarray(rng.integers(low, high, size=shape).astype(dtype))


def bools(rng, *shape):
  return jnp.asarray(rng.random(shape) > 0.5)


def _layernorm(x, g, b):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + 1e-5) * g + b


def _mlp_loss(params, x, y):
  h = jax.nn.relu(x @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] - y) ** 2)


def _mlp_grad(params, x, y):
  return jax.value_and_grad(_mlp_loss)(params, x, y)


def _adam(p, g, m, v, t):
  m = 0.9 * m + 0.1 * g
  v = 0.999 * v + 0.001 * g * g
  mhat = m / (1 - 0.9 ** t)
  vhat = v / (1 - 0.999 ** t)
  return p - 1e-3 * mhat / (jnp.sqrt(vhat) + 1e-8), m, v


def _transformer_block(x, p):
  h = _layernorm(x, p["g1"], p["b1"])
  q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
  att = jax.nn.softmax(q @ k.T / jnp.sqrt(q.shape[-1]) + jnp.tril(
      jnp.zeros((x.shape[0], x.shape[0]))) - 1e9 * jnp.triu(
          jnp.ones((x.shape[0], x.shape[0])), 1), axis=-1)
  x = x + (att @ v) @ p["wo"]
  h = _layernorm(x, p["g2"], p["b2"])
  return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]


def _block_params(rng, d=16):
  return {"g1": 1 + 0.1 * normal(rng, d), "b1": normal(rng, d), "g2": 1 + 0.1 * normal(rng, d),
          "b2": normal(rng, d), "wq": normal(rng, d, d), "wk": normal(rng, d, d),
          "wv": normal(rng, d, d), "wo": normal(rng, d, d), "w1": normal(rng, d, 4 * d),
          "w2": normal(rng, 4 * d, d)}


@jax.custom_vjp
def _clip_grad_sin(x):
  return jnp.sin(x)


_clip_grad_sin.defvjp(lambda x: (jnp.sin(x), x),
                      lambda x, g: (jnp.clip(g * jnp.cos(x), -0.5, 0.5),))


_CONST = np.linspace(-1.0, 2.0, 12, dtype=np.float32).reshape(3, 4)


def _host_sin(x):
  return jax.pure_callback(lambda a: np.sin(a).astype(a.dtype),
                           jax.ShapeDtypeStruct(x.shape, x.dtype), x)


CASES = [
    ("broadcast_add", lambda x, y: x + y, lambda r: (normal(r, 3, 4), normal(r, 4))),
    ("weak_literals", lambda x: x * 2 + 1.5, lambda r: (normal(r, 5),)),
    ("weak_scalar_arg", lambda x, s: x * s - s, lambda r: (normal(r, 4), float(r.random() + 0.5))),
    ("int_arith", lambda x: x // 3 + x % 5 - x * 7, lambda r: (ints(r, 6),)),
    ("bool_logic", lambda x, y: ((x > 0) & (y < 0.5)) | ~(x > y),
     lambda r: (normal(r, 7), normal(r, 7))),
    ("reductions", lambda x: (x.sum(0), x.max(1), x.min(), x.mean(), jnp.prod(x[:2, :2])),
     lambda r: (normal(r, 4, 5),)),
    ("argmax_argmin", lambda x: (jnp.argmax(x, 1), jnp.argmin(x, 0)), lambda r: (normal(r, 4, 6),)),
    ("matmul", lambda a, b: a @ b, lambda r: (normal(r, 8, 16), normal(r, 16, 4))),
    ("batched_einsum", lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
     lambda r: (normal(r, 3, 4, 5), normal(r, 3, 5, 2))),
    ("conv2d", lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME"),
     lambda r: (normal(r, 2, 3, 8, 8), normal(r, 4, 3, 3, 3))),
    ("softmax", lambda x: jax.nn.softmax(x, axis=-1), lambda r: (normal(r, 4, 10),)),
    ("layernorm", _layernorm, lambda r: (normal(r, 4, 8), normal(r, 8), normal(r, 8))),
    ("gelu", lambda x: (jax.nn.gelu(x), jax.nn.gelu(x, approximate=False)),
     lambda r: (normal(r, 16),)),
    ("relu_custom_jvp", lambda x: jax.nn.relu(x) + jax.nn.relu6(x), lambda r: (normal(r, 9),)),
    ("scan", lambda x: lax.scan(lambda c, a: (c * 0.5 + a, c.sum()), jnp.zeros(3), x),
     lambda r: (normal(r, 6, 3),)),
    ("fori_loop", lambda x: lax.fori_loop(0, 5, lambda i, c: c * 1.1 + i, x),
     lambda r: (normal(r, 4),)),
    ("while_loop", lambda x: lax.while_loop(lambda c: c[0] < 10, lambda c: (c[0] + 1, c[1] * 0.9),
                                            (0, x)), lambda r: (normal(r, 3),)),
    ("cond", lambda p, x: lax.cond(p > 0, lambda v: v * 2, lambda v: -v, x),
     lambda r: (normal(r), normal(r, 3))),
    ("switch", lambda i, x: lax.switch(i, [jnp.sin, jnp.cos, jnp.tanh], x),
     lambda r: (jnp.int32(r.integers(0, 3)), normal(r, 4))),
    ("nested_jit", lambda x: jax.jit(lambda a: jax.jit(jnp.tanh)(a) * 2)(x) + 1,
     lambda r: (normal(r, 5),)),
    ("random_key_input", lambda k: (jax.random.normal(k, (3,)), jax.random.uniform(k, (2,))),
     lambda r: (jax.random.key(int(r.integers(1 << 30))),)),
    ("random_raw_key", lambda k: jax.random.bernoulli(k, 0.3, (8,)),
     lambda r: (jax.random.PRNGKey(int(r.integers(1 << 30))),)),
    ("at_set", lambda x, v: x.at[2].set(v), lambda r: (normal(r, 5, 3), normal(r, 3))),
    ("gather", lambda x, i: x[i], lambda r: (normal(r, 10, 2), ints(r, 4, low=0, high=10))),
    ("scatter_add", lambda x, i, v: x.at[i].add(v),
     lambda r: (normal(r, 6), ints(r, 4, low=0, high=6), normal(r, 4))),
    ("sort", lambda x: (jnp.sort(x), jnp.argsort(x)), lambda r: (normal(r, 12),)),
    ("top_k", lambda x: lax.top_k(x, 3), lambda r: (normal(r, 2, 9),)),
    ("cumsum", lambda x: (jnp.cumsum(x, 0), jnp.cumprod(x[:3], 1)), lambda r: (normal(r, 4, 3),)),
    ("float16", lambda x, y: (x * y + x).astype(jnp.float16),
     lambda r: (normal(r, 6, dtype=jnp.float16), normal(r, 6, dtype=jnp.float16))),
    ("bfloat16_matmul", lambda a, b: a @ b,
     lambda r: (normal(r, 4, 8, dtype=jnp.bfloat16), normal(r, 8, 3, dtype=jnp.bfloat16))),
    ("int8", lambda x, y: x + y * 2 - (x >> 1), lambda r: (ints(r, 6, low=-30, high=30,
                                                              dtype=np.int8),
                                                         ints(r, 6, low=-30, high=30,
                                                              dtype=np.int8))),
    ("scalars", lambda a, b: (a * b, a - b), lambda r: (normal(r), normal(r))),
    ("zero_size", lambda x, e: (e.sum(0), jnp.concatenate([x, e[:, :2]], 0)),
     lambda r: (normal(r, 2, 2), normal(r, 0, 3))),
    ("dict_pytrees", lambda d: {"sum": d["a"] + d["b"]["c"], "neg": -d["a"]},
     lambda r: ({"a": normal(r, 3), "b": {"c": normal(r, 3)}},)),
    ("tuple_none_pytrees", lambda t: {"s": t[0] + t[2], "n": None, "t": (t[0],)},
     lambda r: ((normal(r, 2), None, normal(r, 2)),)),
    ("mlp_forward_backward", _mlp_grad,
     lambda r: ({"w1": normal(r, 8, 16), "b1": normal(r, 16), "w2": normal(r, 16, 1)},
                normal(r, 32, 8), normal(r, 32, 1))),
    ("adam_update", _adam, lambda r: (normal(r, 10), normal(r, 10), normal(r, 10) * 0.1,
                                      jnp.abs(normal(r, 10)) * 0.01,
                                      jnp.float32(r.integers(1, 100)))),
    ("transformer_block", _transformer_block, lambda r: (normal(r, 6, 16), _block_params(r))),
    ("custom_vjp_grad", jax.grad(lambda x: _clip_grad_sin(x).sum()), lambda r: (normal(r, 5),)),
    ("remat_grad", jax.grad(lambda x: jax.checkpoint(lambda a: jnp.sin(a) ** 2)(x).sum()),
     lambda r: (normal(r, 5),)),
    ("shape_ops", lambda x: (x.reshape(6, 2).T, jnp.concatenate([x, x], 1)[:, 1:5:2],
                             jnp.flip(x, 0), jnp.pad(x, 1)), lambda r: (normal(r, 3, 4),)),
    ("where_clip", lambda x: jnp.where(x > 0, x, 0.1 * x) + jnp.clip(x, -0.5, 0.5),
     lambda r: (normal(r, 10),)),
    ("dynamic_slices", lambda x, i: (lax.dynamic_slice(x, (i, 0), (2, 3)),
                                     lax.dynamic_update_slice(x, jnp.ones((1, 3)) * 7, (i, 0))),
     lambda r: (normal(r, 5, 3), jnp.int32(r.integers(0, 4)))),
    ("transcendentals", lambda x: (jnp.exp(x), jnp.log1p(jnp.abs(x)), jnp.tanh(x), x ** 3,
                                   lax.integer_pow(x, 4)), lambda r: (normal(r, 8),)),
    ("vmap", jax.vmap(lambda a, b: jnp.dot(a, b)), lambda r: (normal(r, 5, 4), normal(r, 5, 4))),
    ("closure_const", lambda x: x @ _CONST.T + _CONST.sum(), lambda r: (normal(r, 2, 4),)),
    ("identity_and_literal", lambda x, y: (x, 3.0, y * 2), lambda r: (normal(r, 3), normal(r, 2))),
    ("host_callback", lambda x: _host_sin(x * 2) + 1, lambda r: (normal(r, 3, 4),)),
    ("partial_static_like", functools.partial(lambda s, x: x * s, 3.0), lambda r: (normal(r, 4),)),
    ("complex64", lambda z: z * jnp.conj(z) + 1j, lambda r: (
        (normal(r, 4) + 1j * normal(r, 4)).astype(jnp.complex64),)),
]
