"""A small transformer decoder run token by token with a KV cache.

`decode_step(params, cache, token, pos) -> (cache, logits)`: the session keeps
the cache on the device as state and updates it in place (donation).
"""
import jax
import jax.numpy as jnp


def init_params(key, vocab=64, dim=32, heads=4, layers=2, max_len=32):
  keys = iter(jax.random.split(key, 4 + 6 * layers))
  normal = lambda shape, scale: jax.random.normal(next(keys), shape, jnp.float32) * scale
  params = {"embed": normal((vocab, dim), 0.5), "pos": normal((max_len, dim), 0.1),
            "out": normal((dim, vocab), dim ** -0.5), "layers": []}
  for _ in range(layers):
    params["layers"].append({
        "ln1": jnp.ones((dim,)), "ln2": jnp.ones((dim,)),
        "wq": normal((dim, dim), dim ** -0.5), "wk": normal((dim, dim), dim ** -0.5),
        "wv": normal((dim, dim), dim ** -0.5), "wo": normal((dim, dim), dim ** -0.5),
        "w1": normal((dim, 4 * dim), dim ** -0.5),
        "w2": normal((4 * dim, dim), (4 * dim) ** -0.5)})
  return params


def layer_norm(x, scale, eps=1e-5):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * scale


def init_cache(params, batch=2, heads=4, max_len=32):
  dim = params["embed"].shape[1]
  shape = (batch, max_len, heads, dim // heads)
  return [{"k": jnp.zeros(shape), "v": jnp.zeros(shape)} for _ in params["layers"]]


def block(layer, x, cache, pos, heads):
  """One pre-norm block for the token at `pos`; writes its K/V into the cache."""
  b, dim = x.shape
  h = layer_norm(x, layer["ln1"])
  q = (h @ layer["wq"]).reshape(b, heads, -1)
  k = (h @ layer["wk"]).reshape(b, heads, -1)
  v = (h @ layer["wv"]).reshape(b, heads, -1)
  ck = jax.lax.dynamic_update_slice(cache["k"], k[:, None], (0, pos, 0, 0))
  cv = jax.lax.dynamic_update_slice(cache["v"], v[:, None], (0, pos, 0, 0))
  scores = jnp.einsum("bhd,bthd->bht", q, ck) / jnp.sqrt(q.shape[-1])
  mask = jnp.arange(ck.shape[1]) <= pos
  scores = jnp.where(mask[None, None], scores, -1e9)
  attn = jnp.einsum("bht,bthd->bhd", jax.nn.softmax(scores, axis=-1), cv)
  x = x + attn.reshape(b, dim) @ layer["wo"]
  x = x + jax.nn.gelu(layer_norm(x, layer["ln2"]) @ layer["w1"]) @ layer["w2"]
  return x, {"k": ck, "v": cv}


def decode_step(params, cache, token, pos, heads=4):
  x = params["embed"][token] + params["pos"][pos]
  new_cache = []
  for layer, c in zip(params["layers"], cache):
    x, c = block(layer, x, c, pos, heads)
    new_cache.append(c)
  return new_cache, x @ params["out"]


def resident_decode_step(params, cache, token, pos):
  """decode_step for a session that keeps both params and cache on the device
  (state_argnums=(0, 1)): params come back unchanged, which the session sees
  and keeps without a copy or a donation."""
  cache, logits = decode_step(params, cache, token, pos)
  return params, cache, logits
