"""Packed small state (runtime/packing.py, its write-backs fused horizontally
by runtime/horizontal.py) against plain jax.jit, one run.

Prints µs per step and ratios (medians of per-repeat ratios):
  * a step over 200 tiny leaves, Session / jax.jit with donation  (target <= 0.3x),
    and / jax.jit of the same leaves stacked by hand into one array (no target)
  * a flax transformer + optax AdamW at batch 1, the same          (target <= 0.6x)
  * a compute-bound MLP + Adam, packing on / packing off           (target <= 1.02x)
  * 50 leaves of each size in --leaf_bytes, packed / not packed: where
    packing stops paying is what pack_state_below_bytes's default is chosen by.

    python benchmarks/state.py [--state_repeats 9]

flax and optax are benchmark dependencies only (the session needs neither).
"""
import sys

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import common  # noqa: E402
import jaxsession as js  # noqa: E402

flags.DEFINE_integer("state_repeats", 9, "interleaved repeats; medians are reported")
flags.DEFINE_integer("state_calls", 300, "steps per repeat")
flags.DEFINE_integer("pack_below", 1 << 14, "pack_state_below_bytes of the session rows "
                     "(the option is off by default: docs/numerics.md)")
flags.DEFINE_list("leaf_bytes", ["256", "4096", "16384", "65536", "262144"],
                  "leaf sizes of the packing sweep")
FLAGS = flags.FLAGS


def tiny_leaves_step(params, x):
  """200 leaves, each f32[16], nudged towards x: dispatch, not arithmetic."""
  new = jax.tree.map(lambda p: p * 0.99 + 0.01 * x, params)
  return new, new["l0"][0]


def tiny_leaves():
  rng = np.random.default_rng(0)
  params = {f"l{i}": jnp.asarray(rng.standard_normal(16), jnp.float32) for i in range(200)}
  return tiny_leaves_step, (params,), (jnp.asarray(rng.standard_normal(16), jnp.float32),)


def sized_leaves(elements):
  rng = np.random.default_rng(3)
  params = {f"l{i}": jnp.asarray(rng.standard_normal(elements), jnp.float32)
            for i in range(50)}
  x = jnp.asarray(rng.standard_normal(elements), jnp.float32)

  def step(params, x):
    new = jax.tree.map(lambda p: p * 0.99 + 0.01 * x, params)
    return new, new["l0"][0]
  return step, (params,), (x,)


