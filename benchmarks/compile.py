"""First compile: Session.compile against jax.jit(f).lower(*args).compile(), on
generated programs of about 1k and 10k jaxpr equations, measured in one run.

Two program generators: benchmarks/passes.py's (mixed elementwise, broadcast,
reduction and dot ops with duplicates, identities and dead values - the
Session's passes shrink it ~2.6x before XLA sees it), and a chain without
redundancy (every step reads the previous one; nothing for the passes to
remove) at 1k equations by default (XLA:CPU takes ~7 s on it here;
`--chain_programs 1000,10000` adds the 10k one), issue 17's 11.2k-equation
tanh/where chain on f32[4,8] (`where_chain`), and a bfloat16 program over 300
strong float32 scalar state leaves (`weak_state`, compiled with
state_argnums=0 against jax.jit with them donated), whose weak types compile
once asked about leaf by leaf.

Prints:
  * cold compiles: a fresh Session per trial, and a fresh jax.jit of a new
    function object per trial (so none of jax.jit's in-memory caches can hit),
    JAX's persistent compilation cache off in this process (checked). Each
    trial compiles its own program (generated with the trial's seed) with both
    contenders, alternately first; medians of
    the times and of the per-trial ratios (target: Session / jit <= 1.3);
  * the phases of each: jax.jit's trace, lower and XLA compile; the Session's
    trace + import (and the rest of compile outside the passes and Build),
    the pipeline's passes (report.passes) and Build (lowering the final
    KernelGraph plus XLA, as the compile cache's lookup timed it:
    report.cache.seconds);
  * the compile cache: a second compile of the same program (a new function
    object) in the same Session - its time and `report.cache.hit` - beside
    jax.jit's own in-memory cache (the same jitted function lowered and
    compiled again);
  * JAX's persistent cache: a child process compiles the 1k program with
    `SessionOptions(compilation_cache_dir=tmp)` (then jax.jit of it, the cache
    being process-wide), twice; the second process's compile vs the first's.

    python benchmarks/compile.py [--trials 5] [--big_trials 2] [--chain_trials 3]
        [--programs 1000,10000] [--chain_programs 1000] [--where_chain_layers 1400]
        [--weak_state_leaves 300]
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
from jax import lax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import common  # noqa: E402
import jaxsession as js  # noqa: E402
from jaxsession.graph.importer import import_jaxpr  # noqa: E402
from passes import generated_program  # noqa: E402

# (passes.py, imported for its program generator, defines --sizes and --repeats,
# which this benchmark does not read.)
flags.DEFINE_string("programs", "1000,10000", "equation counts of the generated programs")
flags.DEFINE_integer("trials", 5, "cold trials of each program under 5000 equations")
flags.DEFINE_integer("big_trials", 2, "cold trials of each program of 5000 equations or more "
                     "(XLA:CPU takes ~30 s on the 10k program on 2 cores)")
flags.DEFINE_string("chain_programs", "1000", "equation counts of the chain programs "
                    "(nothing for the passes to remove); XLA takes ~7 s on the 1k one")
flags.DEFINE_integer("chain_trials", 3, "cold trials of each chain program under 5000 "
                     "equations")
flags.DEFINE_integer("where_chain_layers", 1400, "layers of the tanh/where chain (8 eqns a "
                     "layer: 1400 is issue 17's 11.2k-equation program); 0: skip it")
flags.DEFINE_integer("where_chain_trials", 3, "cold trials of the tanh/where chain")
flags.DEFINE_integer("weak_state_leaves", 300, "strong float32 scalar state leaves of the "
                     "bfloat16 program (0: not run)")
flags.DEFINE_integer("weak_state_trials", 3, "cold trials of the weak-state program")
flags.DEFINE_integer("persistent_eqns", 1000, "equations of the persistent-cache program")
flags.DEFINE_string("child_cache_dir", None, "internal: run as the persistent-cache child")
FLAGS = flags.FLAGS

TARGET = 1.3
WHERE_CHAIN_TARGET = 1.2  # issue 17's target for the tanh/where chain


CHAIN_EQNS_PER_STEP = (1 + 1 + 1 + 2 + 3 + 4) / 6  # the mean over the 6 kinds below


def chain_program(n_eqns, seed=0):
  """About n_eqns equations with nothing for the passes to remove: every step
  reads the previous step's result (no dead values), no two steps compute the
  same thing (no CSE), no identities (nothing to simplify). The contrast to
  passes.py's generator, which the Session's passes shrink ~2.6x."""
  rng = np.random.default_rng(seed)
  steps = int(round(n_eqns / CHAIN_EQNS_PER_STEP))
  choices = rng.integers(0, 6, size=steps)
  picks = rng.integers(0, 1 << 30, size=steps)

  def program(x, bias, w):
    pool = [x]
    for kind, b in zip(choices, picks):
      u, v = pool[-1], pool[b % len(pool)]
      if kind == 0:
        out = lax.sin(u)                                          # 1 eqn
      elif kind == 1:
        out = lax.add(u, v)                                       # 1
      elif kind == 2:
        out = lax.mul(u, v)                                       # 1
      elif kind == 3:
        out = u + lax.broadcast_in_dim(bias, u.shape, (1,))       # 2
      elif kind == 4:
        out = u - lax.broadcast_in_dim(lax.reduce_max(u, (1,)), u.shape, (0,))  # 3
      else:
        out = lax.tanh(lax.dot(u, w) + lax.broadcast_in_dim(bias, u.shape, (1,)))  # 4
      pool.append(out)
      if len(pool) > 16:
        pool = pool[-16:]
    return pool[-1]
  return program


def where_chain(layers, seed=0):
  """Issue 17's elementwise chain: per layer `tanh(x*w)*0.5+x`, then
  `where(h>0, h, 0.1*h)-w` (8 equations, one of them jnp.where's nested
  jit), on f32[4,8] with 4 weights taken in turn. The seed only makes each
  trial's function object new."""
  del seed

  def program(x, w0, w1, w2, w3):
    ws = (w0, w1, w2, w3)
    for i in range(layers):
      w = ws[i % 4]
      h = jnp.tanh(x * w) * 0.5 + x
      x = jnp.where(h > 0, h, 0.1 * h) - w
    return x
  return program


