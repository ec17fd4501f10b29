"""Training and serving workflows (issue 16), each against plain JAX in the
same run:

  * decode: 32 greedy tokens per request with the KV cache, token and
    position reset by `replace_state` (the parameters stay), one sunk run
    (`steps=32`), against a `lax.scan` decode loop under `jax.jit` given the
    same parameters and initial cache; tokens/s (target >= 1.0x);
  * checkpoints: MLP+Adam train steps while an asynchronous `save` is in
    flight against steps without one (target <= 1.1x); a save (until
    written) and a restore of a --save_mib MiB state, and of a small state
    into a directory of --wf_steps steps, against orbax's CheckpointManager
    used directly; a restore of two of the big state's eight leaves into
    an eval graph (`state_map`) against the whole restore;
  * memory: peak RSS of compile + bind + first step of a state of
    --big_mib MiB, each in a fresh process: the session compiled from
    `jax.ShapeDtypeStruct`s and bound with `set_state(donate=True)`, beside
    `jax.jit` with `donate_argnums`; peak minus the RSS before the state was
    made, over the state size (target <= 1.15x).

    python benchmarks/workflows.py [--wf_repeats 5] [--big_mib 1536] [--save_mib 1024]
                                  [--wf_steps 200]
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import decode  # noqa: E402  (benchmarks/decode.py: the decode row)

import jaxsession as js  # noqa: E402
from jaxsession.examples import mlp_adam  # noqa: E402

flags.DEFINE_integer("wf_repeats", 5, "interleaved repeats (medians reported)")
flags.DEFINE_integer("big_mib", 1536, "the state of the memory case, MiB")
flags.DEFINE_integer("save_mib", 1024, "the state of the big save/restore case, MiB")
flags.DEFINE_integer("wf_steps", 200, "steps already in the directory of the many-steps case")
FLAGS = flags.FLAGS


def decode_case(rows):
  rows.append(decode.reset_by_replace_state_row(20, FLAGS.wf_repeats))


def checkpoint_case(rows):
  key_p, key_d = jax.random.split(jax.random.key(0))
  params = mlp_adam.init_params(key_p, sizes=(32, 1024, 1024, 1))
  opt = mlp_adam.adam_init(params)
  data = mlp_adam.make_data(key_d, 8)
  batch = jax.tree.map(lambda a: a[0], data)
  sess = js.Session()
  gid = sess.compile(mlp_adam.train_step, params, opt, batch, state_argnums=(0, 1))
  for _ in range(3):
    jax.block_until_ready(sess.run(gid, batch))
  steps = 20
  with tempfile.TemporaryDirectory() as tmp:
    free, busy = [], []
    for r in range(FLAGS.wf_repeats):
      start = time.perf_counter()
      for _ in range(steps):
        jax.block_until_ready(sess.run(gid, batch))
      free.append((time.perf_counter() - start) / steps)
      sess.save(gid, tmp, r)
      start = time.perf_counter()
      for _ in range(steps):
        jax.block_until_ready(sess.run(gid, batch))
      busy.append((time.perf_counter() - start) / steps)
      sess.wait_until_saved()
    ratio = statistics.median(b / f for b, f in zip(busy, free))
    nbytes = sum(x.nbytes for x in jax.tree.leaves((params, opt)))
    rows.append((f"train step (MLP+Adam, {nbytes / 2**20:.0f} MiB state) while a save is in "
                 "flight / without", f"{statistics.median(free) * 1e6:.0f} us",
                 f"{statistics.median(busy) * 1e6:.0f} us", f"{ratio:.2f}x", "<= 1.1x",
                 "yes" if ratio <= 1.1 else "no"))


def big_save_case(rows):
  """save (until written) and restore of a --save_mib MiB state of 8
  random f32 leaves, against orbax's CheckpointManager used directly on the
  same arrays, interleaved; the page cache written back (os.sync) before
  each, so one write's flush does not slow the next."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(0)
  per = FLAGS.save_mib * 2**20 // 4 // 8
  state = {f"w{i}": rng.standard_normal(per, dtype=np.float32) for i in range(8)}
  sess = js.Session(js.SessionOptions(checkpoint_keep=1))  # as orbax's max_to_keep=1
  gid = sess.compile(lambda s: (jax.tree.map(lambda w: w * 0.5 + 1.0, s), s["w0"][0]), state,
                     state_argnums=0)
  sess.run(gid)
  # an eval graph of two of the eight leaves, restored out of the same checkpoints
  part = sess.compile(lambda a, b, x: jnp.sum(a) + jnp.sum(b) + x,
                      *(jax.ShapeDtypeStruct(state[k].shape, state[k].dtype)
                        for k in ("w0", "w1")), 1.0, state_argnums=(0, 1),
                      updates_state=False)
  del state
  times = {}
  with tempfile.TemporaryDirectory() as tmp:
    manager = ocp.CheckpointManager(os.path.join(tmp, "orbax"), options=(
        ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=False)))
    for r in range(FLAGS.wf_repeats):
      for way in ("orbax", "session") if r % 2 else ("session", "orbax"):
        held = sess.get_state(gid)[0] if way == "orbax" else None  # (copies, untimed)
        os.sync()
        start = time.perf_counter()
        if way == "orbax":
          manager.save(r, args=ocp.args.StandardSave(held))
          manager.wait_until_finished()
        else:
          sess.save(gid, os.path.join(tmp, "session"), r)
          sess.wait_until_saved()
        times.setdefault((way, "save"), []).append(time.perf_counter() - start)
        start = time.perf_counter()
        if way == "orbax":
          got = manager.restore(r, args=ocp.args.StandardRestore(jax.tree.map(
              lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), held)))
          jax.block_until_ready(got)
          del got
        else:
          sess.restore(gid, os.path.join(tmp, "session"))
        times.setdefault((way, "restore"), []).append(time.perf_counter() - start)
        if way == "session":  # the part: only its leaves are read
          start = time.perf_counter()
          sess.restore(part, os.path.join(tmp, "session"),
                       state_map=[(0, "['w0']"), (0, "['w1']")])
          times.setdefault(("session", "part"), []).append(time.perf_counter() - start)
        del held
    manager.close()
  for what in ("save (until written)", "restore"):
    key = what.split()[0]
    ours, theirs = (statistics.median(times[(w, key)]) for w in ("session", "orbax"))
    rows.append((f"{what}, {FLAGS.save_mib} MiB state, s (orbax directly / session)",
                 f"{theirs:.2f}", f"{ours:.2f}", f"{ours / theirs:.2f}x", "-", "-"))
  whole, part_s = (statistics.median(times[("session", k)]) for k in ("restore", "part"))
  rows.append(("restore of 2 of its 8 leaves (state_map) / the whole, s", f"{whole:.2f}",
               f"{part_s:.2f}", f"{part_s / whole:.2f}x", "-", "-"))


