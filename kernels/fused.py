"""XLA kernels of the fused ops that the fusion passes create. Each is the
same arithmetic as the subgraph it replaces, so results stay equal to jax.jit."""
import functools

import jax
import jax.numpy as jnp
from jax import lax

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
