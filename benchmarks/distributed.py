"""Beyond one device (issue 9): the bundled MLP with Adam trained data
parallel on 8 CPU devices in one process, through the Session and through
plain `jax.jit` given the same shardings and donation, measured in the same
run:

  1. step time, Session.run vs jax.jit (target <= 1.05x: the same SPMD
     program through the same engine), replicated and "zero" state;
  2. per-device state bytes, "zero" vs replicated (target <= 0.15x);
  3. all-reduces per step in the executable: XLA's CPU combiner on (the
     default) and off (`xla_disable_hlo_passes=cpu-all-reduce-combiner`,
     one all-reduce per gradient leaf), without and with the session's
     bucket plan (SessionOptions(allreduce_bucket_bytes=...));
  4. 100 steps as one sunk run (steps=100) vs 100 Session.run calls vs 100
     jax.jit calls;
  5. collective bytes per step, "zero" / replicated, with the bucket plan
     (under "zero" the sharded leaves' gradients are reduce-scattered;
     target <= 0.2x all-reduce + reduce-scatter bytes), and every kind.

8 CPU devices on a machine with few cores measure overhead, not scaling.
Run: .venv/bin/python benchmarks/distributed.py
"""
import os
import sys

# 8 CPU devices: before anything starts a JAX backend (absl parses the flags later).
_DEVICES = 8
for _arg in sys.argv[1:]:
  if _arg.startswith("--devices="):
    _DEVICES = int(_arg.split("=", 1)[1])

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", _DEVICES)

from absl import app, flags  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (benchmarks/common.py)

import jaxsession as js  # noqa: E402
from jaxsession.examples import mlp_adam  # noqa: E402
from jaxsession.runtime import collectives  # noqa: E402

flags.DEFINE_integer("devices", _DEVICES, "CPU devices of the mesh (read before JAX starts)")
flags.DEFINE_integer("batch", 256, "global batch size")
flags.DEFINE_integer("calls", 50, "steps per timed repeat (step-time table)")
flags.DEFINE_integer("sunk", 100, "steps of the sunk-vs-calls table")
flags.DEFINE_integer("repeats", 7, "interleaved repeats (medians reported)")
flags.DEFINE_integer("bucket_bytes", 32 << 10, "allreduce_bucket_bytes of the bucketed rows")
FLAGS = flags.FLAGS

# Every per-step loop waits for each step's loss (as a loop that logs its loss
# does), the jax.jit loops and the session's alike: with 8 CPU devices on a
# 2-core machine, plain jax.jit steps dispatched back to back without a wait
# deadlock now and then in XLA's in-process all-reduce rendezvous ("Expected 8
# threads to join the rendezvous, but only 7 of them arrived", then abort;
# measured with jax 0.10.2, no session involved).
SYNC = "wait for each step"
NO_COMBINER = {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}


def setup():
  """The mesh, initial state and data (host numpy), and the batches laid out
  as the session lays them out (rows over the mesh)."""
  devices = jax.devices()[:FLAGS.devices]
  mesh = Mesh(np.array(devices), ("data",))
  kp, kd = jax.random.split(jax.random.key(0))
  params = jax.tree.map(np.asarray, mlp_adam.init_params(kp))
  opt = jax.tree.map(np.asarray, mlp_adam.adam_init(params))
  n = max(FLAGS.calls, FLAGS.sunk)
  data = jax.tree.map(np.asarray, mlp_adam.make_data(kd, n, FLAGS.batch))
  rows = NamedSharding(mesh, P("data"))
  batches = [jax.device_put(jax.tree.map(lambda a: a[t], data), rows) for t in range(n)]
  stacked = jax.device_put(jax.tree.map(lambda a: a[:FLAGS.sunk], data),
                           NamedSharding(mesh, P(None, "data")))
  return mesh, params, opt, batches, stacked


def session(mesh, params, opt, batch, specs, **options):
  sess = js.Session(js.SessionOptions(mesh=mesh, **options))
  gid = sess.compile(mlp_adam.train_step, params, opt, batch, state_argnums=(0, 1),
                     state_specs=specs)
  return sess, gid


def gspmd_jit(mesh, sess, gid, compiler_options=None):
  """jax.jit of the same step with the session's shardings and donation;
  returns (step, state holder)."""
  same = tuple(jax.tree.map(lambda x: x.sharding, sess.get_state(gid)))
  rows = NamedSharding(mesh, P("data"))
  jitted = jax.jit(mlp_adam.train_step, in_shardings=(*same, rows),
                   out_shardings=(*same, NamedSharding(mesh, P())), donate_argnums=(0, 1))
  holder = list(jax.tree.map(lambda x: x.copy(), sess.get_state(gid)))
  return jitted, holder


def all_reduces(colls):
  """(count, bytes) of the all-reduces in a list of Collectives."""
  ars = [c for c in colls if c.kind == "all-reduce"]
  return len(ars), sum(c.bytes for c in ars)