def transformer(optimizer="adamw"):
  """A 2-layer flax transformer (d=64, 4 heads, MLP 256) with AdamW (or
  `optimizer`, an optax name) at batch 1."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.LayerNorm()(x)
      x = x + nn.SelfAttention(num_heads=4, qkv_features=64)(h)
      h = nn.LayerNorm()(x)
      return x + nn.Dense(64)(nn.gelu(nn.Dense(256)(h)))

  class Model(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      x = nn.Embed(128, 64)(tokens)
      x = x + self.param("pos", nn.initializers.normal(0.02), (16, 64))[:x.shape[1]]
      for _ in range(2):
        x = Block()(x)
      return nn.Dense(128)(nn.LayerNorm()(x))

  model, tx = Model(), getattr(optax, optimizer)(1e-3)
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, 128, (1, 16)), jnp.int32)
  params = model.init(jax.random.key(0), tokens)
  opt_state = tx.init(params)

  def step(params, opt_state, tokens):
    def loss_fn(p):
      logits = model.apply(p, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step, (params, opt_state), (tokens,)


def mlp():
  """A compute-bound 12-layer 512-wide MLP with Adam at batch 256."""
  import optax  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(2)
  params = [(jnp.asarray(rng.standard_normal((512, 512)) / 23, jnp.float32),
             jnp.asarray(rng.standard_normal(512) * 0.1, jnp.float32)) for _ in range(12)]
  tx = optax.adam(1e-3)
  x = jnp.asarray(rng.standard_normal((256, 512)), jnp.float32)

  def step(params, opt_state, x):
    def loss_fn(p):
      h = x
      for w, b in p:
        h = jnp.tanh(h @ w + b)
      return jnp.mean(h * h)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step, (params, tx.init(params)), (x,)


def jit_runner(step, state, args):
  """jax.jit with the state donated, threaded through by hand."""
  n = len(state)
  jitted = jax.jit(step, donate_argnums=tuple(range(n)))
  holder = [jax.tree.map(lambda a: a.copy(), state)]

  def call():
    *new, out = jitted(*holder[0], *args)
    holder[0] = new
    return out
  return call


def session_runner(step, state, args, **options):
  sess = js.Session(js.SessionOptions(**options))
  gid = sess.compile(step, *state, *args, state_argnums=tuple(range(len(state))))
  report = sess.report(gid)
  packed = sum(1 for _, p, _ in report.memory.packing if p)
  buffers = sum(report.memory.state_buffers)
  # packed buffers updated by whole-buffer ops (runtime/horizontal.py) / written back
  merged = sum("whole buffer" in line for line in report.memory.horizontal)
  return ((lambda: sess.run(gid, *args)), packed, buffers, len(report.memory.packing),
          f"{merged} / {len(report.memory.horizontal)}")


def ratio_row(name, a, b, calls, repeats, target=None, labels=("jax.jit + donation", "Session")):
  samples = []
  t_a, t_b = common.compare_us([a, b], calls, repeats, warmup=30, samples_out=samples)
  ratio = common.paired_ratio(samples[1], samples[0])
  met = "-" if target is None else ("yes" if ratio <= target else "NO")
  return (name, f"{t_a:.1f}", f"{t_b:.1f}", f"{ratio:.2f}x",
          "-" if target is None else f"<= {target}x", met)


def main(argv):
  del argv
  r, n = FLAGS.state_repeats, FLAGS.state_calls
  print(f"machine: {common.machine()}")
  rows, leaf_rows = [], []
  for name, make, target, n_calls in (("200 tiny leaves", tiny_leaves, 0.3, n * 4),
                                      ("flax transformer + AdamW, batch 1", transformer, 0.6,
                                       n)):
    step, state, args = make()
    run, packed, buffers, leaves, merged = session_runner(
        step, state, args, pack_state_below_bytes=FLAGS.pack_below)
    rows.append(ratio_row(f"{name}, Session / jax.jit + donation", jit_runner(step, state, args),
                          run, n_calls, r, target))
    leaf_rows.append((name, leaves, packed, buffers, merged))
    if make is tiny_leaves:  # the same layout by hand: the leaves stacked into one array
      stacked = (jnp.stack([state[0][f"l{i}"] for i in range(200)]),)
      by_hand = lambda p, x: (p * 0.99 + 0.01 * x, (p * 0.99 + 0.01 * x)[0, 0])  # noqa: E731
      rows.append(ratio_row(f"{name}, Session / jax.jit + donation of the leaves stacked by "
                            "hand into one f32[200, 16]", jit_runner(by_hand, stacked, args),
                            run, n_calls, r))
  step, state, args = mlp()
  on, packed, buffers, leaves, merged = session_runner(step, state, args,
                                                       pack_state_below_bytes=FLAGS.pack_below)
  off, *_ = session_runner(step, state, args, pack_state_below_bytes=0)
  rows.append(ratio_row("compute-bound MLP + Adam, packing on / off", off, on, max(n // 10, 20),
                        r, 1.02))
  leaf_rows.append(("compute-bound MLP + Adam", leaves, packed, buffers, merged))
  common.print_table(f"packed small state (pack_state_below_bytes={FLAGS.pack_below}): µs per "
                     "step, medians; ratio: median of per-repeat ratios", rows, ["case", "jax.jit (or: off)", "Session (or: on)",
                                      "ratio", "target", "met"])
  common.print_table("state leaves and the buffers the session passes", leaf_rows,
                     ["case", "state leaves", "packed", "buffers passed",
                      "buffers updated by whole-buffer ops / written back"])
  # What bounds the transformer row: its forward and backward alone, under
  # jax.jit with SGD (an update of one multiply-add per leaf), against AdamW's
  adamw, sgd = (jit_runner(*transformer(name)) for name in ("adamw", "sgd"))
  common.print_table("the transformer's floor: jax.jit + donation, µs per step, medians",
                     [ratio_row("flax transformer, SGD / AdamW", adamw, sgd, n, r)],
                     ["case", "AdamW", "SGD", "ratio", "target", "met"])

  sweep = []
  for size in map(int, FLAGS.leaf_bytes):
    step, state, args = sized_leaves(size // 4)
    off = session_runner(step, state, args, pack_state_below_bytes=0)[0]
    on = session_runner(step, state, args, pack_state_below_bytes=size + 1)[0]
    samples = []
    t_off, t_on = common.compare_us([off, on], n, r, warmup=30, samples_out=samples)
    sweep.append((size, f"{t_off:.1f}", f"{t_on:.1f}",
                  f"{common.paired_ratio(samples[1], samples[0]):.2f}x"))
  common.print_table("50 f32 leaves of one size, elementwise step: packed / own buffers "
                     "(µs per step, medians)", sweep,
                     ["leaf bytes", "own buffers", "packed", "ratio"])


if __name__ == "__main__":
  app.run(main)