def weak_state(leaves, seed=0):
  """A bfloat16 program over `leaves` strong float32 scalar state leaves
  (per-layer scales, `h + a * tanh(h)`), returning them updated: every
  leaf's weak type would change the program, which compile once traced
  again leaf by leaf (session/state_typing.py)."""
  del seed

  def program(scales, x):
    h = x
    for a in scales:
      h = h + a * jnp.tanh(h).astype(jnp.bfloat16)
    return [a * 0.999 for a in scales], h
  return program


def weak_state_args():
  rng = np.random.default_rng(5)
  return ([jnp.float32(rng.standard_normal()) for _ in range(FLAGS.weak_state_leaves)],
          jnp.asarray(rng.standard_normal((4, 8)), jnp.bfloat16))


def where_chain_args():
  rng = np.random.default_rng(17)
  return tuple(jnp.asarray(rng.standard_normal((4, 8)), jnp.float32) for _ in range(5))


def example_args():
  x = jnp.ones((8, 16), jnp.float32) * 0.5
  bias, w = jnp.ones((16,), jnp.float32) * 0.1, jnp.eye(16, dtype=jnp.float32) * 0.3
  return x, bias, w


def jit_cold(gen, n, seed, args, state=()):
  """jax.jit of a new function object (the `state` positions donated):
  trace, lower, XLA compile, seconds."""
  fn = gen(n, seed)
  jitted = jax.jit(fn, donate_argnums=state)
  t0 = time.perf_counter()
  traced = jitted.trace(*args)
  t1 = time.perf_counter()
  lowered = traced.lower()
  t2 = time.perf_counter()
  lowered.compile()
  t3 = time.perf_counter()
  return dict(total=t3 - t0, trace=t1 - t0, lower=t2 - t1, xla=t3 - t2,
              eqns=len(traced.jaxpr.eqns), jitted=jitted)


def session_compile(sess, gen, n, seed, args, state=()):
  """Session.compile of a new function object (`state`: its state_argnums):
  wall seconds and the report's breakdown."""
  fn = gen(n, seed)
  t0 = time.perf_counter()
  gid = sess.compile(fn, *args, state_argnums=state)
  wall = time.perf_counter() - t0
  report = sess.report(gid)
  passes = sum(p.seconds for p in report.passes)
  build = report.cache.seconds
  stages = {}
  for p in report.passes:
    stages[p.stage] = stages.get(p.stage, 0.0) + p.seconds
  return dict(total=wall, reported=report.compile_seconds, passes=passes, build=build,
              rest=report.compile_seconds - passes - build, stages=stages,
              hit=report.cache.hit, hits=report.cache.hits, misses=report.cache.misses,
              nodes=(report.nodes_imported, report.nodes_final))


