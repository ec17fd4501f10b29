"""Threads: a Session shared between threads. Trainers, an evaluator and
state readers hammer graphs that share one state; no call fails, no update is
lost, no read is torn."""
import textwrap
import threading

from absl.testing import absltest
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from subproc import HELPERS, run_json

RUNS = 150


def busy(s):
  """A few hundred µs of work that depends on the state, so that runs in
  several threads overlap inside the executables (which release the GIL)."""
  w = jnp.arange(128.0) + jnp.sum(s["a"]).astype(jnp.float32)
  m = jnp.tanh(jnp.outer(w, w) * 1e-6)
  return (jnp.sum(m @ m @ m) > 1e30).astype(jnp.int32)


def count_step(s, x):
  """Both leaves advance together: a consistent read has a == b."""
  return {"a": s["a"] + 1, "b": s["b"] + x}, s["a"][0] + busy(s)


def read_step(s, x):
  return s["a"] * x + busy(s), s["b"] * x


def hammer(workers):
  """Runs every worker in its own thread; returns the exceptions they raised."""
  errors = []
  barrier = threading.Barrier(len(workers))

  def wrap(work):
    def run():
      barrier.wait()
      try:
        work()
      except BaseException as exc:  # collected, asserted empty by the test
        errors.append(exc)
    return run
  threads = [threading.Thread(target=wrap(w)) for w in workers]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  return errors


