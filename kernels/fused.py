"""XLA kernels of the fused ops that the fusion passes create. Each is the
same arithmetic as the subgraph it replaces, so results stay equal to jax.jit.

The arithmetic lives in `*_math` functions over plain arrays, which the Pallas
kernels (kernels/pallas.py) run on their blocks too: one formula, two kernels."""
import functools

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from jaxsession.kernels.registry import register_kernel


def softmax_math(x, axes):
  e = jnp.exp(x - lax.stop_gradient(jnp.max(x, axis=axes, keepdims=True)))
  return e / jnp.sum(e, axis=axes, keepdims=True)


@register_kernel("Softmax", backend="xla", name="xla:softmax")
def softmax(node, x):
  return [softmax_math(x, node.params["axes"])]


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


def layer_norm_math(x, p, axes, scale_bias):
  n = np.prod([x.shape[a] for a in axes]).astype(x.dtype)
  mean = jnp.sum(x, axis=axes, keepdims=True) / n
  centered = x - mean
  if p["variance"] == "two_pass":
    var = jnp.sum(centered * centered, axis=axes, keepdims=True) / n
  else:
    var = jnp.sum(x * x, axis=axes, keepdims=True) / n - mean * mean
    if p["variance"] == "fast_clamped":
      var = jnp.maximum(var, 0)
  return _affine(_normalise(x, centered, var, p), p, scale_bias)


@register_kernel("LayerNorm", backend="xla", name="xla:layer_norm")
def layer_norm(node, x, *scale_bias):
  return [layer_norm_math(x, node.params, node.params["axes"], scale_bias)]


def rms_norm_math(x, p, axes, scale):
  n = np.prod([x.shape[a] for a in axes]).astype(x.dtype)
  ms = jnp.sum(x * x, axis=axes, keepdims=True) / n
  return _affine(_normalise(x, x, ms, p), p, scale)


@register_kernel("RMSNorm", backend="xla", name="xla:rms_norm")
def rms_norm(node, x, *scale):
  return [rms_norm_math(x, node.params, node.params["axes"], scale)]


def _batch_norm(p, x, mean, inv, *rest):
  """The user's own BatchNorm arithmetic, on operands already at x's rank."""
  if p["form"] == "scale_after":
    gamma, beta = rest[:2]
    return (x - mean) * inv * gamma + beta, rest[2:]
  if p["form"] == "scale_folded":
    gamma, beta = rest[:2]
    return (x - mean) * (inv * gamma) + beta, rest[2:]
  return (x - mean) * inv + rest[0], rest[1:]


@register_kernel("BatchNormRelu", backend="xla", name="xla:batch_norm_relu")
def batch_norm_relu(node, x, *operands):
  y, _ = _batch_norm(node.params, x, *operands)
  return [jnp.maximum(y, 0)]


@register_kernel("BatchNormAddRelu", backend="xla", name="xla:batch_norm_add_relu")
def batch_norm_add_relu(node, x, *operands):
  y, (residual,) = _batch_norm(node.params, x, *operands)
  return [jnp.maximum(y + residual, 0)]


@register_kernel("Adam", backend="xla", name="xla:adam")
def adam(node, p, g, m, v, *scalars):
  return list(adam_math(node.params, p, g, m, v, scalars))


def adam_math(k, p, g, m, v, scalars):
  """One parameter's Adam/AdamW step, in the arithmetic order of the form
  it was fused from; returns (new param, new m, new v)."""
  lit = lambda name: jnp.asarray(k[name], p.dtype)
  m_new = lit("b1") * m + lit("c1") * g
  if k["v_form"] == "c2_g2":
    v_new = lit("b2") * v + lit("c2") * (g * g)
  else:
    v_new = lit("b2") * v + lit("c2") * g * g
  if k["form"] == "scaled_step":
    (step,) = scalars
    return p - step * m_new / (jnp.sqrt(v_new) + lit("eps")), m_new, v_new
  bc1, bc2 = scalars
  u = (m_new / bc1) / (jnp.sqrt(v_new / bc2) + lit("eps"))
  if k["form"] == "optax_adamw":
    u = u + lit("wd") * p
  return p + lit("neg_lr") * u, m_new, v_new