def cold_trials(gen, n, trials, args, state=()):
  out = []
  for t in range(trials):
    seed = 1000 * n + t
    order = ("jit", "session") if t % 2 == 0 else ("session", "jit")
    trial = {}
    sess = None
    for who in order:
      if who == "jit":
        trial["jit"] = jit_cold(gen, n, seed, args, state)
      else:
        sess = js.Session()
        trial["session"] = session_compile(sess, gen, n, seed, args, state)
    assert not trial["session"]["hit"] and trial["session"]["misses"] >= 1, trial["session"]
    # The compile cache: the same program again (a new function object) in
    # the same Session, and jax.jit's own cache (same jitted function).
    trial["session_again"] = session_compile(sess, gen, n, seed, args, state)
    jitted = trial["jit"].pop("jitted")
    t0 = time.perf_counter()
    jitted.lower(*args).compile()
    trial["jit_again"] = time.perf_counter() - t0
    # Pieces of the Session's "trace + import + rest", measured alone on the
    # same program: one trace (jax.make_jaxpr) and the import into a KernelGraph.
    t0 = time.perf_counter()
    closed = jax.make_jaxpr(gen(n, seed))(*args)
    t1 = time.perf_counter()
    import_jaxpr(closed)
    trial["trace_alone"], trial["import_alone"] = t1 - t0, time.perf_counter() - t1
    del sess, jitted, closed
    out.append(trial)
  return out


def child(path):
  """One process of the persistent-cache row: Session.compile, then jax.jit
  of the same program, with JAX's persistent cache in `path`."""
  events = []
  jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
  hit_event = "/jax/compilation_cache/cache_hits"
  args = example_args()
  sess = js.Session(js.SessionOptions(compilation_cache_dir=path))
  s = session_compile(sess, generated_program, FLAGS.persistent_eqns, 0, args)
  s_hits = events.count(hit_event)
  j = jit_cold(generated_program, FLAGS.persistent_eqns, 0, args)
  j.pop("jitted")
  print(json.dumps({"session": s, "jit": j, "session_disk_hits": s_hits,
                    "jit_disk_hits": events.count(hit_event) - s_hits}))


def persistent_rows():
  with tempfile.TemporaryDirectory() as path:
    runs = []
    for _ in range(2):
      proc = subprocess.run([sys.executable, __file__, f"--child_cache_dir={path}",
                             f"--persistent_eqns={FLAGS.persistent_eqns}"],
                            capture_output=True, text=True, timeout=600)
      if proc.returncode != 0:
        raise RuntimeError(f"persistent-cache child failed:\n{proc.stderr[-3000:]}")
      runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
      runs[-1]["entries"] = len(os.listdir(path))
  return runs


def fmt_s(x):
  return f"{x:.3f}"