class SharedStateThreadsTest(absltest.TestCase):

  def _session(self, options=None):
    state = {"a": jnp.zeros(3, jnp.int32), "b": jnp.zeros(3, jnp.int32)}
    one = jnp.ones(3, jnp.int32)
    sess = js.Session(options)
    train = sess.compile(count_step, state, one, state_argnums=0)
    second = sess.compile(count_step, state, one, state_argnums=0, state_from=train)
    evaluate = sess.compile(read_step, state, one, state_argnums=0, state_from=train,
                            updates_state=False)
    return sess, train, second, evaluate, one

  def _check(self, options=None):
    sess, train, second, evaluate, one = self._session(options)
    reads, seen_by_trainer = [], []

    def trainer():
      for _ in range(RUNS):
        seen_by_trainer.append(int(sess.run(train, one)))

    def second_trainer():
      for _ in range(RUNS // 5):
        sess.run(second, jnp.ones((5, 3), jnp.int32), steps=5)  # loop-sunk

    def evaluator():
      for _ in range(RUNS):
        reads.append(tuple(np.asarray(v) for v in sess.run(evaluate, one)))

    def reader():
      for _ in range(RUNS):
        state, = sess.get_state(train)
        reads.append((np.asarray(state["a"]), np.asarray(state["b"])))

    errors = hammer([trainer, second_trainer, evaluator, reader])
    self.assertEqual(errors, [])
    final, = sess.get_state(train)
    total = RUNS + (RUNS // 5) * 5
    np.testing.assert_array_equal(final["a"], np.full(3, total, np.int32))
    np.testing.assert_array_equal(final["b"], np.full(3, total, np.int32))
    for a, b in reads:
      np.testing.assert_array_equal(a, b)  # never half of one update
    self.assertEqual(len(set(seen_by_trainer)), RUNS)  # each run saw its own state

  def test_trainers_evaluator_and_readers(self):
    self._check()

  def test_without_donation_no_update_is_lost(self):
    self._check(js.SessionOptions(donate_state=False))

  def test_set_state_between_runs_is_atomic(self):
    sess, train, _, evaluate, one = self._session()
    values = [{"a": jnp.full(3, k, jnp.int32), "b": jnp.full(3, k, jnp.int32)}
              for k in range(0, 1000, 100)]
    reads = []

    def setter():
      for value in values:
        sess.set_state(train, value)

    def runner():
      for _ in range(RUNS):
        sess.run(train, one)

    def evaluator():
      for _ in range(RUNS):
        reads.append(tuple(np.asarray(v) for v in sess.run(evaluate, one)))

    self.assertEqual(hammer([setter, runner, evaluator]), [])
    for a, b in reads:
      np.testing.assert_array_equal(a, b)

  def test_compiles_in_threads(self):
    """One Simplify pass serves every compile: its per-run state was shared,
    and compiles in threads raised PassError (a review's find)."""
    sess = js.Session()
    x = jnp.asarray(np.random.default_rng(12).standard_normal(64), jnp.float32)
    errors, results = [], {}

    def work(t):
      for i in range(100):
        try:
          fn = lambda a, c=float(t * 1000 + i): jnp.sin(a * 2.0 + c) * 1.0 + 0.0 - a  # noqa: E731
          results[t, i] = (sess.run(sess.compile(fn, x), x), fn)
        except Exception as exc:  # pylint: disable=broad-except
          errors.append(exc)
          return
    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    self.assertEqual(errors, [])
    import jax  # pylint: disable=import-outside-toplevel
    for got, fn in list(results.values())[::37]:
      np.testing.assert_array_equal(got, jax.jit(fn)(x))

  def test_independent_graphs_run_side_by_side(self):
    sess = js.Session()
    gids = [sess.compile(lambda w, x: (w + x, jnp.sum(w)), jnp.zeros(4), jnp.ones(4),
                         state_argnums=0) for _ in range(3)]

    def work(gid):
      return lambda: [sess.run(gid, jnp.ones(4)) for _ in range(RUNS)]

    self.assertEqual(hammer([work(g) for g in gids]), [])
    for gid in gids:
      np.testing.assert_array_equal(sess.get_state(gid)[0], np.full(4, RUNS, np.float32))


class CallbackReentryTest(absltest.TestCase):
  """A callback calling back into the state its own run holds waited for that
  run forever (release, replace_state: a break-it find); it is refused, the
  state as before the run. Run in a subprocess, so a hang fails the test."""

  def test_refused_not_hung(self):
    out = run_json(HELPERS + textwrap.dedent("""
      import json, tempfile
      import jax, jax.numpy as jnp, numpy as np
      import jaxsession as js
      sess = js.Session()
      box = {}
      def cb(v):
        box["call"]()
        return np.asarray(v) * 2
      def step(s, x):
        y = jax.pure_callback(cb, jax.ShapeDtypeStruct(x.shape, x.dtype), s * x)
        return s + y, y.sum()
      def in_scan(s, x):
        def body(c, _):
          return c + jax.pure_callback(cb, jax.ShapeDtypeStruct(x.shape, x.dtype), c), None
        return s + 1.0, jax.lax.scan(body, x, None, length=2)[0]
      rng = np.random.default_rng(21)
      s0 = jnp.asarray(rng.standard_normal(4), jnp.float32)
      x = jnp.asarray(rng.standard_normal(4), jnp.float32)
      other = sess.compile(lambda t, x: (t * x, t.sum()), s0, x, state_argnums=0)
      d = tempfile.mkdtemp()
      results = {}
      for name, fn in (("host", step), ("scan", in_scan)):
        gid = sess.compile(fn, s0, x, state_argnums=0)
        calls = {
            "run": lambda: sess.run(gid, x), "get_state": lambda: sess.get_state(gid),
            "set_state": lambda: sess.set_state(gid, s0),
            "replace_state": lambda: sess.replace_state(gid, 0, s0),
            "save": lambda: sess.save(gid, d, 1), "release": lambda: sess.release(gid)}
        for what, call in calls.items():
          box["call"] = call
          before = np.asarray(sess.get_state(gid)[0])
          got = err(lambda: sess.run(gid, x))
          results[f"{name} {what}"] = [got[0], what + "(graph" in got[1] and
                                       "called from inside a run" in got[1],
                                       bool(np.array_equal(np.asarray(sess.get_state(gid)[0]),
                                                           before))]
        box["call"] = lambda: sess.run(other, x)  # another graph's state: runs
        results[f"{name} other"] = err(lambda: sess.run(gid, x))
      # an argument still being computed: XLA runs the executable, and its
      # callback, on a thread of its own once the argument is ready (the
      # mark on the run's thread was not seen there: a hang, a review's find)
      heavy = jax.jit(lambda m: jnp.tanh(jnp.tanh(m @ m) @ m))
      m0 = jnp.asarray(rng.standard_normal((700, 700)) * 1e-2, jnp.float32)
      late = sess.compile(lambda s, m: in_scan(s, m[0, :4]), s0, m0, state_argnums=0)
      heavy(m0).block_until_ready()
      box["call"] = lambda: sess.get_state(late)
      got = err(lambda: sess.run(late, heavy(m0)))
      results["pipelined get_state"] = [got[0], "called from inside a run" in got[1], True]
      # two graphs of one function share a cached executable: B's callback
      # reading A's state, while A runs in another thread, waits for A (it
      # was refused: the shared recorder listed A's lock for B's callback)
      import threading, time
      def by_thread(v):  # A's run (thread "A") sleeps; B's reads A's state
        if threading.current_thread().name == "A":
          time.sleep(0.3)
        else:
          sess.get_state(box["ga"])
        return np.asarray(v)
      def share(s, x):  # in a scan: inside the executable, through its recorder
        def body(c, _):
          return c + jax.pure_callback(by_thread, jax.ShapeDtypeStruct(x.shape, x.dtype),
                                       c), None
        return s + 1.0, jax.lax.scan(body, s * x, None, length=1)[0]
      ga = box["ga"] = sess.compile(share, s0, x, state_argnums=0)
      gb = sess.compile(share, s0, x, state_argnums=0)
      t = threading.Thread(target=lambda: sess.run(ga, x), name="A")
      t.start()
      time.sleep(0.05)
      results["other graph, shared executable"] = err(lambda: sess.run(gb, x))
      t.join()
      print(json.dumps(results))
    """), devices=1, timeout=240)
    for key, got in out.items():
      if key.endswith("other") or key.endswith("shared executable"):
        self.assertIsNone(got, key)
      else:
        self.assertEqual(got, ["HostOpError", True, True], key)


if __name__ == "__main__":
  absltest.main()
