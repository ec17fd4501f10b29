"""The CLI's other main jobs: `jaxsession demo --model decode` and
`jaxsession demo --model serve` (session/cli/__init__.py parses the flags).

decode: greedy decoding with the bundled GPT-style decoder
(examples/transformer_decode.py, random weights made here). The KV cache,
the last token and the position are session state - the cache updated with
`dynamic_update_slice` inside the step - and the next token is chosen on the
device, so `run(gid, steps=N)` decodes N tokens in one dispatch with no host
round trip per token. Beside it, the usual per-token `jax.jit` loop that reads
each token on the host to feed the next step; the tokens must be equal.

serve: requests of batch sizes drawn from 1..64 through auto shape buckets
(`buckets={1: "auto"}`) against `jax.jit`, which compiles every new shape;
compiles, padding waste and requests/s, compile time included.
"""
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def greedy_step(params, cache, token, pos):
  """One token, everything state: (params, cache, token, position) in, the
  same advanced and the token out. The params are state too: resident,
  never passed to `run`."""
  from jaxsession.examples import transformer_decode as td
  cache, logits = td.decode_step(params, cache, token, pos)
  nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return params, cache, nxt, pos + 1, nxt


def jit_decode(jitted, params, cache, token, tokens):
  """The usual loop: `jitted` (jax.jit of decode_step) per token, each token
  read on the host to feed the next step; the tokens, stacked."""
  out = []
  for t in range(tokens):
    cache, logits = jitted(params, cache, token, np.int32(t))
    token = np.asarray(jnp.argmax(logits, axis=-1)).astype(np.int32)  # read on the host
    out.append(token)
  return np.stack(out)


def _median_rate(fn, units, repeats):
  rates = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    rates.append(units / (time.perf_counter() - start))
  return statistics.median(rates)


def decode(seed, tokens, repeats, say=print):
  """Decodes `tokens` tokens per run, the session against the jax.jit loop."""
  import jaxsession as js
  from jaxsession.examples import transformer_decode as td

  params = td.init_params(jax.random.key(seed))
  cache0 = td.init_cache(params)
  max_len = params["pos"].shape[0]  # positions the cache holds
  if tokens > max_len:
    say(f"error: --tokens={tokens} is more than the cache holds ({max_len})")
    return 2
  token0, pos0 = jnp.array([3, 7], jnp.int32), jnp.int32(0)

  sessions = {}
  for profiled in (False, True):
    sess = js.Session(js.SessionOptions(enable_profiling=profiled))
    gid = sess.compile(greedy_step, params, cache0, token0, pos0, state_argnums=(0, 1, 2, 3),
                       name="greedy_step")
    sessions[profiled] = (sess, gid)
  sess, gid = sessions[False]

  def session_decode(sess=sess, gid=gid):
    sess.set_state(gid, params, cache0, token0, pos0)
    return sess.run(gid, steps=tokens)  # N tokens, one dispatch

  jitted = jax.jit(td.decode_step)

  def jit_loop():
    return jit_decode(jitted, params, cache0, token0, tokens)

  got, want = np.asarray(session_decode()), jit_loop()
  same = np.array_equal(got, want)
  say(f"greedy decode, {tokens} tokens x batch {token0.shape[0]}, "
      f"{len(params['layers'])}-layer decoder, random weights")
  say(f"  tokens (sequence 0): {got[:, 0].tolist()}")
  say(f"  equal to the per-token jax.jit loop's: {'yes' if same else 'NO'}")
  for fn in (session_decode, jit_loop):  # warm up
    jax.block_until_ready(fn())
  rates = {"jax.jit per token, token read on the host": [],
           f"Session.run(steps={tokens}), state on the device": []}
  fns = [jit_loop, session_decode]
  for _ in range(repeats):  # interleaved
    for name, fn in zip(rates, fns):
      rates[name].append(_median_rate(fn, tokens, 1))
  base = statistics.median(rates[next(iter(rates))])
  say(f"\ntokens/s, median of {repeats} interleaved repeats ({jax.devices()[0].platform}; "
      "the session's set_state of the initial cache included):")
  say(f"  {'way':48s} {'tokens/s':>9s}   vs jit")
  for name, values in rates.items():
    rate = statistics.median(values)
    say(f"  {name:48s} {rate:9.0f}   {rate / base:5.2f}x")

  psess, pgid = sessions[True]
  session_decode(psess, pgid)
  say("\nthe profiler (SessionOptions(enable_profiling=True)), one decode of "
      f"{tokens} tokens:")
  psess.profiler.summary()
  return 0 if same else 1


def _serve_model(params, x):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  h = jnp.tanh(h @ params["w2"])
  return jax.nn.softmax(h @ params["w3"], axis=-1)


def serve(seed, requests, max_buckets, say=print):
  """`requests` batches of sizes uniform in 1..64 through auto buckets."""
  import jaxsession as js

  rng = np.random.default_rng(seed)
  features, hidden = 64, 256

  def normal(*shape):
    return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32)
  params = {"w1": normal(features, hidden), "b1": jnp.zeros(hidden),
            "w2": normal(hidden, hidden), "w3": normal(hidden, 10)}
  sizes = rng.integers(1, 65, requests)
  xs = [jnp.asarray(rng.standard_normal((int(n), features)), jnp.float32) for n in sizes]

  jitted = jax.jit(_serve_model)
  start = time.perf_counter()
  want = [jitted(params, x) for x in xs]
  jax.block_until_ready(want)
  jit_seconds = time.perf_counter() - start

  sess = js.Session(js.SessionOptions(recompile_warn_limit=0))
  start = time.perf_counter()
  gid = sess.compile(_serve_model, params, xs[0], state_argnums=0, updates_state=False,
                     buckets={1: "auto"}, max_buckets=max_buckets, name="serve")
  got = [sess.run(gid, x) for x in xs]
  jax.block_until_ready(got)
  sess_seconds = time.perf_counter() - start
  dispatcher = sess.report(gid).buckets
  worst = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, want))
  shapes_ok = all(a.shape == b.shape for a, b in zip(got, want))

  say(f"serving {requests} requests, batch sizes uniform in 1..64, a 3-layer MLP "
      f"({features}-{hidden}-{hidden}-10), compile time included:")
  say(f"  {'way':44s} {'compiles':>8s} {'seconds':>8s} {'requests/s':>11s}")
  say(f"  {'jax.jit (compiles every new shape)':44s} {len(set(sizes.tolist())):8d} "
      f"{jit_seconds:8.2f} {requests / jit_seconds:11.0f}")
  say(f"  {'Session, auto buckets (at most %d)' % max_buckets:44s} "
      f"{len(dispatcher.sizes):8d} {sess_seconds:8.2f} {requests / sess_seconds:11.0f}")
  say(f"  speed-up {jit_seconds / sess_seconds:.1f}x")
  say(f"  {dispatcher.describe()}")
  say(f"  outputs: the caller sees exactly its rows ({'yes' if shapes_ok else 'NO'}); "
      f"max |session - jax.jit| = {worst:.2g} (XLA:CPU rounds a dot's rows by the "
      "batch it is compiled for: see the README)")
  return 0 if shapes_ok else 1
