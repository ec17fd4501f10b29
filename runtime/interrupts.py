"""Ctrl-C never lands between a run's donation and its commit.

A run hands the session's state buffers to its executable (donation) and
writes the new values back to the slots afterwards. CPython raises a pending
signal's exception at the next eval-breaker point - right after the
executable's call returns, say - and a KeyboardInterrupt there would leave
the slots holding consumed buffers ("Array has been deleted").

So a run's critical section - from before its first executable until its
state is committed (`Runner.call`) - counts itself: `enter()` and `leave()`
are two C-level counters (itertools.count: atomic under the GIL, ~0.05 µs
each), `depth()` their difference. The SIGINT handler, wrapped once per
process by `install()`, only records a SIGINT that arrives while
`depth() > 0`. The outermost section that ends
delivers it: in the main thread by calling the handler that was installed
before ours (Python's default raises KeyboardInterrupt there, after the
commit); in another thread by `_thread.interrupt_main(signum)`, which makes
the main thread receive it again. Runs in several threads share one count:
a Ctrl-C waits until no run is in its critical section.

What it covers: SIGINT, with a Python-level handler installed when a Session
was created or a graph compiled (Python's default one, or the user's). A
handler installed after that replaces ours, and a Ctrl-C during a run then
behaves as that handler makes it; compiling another graph wraps it again.
Other signals, and SIGINT handlers set to SIG_IGN/SIG_DFL or installed in C,
are left alone.
"""
import _thread
import itertools
import signal
import threading

_entered, _left = itertools.count(), itertools.count()
enter, leave = _entered.__next__, _left.__next__  # a critical section's ends
pending = []  # signals received while depth() > 0, delivered when it is 0


def _value(counter):
  return int(repr(counter)[len("count("):-1])  # the next value, read without taking it


def depth():
  """Runs inside their critical section now, in every thread."""
  return _value(_entered) - _value(_left)


class _Deferring:
  """The SIGINT handler: the previous one, deferred while a run commits."""

  def __init__(self, previous):
    self.previous = previous

  def __call__(self, signum, frame):
    if depth():
      pending.append(signum)
      if not depth():  # the section ended while this recorded it: deliver it now
        deliver()
      return
    self.previous(signum, frame)


def install():
  """Wraps the current SIGINT handler in a deferring one, once per handler:
  only from the main thread, and only a Python callable that is not ours."""
  if threading.current_thread() is not threading.main_thread():
    return
  current = signal.getsignal(signal.SIGINT)
  if isinstance(current, _Deferring) or not callable(current):
    return
  signal.signal(signal.SIGINT, _Deferring(current))


def deliver():
  """Delivers a signal recorded during critical sections that have all
  ended (a section's end calls it when `pending` is set)."""
  if depth() or not pending:
    return
  try:
    signum = pending.pop()
  except IndexError:  # another thread delivered it
    return
  del pending[:]
  if threading.current_thread() is threading.main_thread():
    handler = signal.getsignal(signum)
    if isinstance(handler, _Deferring):
      handler.previous(signum, None)
    elif callable(handler):
      handler(signum, None)
  else:
    _thread.interrupt_main(signum)