def step_times(mesh, params, opt, batches):
  """Table 1 and the state-bytes table."""
  rows, byte_rows = [], []
  per_device = {}
  for specs in (None, "zero"):
    sess, gid = session(mesh, params, opt, batches[0], specs)
    calls = FLAGS.calls
    jit_loop, session_loop = call_loops(sess, gid, gspmd_jit(mesh, sess, gid),
                                        batches[:calls])

    samples = []
    jit_us, sess_us = common.compare_us([jit_loop, session_loop], 1, FLAGS.repeats, warmup=2,
                                        samples_out=samples)
    ratio = common.paired_ratio(samples[1], samples[0])
    name = "replicated" if specs is None else '"zero"'
    rows.append((f"state {name}", f"{jit_us / calls:.0f}", f"{sess_us / calls:.0f}",
                 f"{ratio:.2f}x", "<= 1.05x", "yes" if ratio <= 1.05 else "no"))
    rep = sess.report(gid).sharding
    measured = js.runtime.sharding.device_bytes(jax.tree.leaves(sess.get_state(gid)))
    per_device[specs] = (rep.state_bytes_per_device, measured, rep.state_bytes_replicated)
  zero, replicated = per_device["zero"], per_device[None]
  ratio = zero[0] / replicated[0]
  byte_rows.append(("params + Adam m, v, t", replicated[0], zero[0], zero[1],
                    f"{ratio:.3f}x", "<= 0.15x", "yes" if ratio <= 0.15 else "no"))
  return rows, byte_rows


def collective_counts(mesh, params, opt, batches):
  """Table 3: all-reduces per step, by configuration; jax.jit's count for
  the same compiler options beside the session's."""
  rows = []
  for combiner in (True, False):
    for bucket in (None, FLAGS.bucket_bytes, 1 << 20):
      options = {} if combiner else {"compiler_options": dict(NO_COMBINER)}
      sess, gid = session(mesh, params, opt, batches[0], None,
                          allreduce_bucket_bytes=bucket, **options)
      rep = sess.report(gid)
      count, nbytes = all_reduces(rep.collectives)
      plan = rep.sharding.plan
      planned = "-" if plan is None else str(len(plan.buckets))
      jitted, holder = gspmd_jit(mesh, sess, gid)
      compiled = jitted.lower(*holder, batches[0]).compile(
          compiler_options=None if combiner else dict(NO_COMBINER))
      jit_count, _ = all_reduces(collectives.collectives(compiled))
      loss = float(sess.run(gid, batches[0]))  # runs, and runs the same step
      rows.append(("on (default)" if combiner else "off", "none" if bucket is None
                   else f"{bucket} B", planned, count, nbytes, jit_count, f"{loss:.6f}"))
  return rows


def zero_traffic(mesh, params, opt, batches):
  """Table 5: collective bytes per step by kind, replicated vs "zero", both
  with the bucket plan (allreduce_bucket_bytes), and jax.jit's "zero"."""
  rows, moved = [], {}
  for specs in (None, "zero"):
    sess, gid = session(mesh, params, opt, batches[0], specs,
                        allreduce_bucket_bytes=FLAGS.bucket_bytes)
    kinds = {}
    for c in sess.report(gid).collectives:
      kinds[c.kind] = kinds.get(c.kind, 0) + c.bytes
    moved[specs] = kinds.get("all-reduce", 0) + kinds.get("reduce-scatter", 0)
    name = "replicated" if specs is None else '"zero"'
    rows.append((f"Session, {name}", kinds.get("all-reduce", 0), kinds.get("reduce-scatter", 0),
                 kinds.get("all-gather", 0), sum(kinds.values()) - sum(
                     kinds.get(k, 0) for k in ("all-reduce", "reduce-scatter", "all-gather")),
                 moved[specs]))
    if specs == "zero":
      jitted, holder = gspmd_jit(mesh, sess, gid)
      jkinds = {}
      for c in collectives.collectives(jitted.lower(*holder, batches[0]).compile()):
        jkinds[c.kind] = jkinds.get(c.kind, 0) + c.bytes
      rows.append(('jax.jit, "zero" shardings', jkinds.get("all-reduce", 0),
                   jkinds.get("reduce-scatter", 0), jkinds.get("all-gather", 0),
                   sum(jkinds.values()) - sum(jkinds.get(k, 0) for k in
                                              ("all-reduce", "reduce-scatter", "all-gather")),
                   jkinds.get("all-reduce", 0) + jkinds.get("reduce-scatter", 0)))
  ratio = moved["zero"] / moved[None]
  rows.append(('"zero" / replicated, all-reduce + reduce-scatter bytes', "-", "-", "-", "-",
               f"{ratio:.3f}x (target <= 0.2x: {'yes' if ratio <= 0.2 else 'no'})"))
  return rows