def main(argv):
  del argv
  if FLAGS.child_cache_dir:
    child(FLAGS.child_cache_dir)
    return
  cache_dir = jax.config.values.get("jax_compilation_cache_dir")
  if cache_dir:
    raise SystemExit(f"JAX's persistent compilation cache is on ({cache_dir}): the cold "
                     "numbers need it off (unset JAX_COMPILATION_CACHE_DIR)")
  args = example_args()
  start = time.perf_counter()
  # Warm-up, discarded: first-use costs of jax, XLA and the session's modules.
  cold_trials(generated_program, 200, 1, args)

  results = {}
  for n in [int(s) for s in FLAGS.programs.split(",") if s]:
    trials = FLAGS.big_trials if n >= 5000 else FLAGS.trials
    results[f"{n} eqns, passes.py generator"] = cold_trials(generated_program, n, trials, args)
  for n in [int(s) for s in FLAGS.chain_programs.split(",") if s]:
    trials = FLAGS.big_trials if n >= 5000 else FLAGS.chain_trials
    results[f"{n} eqns, chain without redundancy"] = cold_trials(chain_program, n, trials,
                                                                 args)
  if FLAGS.where_chain_layers:
    results[f"{8 * FLAGS.where_chain_layers} eqns, tanh/where chain"] = cold_trials(
        where_chain, FLAGS.where_chain_layers, FLAGS.where_chain_trials, where_chain_args())
  if FLAGS.weak_state_leaves:
    results[f"{FLAGS.weak_state_leaves} scalar state leaves, bf16"] = cold_trials(
        weak_state, FLAGS.weak_state_leaves, FLAGS.weak_state_trials, weak_state_args(),
        state=(0,))
  assert not jax.config.values.get("jax_compilation_cache_dir"), "persistent cache turned on"
  persistent = persistent_rows()
  elapsed = time.perf_counter() - start

  print(f"machine: {common.machine()}")
  med = statistics.median
  rows, breakdown, cache_rows, notes = [], [], [], []
  for n, trials in results.items():
    jit_t = med(t["jit"]["total"] for t in trials)
    ses_t = med(t["session"]["total"] for t in trials)
    ratio = med(t["session"]["total"] / t["jit"]["total"] for t in trials)
    eqns = sorted({t["jit"]["eqns"] for t in trials})
    nodes = [t["session"]["nodes"] for t in trials]
    label = f"{eqns[0]}" if len(eqns) == 1 else f"{eqns[0]}-{eqns[-1]}"
    target = WHERE_CHAIN_TARGET if "tanh/where" in n else TARGET
    rows.append([n, label, len(trials), fmt_s(jit_t), fmt_s(ses_t), f"{ratio:.2f}",
                 f"<= {target}", "yes" if ratio <= target else "NO"])
    again = med(t["session_again"]["total"] for t in trials)
    hits = [t["session_again"]["hit"] for t in trials]
    cache_rows.append([n, fmt_s(ses_t), fmt_s(again),
                       f"{med(t['session_again']['total'] / t['session']['total'] for t in trials):.2f}",
                       f"{all(hits)} ({sum(hits)}/{len(hits)})",
                       fmt_s(jit_t), f"{med(t['jit_again'] for t in trials):.4f}"])
    breakdown.append([
        n, fmt_s(med(t["jit"]["trace"] for t in trials)),
        fmt_s(med(t["jit"]["lower"] for t in trials)),
        fmt_s(med(t["jit"]["xla"] for t in trials)),
        fmt_s(med(t["session"]["rest"] for t in trials)),
        fmt_s(med(t["trace_alone"] for t in trials)),
        fmt_s(med(t["import_alone"] for t in trials)),
        fmt_s(med(t["session"]["passes"] for t in trials)),
        fmt_s(med(t["session"]["build"] for t in trials)),
        f"{med(t['session']['build'] / t['jit']['xla'] for t in trials):.2f}",
        fmt_s(med(t["session_again"]["rest"] for t in trials)),
        fmt_s(med(t["session_again"]["passes"] for t in trials)),
        fmt_s(med(t["session_again"]["build"] for t in trials))])
    stage_names = list(trials[0]["session"]["stages"])
    notes.append(f"{n}: nodes imported -> after the pipeline {nodes}; passes by stage "
                 "(median s): " + ", ".join(
                     f"{s} {med(t['session']['stages'].get(s, 0.0) for t in trials):.3f}"
                     for s in stage_names) +
                 "; per-trial Session/jit ratios: " + ", ".join(
                     f"{t['session']['total'] / t['jit']['total']:.2f}" for t in trials) +
                 "; outside XLA (Session: compile less Build; jit: trace + lower), median s: "
                 f"Session {med(t['session']['total'] - t['session']['build'] for t in trials):.3f}"
                 f", jit {med(t['jit']['trace'] + t['jit']['lower'] for t in trials):.3f}")

  first, second = persistent
  persist_rows = []
  for who, label in (("session", "Session.compile (compilation_cache_dir=tmp)"),
                     ("jit", "jax.jit(f).lower().compile() (same process, cache on)")):
    a, b = first[who]["total"], second[who]["total"]
    disk = f"{who}_disk_hits"
    persist_rows.append([label, first["jit"]["eqns"], fmt_s(a), fmt_s(b), f"{b / a:.2f}",
                         f"{first[disk]} / {second[disk]}",
                         f"{first['entries']} / {second['entries']}",
                         "yes" if second[disk] >= 1 and first[disk] == 0 else "NO"])
  notes.append(f"persistent cache, 2nd process: the Session's in-memory compile cache "
               f"reports hit={second['session']['hit']} (a new process starts empty), yet "
               f"Build took {second['session']['build']:.3f} s against "
               f"{first['session']['build']:.3f} s in the 1st (XLA skipped: loaded from "
               f"disk); its other phases: trace + import + rest "
               f"{second['session']['rest']:.3f} s, passes {second['session']['passes']:.3f} s")

  common.print_table(
      "compile, cold: seconds, Session.compile vs jax.jit(f).lower(*args).compile(); medians",
      rows, ["program", "jaxpr eqns", "trials", "jax.jit s", "Session s",
             "Session / jit (median of per-trial ratios)", "target", "met"])
  common.print_table(
      "compile phases (median seconds)", breakdown,
      ["program", "jit trace", "jit lower", "jit XLA compile",
       "Session trace + import + rest", "of which: 1 trace (alone)",
       "of which: import (alone)", "Session passes", "Session Build (lower + XLA)",
       "Build / jit XLA", "2nd compile: trace + import + rest", "2nd: passes",
       "2nd: Build (cache lookup)"])
  common.print_table(
      "compile cache: a 2nd compile of the same program (new function object) in the same "
      "Session; medians", cache_rows,
      ["program", "Session cold s", "Session 2nd compile s", "2nd / cold",
       "report.cache.hit on the 2nd (trials)", "jax.jit cold s",
       "jax.jit, same jitted fn lowered+compiled again s"])
  common.print_table(
      f"JAX's persistent compilation cache: two processes compile the same "
      f"{FLAGS.persistent_eqns}-eqn program", persist_rows,
      ["contender", "jaxpr eqns", "1st process (cold) s", "2nd process s", "2nd / 1st",
       "disk-cache hits 1st / 2nd", "cache dir entries after 1st / 2nd",
       "2nd loads from disk"])
  print()
  for note in notes:
    print(f"- {note}")
  for n, trials in results.items():
    ratio = med(t["session"]["total"] / t["jit"]["total"] for t in trials)
    if ratio > TARGET:
      print(f"- TARGET MISSED on {n}: Session.compile is {ratio:.2f}x jax.jit "
            f"(target <= {TARGET}); see the phases above.")
  print("- Cold: every trial compiles a program generated with its own seed, each contender "
        "from a new function object (jax.jit's in-memory caches key on the function), in a "
        "fresh Session; JAX's persistent cache is off in this process "
        f"(jax_compilation_cache_dir={jax.config.values.get('jax_compilation_cache_dir')}).")
  print("- Session Build = report.cache.seconds (the compile cache's lookups and the "
        "compiles they ran: lowering the final KernelGraph and XLA); 'Session passes' = the "
        "sum of report.passes seconds (each pass's own run, without the graph verification "
        "after it); 'trace + import + rest' = report.compile_seconds - passes - Build: the "
        "trace, the weak-type check (tracing.weak_sensitive: no second trace here - every "
        "value of these programs is float32 or bool, so no weak type can change the "
        "program (tracing.weak_type_is_moot); a mixed-precision program is traced again "
        "once per numeric run arg), the import, "
        "KernelGraph.verify() after every changed pass (verify_graphs=True, the default; the structure again only where a pass rewired the graph), "
        "the fingerprint and the rest. '1 trace (alone)' and 'import (alone)' are "
        "jax.make_jaxpr and import_jaxpr timed by themselves on the same program. The "
        "Session compiles the optimised graph (DCE, simplification, fusions - duplicates "
        "CSE marks are left for XLA: see the node counts), so on passes.py's programs its XLA input is much smaller than "
        "jax.jit's; XLA:CPU's time follows that size only loosely (Build / jit XLA in the "
        "phases table). The chain without redundancy is the fairer test of the Session's "
        "own compile overhead; 'outside XLA' in the notes above is that overhead against "
        "jax.jit's trace + lower. Single runs on this shared 2-core machine vary by up to "
        "~1.5x (see the per-trial ratios).")
  print("- The Session's compile cache skips Build only: a second compile still traces, "
        "imports and runs the passes (the key is a fingerprint of the optimised graph). "
        "jax.jit's own cache, on the same jitted function, skips everything.")
  print(f"- wall time of the whole benchmark: {elapsed:.0f} s")


if __name__ == "__main__":
  app.run(main)
