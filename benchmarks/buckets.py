"""Shape buckets: 200 requests with batch sizes uniform in 1..64 through a
bucketed Session graph vs `jax.jit` compiling every shape it sees, and vs
`jax.jit` given the requests padded to powers of two by hand in numpy.

Total wall time includes every compile (the recompile storm is the point);
each contender starts from a fresh compile cache of its own (a new function
object for jax.jit, a new Session). Padding waste is padded rows per real
row; jax.jit pads nothing.
"""
import statistics
import sys
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import common  # noqa: E402  (benchmarks/common.py)

import jaxsession as js  # noqa: E402

flags.DEFINE_integer("requests", 200, "requests per trial")
flags.DEFINE_integer("repeats", 3, "trials (medians reported)")
flags.DEFINE_integer("warmup_rounds", 1, "discarded rounds of every contender first")
FLAGS = flags.FLAGS
F, H = 64, 256


def model(params, x):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  h = jnp.tanh(h @ params["w2"])
  return jax.nn.softmax(h @ params["w3"], axis=-1)


def make_params(rng):
  n = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[0]), jnp.float32)
  return {"w1": n(F, H), "b1": jnp.zeros(H), "w2": n(H, H), "w3": n(H, 10)}


def trial_jit(params, xs):
  fn = jax.jit(lambda p, x: model(p, x))  # a new function: its own cache
  start = time.perf_counter()
  for x in xs:
    out = fn(params, x)
  jax.block_until_ready(out)
  return time.perf_counter() - start, len({x.shape[0] for x in xs})


def trial_padded(params, hosted):
  """What a JAX user writes by hand: each request padded in numpy to the
  next power of two and passed to jax.jit (7 shapes, 7 compiles). Easier
  on jax.jit than the session: the requests are numpy arrays already and
  the outputs stay padded (the session slices its own)."""
  fn = jax.jit(lambda p, x: model(p, x))
  start = time.perf_counter()
  for x in hosted:
    n = x.shape[0]
    padded = np.zeros((1 << (n - 1).bit_length(), F), np.float32)
    padded[:n] = x
    out = fn(params, padded)
  jax.block_until_ready(out)
  return time.perf_counter() - start, 7


def trial_session(params, xs, **compile_kw):
  sess = js.Session(js.SessionOptions(recompile_warn_limit=0))
  start = time.perf_counter()
  gid = sess.compile(model, params, xs[0], state_argnums=0, updates_state=False,
                     **compile_kw)
  for x in xs:
    out = sess.run(gid, x)
  jax.block_until_ready(out)
  seconds = time.perf_counter() - start
  dispatcher = sess.report(gid).buckets
  return (seconds, len(dispatcher.sizes), dispatcher.policy.measured_waste(),
          dispatcher.policy.expected_waste, dispatcher.describe())


def main(argv):
  del argv
  rng = np.random.default_rng(0)
  params = make_params(rng)
  sizes = rng.integers(1, 65, FLAGS.requests)
  xs = [jnp.asarray(rng.standard_normal((int(n), F)), jnp.float32) for n in sizes]
  history = rng.integers(1, 65, 1000).tolist()  # yesterday's traffic, same distribution
  hosted = [np.asarray(x) for x in xs]
  contenders = {
      "jax.jit, every shape": lambda: trial_jit(params, xs) + (0.0, None, None),
      "jax.jit, padded to powers of two by hand (numpy)": lambda: trial_padded(
          params, hosted) + (None, None, None),
      "Session, powers of two": lambda: trial_session(
          params, xs, buckets={1: [1, 2, 4, 8, 16, 32, 64]}),
      "Session, auto (7) from a size hint": lambda: trial_session(
          params, xs, buckets={1: "auto"}, max_buckets=7, bucket_sizes_hint=history),
      "Session, auto (7) learning from traffic": lambda: trial_session(
          params, xs, buckets={1: "auto"}, max_buckets=7),
  }
  names = list(contenders)
  results = {name: [] for name in contenders}
  for _ in range(FLAGS.warmup_rounds):  # discarded: jax's and XLA's first-use costs
    for name in names:
      contenders[name]()
  for k in range(FLAGS.repeats):  # the order rotated, so no one always goes first
    for name in names[k % len(names):] + names[:k % len(names)]:
      results[name].append(contenders[name]())
  print(f"machine: {common.machine()}")
  base = statistics.median(r[0] for r in results[names[0]])
  padded = statistics.median(r[0] for r in results[names[1]])
  rows = []
  for name, trials in results.items():
    seconds = statistics.median(r[0] for r in trials)
    compiles, waste, expected = trials[-1][1], trials[-1][2], trials[-1][3]
    target = ("-" if name.startswith("jax") else
              ">= 4x faster, <= 7 compiles" + (", waste <= 13%" if "auto" in name else ""))
    met = "-" if name.startswith("jax") else (
        "yes" if base / seconds >= 4 and compiles <= 7
        and ("auto" not in name or waste <= 0.13) else "no")
    rows.append((name, f"{seconds:.2f}", f"{base / seconds:.1f}x", f"{padded / seconds:.2f}x",
                 compiles, "-" if expected is None else f"{expected:.1%}",
                 "-" if waste is None else f"{waste:.1%}", target, met))
  common.print_table(f"{FLAGS.requests} requests, batch sizes uniform in 1..64, "
                     f"total wall time incl. compiles, median of {FLAGS.repeats} after a "
                     "discarded round, order rotated",
                     rows, ["contender", "seconds", "speed-up vs jit", "vs jit padded by hand",
                            "compiles", "expected waste (histogram)", "measured waste",
                            "target", "met"])
  print("\n- waste = padded rows per real row; 'expected' is the chosen buckets on the"
        " histogram they were chosen from, 'measured' what these 200 requests padded.")
  print("- 'learning from traffic' pads its first requests to one learning bucket (the"
        " next power of two of the largest size seen) instead of compiling exact shapes,"
        " then chooses buckets at 4, 8, 16 and 32 requests (4, 5, 6, 7 of them), keeping"
        " every size already compiled: the measured waste includes the learning phase,"
        " which is the price of not knowing the traffic in advance.")
  for name, trials in results.items():
    if trials[-1][4]:
      print(f"- {name}: {trials[-1][4]}")


if __name__ == "__main__":
  app.run(main)
