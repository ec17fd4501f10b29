"""XLA kernels of the fused ops that the fusion passes create. Each is the
same arithmetic as the subgraph it replaces, so results stay equal to jax.jit."""
import functools

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from jaxsession.kernels.registry import register_kernel


@register_kernel("Softmax", backend="xla", name="xla:softmax")
def softmax(node, x):
  axes = node.params["axes"]
  e = jnp.exp(x - lax.stop_gradient(jnp.max(x, axis=axes, keepdims=True)))
  return [e / jnp.sum(e, axis=axes, keepdims=True)]


@register_kernel("GeluTanh", backend="xla", name="xla:gelu_tanh")
def gelu_tanh(node, x):
  return [jax.nn.gelu(x, approximate=True)]


@register_kernel("MatMulBiasAdd", backend="xla", name="xla:matmul_bias_add")
def matmul_bias_add(node, a, w, bias):
  p = node.params
  y = lax.dot_general(a, w, p["dimension_numbers"], p.get("precision"),
                      preferred_element_type=p.get("preferred_element_type"))
  return [y + bias.reshape((1,) * (y.ndim - 1) + bias.shape)]


@register_kernel("AddN", backend="xla", name="xla:add_n")
def add_n(node, *xs):
  return [functools.reduce(lax.add, xs)]  # the order the user's adds had


def _normalise(x, centered, var, p):
  """centered * rsqrt(var + eps), or centered / sqrt(var + eps), as the user wrote it."""
  if p["inverse"] == "div_sqrt":
    return centered / jnp.sqrt(var + p["eps"])
  return centered * lax.rsqrt(var + p["eps"])


def _affine(y, p, rest):
  rest = list(rest)
  if p["scale"]:
    y = y * rest.pop(0)
  if p.get("bias"):
    y = y + rest.pop(0)
  return y


@register_kernel("LayerNorm", backend="xla", name="xla:layer_norm")
def layer_norm(node, x, *scale_bias):
  p = node.params
  axes = p["axes"]
  n = np.prod([x.shape[a] for a in axes]).astype(x.dtype)
  mean = jnp.sum(x, axis=axes, keepdims=True) / n
  centered = x - mean
  if p["variance"] == "two_pass":
    var = jnp.sum(centered * centered, axis=axes, keepdims=True) / n
  else:
    var = jnp.sum(x * x, axis=axes, keepdims=True) / n - mean * mean
    if p["variance"] == "fast_clamped":
      var = jnp.maximum(var, 0)
  return [_affine(_normalise(x, centered, var, p), p, scale_bias)]


@register_kernel("RMSNorm", backend="xla", name="xla:rms_norm")
def rms_norm(node, x, *scale):
  p = node.params
  axes = p["axes"]
  n = np.prod([x.shape[a] for a in axes]).astype(x.dtype)
  ms = jnp.sum(x * x, axis=axes, keepdims=True) / n
  return [_affine(_normalise(x, x, ms, p), p, scale)]
