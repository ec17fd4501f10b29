"""Greedy decoding, 32 tokens: one loop-sunk Session run (`steps=32`: the
cache, the token and the position stay on the device as state) vs the usual
per-token `jax.jit` loop that reads each token back on the host to feed the
next step. Both produce the same tokens. Then the cache reset by
`replace_state` against a `lax.scan` decode under `jax.jit`
(`reset_by_replace_state_row`, issue 17's row)."""
import functools
import sys

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import common  # noqa: E402  (benchmarks/common.py)

import jaxsession as js  # noqa: E402
from jaxsession.cli import demo_models  # noqa: E402
from jaxsession.examples import transformer_decode as td  # noqa: E402

flags.DEFINE_integer("decode_tokens", 32, "tokens per decode (the cache holds 32)")
flags.DEFINE_integer("decode_calls", 20, "decodes per repeat")
flags.DEFINE_integer("decode_repeats", 7, "interleaved repeats (medians reported)")
FLAGS = flags.FLAGS


def reset_by_replace_state_row(calls, repeats, together=True):
  """32 greedy tokens per request with the KV cache, token and position
  reset by `replace_state` (the parameters stay), one sunk run (`steps=32`),
  against a `lax.scan` decode loop under `jax.jit` given the same parameters
  and initial cache: a table row, tokens/s (target >= 1.0x). `together`:
  the three state args replaced by one call (one copy dispatch), else one
  call each. Also benchmarks/workflows.py's decode row."""
  params = td.init_params(jax.random.key(0))
  cache0 = td.init_cache(params)
  token0, pos0 = jnp.array([3, 7], jnp.int32), jnp.int32(0)
  sess = js.Session()
  gid = sess.compile(demo_models.greedy_step, params, cache0, token0, pos0,
                     state_argnums=(0, 1, 2, 3))

  def session_decode():
    if together:  # the parameters stay: no copy of them
      sess.replace_state(gid, (1, 2, 3), (cache0, token0, pos0))
    else:
      sess.replace_state(gid, 1, cache0)
      sess.replace_state(gid, 2, token0)
      sess.replace_state(gid, 3, pos0)
    return sess.run(gid, steps=32)

  @jax.jit
  def scan_decode(params, cache, token):
    def body(carry, t):
      cache, token = carry
      cache, logits = td.decode_step(params, cache, token, t)
      nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
      return (cache, nxt), nxt
    return jax.lax.scan(body, (cache, token), jnp.arange(32, dtype=jnp.int32))[1]

  def jit_decode():
    return scan_decode(params, cache0, token0)

  np.testing.assert_array_equal(np.asarray(session_decode()), np.asarray(jit_decode()))
  samples = []
  sess_us, jit_us = common.compare_us([session_decode, jit_decode], calls, repeats,
                                      warmup=3, samples_out=samples)
  speed = common.paired_ratio(samples[1], samples[0])  # jit time / session time
  how = "one replace_state call" if together else "three replace_state calls"
  return (f"decode 32 tokens, cache reset by {how}: tokens/s vs lax.scan "
          "under jax.jit", f"{32 / jit_us * 1e6:.0f}", f"{32 / sess_us * 1e6:.0f}",
          f"{speed:.2f}x", ">= 1.0x", "yes" if speed >= 1.0 else "no")


def main(argv):
  del argv
  params = td.init_params(jax.random.key(0))
  cache0 = td.init_cache(params)
  token0, pos0 = jnp.array([3, 7], jnp.int32), jnp.int32(0)
  steps = FLAGS.decode_tokens

  sess = js.Session()
  gid = sess.compile(demo_models.greedy_step, params, cache0, token0, pos0,
                     state_argnums=(0, 1, 2, 3))

  def session_decode():
    sess.set_state(gid, params, cache0, token0, pos0)
    return sess.run(gid, steps=steps)

  jitted = jax.jit(td.decode_step)

  def jit_decode():
    return demo_models.jit_decode(jitted, params, cache0, token0, steps)

  # the per-token loop kept on the device: argmax inside the jitted step, the
  # token never read back, the cache donated (copied once per request, as
  # set_state copies it), positions made once
  @functools.partial(jax.jit, donate_argnums=1)
  def token_step(params, cache, token, pos):
    cache, logits = td.decode_step(params, cache, token, pos)
    return cache, jnp.argmax(logits, axis=-1).astype(jnp.int32)
  copy_cache = jax.jit(lambda c: jax.tree.map(jnp.copy, c))
  positions = [jnp.int32(t) for t in range(steps)]

  def device_decode():
    cache, token, out = copy_cache(cache0), token0, []
    for pos in positions:
      cache, token = token_step(params, cache, token, pos)
      out.append(token)
    return jnp.stack(out)

  np.testing.assert_array_equal(np.asarray(session_decode()), jit_decode())
  np.testing.assert_array_equal(np.asarray(device_decode()), jit_decode())
  samples = []
  sess_us, jit_us, dev_us = common.compare_us(
      [session_decode, jit_decode, device_decode], FLAGS.decode_calls, FLAGS.decode_repeats,
      warmup=3, samples_out=samples)
  ratio = common.paired_ratio(samples[1], samples[0])
  on_device = common.paired_ratio(samples[2], samples[0])
  print(f"machine: {common.machine()}")
  rows = [(f"{steps} tokens, batch 2, 2-layer decoder: vs jax.jit per token, the token read "
           "on the host", f"{steps / jit_us * 1e6:.0f}", f"{steps / sess_us * 1e6:.0f}",
           f"{ratio:.2f}x", ">= 2x", "yes" if ratio >= 2 else "no"),
          (f"{steps} tokens, batch 2, 2-layer decoder: vs jax.jit per token kept on the device "
           "(argmax inside, cache donated)", f"{steps / dev_us * 1e6:.0f}",
           f"{steps / sess_us * 1e6:.0f}", f"{on_device:.2f}x", "-", "-")]
  common.print_table(f"greedy decode, tokens/s, median of {FLAGS.decode_repeats} interleaved "
                     "repeats (set_state of the params and the initial cache included in "
                     "the session)",
                     rows, ["case", "jax.jit per token", "Session.run(steps=32)", "speed-up",
                            "target", "met"])
  common.print_table(f"greedy decode with the cache reset by replace_state, median of "
                     f"{FLAGS.decode_repeats} interleaved repeats",
                     [reset_by_replace_state_row(FLAGS.decode_calls, FLAGS.decode_repeats,
                                                 together)
                      for together in (True, False)],
                     ["case", "lax.scan decode under jax.jit", "Session.run(steps=32)",
                      "speed-up", "target", "met"])


if __name__ == "__main__":
  app.run(main)
