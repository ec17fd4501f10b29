"""The jaxsession command line.

Usage: jaxsession <command> [flags]

Commands:
  demo   Train the bundled MLP-with-Adam example through a Session: prints the
         compile report, the loss going down, and steps/s beside plain jax.jit
         (with donation) measured in the same run.
"""
import statistics
import sys
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

# Range-checked at parsing: absl names the flag, its value and the bound.
flags.DEFINE_integer("steps", 300, "demo: training steps", lower_bound=1)
flags.DEFINE_integer("batch", 128, "demo: batch size", lower_bound=1)
flags.DEFINE_integer("sink", 50, "demo: steps per loop-sunk run in the timing table",
                     lower_bound=1)
flags.DEFINE_integer("repeats", 5, "demo: timing repeats (medians are reported)",
                     lower_bound=1)
flags.DEFINE_string("save_graphs", None, "demo: folder for IR dumps (SessionOptions.save_graphs)")
flags.DEFINE_integer("seed", 0, "demo: random seed for the data and the initial params",
                     lower_bound=0, upper_bound=2**32 - 1)
FLAGS = flags.FLAGS

COMMANDS = ("demo",)


def demo():
  import jaxsession as js
  from jaxsession.examples import mlp_adam

  key_params, key_data = jax.random.split(jax.random.key(FLAGS.seed))
  params = mlp_adam.init_params(key_params)
  opt_state = mlp_adam.adam_init(params)
  data = mlp_adam.make_data(key_data, FLAGS.steps, FLAGS.batch)
  batch0 = jax.tree.map(lambda a: a[0], data)

  sess = js.Session(js.SessionOptions(save_graphs=FLAGS.save_graphs))
  train = sess.compile(mlp_adam.train_step, params, opt_state, batch0,
                       state_argnums=(0, 1), name="train_step")
  evaluate = sess.compile(mlp_adam.eval_step, params, batch0, state_argnums=0,
                          state_from=train, updates_state=False, name="eval_step")
  print(sess.report(train))
  print()
  print(f"training {FLAGS.steps} steps (batch {FLAGS.batch}) through Session.run:")
  every = max(FLAGS.steps // 6, 1)
  for step in range(FLAGS.steps):
    loss = sess.run(train, jax.tree.map(lambda a: a[step], data))
    if step % every == 0 or step == FLAGS.steps - 1:
      print(f"  step {step:4d}  loss {float(loss):.5f}")
  print(f"  eval graph sharing the trained params (state_from): loss "
        f"{float(sess.run(evaluate, batch0)):.5f}")

  # The same training with plain jax.jit, from the same start, as a check.
  jit_step = jax.jit(mlp_adam.train_step, donate_argnums=(0, 1))
  p, o = jax.tree.map(jnp.copy, (params, opt_state))
  for step in range(FLAGS.steps):
    p, o, _ = jit_step(p, o, jax.tree.map(lambda a: a[step], data))
  diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in
             zip(jax.tree.leaves(sess.get_state(train)[0]), jax.tree.leaves(p)))
  print(f"  max |params - plain jax.jit loop params| = {diff:.3g}")
  print()
  timing_table(sess, train, jit_step, params, opt_state, data)
  return 0


def timing_table(sess, train, jit_step, params, opt_state, data):
  """Steps/s of the three ways to run the same step, interleaved repeats."""
  n = min(FLAGS.sink, FLAGS.steps)
  chunk = jax.tree.map(lambda a: a[:n], data)
  batches = [jax.tree.map(lambda a: a[i], data) for i in range(n)]
  holder = list(jax.tree.map(jnp.copy, (params, opt_state)))

  def jit_loop():
    for b in batches:
      holder[0], holder[1], loss = jit_step(holder[0], holder[1], b)
    return loss

  def session_loop():
    for b in batches:
      loss = sess.run(train, b)
    return loss

  def session_sunk():
    return sess.run(train, chunk, steps=n)

  ways = [("jax.jit, donate_argnums=(0, 1)", jit_loop), ("Session.run per step", session_loop),
          (f"Session.run(steps={n}) (loop sink)", session_sunk)]
  times = {name: [] for name, _ in ways}
  for name, fn in ways:  # warm up (compiles the sunk executable)
    jax.block_until_ready(fn())
  for _ in range(FLAGS.repeats):
    for name, fn in ways:
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(n / (time.perf_counter() - start))
  base = statistics.median(times[ways[0][0]])
  print(f"steps/s, median of {FLAGS.repeats} interleaved repeats of {n} steps "
        f"({jax.devices()[0].platform}):")
  print(f"  {'way':40s} {'steps/s':>10s} {'vs jit':>8s}")
  for name, _ in ways:
    rate = statistics.median(times[name])
    print(f"  {name:40s} {rate:10.0f} {rate / base:7.2f}x")


def main(argv):
  args = argv[1:]
  if not args or args[0] not in COMMANDS:
    print(__doc__.strip(), file=sys.stderr)
    print(f"\nerror: expected a command, one of {list(COMMANDS)}; got {args[:1]}",
          file=sys.stderr)
    return 2
  if len(args) > 1:
    print(f"error: unexpected arguments {args[1:]}; see --help", file=sys.stderr)
    return 2
  np.set_printoptions(precision=4)
  return demo()


def usage():
  return __doc__ + "\nFlags:\n" + FLAGS.module_help(__name__).split("\n", 1)[-1]


def run_main():
  """Console-script entry point. Help is answered here, with this module's
  docstring and flags and exit status 0 (absl's own --help would print the
  console-script stub's docstring and exit 1)."""
  if any(arg in ("-h", "--help", "--helpshort", "-?") for arg in sys.argv[1:]):
    print(usage())
    sys.exit(0)
  app.run(main)


if __name__ == "__main__":
  run_main()
