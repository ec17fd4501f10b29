"""A Ctrl-C at the narrowest windows of save() and compile(): a real SIGINT
sent at one chosen instant (sys.settrace picks the line, the signal lands
at CPython's next check), in a subprocess each. Each window broke the
session for the rest of the process before its fix (break-it finds)."""
import textwrap

from absl.testing import absltest
import pytest

from subproc import run_json

PRELUDE = """
import gc, json, os, signal, sys, tempfile, threading, time
import numpy as np, jax, jax.numpy as jnp
import jaxsession as js
from jaxsession import checkpoint_steps

def interrupt_when(pick):
  # the user's Ctrl-C at the first trace event `pick` accepts
  fired = []
  def trace(frame, event, arg):
    if not fired and pick(frame, event):
      fired.append(True)
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.01)  # handled at the next check: here
    return trace
  sys.settrace(trace)
  return fired

def called(fn):
  try:
    fn()
    return "returned"
  except KeyboardInterrupt:
    return "KeyboardInterrupt"
  finally:
    sys.settrace(None)

def within(seconds, fn):
  # fn() in a thread: its result, or "hung" (a deadlock)
  box = ["hung"]
  def go():
    try:
      box[0] = fn()
    except Exception as exc:
      box[0] = f"{type(exc).__name__}: {exc}"
  t = threading.Thread(target=go, daemon=True)
  t.start()
  t.join(seconds)
  return box[0]

sess = js.Session()
gid = sess.compile(lambda a, x: (a + x, jnp.sum(a)), jnp.asarray([0.5, -1.5, 2.25, 3.0]),
                   jnp.float32(1), state_argnums=0)
folder = tempfile.mkdtemp()
sess.save(gid, folder, 1)
sess.wait_until_saved()  # orbax imported, the writer thread running
sess.run(gid, jnp.float32(1))

def later_saves():
  sess.run(gid, jnp.float32(1))
  sess.save(gid, folder, 3)
  sess.wait_until_saved()
  steps = sorted(checkpoint_steps.complete_steps(folder))
  restored = []
  for step in steps:  # each complete step restores
    sess.restore(gid, folder, step)
    restored.append(float(np.asarray(sess.get_state(gid)[0]).sum()))
  return [steps, restored]
"""


