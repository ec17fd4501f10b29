"""The graphs `jaxsession.jit` compiled, per function: shared by the
function's wrappers, and kept a while after the last wrapper goes.

jax.jit's cache is keyed by the function, so `jax.jit(f)(x)` written at each
call traces once. js.jit does the same: the graphs of one function compiled
with the same statics in the same session are one `Signatures`, found by the
function's identity from every wrapper of it (a re-wrap compiled and
released at every call, ~100 ms, before). When the last wrapper of a
function goes, its Signatures are parked: kept for a wrapper made again,
among the PARKED most recently parked; one pushed out is released. They are
not tied to the function's own life: a graph holds its function (the
outputs' weak types are traced again from it), so the function lives as
long as its graphs. While any Signatures of a function exist, this module
holds the function, so its id names no other.

A wrapper goes in a finalizer, which the cyclic GC may run wherever an
allocation triggers it - inside this module's lock, or a session's own: a
release there deadlocked (a review's find). The finalizer only queues
(deque.append and SimpleQueue.put take no lock of Python's); a background
thread parks and releases, and `release_dead()` does it at once.
"""
import collections
import os
import queue
import threading
import weakref

PARKED = 32  # Signatures kept after their last wrapper went, most recent first

_BY_FN = {}  # id(fn) -> (fn, {(statics, id(session)): Signatures})
_LOCK = threading.Lock()
_PARK = collections.OrderedDict()  # id(Signatures) -> Signatures, oldest first
_DROPPED = collections.deque()     # Signatures whose wrapper went, not yet counted
_WAKE = queue.SimpleQueue()
_REAP_LOCK = threading.Lock()
_REAPER = []  # the background thread, started on first use (again in a forked child)
os.register_at_fork(after_in_child=_REAPER.clear)


class Signatures:
  """One function's graphs in one session, per signature."""
  __slots__ = ("graphs", "committed", "lock", "session_ref", "wrappers", "fn_id", "key")

  def __init__(self, session, fn_id, key):
    self.graphs = {}     # signature -> graph id (or jitted._JAX)
    self.committed = {}  # graph id -> whether jax.jit commits its outputs
    self.lock = threading.RLock()  # held while compiling
    # the session, weakly: the wrappers hold it; parked graphs go with it
    self.session_ref = None if session is None else weakref.ref(session)
    self.wrappers = 0
    self.fn_id, self.key = fn_id, key

  def bind(self, session):
    """The default session, once a wrapper resolved it."""
    if self.session_ref is None:
      self.session_ref = weakref.ref(session)

  def release(self):
    session = None if self.session_ref is None else self.session_ref()
    if session is None:  # gone, and its graphs with it
      return
    for gid in list(self.graphs.values()):
      if isinstance(gid, int):
        try:
          session.release(gid)
        except Exception:  # pylint: disable=broad-except
          pass  # released already (the session's own release)
    self.graphs.clear()


def acquire(fn, statics, session):
  """The Signatures of (fn, statics, session) for one more wrapper (give it
  back with `dropped`, from the wrapper's finalizer)."""
  key = (statics, id(session))
  with _LOCK:
    if not _REAPER:
      _REAPER.append(threading.Thread(target=_reap_forever, daemon=True,
                                      name="jaxsession.jit releases"))
      _REAPER[0].start()
    table = _BY_FN.setdefault(id(fn), (fn, {}))[1]
    sigs = table.get(key)
    if sigs is None or (session is not None and sigs.session_ref() is not session):
      sigs = table[key] = Signatures(session, id(fn), key)  # (a dead session's id again)
    sigs.wrappers += 1
    _PARK.pop(id(sigs), None)
    return sigs


def dropped(sigs):
  """A wrapper's finalizer: queues, takes no lock (the module docstring)."""
  _DROPPED.append(sigs)
  _WAKE.put(None)


def _reap_forever():
  while True:
    _WAKE.get()
    release_dead()


def release_dead():
  """Counts the wrappers gone, parks the Signatures left without one and
  releases those pushed out of the park; at once (the background thread
  does it soon otherwise)."""
  with _REAP_LOCK:  # one at a time: an item leaves the queue once counted
    out = []
    with _LOCK:
      while _DROPPED:
        sigs = _DROPPED.popleft()
        sigs.wrappers -= 1
        if sigs.wrappers == 0:
          _PARK[id(sigs)] = sigs
      while len(_PARK) > PARKED:
        out.append(_PARK.popitem(last=False)[1])
      for sigs in out:
        table = _BY_FN[sigs.fn_id][1]
        if table.get(sigs.key) is sigs:
          del table[sigs.key]
        if not table:
          del _BY_FN[sigs.fn_id]
    for sigs in out:  # outside the lock: a release takes the session's
      sigs.release()
