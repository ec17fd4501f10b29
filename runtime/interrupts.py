"""Ctrl-C never lands inside a run's commit, nor while it holds slot locks.

A run locks its state slots, hands the session's state buffers to its
executable (donation) and writes the new values back before it unlocks.
CPython raises a pending signal's exception at the next eval-breaker point -
right after the executable's call returns, say, or between two lock
acquires - and a KeyboardInterrupt there would leave the slots holding
consumed buffers ("Array has been deleted") or a lock held forever.

So the functions that hold slot locks are marked `critical` (Runner.call,
Session.get_state, set_state, release): marking only records the function's
code object, it wraps nothing and costs nothing per call. The SIGINT
handler, wrapped once per handler by `install()`, runs in the main thread
(Python runs signal handlers there only) and looks at the frames that
thread is executing: inside a critical function it only records the
signal; the critical function delivers it as its last step
(`if pending: deliver()`), after the commit and the unlock, by calling the
handler that was installed before ours (Python's default raises
KeyboardInterrupt there). A run in another thread never receives
KeyboardInterrupt, so it defers nothing: a Ctrl-C reaches an idle main
thread at once, whatever other threads run.

What it covers: SIGINT, with a Python-level handler installed when a Session
was created or a graph compiled (Python's default one, or the user's). A
handler installed after that replaces ours, and a Ctrl-C during a run then
behaves as that handler makes it; compiling another graph wraps it again.
A SIGINT that lands inside jax's garbage-collector callback, where CPython
would ignore the KeyboardInterrupt, is sent again once that callback returned.
Other signals, and SIGINT handlers set to SIG_IGN/SIG_DFL or installed in C,
are left alone. A run of the main thread that never returns (a callback that
blocks forever) cannot be interrupted by Ctrl-C: its state would be lost.
"""
import os
import signal
import threading

_CRITICAL = set()  # code objects of the functions that hold slot locks
pending = []       # signals recorded inside a critical function, not yet delivered


def critical(fn):
  """Marks `fn` (which must end with `if pending: deliver()`) as a function
  a SIGINT waits for; returns `fn` itself."""
  _CRITICAL.add(fn.__code__)
  return fn


def _inside_critical(frame):
  while frame is not None:
    if frame.f_code in _CRITICAL:
      return True
    frame = frame.f_back
  return False


def _inside_gc_callback(frame):
  """Whether the handler runs inside a garbage-collector callback (jax
  registers one, `_xla_gc_callback`): CPython ignores what a gc callback
  raises ("Exception ignored in ..."), so a KeyboardInterrupt raised there
  is lost - measured here: 1 Ctrl-C in ~20 during a loop of plan runs."""
  while frame is not None:
    if frame.f_code.co_name == "_xla_gc_callback":
      return True
    frame = frame.f_back
  return False


def _resend(signum):
  """Sends `signum` to this process again from another thread, so the main
  thread's handler runs once the gc callback has returned."""
  threading.Thread(target=os.kill, args=(os.getpid(), signum), daemon=True).start()


class _Deferring:
  """The SIGINT handler: the previous one, deferred inside critical functions."""

  def __init__(self, previous):
    self.previous = previous

  def __call__(self, signum, frame):
    if _inside_critical(frame):
      pending.append(signum)
      return
    if _inside_gc_callback(frame):
      _resend(signum)
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
  """Delivers the signal recorded inside a critical function, in the main
  thread (the only one where it was recorded); a no-op elsewhere."""
  if not pending or threading.current_thread() is not threading.main_thread():
    return
  signum = pending[-1]
  del pending[:]
  handler = signal.getsignal(signum)
  previous = handler.previous if isinstance(handler, _Deferring) else handler
  if callable(previous):
    previous(signum, None)
