"""Optimize + SelectKernel on big generated graphs, and what the fusions buy.

Prints two tables:
  * Optimize+SelectKernel wall time on generated graphs of 1k, 10k and 50k
    equations (targets: 10x the equations costs at most 12x the time; the 10k
    graph takes under 1 s);
  * steady-state step time of the MLP+Adam train step and of a transformer
    block with the fusions on vs off (target: fusions make the CPU step at
    most 3% slower; ratio on/off reported).

    python benchmarks/passes.py [--repeats 5]
"""
import statistics
import sys
import time

from absl import app, flags
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import common  # noqa: E402
import jaxsession as js  # noqa: E402
from jaxsession import gc_pause, pipeline  # noqa: E402
from jaxsession.examples import mlp_adam, transformer_decode  # noqa: E402
from jaxsession.graph.importer import import_jaxpr  # noqa: E402
from jaxsession.optimizer_passes import PassContext  # noqa: E402

flags.DEFINE_integer("repeats", 5, "repeats per measurement; medians are reported")
flags.DEFINE_string("sizes", "1000,10000,50000", "equation counts of the generated graphs")
FLAGS = flags.FLAGS


EQNS_PER_STEP = (1 + 1 + 2 + 2 + 3 + 4 + 2 + 3) / 8  # the mean over the 8 kinds below


def generated_program(n_eqns, seed=0):
  """About n_eqns equations of elementwise, broadcast, reduction and dot ops,
  with duplicates (CSE marks them), identities (simplify), dead values (DCE) and fusable
  shapes (matmul+bias, add chains)."""
  rng = np.random.default_rng(seed)
  steps = int(round(n_eqns / EQNS_PER_STEP))
  choices = rng.integers(0, 8, size=steps)
  picks = rng.integers(0, 1 << 30, size=(steps, 2))

  def program(x, bias, w):
    pool = [x]
    for kind, (a, b) in zip(choices, picks):
      u, v = pool[a % len(pool)], pool[b % len(pool)]
      if kind == 0:
        out = lax.sin(u)                                         # 1 eqn
      elif kind == 1:
        out = lax.add(u, v)                                      # 1
      elif kind == 2:
        out = lax.mul(lax.mul(u, 1.0), v)                        # 2, one an identity
      elif kind == 3:
        out = u + lax.broadcast_in_dim(bias, u.shape, (1,))      # 2: broadcast add
      elif kind == 4:
        out = u - lax.broadcast_in_dim(lax.reduce_max(u, (1,)), u.shape, (0,))  # 3
      elif kind == 5:
        out = lax.tanh(lax.dot(u, w) + lax.broadcast_in_dim(bias, u.shape, (1,)))  # 4
      elif kind == 6:
        out = lax.max(u, v), lax.sin(u)                          # 2, one dead
        out = out[0]
      else:
        out = lax.add(lax.add(u, v), lax.add(v, u))              # 3, CSE and AddN bait
      pool.append(out)
      if len(pool) > 16:  # a sliding window: deep chains, little dead code
        pool = pool[-16:]
    return tuple(pool[-4:])
  return program


def optimize_and_select_seconds(closed, verify):
  """Wall time of the Optimize and SelectKernel stages on a fresh import, with
  `KernelGraph.verify()` after every changed pass (as a Session runs them by
  default) or without."""
  graph = import_jaxpr(closed)
  ctx = PassContext(platform="cpu", options=js.SessionOptions(), verify=verify)
  optimizer = pipeline.graph_optimizer()
  with gc_pause.paused():  # as Session.compile runs the stages
    start = time.perf_counter()
    optimizer.run_stage("Optimize", graph, ctx)
    optimizer.run_stage("SelectKernel", graph, ctx)
    seconds = time.perf_counter() - start
  return seconds, len(graph.nodes)


def scaling_table():
  rows, per_size = [], {}
  x = jnp.ones((8, 16), jnp.float32) * 0.5
  bias, w = jnp.ones((16,), jnp.float32) * 0.1, jnp.eye(16, dtype=jnp.float32) * 0.3
  for size in [int(s) for s in FLAGS.sizes.split(",")]:
    closed = jax.make_jaxpr(generated_program(size))(x, bias, w)
    n_eqns = len(closed.jaxpr.eqns)
    times = {False: [], True: []}
    nodes_after = 0
    for _ in range(FLAGS.repeats):
      for verify in (False, True):  # interleaved
        seconds, nodes_after = optimize_and_select_seconds(closed, verify)
        times[verify].append(seconds)
    per_size[size] = {v: statistics.median(t) for v, t in times.items()}
    rows.append([size, n_eqns, nodes_after, per_size[size][False] * 1e3,
                 per_size[size][True] * 1e3])
  sizes = sorted(per_size)
  for row in rows:
    prev = [s for s in sizes if s < row[0] and row[0] // s == 10]
    for verify in (False, True):
      row.append(f"{per_size[row[0]][verify] / per_size[prev[0]][verify]:.1f}x"
                 if prev else "-")
  return rows


def step_time_table():
  """Per-step time with fusions on and off, interleaved repeats."""
  fusion_names = [name for name in pipeline.optional_pass_names() if name.startswith("fuse_")]
  rows = []
  params = mlp_adam.init_params(jax.random.key(0))
  data = mlp_adam.make_data(jax.random.key(1), 1)
  batch = jax.tree.map(lambda a: a[0], data)
  tparams = transformer_decode.init_params(jax.random.key(2), dim=64, layers=2, max_len=64)
  cache = transformer_decode.init_cache(tparams, batch=8, max_len=64)
  token = jnp.arange(8) % 64
  cases = [
      ("MLP+Adam train step", mlp_adam.train_step, (params, mlp_adam.adam_init(params), batch),
       (0, 1), (batch,)),
      ("transformer decode step (2 blocks)", transformer_decode.resident_decode_step,
       (tparams, cache, token, 7), (0, 1), (token, 7)),
  ]
  for name, fn, example, state, run_args in cases:
    runs, fused_counts = [], []
    for disabled in ((), fusion_names):
      sess = js.Session(js.SessionOptions(disabled_passes=disabled))
      gid = sess.compile(fn, *example, state_argnums=state)
      fused_counts.append(sum(n.prim is None for n in sess.graph(gid).nodes))
      runs.append(lambda sess=sess, gid=gid: sess.run(gid, *run_args))
    samples = []
    on_us, off_us = common.compare_us(runs, calls=300, repeats=3 * FLAGS.repeats, warmup=30,
                                      samples_out=samples)
    ratio = common.paired_ratio(*samples)
    rows.append([name, fused_counts[0], on_us, off_us, ratio,
                 "yes" if ratio <= 1.03 else "NO"])
  return rows


def main(argv):
  del argv
  print(f"machine: {common.machine()}")
  common.print_table(
      f"Optimize+SelectKernel wall time, median of {FLAGS.repeats}",
      scaling_table(), ["target eqns", "eqns", "nodes after", "ms (verify off)",
                        "ms (verify on, as a Session runs it)",
                        "off: vs 10x fewer (target <= 12x)", "on: vs 10x fewer"])
  common.print_table(
      f"steady-state step, fusions on vs off, median of {3 * FLAGS.repeats} interleaved repeats",
      step_time_table(),
      ["program", "fused nodes", "fusions on µs", "fusions off µs",
       "on/off (median of paired ratios)", "<= 1.03"])


if __name__ == "__main__":
  app.run(main)
