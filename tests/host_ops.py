"""Small host-op helpers shared by the placement, memory and stream tests."""
import jax
import jax.numpy as jnp
import numpy as np

RNG = np.random.default_rng(2024)


def _f32(*shape):
  return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


def _cb(fn, *xs, like=None):
  """pure_callback of `fn` whose result has the shape and dtype of `like`
  (default: the first argument)."""
  like = xs[0] if like is None else like
  return jax.pure_callback(fn, jax.ShapeDtypeStruct(like.shape, like.dtype), *xs)


def _host_affine(a):
  return (np.asarray(a) * np.float32(0.5) - np.float32(1.25)).astype(np.float32)
