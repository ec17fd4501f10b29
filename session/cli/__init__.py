"""The jaxsession command line.

Usage: jaxsession <command> [flags]

Commands:
  demo   Train the bundled MLP-with-Adam example through a Session: prints the
         compile report, the loss going down, and steps/s beside plain jax.jit
         (with donation) measured in the same run.

         demo --devices 8: the same MLP trained data-parallel on a mesh of 8
         devices in one process (CPU devices made with jax_num_cpu_devices; on
         a GPU machine, capped at the GPUs that exist), the optimizer state
         sharded ZeRO-style (--state_specs); prints the losses beside
         single-device jax.jit, the per-device state bytes and the collectives.

         demo --checkpoint-dir DIR: saves the training state every
         --checkpoint_every steps and resumes from the newest complete
         checkpoint in DIR when started again.

         demo --model decode: greedy decoding with the bundled GPT-style
         decoder, the KV cache as session state, --tokens per run in one
         dispatch (steps=N); tokens/s beside a per-token jax.jit loop that
         reads each token on the host, and the profiler's tables.

         demo --model serve: --requests batches of sizes 1..64 through auto
         shape buckets; compiles, padding waste and requests/s beside jax.jit.

         demo --processes 2: launches 2 local processes on localhost, each
         with 2 CPU devices (--devices), joined by jax.distributed; each passes
         its half of every batch and the session trains across them. Process 0
         prints what --devices prints.
"""
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np

# Range-checked at parsing: absl names the flag, its value and the bound.
flags.DEFINE_integer("steps", 300, "demo: training steps", lower_bound=1)
flags.DEFINE_integer("batch", 128, "demo: batch size", lower_bound=1)
flags.DEFINE_integer("sink", 50, "demo: steps per loop-sunk run in the timing table (under a "
                     "mesh: the last steps of the training, run as one sunk run)",
                     lower_bound=1)
flags.DEFINE_integer("repeats", 5, "demo: timing repeats (medians are reported)",
                     lower_bound=1)
flags.DEFINE_string("save_graphs", None, "demo: folder for IR dumps (SessionOptions.save_graphs)")
flags.DEFINE_string("checkpoint_dir", None, "demo: save the training state there every "
                    "--checkpoint_every steps (orbax) and resume from its newest complete "
                    "checkpoint when started again (also spelt --checkpoint-dir)")
flags.DEFINE_integer("checkpoint_every", 50, "demo --checkpoint_dir: steps between saves",
                     lower_bound=1)
flags.DEFINE_integer("seed", 0, "demo: random seed for the data and the initial params",
                     lower_bound=0, upper_bound=2**32 - 1)
flags.DEFINE_integer("devices", None, "demo: train data-parallel on a mesh of this many devices "
                     "(CPU devices via jax_num_cpu_devices; on a GPU machine at most the GPUs "
                     "there are); with --processes, the CPU devices of each process (default 2)",
                     lower_bound=1)
flags.DEFINE_integer("processes", None, "demo: launch this many local processes on localhost "
                     "(jax.distributed, CPU) and train across them", lower_bound=2)
flags.DEFINE_enum("state_specs", "zero", ["zero", "replicated"],
                  "demo under a mesh: the state's layout (compile's state_specs): 'zero' shards "
                  "each state leaf on its largest axis that divides by the device count")
flags.DEFINE_enum("model", "mlp", ["mlp", "decode", "serve"],
                  "demo: mlp trains the MLP with Adam; decode runs greedy decoding with "
                  "the KV cache as state; serve runs requests through auto shape buckets")
flags.DEFINE_integer("tokens", 32, "demo --model decode: tokens per run (the cache holds 32)",
                     lower_bound=1)
flags.DEFINE_integer("requests", 200, "demo --model serve: requests", lower_bound=1)
flags.DEFINE_integer("max_buckets", 7, "demo --model serve: auto buckets at most",
                     lower_bound=1)
