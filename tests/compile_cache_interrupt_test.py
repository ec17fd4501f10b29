"""A Ctrl-C while the compile cache registers, stores or waits for a compile
(runtime/compile_cache.py, interrupts.wait_for): raised or not, nothing
stays registered and no thread waits for good (break-it finds)."""
import threading
import time

from absl.testing import absltest

import jaxsession as js
from line_interrupts import ctrl_c_at, line_points
from jaxsession.runtime.compile_cache import ExecutableCache


class CompileCacheInterruptTest(absltest.TestCase):

  def test_a_ctrl_c_while_waiting_for_anothers_compile(self):
    # a Ctrl-C raised inside the wait's own Python (Condition.wait re-taking
    # its lock) could leave released a lock the compiling thread held: its
    # release then failed and every later wait hung (the same wait as the
    # checkpoint writer's, a break-it find there). A Ctrl-C on each line of
    # that Python, in turn: raised in the waiter, the compile goes on.
    js.Session()  # Ctrl-C handling installed (interrupts.install)
    points = line_points(threading.Condition.wait, threading.Event.wait,
                         threading.Condition.__enter__)
    died = []
    hook, threading.excepthook = threading.excepthook, lambda args: died.append(
        f"{args.exc_type.__name__}: {args.exc_value}")
    self.addCleanup(setattr, threading, "excepthook", hook)
    raised = 0
    for n, (code, line) in enumerate(points):
      cache, gate = ExecutableCache(8), threading.Event()
      compiling = threading.Thread(
          target=cache.get_or_compile, args=("k", lambda gate=gate: gate.wait() and n))
      compiling.start()
      while not cache._pending:  # pylint: disable=protected-access
        time.sleep(0.001)
      threading.Timer(0.2, gate.set).start()
      try:
        with ctrl_c_at(code, line):
          got = cache.get_or_compile("k", lambda: "the waiter's own")
      except KeyboardInterrupt:
        raised += 1
        got = None
      compiling.join(10)
      with self.subTest(code=code.co_qualname, line=line):
        self.assertFalse(compiling.is_alive())
        self.assertEqual(died, [])
        self.assertIn(got, (None, (n, True)))
        self.assertEqual(cache.get_or_compile("k", lambda: "again"), (n, True))
    self.assertGreater(raised, 3)

  def test_a_ctrl_c_anywhere_in_a_compile_leaves_no_compile_registered(self):
    # one landing between the compile's registration and its try, or after
    # the compile returned and before it was stored and finished, left it
    # registered for good: every later compile of the program, in any
    # thread, waited for it forever (a break-it find). A Ctrl-C on each line
    # of the cache's own code, in turn: raised or not, nothing stays behind.
    js.Session()  # Ctrl-C handling installed (interrupts.install)
    points = line_points(ExecutableCache.get_or_compile, ExecutableCache._claim,  # pylint: disable=protected-access
                         ExecutableCache._store, ExecutableCache._abandon)  # pylint: disable=protected-access
    raised = 0
    for n, (code, line) in enumerate(points):
      cache = ExecutableCache(8)
      try:
        with ctrl_c_at(code, line):
          cache.get_or_compile("k", lambda n=n: n)
      except KeyboardInterrupt:
        raised += 1
      other = []
      thread = threading.Thread(target=lambda: other.append(
          cache.get_or_compile("k", lambda: "the other thread's")))
      thread.start()
      thread.join(10)
      with self.subTest(code=code.co_qualname, line=line):
        self.assertFalse(thread.is_alive(), "a later compile waits for good")
        self.assertIn(other, ([(n, True)], [("the other thread's", False)]))
        self.assertEqual(cache._pending, {})  # pylint: disable=protected-access
    self.assertGreater(raised, 10)


if __name__ == "__main__":
  absltest.main()