@pytest.mark.slow  # subprocesses
class InterruptWindowsTest(absltest.TestCase):

  def _run(self, body):
    return run_json(PRELUDE + textwrap.dedent(body), devices=1, timeout=300)

  def test_a_ctrl_c_inside_the_queueing_of_a_save(self):
    # after the write was appended, before it was counted (inside Queue.put,
    # the writer thread died on task_done, and every later wait_until_saved
    # hung; now a C SimpleQueue's put, then the session's own count)
    out = self._run("""
        from jaxsession import checkpoints
        HAND_OFF = checkpoints.Checkpointer._hand_off.__code__
        line = next(i for i, text in enumerate(open(checkpoints.__file__).read().splitlines(), 1)
                    if "self._asked += 1" in text)
        fired = interrupt_when(lambda f, e: f.f_code is HAND_OFF and e == "line"
                               and f.f_lineno == line)
        first = called(lambda: sess.save(gid, folder, 2))
        writers = [t.name for t in threading.enumerate() if "checkpoint" in t.name]
        print(json.dumps([bool(fired), first, within(60, later_saves), writers]))
        """)
    fired, first, later, writers = out
    self.assertTrue(fired)
    self.assertEqual(first, "KeyboardInterrupt")  # the user's Ctrl-C is not lost
    steps, sums = later
    self.assertEqual(steps[0], 1)
    self.assertEqual(steps[-1], 3)
    self.assertEqual([sums[0], sums[-1]], [4.25, 12.25])  # as saved: 4.25 + 4 per run
    self.assertTrue(writers)  # the writer thread lives on

  def test_a_handler_that_returns_does_not_end_the_wait_for_a_save(self):
    # the user's own handler (a flag for a graceful stop) returns: the wait
    # went on no more, and wait_until_saved returned with the save unwritten
    # (a break-it find)
    out = self._run("""
        flags = []
        signal.signal(signal.SIGINT, lambda signum, frame: flags.append(signum))
        big = sess.compile(lambda w: (w * 0.5, w[0]), jnp.asarray(
            np.random.default_rng(3).standard_normal(1 << 22), jnp.float32), state_argnums=0)
        written = []
        for k in range(3):
          sess.save(big, folder, 10 + k)
          for t in (0.005, 0.02, 0.08):
            threading.Timer(t, os.kill, (os.getpid(), signal.SIGINT)).start()
          sess.wait_until_saved()
          written.append(10 + k in checkpoint_steps.complete_steps(folder))
          time.sleep(0.1)
        print(json.dumps([len(flags), written]))
        """)
    flags, written = out
    self.assertGreater(flags, 0)  # the handler ran
    self.assertEqual(written, [True, True, True])

  def test_a_ctrl_c_as_a_critical_function_delivers_is_raised_after_it(self):
    # one arriving as the closing deliver() returned (after its look) was
    # recorded and delivered by no one: the call returned, a sleep after it
    # ran its course, and the Ctrl-C came out of some later session call, or
    # never (a break-it find). Here: as save's leave() returns, and as a
    # run returns.
    out = self._run("""
        from jaxsession.runtime import interrupts
        LEAVE = interrupts.leave.__code__
        where = []
        picks = {  # save's leave() returning; a run returning (its deliver() looked)
            "_hand_off": lambda f, e: f.f_code is LEAVE and e == "return"
                                      and f.f_back.f_code.co_name == "_hand_off",
            "call": lambda f, e: f.f_code in interrupts._CRITICAL and e == "return"
                                 and f.f_code.co_name == "call"}
        def stage_of(pick, call):  # where the Ctrl-C came out
          fired = interrupt_when(pick)
          stage = "the call"
          try:
            call()
            sys.settrace(None)
            stage = "the sleeps after it"
            for _ in range(100):
              time.sleep(0.02)
            stage = "never"
          except KeyboardInterrupt:
            pass
          finally:
            sys.settrace(None)
          return [bool(fired), stage, list(interrupts.pending)]
        for caller, call in (("_hand_off", lambda k: sess.save(gid, folder, 10 + k)),
                             ("call", lambda k: sess.run(gid, jnp.float32(1)))):
          for k in range(3):
            where.append([caller, *stage_of(picks[caller], lambda: call(k))])
        # under a profiler of the user's: it stays, and so does the answer
        # (a first cut's profile hook replaced a C profiler: a review's find)
        events = []
        profiler = lambda frame, event, arg: events.append(event)
        sys.setprofile(profiler)
        where.append(["call, profiled", *stage_of(picks["call"],
                                                  lambda: sess.run(gid, jnp.float32(1)))])
        kept, seen = sys.getprofile() is profiler, len(events)
        sys.setprofile(None)
        sess.wait_until_saved()
        print(json.dumps([where, kept, seen]))
        """)
    where, kept, seen = out
    for caller, fired, stage, pending in where:
      self.assertTrue(fired, caller)
      self.assertIn(stage, ("the call", "the sleeps after it"), caller)
      self.assertEqual(pending, [], caller)
    self.assertTrue(kept)  # the user's profiler is still the one
    self.assertGreater(seen, 0)

  def test_a_ctrl_c_as_the_save_takes_a_snapshot_slot(self):
    # inside threading.Semaphore.acquire, as it leaves `with self._cond:`:
    # its lock stayed held and every later save blocked for good
    out = self._run("""
        EXIT = threading.Condition.__exit__.__code__
        ACQUIRE = threading.Semaphore.acquire.__code__
        fired = interrupt_when(lambda f, e: e == "call" and f.f_code is EXIT
                               and f.f_back is not None and f.f_back.f_code is ACQUIRE)
        first = called(lambda: sess.save(gid, folder, 2))
        print(json.dumps([bool(fired), first, within(60, later_saves)]))
        """)
    fired, first, later = out
    self.assertTrue(fired)
    self.assertEqual(first, "KeyboardInterrupt")
    self.assertEqual(later, [[1, 3], [4.25, 12.25]])  # nothing of step 2 was queued

  def test_a_save_a_handler_that_returns_stopped_is_written(self):
    # a Ctrl-C as the save took a snapshot slot, to a handler of the user's
    # that sets a flag and returns: nothing was queued, and save() returned
    # as saved (31 of 100 random presses: a break-it find); now it goes on
    out = self._run("""
        EXIT = threading.Condition.__exit__.__code__
        ACQUIRE = threading.Semaphore.acquire.__code__
        flags = []
        signal.signal(signal.SIGINT, lambda signum, frame: flags.append(signum))
        fired = interrupt_when(lambda f, e: e == "call" and f.f_code is EXIT
                               and f.f_back is not None and f.f_back.f_code is ACQUIRE)
        first = called(lambda: sess.save(gid, folder, 2))
        sess.wait_until_saved()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print(json.dumps([bool(fired), first, len(flags),
                          sorted(checkpoint_steps.complete_steps(folder))]))
        """)
    self.assertEqual(out, [True, "returned", 1, [1, 2]])

  def test_two_presses_as_a_save_waiting_in_line_ends_leave_the_line_clear(self):
    # a save waiting its turn behind another session's, a raising handler of
    # the user's: a press past the save's commit gave the user's handler back
    # early (the lend was its place in line's, a generator off the stack), and
    # a second as it left the line was raised before the removal: every later
    # save into the directory waited for good (a break-it find)
    out = self._run("""
        from jaxsession.runtime import interrupts
        other = js.Session()
        big = other.compile(lambda x: (x + 1, x[0]), jnp.zeros(1 << 22, jnp.float32),
                            state_argnums=0)
        presses = []
        def raising(signum, frame):
          raise KeyboardInterrupt(len(presses))
        signal.signal(signal.SIGINT, raising)
        leave, leave_line = interrupts.leave, checkpoint_steps._leave_line
        join_line, joined = checkpoint_steps._join_line, []
        def joining(path, writer):
          joined.append(writer)
          return join_line(path, writer)
        def pressed_leave(lending):  # press 1: past _hand_off's commit, in line
          if sys._getframe(1).f_code.co_name == "_hand_off" and joined and not presses:
            presses.append(1)
            os.kill(os.getpid(), signal.SIGINT)
          return leave(lending)
        def pressed_leave_line(path, writer):  # press 2: as it leaves the line
          if len(presses) == 1:
            presses.append(2)
            os.kill(os.getpid(), signal.SIGINT)
          return leave_line(path, writer)
        interrupts.leave, checkpoint_steps._leave_line = pressed_leave, pressed_leave_line
        checkpoint_steps._join_line = joining
        other.save(big, folder, 5)  # its write in flight: sess's save waits in line
        first = called(lambda: sess.save(gid, folder, 6))
        interrupts.leave, checkpoint_steps._leave_line = leave, leave_line
        checkpoint_steps._join_line = join_line
        kept = signal.getsignal(signal.SIGINT) is raising
        signal.signal(signal.SIGINT, signal.default_int_handler)
        other.wait_until_saved()
        sess.wait_until_saved()
        after = within(60, lambda: (other.save(big, folder, 7), other.wait_until_saved(),
                                    sorted(checkpoint_steps.complete_steps(folder)))[-1])
        print(json.dumps([presses, first, kept, after]))
        """)
    presses, first, kept, after = out
    self.assertEqual(presses, [1, 2])
    self.assertEqual(first, "KeyboardInterrupt")
    self.assertTrue(kept)
    self.assertNotEqual(after, "hung")  # every later save into the directory waited
    self.assertIn(7, after)

  def test_a_ctrl_c_as_the_collector_is_paused(self):
    # right after gc.disable() (compile's pause, run_op's), and as the pause's
    # entry returns: the collector stayed off for the process
    out = self._run("""
        from jaxsession import gc_pause
        ENTER = gc_pause._enter.__code__
        line = next(i for i, text in enumerate(open(gc_pause.__file__).read().splitlines(), 1)
                    if "_DEPTH[0] += 1" in text)
        calls = {"compile": lambda: sess.compile(lambda a: a * 2, jnp.ones(3)),
                 "run_op": lambda: sess.run_op(jax.lax.sin_p, jnp.ones(3) * 0.25)}
        found = {}
        for name, call in calls.items():
          for when in ("counted", "entered"):
            if when == "counted":
              fired = interrupt_when(lambda f, e: f.f_code is ENTER and e == "line"
                                     and f.f_lineno == line)
            else:
              fired = interrupt_when(lambda f, e: f.f_code is ENTER and e == "return")
            first = called(call)
            found[f"{name} {when}"] = [bool(fired), first, gc.isenabled()]
        sess.compile(lambda a: a - 1, jnp.ones(3))
        print(json.dumps([found, gc.isenabled()]))
        """)
    found, enabled = out
    for name, (fired, first, on) in found.items():
      self.assertTrue(fired, name)
      self.assertEqual(first, "KeyboardInterrupt", name)
      self.assertTrue(on, name)
    self.assertTrue(enabled)


  def test_a_pause_in_another_thread_ignores_the_main_threads_ctrl_c(self):
    # a Ctrl-C recorded for the main thread (inside a run, say) made a
    # compile in a worker thread undo its pause on entry and again on exit:
    # the count went negative and the collector was never paused again
    out = self._run("""
        from jaxsession import gc_pause
        from jaxsession.runtime import interrupts
        interrupts.pending.append((signal.SIGINT, signal.getsignal(signal.SIGINT)))  # as recorded
        seen = []
        def worker():
          sess.compile(lambda a: a * 3, jnp.ones(3))
          with gc_pause.paused():
            seen.append(gc.isenabled())
        t = threading.Thread(target=worker)
        t.start()
        t.join(60)
        del interrupts.pending[:]
        with gc_pause.paused():
          seen.append(gc.isenabled())
        print(json.dumps([seen, gc.isenabled()]))
        """)
    self.assertEqual(out, [[False, False], True])


  def test_a_pause_inside_a_critical_function_leaves_the_ctrl_c_to_it(self):
    # a compile from a run's callback (inside the run's critical section):
    # its pause undid itself and delivered the Ctrl-C inside the run's
    # commit; now the pause holds, and the outer function delivers at its end
    out = self._run("""
        from jaxsession import gc_pause
        from jaxsession.runtime import interrupts

        @interrupts.critical
        def outer():  # as Runner.call: lends ours, ends by delivering
          lending = interrupts.lend()
          interrupts.pending.append((signal.SIGINT, signal.getsignal(signal.SIGINT)))  # recorded
          with gc_pause.paused():
            inside = gc.isenabled()
          seen.extend([inside, bool(interrupts.pending)])
          left_critical = True
          interrupts.leave(lending)

        seen = []
        seen.append(called(outer))
        with gc_pause.paused():
          seen.append(gc.isenabled())
        print(json.dumps([seen, gc.isenabled()]))
        """)
    self.assertEqual(out, [[False, True, "KeyboardInterrupt", False], True])


