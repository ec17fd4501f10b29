"""Dispatch overhead of Session.run against plain jax.jit, measured in one run.

Prints a table of per-call times and ratios (session / jit):
  * a tiny stateless graph                 (target <= 1.05x jit)
  * a tiny stateful step, jit with donation (target <= 1.0x jit)
  * 100 steps sunk into one run vs 100 jit calls (target <= 0.03x), and vs
    the same loop written by hand: jax.jit of lax.scan, donated (no target)
  * jaxsession.jit in place of jax.jit: a tiny call, a call over a
    100-leaf pytree, and a call donating its state (no issue names a target:
    the bar here is the tiny stateless row's, <= 1.05x)
(issue 17's targets; the session's single run is the same C++ executable
call jax.jit makes, plus the session's Python: benchmarks/RESULTS.md)

    python benchmarks/dispatch.py [--repeats 7]
"""
import sys

from absl import app, flags
import jax
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import common  # noqa: E402
import jaxsession as js  # noqa: E402

flags.DEFINE_integer("repeats", 7, "repeats per measurement; the median is reported")
flags.DEFINE_integer("calls", 5000, "calls per repeat for per-call timings")
FLAGS = flags.FLAGS


tiny, tiny_step = common.tiny, common.tiny_step


def check_equal(want, got, what):
  """The contenders compute the same bits (a benchmark of different work
  would measure nothing)."""
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=what)


def ok(ratio, target):
  return "yes" if ratio <= target else "NO"


def main(argv):
  del argv
  r, n = FLAGS.repeats, FLAGS.calls
  key = jax.random.key(0)
  x = jax.random.normal(key, (16,))
  sess = js.Session()
  rows = []

  jit_tiny = jax.jit(tiny)
  gid = sess.compile(tiny, x)
  check_equal(jit_tiny(x), sess.run(gid, x), "tiny stateless graph")
  t_jit, t_sess = common.compare_us([lambda: jit_tiny(x), lambda: sess.run(gid, x)], n, r)
  rows.append(("tiny stateless graph", t_jit, t_sess, f"{t_sess / t_jit:.3f}", "<= 1.05",
               ok(t_sess / t_jit, 1.05)))

  jit_step = jax.jit(tiny_step, donate_argnums=0)
  holder = [jax.random.normal(jax.random.key(1), (16,))]

  def jit_call():
    holder[0], out = jit_step(holder[0], x)
    return out
  sid = sess.compile(tiny_step, holder[0] + 0, x, state_argnums=0)
  t_jit, t_sess = common.compare_us([jit_call, lambda: sess.run(sid, x)], n, r)
  rows.append(("tiny stateful step (jit donates)", t_jit, t_sess, f"{t_sess / t_jit:.3f}",
               "<= 1.0", ok(t_sess / t_jit, 1.0)))

  xs = jax.random.normal(jax.random.key(2), (100, 16))
  rows_x = [xs[i] for i in range(100)]

  def jit_100():
    out = None
    for xi in rows_x:
      holder[0], out = jit_step(holder[0], xi)
    return out
  t_jit, t_sess = common.compare_us([jit_100, lambda: sess.run(sid, xs, steps=100)],
                                    max(n // 100, 20), r, warmup=3)
  rows.append(("100 steps: one sunk run vs 100 jit calls", t_jit, t_sess,
               f"{t_sess / t_jit:.3f}", "<= 0.03", ok(t_sess / t_jit, 0.03)))
  # what a JAX user writes for many steps in one dispatch: the same loop by
  # hand, jax.jit of lax.scan with the state donated (no issue sets a target:
  # the session's sunk run is that program, plus its Python per call)
  scan_100 = jax.jit(lambda w, xs: jax.lax.scan(tiny_step, w, xs), donate_argnums=0)
  scanned = [holder[0] + 0]

  def jit_scan():
    scanned[0], out = scan_100(scanned[0], xs)
    return out
  check_equal(scan_100(holder[0] + 0, xs)[1],
              sess.run(sess.compile(tiny_step, holder[0] + 0, x, state_argnums=0), xs,
                       steps=100), "100 sunk steps vs jax.jit(lax.scan)")
  t_jit, t_sess = common.compare_us([jit_scan, lambda: sess.run(sid, xs, steps=100)],
                                    max(n // 100, 20), r, warmup=3)
  rows.append(("100 steps: one sunk run vs jax.jit(lax.scan), donated", t_jit, t_sess,
               f"{t_sess / t_jit:.3f}", "-", "-"))

  # js.jit where jax.jit was: its per-call work is the signature (per leaf) and run
  js_tiny = js.jit(tiny, session=sess)
  t_jit, t_js = common.compare_us([lambda: jit_tiny(x), lambda: js_tiny(x)], n, r)
  rows.append(("js.jit tiny call vs jax.jit", t_jit, t_js, f"{t_js / t_jit:.3f}", "<= 1.05",
               ok(t_js / t_jit, 1.05)))
  tree = {f"w{i}": jax.random.normal(jax.random.key(10 + i), (4,)) for i in range(100)}
  scale = jax.random.normal(jax.random.key(3), ())

  def scaled(p, s):
    return jax.tree_util.tree_map(lambda a: a * s, p)
  jit_tree, js_tree = jax.jit(scaled), js.jit(scaled, session=sess)
  t_jit, t_js = common.compare_us([lambda: jit_tree(tree, scale), lambda: js_tree(tree, scale)],
                                  max(n // 10, 50), r)
  rows.append(("js.jit 100-leaf pytree call vs jax.jit", t_jit, t_js, f"{t_js / t_jit:.3f}",
               "<= 1.05", ok(t_js / t_jit, 1.05)))
  # a donating call (eqx.filter_jit(donate="all") routed): jax.jit's executable, run
  # by the wrapper's C++ front (through Python it cost twice jax.jit's dispatch)
  jit_don = jax.jit(tiny_step, donate_argnums=0)
  js_don = js.jit(tiny_step, donate_argnums=0, session=sess)
  held = {"jit": holder[0] + 0, "js": holder[0] + 0}

  def donating(name, f):
    def call():
      held[name], out = f(held[name], x)
      return out
    return call
  t_jit, t_js = common.compare_us([donating("jit", jit_don), donating("js", js_don)], n, r)
  rows.append(("js.jit donating call vs jax.jit", t_jit, t_js, f"{t_js / t_jit:.3f}",
               "<= 1.05", ok(t_js / t_jit, 1.05)))

  print(f"machine: {common.machine()}")
  common.print_table(f"dispatch: µs per call, median of {r} interleaved repeats", rows,
                     ["case", "jax.jit µs", "Session.run µs", "ratio", "target", "met"])


if __name__ == "__main__":
  app.run(main)
