"""Ctrl-C never lands inside a run's commit, nor while it holds slot locks.

A run locks its state slots, hands the session's state buffers to its
executable (donation) and writes the new values back before it unlocks.
CPython raises a pending signal's exception at the next eval-breaker point -
right after the executable's call returns, say, or between two lock
acquires - and a KeyboardInterrupt there would leave the slots holding
consumed buffers ("Array has been deleted") or a lock held forever.

So the functions that hold slot locks are marked `critical` (Runner.call,
and state.holding, through which Session.get_state, set_state, release and
the checkpoints take them): marking only records the function's
code object, it wraps nothing. Each begins with `lend()` and ends with
`leave()`: in the main thread (Python runs signal handlers there only),
ours takes the place of a SIGINT handler of the user's for the call, and
the user's is put back at its end, so between runs `signal.getsignal`
gives the user's own object (code that puts its previous handler back only
where the current one is still its own - a graceful-stop context
manager's - found ours when it stayed installed from the first compile on,
left it, and the next Ctrl-C set a stale flag alone: a break-it find). A
lend and its give-back cost ~1 µs a run, so Python's default handler,
no object of the user's, is replaced for good when a Session is created or
a graph compiled (`install`): a run then pays one look at the handler
(asyncio.run, which installs its own handler only over Python's default,
installs none then: a Ctrl-C raises KeyboardInterrupt where its loop is,
as before Python 3.11). A nested critical call finds ours and lends
nothing. Our handler looks at
the frames the main thread is executing: inside a critical function it only
records the signal; the function's last look (`leave`) delivers it, after
the commit and the unlock and once the user's handler is back, by calling
the handler it deferred (Python's default raises KeyboardInterrupt there).
Past its commit a critical function sets a local (`critical`): a signal
handled after that is raised at once, none waits for a look that already
happened. A run in another thread
lends nothing and never receives KeyboardInterrupt: a Ctrl-C reaches an
idle main thread at once, whatever other threads run.

The session's waits for another thread (the checkpoint writer, another
thread's compile of the same program) go through `wait_for`, critical too: a
Ctrl-C ends the wait at its next look and is raised there, never inside the
Condition's own Python, where it left a lock or a queue's count wrong.

What it covers: SIGINT, with a Python-level handler (Python's default one,
or the user's, whenever it was installed: one installed after the Session
was compiled let one Ctrl-C consume the donated state when the handler was
wrapped once at compile, a break-it find). One a run's host callback
installs is wrapped as the callback returns (`rewrap`), and is the one put
back. asyncio's handler of loop.add_signal_handler, which does nothing, is
not wrapped. Presses that reach CPython before its handler could run merge
into one call of it, as under jax.jit.
A SIGINT whose KeyboardInterrupt CPython ignores (raised inside a gc
callback, a __del__ or a weakref callback) is sent again (`_Unraisable`).
SIGTERM and SIGHUP with a Python handler of the user's are lent for the call
as SIGINT's is (`OTHER`), also one a host callback installs (`rewrap`); their
defaults end the process, as SIGKILL does. Other signals, and handlers set to
SIG_IGN/SIG_DFL or installed in C, are left alone. A run of the main thread that never returns (a callback
that blocks forever) cannot be interrupted by Ctrl-C: its state would be lost.
"""
import _signal
import _thread
import os
import signal
import sys
import threading
import time

_CRITICAL = set()  # code objects of the functions that hold slot locks
pending = []       # signals recorded inside a critical function, not yet delivered
LEFT = "left_critical"  # the local a critical function sets past its commit
_INSIDE = "inside"


def critical(fn):
  """Marks `fn` as a function a SIGINT waits for; returns `fn` itself. Its
  last steps, in its `finally`: `left_critical = True` (LEFT) once its work
  is done - its commit, its unlock - then the give-back of what it lent and
  a look at `pending` (`leave`, or Runner.call's own). A Ctrl-C handled
  before the local is set is recorded and that look delivers it; one handled
  after is raised at once (`_where`): none is recorded where no look
  follows. Refused without the local (a signal recorded past the look
  stayed recorded until some later call ended, or for good: a break-it
  find, then covered by a watcher thread's re-sent signals, which merged
  with the user's presses and dropped them)."""
  if LEFT not in fn.__code__.co_varnames:
    raise TypeError(f"interrupts.critical: {fn.__qualname__} never sets {LEFT}")
  _CRITICAL.add(fn.__code__)
  return fn