def many_steps_case(rows):
  """save (until written) + restore of a small state in a directory that
  already holds --wf_steps steps: the session, the session reading orbax's
  list of steps again on every call (as it did before
  checkpoint_steps.refresh), and orbax's CheckpointManager used directly."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  from jaxsession import checkpoint_steps  # pylint: disable=import-outside-toplevel
  state = np.arange(4096, dtype=np.float32)
  sess = js.Session()
  gid = sess.compile(lambda w: (w + 1.0, jnp.sum(w[:8])), state, state_argnums=0)
  refresh = checkpoint_steps.refresh

  def reload_always(manager, path):
    del path
    manager.reload()

  def session_way(tmp, always):
    checkpoint_steps.refresh = reload_always if always else refresh
    try:
      for step in range(FLAGS.wf_steps):
        sess.save(gid, tmp, step)
      sess.wait_until_saved()
      saves, restores = [], []
      for step in range(FLAGS.wf_steps, FLAGS.wf_steps + FLAGS.wf_repeats):
        start = time.perf_counter()
        sess.save(gid, tmp, step)
        sess.wait_until_saved()
        saves.append(time.perf_counter() - start)
        start = time.perf_counter()
        sess.restore(gid, tmp)
        restores.append(time.perf_counter() - start)
      return statistics.median(saves), statistics.median(restores)
    finally:
      checkpoint_steps.refresh = refresh

  def orbax_way(tmp):
    manager = ocp.CheckpointManager(tmp, options=ocp.CheckpointManagerOptions(max_to_keep=None))
    for step in range(FLAGS.wf_steps):
      manager.save(step, args=ocp.args.StandardSave({"w": state}))
    manager.wait_until_finished()
    saves, restores = [], []
    for step in range(FLAGS.wf_steps, FLAGS.wf_steps + FLAGS.wf_repeats):
      start = time.perf_counter()
      manager.save(step, args=ocp.args.StandardSave({"w": state}))
      manager.wait_until_finished()
      saves.append(time.perf_counter() - start)
      start = time.perf_counter()
      manager.restore(step, args=ocp.args.StandardRestore({"w": state}))
      restores.append(time.perf_counter() - start)
    manager.close()
    return statistics.median(saves), statistics.median(restores)

  ways = [("orbax", orbax_way), ("session", lambda t: session_way(t, False)),
          ("reloading", lambda t: session_way(t, True))]
  passes = {name: [] for name, _ in ways}
  for order in (ways, ways[::-1]):  # twice, the order reversed: no one always goes first
    for name, way in order:
      with tempfile.TemporaryDirectory() as tmp:
        passes[name].append(way(tmp))
  got = {name: [statistics.median(p[i] for p in runs) for i in range(2)]
         for name, runs in passes.items()}
  for i, what in enumerate(("save (until written)", "restore")):
    rows.append((f"{what}, 16 KiB state, directory of {FLAGS.wf_steps} steps, ms "
                 "(orbax directly / session; session reading orbax's list every call: "
                 f"{got['reloading'][i] * 1e3:.0f} ms)",
                 f"{got['orbax'][i] * 1e3:.0f}", f"{got['session'][i] * 1e3:.0f}",
                 f"{got['session'][i] / got['orbax'][i]:.2f}x", "-", "-"))


MEMORY_CHILD = r"""
import json, resource, sys
import numpy as np, jax, jax.numpy as jnp
import jaxsession as js
contender, mib = sys.argv[1], int(sys.argv[2])
def rss():
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * 4096
step = lambda w, x: (w * 0.5 + x, x + 1.0)  # the update in place: nothing else reads w
x = jnp.float32(1.0)
n = mib * 2**18
jax.block_until_ready(jnp.ones(8) + 1)  # jax started
before = rss()
w = jnp.ones((n,), jnp.float32)  # the state, made on the device
w.block_until_ready()
if contender == "session":
  sess = js.Session()
  gid = sess.compile(step, jax.ShapeDtypeStruct((n,), jnp.float32), x, state_argnums=0)
  sess.set_state(gid, w, donate=True)
  del w
  jax.block_until_ready(sess.run(gid, x))