flags.DEFINE_integer("timeout", 600, "demo --processes: seconds before the launcher kills the "
                     "processes (also their jax.distributed start-up timeout)", lower_bound=1)
# Internal: what the launcher of `demo --processes` passes to each process it
# starts. Kept out of --help (another module name).
_INTERNAL = "jaxsession.cli.internal"
flags.DEFINE_integer("process_id", None, "internal: this process's index", lower_bound=0,
                     module_name=_INTERNAL)
flags.DEFINE_string("coordinator", None, "internal: the jax.distributed coordinator host:port",
                    module_name=_INTERNAL)
FLAGS = flags.FLAGS

COMMANDS = ("demo",)
RTOL = 1e-6  # the mesh demos' bound on the losses against single-device jax.jit


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
  start = 0
  if FLAGS.checkpoint_dir:
    logging.set_verbosity(logging.WARNING)  # orbax logs every save step at INFO
  if FLAGS.checkpoint_dir and os.path.isdir(FLAGS.checkpoint_dir):
    try:
      start = sess.restore(train, FLAGS.checkpoint_dir)
      print(f"resumed from the checkpoint of step {start} in {FLAGS.checkpoint_dir}")
    except js.InputError as exc:
      if "no complete checkpoint" not in str(exc):
        raise
  print(f"training {FLAGS.steps} steps (batch {FLAGS.batch}) through Session.run:")
  every = max(FLAGS.steps // 6, 1)
  for step in range(start, FLAGS.steps):
    loss = sess.run(train, jax.tree.map(lambda a: a[step], data))
    if step % every == 0 or step == FLAGS.steps - 1:
      print(f"  step {step:4d}  loss {float(loss):.5f}")
    if FLAGS.checkpoint_dir and ((step + 1) % FLAGS.checkpoint_every == 0
                                 or step == FLAGS.steps - 1):
      sess.save(train, FLAGS.checkpoint_dir, step + 1)  # written in the background
  if FLAGS.checkpoint_dir:
    sess.wait_until_saved()
    print(f"  checkpoints in {FLAGS.checkpoint_dir} (every {FLAGS.checkpoint_every} steps "
          "and the last)")
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
  """Steps/s of the four ways to run the same step, interleaved repeats."""
  from jaxsession.examples import mlp_adam  # pylint: disable=import-outside-toplevel
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

  # the same n steps in one dispatch written by hand: what loop sink compiles
  def body(carry, b):
    p, o, loss = mlp_adam.train_step(*carry, b)
    return (p, o), loss
  scan = jax.jit(lambda p, o, xs: jax.lax.scan(body, (p, o), xs), donate_argnums=(0, 1))
  scanned = list(jax.tree.map(jnp.copy, (params, opt_state)))

  def jit_scan():
    (scanned[0], scanned[1]), losses = scan(scanned[0], scanned[1], chunk)
    return losses

  ways = [("jax.jit, donate_argnums=(0, 1)", jit_loop), ("Session.run per step", session_loop),
          (f"Session.run(steps={n}) (loop sink)", session_sunk),
          (f"jax.jit(lax.scan) of {n} steps, donated", jit_scan)]
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


# ---------------------------------------------------------------------------
# Beyond one device: `demo --devices N` and `demo --processes P`.


def start_jax(devices, processes=None, process_id=None, coordinator=None):
  """Starts JAX's backends with `devices` CPU devices (per process), joining
  the jax.distributed job first when there is one; returns the devices of
  the mesh. Must run before anything else touches a JAX backend."""
  try:
    jax.config.update("jax_num_cpu_devices", devices)
  except RuntimeError as exc:  # backends already started (e.g. cli.main called in-process)
    print(f"note: could not set jax_num_cpu_devices={devices}: {exc}", file=sys.stderr)
  if processes:
    jax.distributed.initialize(coordinator, num_processes=processes, process_id=process_id,
                               initialization_timeout=FLAGS.timeout)
    return jax.devices()  # every process's devices: the mesh is global
  return jax.devices()[:devices]


def _relative(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))