def _resend(signum):
  """Sends `signum` to this process again from another thread, 5 ms later, so
  the main thread's handler runs once the code that swallowed it has
  returned. A raw thread: threading.Thread.start() waits for the thread in
  the main thread, where the resent signal would land - inside the code
  that swallows it."""
  def later():
    time.sleep(0.005)
    os.kill(os.getpid(), signum)
  _thread.start_new_thread(later, ())


class _Unraisable:
  """sys.unraisablehook: a KeyboardInterrupt that CPython ignores - raised in
  a gc callback (jax registers one), a __del__ or a weakref callback, which
  may run at any allocation - is sent again instead of lost (measured here:
  1 Ctrl-C in ~20 lost in a loop of runs, first inside jax's gc callback,
  then elsewhere once that one was caught by its frame name); anything else
  goes to the hook before it."""

  def __init__(self, previous):
    self.previous = previous

  def __call__(self, unraisable):
    if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
      _resend(signal.SIGINT)
      return
    self.previous(unraisable)


class _Deferring:
  """The SIGINT handler: the previous one, deferred inside critical functions."""

  def __init__(self, previous):
    self.previous = previous

  def __call__(self, signum, frame):
    where = _where(frame)
    if where is _INSIDE:
      # one a press, each delivered to the handler it deferred (one for all
      # the presses of a long callback: a handler counting them to force
      # a quit saw one of three, a break-it find)
      pending.append((signum, self))
      return
    if lent_by[0] is not None and any(past is lent_by[0] for past in where):
      give_back()  # past the commit of the call that lent, before its give-back: now
    # (and not a lend a critical generator made that is not running now - a
    # save's place in line, whose end must still defer: a break-it find)
    _run_recorded(frame)  # presses recorded before that call's last look, then this one
    self.previous(signum, frame)


def _where(frame):
  """_INSIDE where a critical function runs in `frame` or further out and
  has not set its LEFT local; else the frames of those on the stack that
  have set it (past their commit). (The local, not a global mark: a
  critical call's locals die with it, and a later call's never has it
  before its end.)"""
  past = []
  while frame is not None:
    if frame.f_code in _CRITICAL:
      if LEFT not in frame.f_locals:
        return _INSIDE
      past.append(frame)
    frame = frame.f_back
  return past


_MAIN = threading.main_thread().ident
SIGINT = _signal.SIGINT  # an int (signal.SIGINT's enum costs a lookup)
getsignal = _signal.getsignal  # the raw handler: signal.getsignal's enum costs ~2 µs
lent = [None, None]  # while a critical call of the main thread runs: ours, and the handler it wraps
_last = [None, None]  # the last handler of the user's wrapped, and its wrapper (reused)
DEFAULT = signal.default_int_handler
ours = [None]  # ours over Python's default handler, which stays installed (`install`)


def install():
  """When a Session is created and at each compile: ours in place of
  Python's default SIGINT handler, for good (in the main thread, where
  that one is installed: no object of the user's to give back, and a run
  then pays one look at the handler, ~20 ns, where a lend and its give-back
  cost ~1 µs: benchmarks/dispatch.py, A/B); and sys.unraisablehook wrapped once
  (`_Unraisable`)."""
  if not isinstance(sys.unraisablehook, _Unraisable):
    sys.unraisablehook = _Unraisable(sys.unraisablehook)
  if _thread.get_ident() == _MAIN and getsignal(SIGINT) is DEFAULT:
    if ours[0] is None:
      ours[0] = _Deferring(DEFAULT)
    _signal.signal(SIGINT, ours[0])