def sunk_vs_calls(mesh, params, opt, batches, stacked):
  """Table 4: 100 steps, three ways."""
  n = FLAGS.sunk
  sess, gid = session(mesh, params, opt, batches[0], None)
  jit_calls, session_calls = call_loops(sess, gid, gspmd_jit(mesh, sess, gid), batches[:n])

  def session_sunk():
    return sess.run(gid, stacked, steps=n)

  # the same steps in one dispatch by hand: jax.jit of lax.scan, same
  # shardings (the batches' leading step axis unsharded), state donated
  same = tuple(jax.tree.map(lambda x: x.sharding, sess.get_state(gid)))
  def body(carry, b):
    p, o, loss = mlp_adam.train_step(*carry, b)
    return (p, o), loss
  scan = jax.jit(lambda p, o, xs: jax.lax.scan(body, (p, o), xs),
                 in_shardings=(*same, NamedSharding(mesh, P(None, "data"))),
                 out_shardings=(same, NamedSharding(mesh, P())), donate_argnums=(0, 1))
  scanned = list(jax.tree.map(lambda x: x.copy(), sess.get_state(gid)))

  def jit_scan():
    (scanned[0], scanned[1]), losses = scan(scanned[0], scanned[1], stacked)
    return losses

  samples = []
  jit_us, calls_us, sunk_us, scan_us = common.compare_us(
      [jit_calls, session_calls, session_sunk, jit_scan], 1, FLAGS.repeats, warmup=2,
      samples_out=samples)
  rows = [(f"{n} jax.jit calls (same shardings, donation)", f"{jit_us / n:.0f}", "1.00x"),
          (f"{n} Session.run calls", f"{calls_us / n:.0f}",
           f"{common.paired_ratio(samples[1], samples[0]):.2f}x"),
          (f"one Session.run(steps={n}) (loop sink)", f"{sunk_us / n:.0f}",
           f"{common.paired_ratio(samples[2], samples[0]):.2f}x"),
          (f"one jax.jit(lax.scan) of {n} steps (same shardings, donation)",
           f"{scan_us / n:.0f}", f"{common.paired_ratio(samples[3], samples[0]):.2f}x "
           f"(the sunk run: {common.paired_ratio(samples[2], samples[3]):.2f}x of it)")]
  return rows


def call_loops(sess, gid, jit_and_holder, batches):
  """(a jax.jit loop, a Session.run loop) over `batches`, one call a step,
  each step's loss waited for (see SYNC)."""
  jitted, holder = jit_and_holder

  def jit_loop():
    for b in batches:
      holder[0], holder[1], loss = jitted(holder[0], holder[1], b)
      loss.block_until_ready()
    return loss

  def session_loop():
    for b in batches:
      loss = sess.run(gid, b)
      loss.block_until_ready()
    return loss
  return jit_loop, session_loop


def main(argv):
  del argv
  if len(jax.devices()) < FLAGS.devices:
    raise SystemExit(f"asked for {FLAGS.devices} devices; JAX has {len(jax.devices())}")
  mesh, params, opt, batches, stacked = setup()
  print(f"machine: {common.machine()}; mesh {dict(mesh.shape)} of {FLAGS.devices} "
        f"{jax.devices()[0].platform} devices in one process")
  print(f"model: examples/mlp_adam.py (32-128-128-1, hand-written Adam), global batch "
        f"{FLAGS.batch}, batches already laid out on the mesh (rows split over 'data')")
  step_rows, byte_rows = step_times(mesh, params, opt, batches)
  common.print_table(f"step time, µs/step, median of {FLAGS.repeats} interleaved repeats of "
                     f"{FLAGS.calls} steps (ratio: median of per-repeat ratios)", step_rows,
                     ["case", "jax.jit, same shardings + donation", "Session.run",
                      "session / jit", "target", "met"])
  common.print_table("state bytes per device (report.sharding; measured: summed over "
                     "addressable shards of get_state)", byte_rows,
                     ["state", "replicated B", '"zero" B', '"zero" B, measured',
                      "zero / replicated", "target", "met"])
  common.print_table(
      "all-reduces per step in the executable (report.collectives), replicated state",
      collective_counts(mesh, params, opt, batches),
      ["XLA CPU all-reduce combiner", "allreduce_bucket_bytes", "planned buckets",
       "session all-reduces", "session all-reduce bytes", "jax.jit all-reduces",
       "loss of one step"])
  common.print_table(f"collective bytes per step (report.collectives), allreduce_bucket_bytes="
                     f"{FLAGS.bucket_bytes}", zero_traffic(mesh, params, opt, batches),
                     ["executable", "all-reduce B", "reduce-scatter B", "all-gather B", "other B",
                      "all-reduce + reduce-scatter B"])
  common.print_table(f"{FLAGS.sunk} steps, µs/step, median of {FLAGS.repeats} interleaved "
                     "repeats, replicated state", sunk_vs_calls(mesh, params, opt, batches,
                                                               stacked),
                     ["way", "µs/step", "vs jax.jit"])


if __name__ == "__main__":
  app.run(main)