def _gather(tree):
  """The whole value of every leaf of `tree` (global arrays) as numpy, on
  every process (a collective when the mesh spans processes)."""
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, tree)
  from jax.experimental import multihost_utils
  return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def mesh_demo(devices):
  """Trains the MLP data-parallel on a mesh of `devices`; every process of a
  jax.distributed job runs this, process 0 prints."""
  import jaxsession as js
  from jaxsession.examples import mlp_adam

  pid, nproc = jax.process_index(), jax.process_count()
  say = print if pid == 0 else (lambda *args, **kwargs: None)
  mesh = jax.sharding.Mesh(np.array(devices), ("data",))
  n = mesh.devices.size
  if FLAGS.batch % n:
    print(f"error: --batch={FLAGS.batch} does not divide over the {n} devices of the mesh",
          file=sys.stderr)
    return 2
  platform = devices[0].platform
  if nproc == 1:
    asked = FLAGS.devices
    capped = f" (asked for {asked}; {len(jax.devices())} exist)" if n < asked else ""
    say(f"mesh {dict(mesh.shape)}: {n} {platform} devices in one process{capped}")
  else:
    say(f"mesh {dict(mesh.shape)}: {n} {platform} devices in {nproc} processes "
        f"({jax.local_device_count()} per process, jax.distributed)")

  key_params, key_data = jax.random.split(jax.random.key(FLAGS.seed))
  params = jax.tree.map(np.asarray, mlp_adam.init_params(key_params))
  opt_state = jax.tree.map(np.asarray, mlp_adam.adam_init(params))
  data = jax.tree.map(np.asarray, mlp_adam.make_data(key_data, FLAGS.steps, FLAGS.batch))
  rows = FLAGS.batch // nproc  # this process's rows of every global batch
  local = jax.tree.map(lambda a: a[:, pid * rows:(pid + 1) * rows], data)
  if nproc > 1:
    say(f"each process passes its {rows} rows of every {FLAGS.batch}-row batch "
        "(the session assembles the global batch)")

  specs = None if FLAGS.state_specs == "replicated" else "zero"
  sess = js.Session(js.SessionOptions(mesh=mesh, save_graphs=FLAGS.save_graphs))
  train = sess.compile(mlp_adam.train_step, params, opt_state,
                       jax.tree.map(lambda a: a[0], local), state_argnums=(0, 1),
                       state_specs=specs, name="train_step")
  sunk = min(FLAGS.sink, FLAGS.steps - 1) if FLAGS.steps > 1 else 0
  single = FLAGS.steps - sunk
  how = (f"{single} Session.run calls, then one Session.run(steps={sunk}) (loop sink)"
         if sunk else "one Session.run call")
  say(f"\ntraining {FLAGS.steps} steps (global batch {FLAGS.batch}, state_specs="
      f"{specs!r}): {how}")
  losses = []
  for step in range(single):
    losses.append(float(sess.run(train, jax.tree.map(lambda a: a[step], local))))
  if sunk:
    out = sess.run(train, jax.tree.map(lambda a: a[single:], local), steps=sunk)
    losses += [float(x) for x in _gather(out)]
  every = max(FLAGS.steps // 6, 1)
  for step, loss in enumerate(losses):
    if step % every == 0 or step == FLAGS.steps - 1:
      say(f"  step {step:4d}  loss {loss:.5f}")
  state = _gather(sess.get_state(train))
  rep = sess.report(train)

  # The same steps with jax.jit given the same shardings and donation (the
  # same SPMD program through the same engine): equal bit for bit.
  same = jax.tree.map(lambda x: x.sharding, sess.get_state(train))
  rows_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  gspmd_step = jax.jit(mlp_adam.train_step, in_shardings=(*same, rows_sharding),
                       out_shardings=(*same, replicated), donate_argnums=(0, 1))
  p, o = jax.tree.map(lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: x[i]),
                      (params, opt_state), same)
  gspmd = []
  for step in range(FLAGS.steps):
    batch = jax.tree.map(lambda a: jax.make_array_from_process_local_data(
        rows_sharding, a[step]), local)
    p, o, loss = gspmd_step(p, o, batch)
    gspmd.append(float(loss))
  gspmd_state = _gather((p, o))
  bitwise = np.array_equal(losses, gspmd) and all(
      np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(gspmd_state)))
  where = f"{n} devices" if nproc == 1 else f"{nproc} processes x {n // nproc} devices"
  say(f"\nlosses and final state vs jax.jit with the same shardings and donation on the same "
      f"mesh ({where}): equal bit for bit: {'yes' if bitwise else 'NO'}")

  if pid == 0:
    # The same training with single-device jax.jit on the global batch.
    jit_step = jax.jit(mlp_adam.train_step, donate_argnums=(0, 1))
    p, o = jax.tree.map(jnp.asarray, (params, opt_state))
    ref = []
    for step in range(FLAGS.steps):
      p, o, loss = jit_step(p, o, jax.tree.map(lambda a: a[step], data))
      ref.append(float(loss))
    loss_rel = _relative(losses, ref)
    early = min(FLAGS.steps, 100)
    diff = max(float(np.max(np.abs(a - np.asarray(b)))) for a, b in
               zip(jax.tree.leaves(state), jax.tree.leaves((p, o))))
    say(f"losses vs single-device jax.jit on the global batch: max relative difference "
        f"{_relative(losses[:early], ref[:early]):.3g} over the first {early} steps, "
        f"{loss_rel:.3g} over all {FLAGS.steps}; first {early} steps match (rtol {RTOL:g}): "
        f"{'yes' if _relative(losses[:early], ref[:early]) <= RTOL else 'NO'}")
    say(f"  max |state - single-device jax.jit state| = {diff:.3g}")
    say("  (summation order only: each device sums its rows, then the devices' sums are "
        "added; Adam's m / sqrt(v) grows the difference over many steps)")

  say("\nper-device state (report.sharding):")
  for line in rep.sharding.describe():
    say(f"  {line}")
  kinds = {}
  for c in rep.collectives:
    kinds[c.kind] = kinds.get(c.kind, 0) + 1
  say(f"\ncollectives in the executable (report.collectives): "
      f"{', '.join(f'{v} {k}' for k, v in kinds.items()) or 'none'}")
  for c in rep.collectives:
    say(f"  {c.describe()}")
  return 0


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(processes, per_process):
  """Starts `processes` copies of this demo on localhost, joined by
  jax.distributed; waits for all, forwards their output, and kills the
  others when one fails or the time is up. Returns the exit status."""
  coordinator = f"127.0.0.1:{_free_port()}"
  print(f"launching {processes} processes on localhost, {per_process} CPU devices each, "
        f"coordinator {coordinator}", flush=True)
  forwarded = [f"--{name}={FLAGS[name].value}" for name in
               ("steps", "batch", "sink", "seed", "state_specs", "timeout")]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  procs, files = [], []
  for i in range(processes):
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    files.append((out, err))
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "jaxsession", "demo", f"--processes={processes}",
         f"--process_id={i}", f"--coordinator={coordinator}", f"--devices={per_process}",
         *forwarded], stdout=out, stderr=err, text=True, env=env))
  deadline = time.monotonic() + FLAGS.timeout
  failure = None
  while failure is None:
    codes = [p.poll() for p in procs]
    bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
    if bad:
      failure = f"process {bad[0]} exited with status {codes[bad[0]]}"
    elif all(c == 0 for c in codes):
      break
    elif time.monotonic() > deadline:
      failure = f"timed out after {FLAGS.timeout} s"
    else:
      time.sleep(0.05)
  stopped = []
  for i, p in enumerate(procs):
    if p.poll() is None:  # only after a failure: the others would wait for it forever
      p.kill()
      stopped.append(i)
    p.wait()
  for i, (out, err) in enumerate(files):
    out.seek(0)
    err.seek(0)
    text = out.read()
    for line in text.splitlines():
      if line.startswith("[Gloo]"):  # gloo's connection chatter, printed by C++ on stdout
        continue
      print(line if i == 0 else f"[process {i}] {line}")
    if failure:
      for line in err.read().splitlines()[-40:]:
        print(f"[process {i} stderr] {line}", file=sys.stderr)
    out.close()
    err.close()
  if failure:
    killed = f"; stopped process(es) {stopped}" if stopped else ""
    print(f"error: {failure}{killed}", file=sys.stderr)
    return 1
  return 0


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
  for name in ("save_graphs", "checkpoint_dir"):  # refused before any work (--checkpoint_dir
    path = FLAGS[name].value  # failed at the first save, a traceback: a review's find)
    if path is None:
      continue
    if not path:
      print(f"error: --{name} is empty: give a directory", file=sys.stderr)
      return 2
    there = os.path.abspath(path)  # the nearest part of it that exists must be a folder
    while not os.path.exists(there) and os.path.dirname(there) != there:
      there = os.path.dirname(there)
    if not os.path.isdir(there):
      print(f"error: --{name}={path}: {there} is a file, not a directory", file=sys.stderr)
      return 2
  mesh = FLAGS.devices is not None or FLAGS.processes is not None
  for name, used in (("checkpoint_dir", FLAGS.model == "mlp" and not mesh),
                     ("save_graphs", FLAGS.model == "mlp")):
    if FLAGS[name].value and not used:  # (ignored without a word: a review's find)
      print(f"error: --{name} applies to the MLP demo" + (" on one device" if name ==
            "checkpoint_dir" else "") + f", not this one (--model={FLAGS.model}"
            + (", a mesh)" if mesh else ")"), file=sys.stderr)
      return 2
  given = FLAGS["state_specs"].present or not FLAGS["state_specs"].using_default_value
  if given and FLAGS.devices is None and FLAGS.processes is None:
    print("error: --state_specs lays the state out on a mesh: give --devices or --processes",
          file=sys.stderr)
    return 2
  import jaxsession as js  # pylint: disable=g-import-not-at-top
  try:
    return _command()
  except js.InputError as exc:  # what the session refused, said as a flag's error is
    print(f"error: {exc}", file=sys.stderr)
    return 2