def lend():
  """The first step of every critical function, before it takes a lock
  (Runner.call looks first whether ours over the default is the one
  installed and no handler of the user's is on another signal, and calls
  this only where one is): in the main thread, where the SIGINT handler is
  a Python callable of the user's, ours - deferring to it - takes its place
  until `leave` (or give_back) puts it back; Python's default one is
  replaced for good (`install`). So does a Python handler of the user's for
  SIGTERM or SIGHUP (`OTHER`: a preemption handler that saves, or calls
  sys.exit, inside a run waited for good on the run's slot lock, or left
  the state's donated buffers consumed: a judge's finds). Whether it lent:
  a critical function inside another finds ours and lends nothing. A signal
  before it reaches the user's handler where nothing was done yet."""
  if _thread.get_ident() != _MAIN:
    return False
  others = [(signum, h) for signum, h in ((n, getsignal(n)) for n in OTHER) if _lendable(h)]
  current = getsignal(SIGINT)
  sigint = _lendable(current) and current is not DEFAULT
  if current is DEFAULT:
    install()
  if not (sigint or others):
    return False
  lent_by[0] = sys._getframe(1)  # pylint: disable=protected-access
  for signum, handler in others:
    wrapper = _Deferring(handler)
    _signal.signal(signum, wrapper)
    lent_other[signum] = (wrapper, handler)
  if sigint:
    _lend(current)
  return True


def _lendable(handler):
  """A Python handler of the user's (not ours, SIG_DFL/SIG_IGN or asyncio's)."""
  return type(handler) is not _Deferring and callable(handler) and not _does_nothing(handler)


def _lend(current):
  if _last[0] is current:
    wrapper = _last[1]
  else:
    wrapper = _Deferring(current)
    _last[0], _last[1] = current, wrapper
  _signal.signal(SIGINT, wrapper)
  lent[0], lent[1] = wrapper, current


def _does_nothing(handler):
  """asyncio's SIGINT handler of `loop.add_signal_handler`, which does
  nothing (its work is the wakeup fd's, written in C): raising nothing, it
  needs no deferring (wrapped, the signals a watcher thread, since removed,
  sent again each wrote the wakeup fd: its callback ran 2-4 times a press,
  a break-it find)."""
  unix_events = sys.modules.get("asyncio.unix_events")
  return unix_events is not None and handler is getattr(unix_events, "_sighandler_noop", None)


def give_back():
  """Puts back the handler `lend` (or `rewrap`) wrapped, unless one was
  installed since (SIG_IGN, say: the user's choice stays); a wrapper of
  ours put back since - a callback that saved `signal.signal`'s answer,
  one of ours, and restored it later - is unwrapped too (it stayed
  installed for good: a judge's find). Put back before the record of the
  lend is cleared: a Ctrl-C handled in between gives back again
  (`_Deferring`), and finds it done."""
  if lent[0] is not None:
    _unwrap(SIGINT)
  for signum in list(lent_other):
    _unwrap(signum)
    del lent_other[signum]
  lent[0] = lent[1] = lent_by[0] = None


def _unwrap(signum):
  """The user's handler in place of a wrapper of ours (not the one over
  Python's default, which stays: `install`)."""
  now = getsignal(signum)
  if type(now) is _Deferring and now is not ours[0]:
    _signal.signal(signum, now.previous)


lent_by = [None]  # the frame of the critical call that gives the lend back (lend's, rewrap's)
# the signals besides SIGINT whose Python handlers a run defers (lend); their
# defaults (SIG_DFL: the process ends) are left alone, as SIGKILL
OTHER = tuple(getattr(_signal, name) for name in ("SIGTERM", "SIGHUP")
              if hasattr(_signal, name))
lent_other = {}  # signum -> (ours, the user's handler) while lent
TERM, HUP = (OTHER * 2)[:2]  # (a platform with one of them looks twice: Runner.call, rewrap)


