"""An MLP regressor trained with a hand-written Adam, on synthetic data.

`train_step(params, opt_state, batch) -> (params, opt_state, loss)` is the
usual JAX training step; the session keeps params and opt_state on the device.
"""
import jax
import jax.numpy as jnp


def init_params(key, sizes=(32, 128, 128, 1)):
  params = []
  for k, (fan_in, fan_out) in zip(jax.random.split(key, len(sizes) - 1),
                                  zip(sizes[:-1], sizes[1:])):
    w = jax.random.normal(k, (fan_in, fan_out), jnp.float32) * jnp.sqrt(2.0 / fan_in)
    params.append({"w": w, "b": jnp.zeros((fan_out,), jnp.float32)})
  return params


def forward(params, x):
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, batch):
  pred = forward(params, batch["x"])
  return jnp.mean((pred - batch["y"]) ** 2)


def adam_init(params):
  zeros = jax.tree.map(jnp.zeros_like, params)
  return {"m": zeros, "v": jax.tree.map(jnp.zeros_like, params),
          "t": jnp.zeros((), jnp.int32)}


def adam_update(params, grads, opt_state, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8):
  t = opt_state["t"] + 1
  m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, opt_state["m"], grads)
  v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, opt_state["v"], grads)
  tf = t.astype(jnp.float32)
  scale = lr * jnp.sqrt(1 - b2 ** tf) / (1 - b1 ** tf)
  params = jax.tree.map(lambda p, m, v: p - scale * m / (jnp.sqrt(v) + eps), params, m, v)
  return params, {"m": m, "v": v, "t": t}


def train_step(params, opt_state, batch):
  loss, grads = jax.value_and_grad(loss_fn)(params, batch)
  params, opt_state = adam_update(params, grads, opt_state)
  return params, opt_state, loss


def eval_step(params, batch):
  return loss_fn(params, batch)


def make_data(key, num_batches, batch_size=128, dim=32):
  """A fixed random teacher network labels random inputs; stacked batches
  with a leading axis of `num_batches`."""
  k_teacher, k_x, k_noise = jax.random.split(key, 3)
  teacher = init_params(k_teacher, (dim, 64, 1))
  x = jax.random.normal(k_x, (num_batches, batch_size, dim), jnp.float32)
  y = jax.vmap(lambda xb: forward(teacher, xb))(x)
  y = y + 0.01 * jax.random.normal(k_noise, y.shape, jnp.float32)
  return {"x": x, "y": y}
