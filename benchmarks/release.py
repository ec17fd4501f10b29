"""Memory over many compile + run + release cycles: does anything a compile
caches keep the program's jaxprs, constants or executables alive?

Each cycle builds a new function closing over a new array (inside a `cond`
whose branch calls a nested jit, the shape that once pinned a buffer per
compile), compiles it, runs it once and lets it go: `Session.release` for the
session, dropping the jitted function for `jax.jit`. Each contender runs in its
own child process; each prints its resident memory (RSS, /proc/self/statm)
and `len(jax.live_arrays())` after warm-up cycles and at the end.

    python benchmarks/release.py [--cycles 1000] [--warmup 100]
"""
import json
import os
import subprocess
import sys

from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import machine, print_table  # noqa: E402

flags.DEFINE_integer("cycles", 1000, "compile + run + release cycles per contender")
flags.DEFINE_integer("warmup", 100, "cycles before the first reading")
FLAGS = flags.FLAGS

CHILD = r"""
import gc, json, os, sys, time
import numpy as np, jax, jax.numpy as jnp
from jax import lax
import jaxsession as js

contender, cycles, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
x, p = rng.standard_normal(64).astype(np.float32), np.float32(1.0)
sess = js.Session()

def rss_mib():
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

def cycle(i):
  big = jnp.asarray(rng.standard_normal(64).astype(np.float32))
  def f(x, p):
    return lax.cond(p > 0, lambda x: jax.jit(lambda y: y * big)(x), lambda x: x - big, x) + i
  if contender == "session":
    gid = sess.compile(f, x, p)
    jax.block_until_ready(sess.run(gid, x, p))
    sess.release(gid)
  else:
    jax.block_until_ready(jax.jit(f)(x, p))

readings, start = {}, time.perf_counter()
for i in range(cycles):
  cycle(i)
  if i + 1 in (warmup, cycles):
    gc.collect()
    readings[i + 1] = [rss_mib(), len(jax.live_arrays())]
readings["seconds"] = time.perf_counter() - start
print(json.dumps(readings))
"""


def run_child(contender):
  proc = subprocess.run([sys.executable, "-c", CHILD, contender, str(FLAGS.cycles),
                         str(FLAGS.warmup)], capture_output=True, text=True, check=True)
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv):
  del argv
  got = {c: run_child(c) for c in ("jit", "session")}
  rows = []
  for name, c in (("jax.jit", "jit"), ("Session", "session")):
    r = got[c]
    (rss0, live0), (rss1, live1) = r[str(FLAGS.warmup)], r[str(FLAGS.cycles)]
    rows.append([name, f"{rss0:.0f}", f"{rss1:.0f}", f"{rss1 - rss0:+.1f}", live0, live1,
                 f"{r['seconds']:.0f}"])
  print(f"machine: {machine()}")
  print_table(f"RSS over {FLAGS.cycles} compile + run + release cycles "
              f"(readings after cycle {FLAGS.warmup} and {FLAGS.cycles})",
              rows, ["contender", f"RSS MiB @{FLAGS.warmup}", f"RSS MiB @{FLAGS.cycles}",
                     "growth MiB", f"live arrays @{FLAGS.warmup}",
                     f"live arrays @{FLAGS.cycles}", "seconds"])
  s, j = got["session"], got["jit"]
  print(f"\nSession / jax.jit RSS at the end: "
        f"{s[str(FLAGS.cycles)][0] / j[str(FLAGS.cycles)][0]:.2f}")


if __name__ == "__main__":
  app.run(main)