else:
  f = jax.jit(step, donate_argnums=0)
  w, out = f(w, x)
  jax.block_until_ready(out)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"ratio": (peak - before) / (n * 4)}))
"""


def memory_case(rows):
  got = {}
  for contender in ("jit", "session"):
    proc = subprocess.run([sys.executable, "-c", MEMORY_CHILD, contender, str(FLAGS.big_mib)],
                          capture_output=True, text=True, check=True)
    got[contender] = json.loads(proc.stdout.strip().splitlines()[-1])["ratio"]
  rows.append((f"peak RSS of compile + bind + first step / state size ({FLAGS.big_mib} MiB)",
               f"{got['jit']:.2f}x", f"{got['session']:.2f}x", "-", "<= 1.15x",
               "yes" if got["session"] <= 1.15 else "no"))


def main(argv):
  del argv
  rows = []
  decode_case(rows)
  checkpoint_case(rows)
  big_save_case(rows)
  many_steps_case(rows)
  memory_case(rows)
  print(f"machine: {common.machine()}")
  common.print_table(f"workflows, medians of {FLAGS.wf_repeats} repeats", rows,
                     ["case", "plain JAX (or: without)", "Session (or: with)", "ratio",
                      "target", "met"])


if __name__ == "__main__":
  app.run(main)