def _command():
  """The demo the flags ask for (main checked them)."""
  if FLAGS.model != "mlp":
    if FLAGS.processes is not None or FLAGS.devices is not None:
      print(f"error: --model={FLAGS.model} runs on one device; --devices and --processes "
            "train the MLP", file=sys.stderr)
      return 2
    from jaxsession.cli import demo_models  # pylint: disable=g-import-not-at-top
    if FLAGS.model == "decode":
      return demo_models.decode(FLAGS.seed, FLAGS.tokens, FLAGS.repeats)
    return demo_models.serve(FLAGS.seed, FLAGS.requests, FLAGS.max_buckets)
  if FLAGS.processes is not None:
    per_process = FLAGS.devices or 2
    if FLAGS.process_id is None:
      return launch(FLAGS.processes, per_process)
    if FLAGS.coordinator is None or FLAGS.process_id >= FLAGS.processes:
      print("error: --process_id needs --coordinator and must be below --processes",
            file=sys.stderr)
      return 2
    return mesh_demo(start_jax(per_process, FLAGS.processes, FLAGS.process_id,
                               FLAGS.coordinator))
  if FLAGS.devices is not None:
    return mesh_demo(start_jax(FLAGS.devices))
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
  sys.argv = [a.replace("--checkpoint-dir", "--checkpoint_dir", 1)
              if a.startswith("--checkpoint-dir") else a for a in sys.argv]
  app.run(main)


if __name__ == "__main__":
  run_main()