def rewrap():
  """After a host callback returns (codegen's plan after each host op; a
  callback inside an executable, as it returns): a Python handler it
  installed in the main thread, inside a critical call, is wrapped in its
  turn - ours again over Python's default, else lent until the outermost
  critical call ends, which puts it back (one installed there let a Ctrl-C
  consume the donated state: break-it finds, also where ours stood over the
  default and nothing was lent)."""
  if _thread.get_ident() != _MAIN:
    return
  current = getsignal(SIGINT)
  term, hup = getsignal(TERM), getsignal(HUP)  # (inlined: each host op pays this look)
  if (type(current) is _Deferring or not callable(current) or _does_nothing(current)) and not (
      type(term) is not _Deferring and callable(term)
      or type(hup) is not _Deferring and callable(hup)):
    return
  others = [(signum, h) for signum, h in ((n, getsignal(n)) for n in OTHER) if _lendable(h)]
  owner, frame = None, sys._getframe(1)  # pylint: disable=protected-access
  while frame is not None:  # the outermost critical call: it gives back
    if frame.f_code in _CRITICAL:
      owner = frame
    frame = frame.f_back
  if owner is None:
    return  # no critical call runs: nothing to defer
  if current is DEFAULT:
    install()
  sigint = current is not DEFAULT and _lendable(current)
  if (sigint or others) and lent[0] is None and not lent_other:
    lent_by[0] = owner  # (only where something is lent)
  for signum, handler in others:  # the one the callback installed is put back
    wrapper = _Deferring(handler)
    _signal.signal(signum, wrapper)
    lent_other[signum] = (wrapper, handler)
  if sigint:
    _lend(current)


def owed_by_caller():
  """Whether the calling critical function gives back the lend (its own
  `lend`'s or one `rewrap` made for it)."""
  return lent_by[0] is sys._getframe(1)  # pylint: disable=protected-access


def leave(lending):
  """The last step of a critical function that called `lend()` (its result
  `lending`): gives back what it lent, then delivers a Ctrl-C recorded
  meanwhile (`deliver`)."""
  frame = sys._getframe(1)  # pylint: disable=protected-access
  if lending or lent_by[0] is frame:
    give_back()
  if pending:
    deliver(frame)


def _due(frame):
  """Whether a recorded signal is the critical function running in `frame`
  to deliver: in the main thread (the only one where it was recorded; a
  worker's critical section reading it undid its own work, a review's find),
  and where no critical function further out runs (that one delivers at its
  end: a compile from a run's callback must not raise inside the run's
  commit)."""
  return (bool(pending) and _thread.get_ident() == _MAIN
          and _where(frame.f_back) is not _INSIDE)


def waiting():
  """Whether the calling critical function has a signal to deliver (`_due`):
  its work stops short, then it delivers."""
  return _due(sys._getframe(1))  # pylint: disable=protected-access


def deliver(frame=None):
  """Delivers the signal recorded inside a critical function (`_due`) -
  the caller's, or the one running in `frame` - a no-op otherwise."""
  frame = frame or sys._getframe(1)  # pylint: disable=protected-access
  if not _due(frame):
    return
  # with the frame that called the outermost critical function (_due), where
  # the Ctrl-C lands (None broke handlers that log it, 50 of 50 presses; a
  # critical function's own frame made a handler calling ours defer it
  # again: break-it finds)
  _run_recorded(frame.f_back)


def _run_recorded(frame):
  """Each recorded press to the handler that deferred it, not the one
  installed now (a handler a run's callback installed that calls ours ran
  for the press already, and ran twice: 183 of 500 presses, a break-it
  find), with `frame`; where one raises, the presses after it go with it.
  Taken before any handler runs: it may record more."""
  records = pending[:]
  del pending[:len(records)]
  for signum, deferring in records:
    deferring.previous(signum, frame)


POLL_S = 0.05  # how soon a wait_for sees a Ctrl-C


@critical
def wait_for(cond, ready):
  """cond.wait_for(ready) - the one wait for another thread in the
  session's code - where a Ctrl-C waits for the next look at ready()
  (every POLL_S), which ends the wait, and is then raised. Raised inside a
  Condition's or a Queue's own Python instead (Condition.wait re-taking its
  lock; Queue.put between its append and its count, where the checkpoint
  writer now has a SimpleQueue), it left a lock released that another
  thread held, or a count short: that thread died
  on its next release or task_done(), and every later wait hung (a
  break-it find: the checkpoint writer, 3 runs in 4 under rapid Ctrl-Cs).
  Inside another critical function the wait goes on until ready(); that
  one delivers."""
  lending = lend()
  try:
    while True:
      done = False
      try:
        with cond:
          while not (done := ready()) and not waiting():
            cond.wait(POLL_S)
      finally:
        deliver()  # a Ctrl-C seen: its handler runs here
      if done:
        return
      # the handler returned (the user's own, setting a flag): the wait goes
      # on (it returned unfinished, and a restore read before its save was
      # written: a break-it find)
  finally:
    left_critical = True
    leave(lending)
