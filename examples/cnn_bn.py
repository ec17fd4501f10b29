"""A small CNN with BatchNorm+ReLU blocks, in inference form."""
import jax
import jax.numpy as jnp


def init_params(key, channels=(3, 8, 16), classes=10):
  keys = iter(jax.random.split(key, 4 * len(channels)))
  blocks = []
  for c_in, c_out in zip(channels[:-1], channels[1:]):
    blocks.append({
        "w": jax.random.normal(next(keys), (3, 3, c_in, c_out)) * (9 * c_in) ** -0.5,
        "gamma": 1.0 + 0.1 * jax.random.normal(next(keys), (c_out,)),
        "beta": 0.1 * jax.random.normal(next(keys), (c_out,)),
        "mean": 0.1 * jax.random.normal(next(keys), (c_out,)),
        "var": jnp.ones((c_out,)) * 0.9})
  head = jax.random.normal(next(keys), (channels[-1], classes)) * channels[-1] ** -0.5
  return {"blocks": blocks, "head": head}


def conv_bn_relu(block, x, eps=1e-5):
  y = jax.lax.conv_general_dilated(x, block["w"], (1, 1), "SAME",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
  y = (y - block["mean"]) * jax.lax.rsqrt(block["var"] + eps) * block["gamma"] + block["beta"]
  return jax.nn.relu(y)


def infer(params, images):
  x = images
  for block in params["blocks"]:
    x = conv_bn_relu(block, x)
  return x.mean(axis=(1, 2)) @ params["head"]