@pytest.mark.slow  # subprocesses
class RecordedCtrlCTest(absltest.TestCase):

  def test_a_ctrl_c_recorded_through_a_long_wait_hangs_nothing(self):
    # while a Ctrl-C stayed recorded (a run, or a wait inside one, going
    # on), the watcher thread read the main thread's frames every 5 ms with
    # sys._current_frames(): CPython 3.11 holds its thread-list lock there
    # while it allocates, a collection then ran jax's gc callback under it,
    # and a thread ending waited for that lock holding the GIL the watcher
    # waited for - the whole process hung (CI ran out its 90 minutes; gdb
    # showed the two threads). Threads start and end here, the collector
    # runs often, the GIL changes hands at once: the old watcher hung about
    # one process in three; each must end, the Ctrl-C raised once per wait.
    script = """
        import gc, json, os, signal, sys, threading, time
        import jaxsession as js
        from jaxsession.runtime import interrupts
        js.Session()  # the handler installed
        sys.setswitchinterval(1e-6)
        gc.set_threshold(20, 2, 2)
        heap = [[i] for i in range(300000)]  # (a collection takes a while)
        stop = time.monotonic() + 6
        def churn():
          while time.monotonic() < stop:
            t = threading.Thread(target=lambda: [[] for _ in range(50)])
            t.start(); t.join()
            cycle = []; cycle.append(cycle)
        workers = [threading.Thread(target=churn) for _ in range(6)]
        for w in workers: w.start()
        cond = threading.Condition()

        @interrupts.critical
        def outer():  # as a run whose callback waits: its wait is not ended
          interrupts.wait_for(cond, lambda: time.monotonic() > stop)
          left_critical = True
          interrupts.deliver()
        raised = []
        for wait in (lambda: interrupts.wait_for(cond, lambda: time.monotonic() > stop), outer):
          threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGINT)).start()
          try:
            wait()
            raised.append(False)
          except KeyboardInterrupt:
            raised.append(True)
          time.sleep(0.2)
        for w in workers: w.join()
        time.sleep(0.6)  # the watcher's reminders, if any were left, land here
        print(json.dumps(raised))
        """
    for _ in range(2):
      self.assertEqual(run_json(script, devices=1, timeout=90), [True, True])

  def test_the_users_handler_is_lent_for_a_call_and_put_back(self):
    # ours stood in for the user's handler from the first compile on (and
    # wrapped one installed since): code that puts its previous handler back
    # only where the current one is still its own found ours, left it, and
    # the next Ctrl-C set a stale flag alone (a break-it find). Now ours
    # stands in for a handler of the user's for a call only: inside a run (a
    # callback looks) it defers to the user's; after it, getsignal gives the
    # user's own object. Over Python's default ours stays (asyncio.run then
    # installs no handler of its own). asyncio's handler of
    # add_signal_handler, which does nothing, is not wrapped (wrapped, the
    # watcher's reminders fired its callback 2-4 times a press)
    out = run_json("""
        import asyncio, json, os, signal, time
        import jax, jax.numpy as jnp
        import jaxsession as js
        seen = []
        def look(_):
          seen.append(signal.getsignal(signal.SIGINT))
        def step(a, x):
          jax.debug.callback(look, x)
          return a + x, a
        sess = js.Session()
        gid = sess.compile(step, jnp.ones(3), jnp.ones(3), state_argnums=0)
        flags = []
        mine = lambda signum, frame: flags.append(signum)
        previous = signal.signal(signal.SIGINT, mine)  # a graceful stop's context
        sess.run(gid, jnp.ones(3))
        inside = seen[-1]
        lent = [inside is not mine and getattr(inside, "previous", None) is mine,
                signal.getsignal(signal.SIGINT) is mine]
        if signal.getsignal(signal.SIGINT) is mine:  # its exit: put back if still its own
          signal.signal(signal.SIGINT, previous)
        try:
          os.kill(os.getpid(), signal.SIGINT)
          time.sleep(0.5)
          after = "no KeyboardInterrupt"
        except KeyboardInterrupt:
          after = "KeyboardInterrupt"
        loop = asyncio.new_event_loop()
        loop.add_signal_handler(signal.SIGINT, lambda: None)
        noop = signal.getsignal(signal.SIGINT)
        sess.run(gid, jnp.ones(3))
        left = [seen[-1] is noop, signal.getsignal(signal.SIGINT) is noop]
        loop.remove_signal_handler(signal.SIGINT)  # (puts Python's default back)
        loop.close()
        sess.run(gid, jnp.ones(3))
        async def main():  # asyncio.Runner installs its own only over Python's default,
          return signal.getsignal(signal.SIGINT)  # which ours stands in for from the first compile
        kept = asyncio.run(main())
        print(json.dumps([lent, flags, after, left,
                          getattr(kept, "previous", None) is signal.default_int_handler]))
        """, devices=1, timeout=120)
    self.assertEqual(out, [[True, True], [], "KeyboardInterrupt", [True, True], True])

  def test_each_press_during_a_run_reaches_the_handler(self):
    # three presses inside one run's host callback, to a handler of the
    # user's that counts them (press three times to force a quit): each was
    # recorded as one, and the handler ran once (a break-it find)
    out = run_json("""
        import json, os, signal, time
        import jax, jax.numpy as jnp, numpy as np
        import jaxsession as js
        def slow(a):
          for _ in range(3):
            os.kill(os.getpid(), signal.SIGINT)  # handled as the sleep begins
            time.sleep(0.02)
          return np.asarray(a) * 2
        def step(s, x):
          return s + jax.pure_callback(slow, jax.ShapeDtypeStruct(x.shape, x.dtype), x), s
        sess = js.Session()
        gid = sess.compile(step, jnp.ones(3), jnp.ones(3), state_argnums=0)
        calls = []
        signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
        sess.run(gid, jnp.ones(3))
        print(json.dumps([len(calls), np.asarray(sess.get_state(gid)[0]).tolist()]))
        """, devices=1, timeout=120)
    self.assertEqual(out, [3, [3.0, 3.0, 3.0]])

  def test_a_press_recorded_through_a_second_in_c_leaves_no_mark(self):
    # (a review's find) a Ctrl-C recorded while a marked call spent a second
    # in C, the GIL released, left marks that dropped later presses; and a
    # critical function that never sets its LEFT local is refused (one
    # recorded past its last look stayed recorded: a break-it find)
    out = run_json("""
        import hashlib, json, os, signal, time
        import jaxsession as js
        from jaxsession.runtime import interrupts
        js.Session()

        @interrupts.critical
        def long_in_c():
          lending = interrupts.lend()
          try:
            os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C, recorded
            hashlib.pbkdf2_hmac("sha256", b"p", b"s", 1_500_000)  # ~1 s, no GIL
          finally:
            left_critical = True
            interrupts.leave(lending)
        first = "returned"
        try:
          long_in_c()
        except KeyboardInterrupt:
          first = "KeyboardInterrupt"
        later = []
        for _ in range(6):  # each later press raises
          try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            later.append("lost")
          except KeyboardInterrupt:
            later.append("KeyboardInterrupt")
        def no_local():
          return 1
        try:
          interrupts.critical(no_local)
          refused = ""
        except TypeError as exc:
          refused = str(exc)
        print(json.dumps([first, later, refused]))
        """, devices=1, timeout=120)
    self.assertEqual(out[:2], ["KeyboardInterrupt", ["KeyboardInterrupt"] * 6])
    self.assertIn("no_local never sets left_critical", out[2])

  def test_presses_during_a_run_reach_the_handler_as_under_jit(self):
    # a press recorded inside a run's callback, then two while the callback
    # spends a second in C: a watcher thread re-sent SIGINT while one was
    # recorded (for one recorded past a call's last look), and the user's
    # two presses merged with its signals and were dropped as its (the
    # handler ran once, under jax.jit twice: a break-it find's count, 261
    # against 302 of 450 presses)
    out = run_json("""
        import hashlib, json, os, signal, threading, time
        import jax, jax.numpy as jnp, numpy as np
        import jaxsession as js
        def slow(a):
          os.kill(os.getpid(), signal.SIGINT)  # handled as the sleep begins
          time.sleep(0.05)
          for delay in (0.1, 0.25):  # two more while the main thread is in C
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT)).start()
          hashlib.pbkdf2_hmac("sha256", b"p", b"s", 6_000_000)  # ~1.3 s, no GIL
          return np.asarray(a) * 2
        def step(s, x):
          return s + jax.pure_callback(slow, jax.ShapeDtypeStruct(x.shape, x.dtype), x), s
        calls = []
        signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
        x = jnp.asarray(np.random.default_rng(7).standard_normal(3), jnp.float32)
        jitted = jax.jit(step)(x, x)
        jax.block_until_ready(jitted)
        under_jit = len(calls)
        sess = js.Session()
        gid = sess.compile(step, x, x, state_argnums=0)
        del calls[:]
        sess.run(gid, x)
        state = np.asarray(sess.get_state(gid)[0])
        print(json.dumps([under_jit, len(calls),
                          bool(np.array_equal(state, np.asarray(jitted[0])))]))
        """, devices=1, timeout=120)
    under_jit, in_session, equal = out
    self.assertEqual(in_session, under_jit, out)
    self.assertGreaterEqual(under_jit, 2, out)
    self.assertTrue(equal)


if __name__ == "__main__":
  absltest.main()
