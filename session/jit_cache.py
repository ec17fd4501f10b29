"""The graphs `jaxsession.jit` compiled, per function: shared by the
function's wrappers, and kept a while after the last wrapper goes.

jax.jit's cache is keyed by the function, so `jax.jit(f)(x)` written at each
call traces once. js.jit does the same: the graphs of one function compiled
with the same statics in the same session are one `Signatures`, found by the
function's identity from every wrapper of it (a re-wrap compiled and
released at every call, ~100 ms, before). When the last wrapper of a
function goes while the function lives on, its Signatures are parked: kept
for a wrapper made again, among the PARKED most recently parked; one pushed
out is released, and so are the parked graphs of a function that dies
(jax.jit's cache holds its functions weakly too). The function, and the
session, are held weakly here: only wrappers hold them (a table holding the
function kept a bound method's object, and with it its wrapper, alive for
good; parked graphs kept sessions and closed-over arrays alive: reviews'
finds). A function weakref cannot follow is not shared: its graphs go with
its wrapper.

A wrapper or function goes in a finalizer, which the cyclic GC may run
wherever an allocation triggers it - inside this module's lock, or a
session's own: a release there deadlocked (a review's find). The finalizer
only queues (deque.append and SimpleQueue.put take no lock of Python's); a
background thread parks and releases, and `release_dead()` does it at once.
"""
import collections
import functools
import os
import queue
import threading
import weakref

from jaxsession.jax_api import front_cache, register_cache

PARKED = 32  # Signatures kept after their last wrapper went, most recent first

_BY_FN = {}  # id(fn) -> (weakref to fn, {(statics, id(session)): Signatures})
_LOCK = threading.Lock()
_PARK = collections.OrderedDict()  # id(Signatures) -> Signatures, oldest first
_DROPPED = collections.deque()     # Signatures whose wrapper went, not yet counted
_WAKE = queue.SimpleQueue()
_REAP_LOCK = threading.Lock()
_REAPER = []  # the background thread, started on first use (again in a forked child)
os.register_at_fork(after_in_child=_REAPER.clear)


class Signatures:
  """One function's graphs in one session, per signature."""
  __slots__ = ("graphs", "lock", "session_ref", "wrappers", "fn_id", "fn_ref", "key",
               "front", "__weakref__")

  def __init__(self, session, fn_id, fn_ref, key):
    # signature -> (graph id or jitted._JAX, whether jax.jit commits the
    # outputs): signatures that differ by arguments committed to the
    # session's device or not share one graph
    self.graphs = {}
    self.lock = threading.RLock()  # held while compiling
    # the session, weakly: the wrappers hold it; parked graphs go with it
    self.session_ref = None if session is None else weakref.ref(session)
    self.wrappers = 0
    self.fn_id, self.fn_ref, self.key = fn_id, fn_ref, key  # fn_ref None: not shared
    # the executables the wrappers' C++ fronts run without Python, per signature
    # (jax_api.cpp_front): the graphs', so released with them
    self.front = front_cache()
    with _ALL_LOCK:
      _ALL.add(self)

  @property
  def findable(self):
    """Whether a wrapper made again can find these: the function lives."""
    return self.fn_ref is not None and self.fn_ref() is not None

  def bind(self, session):
    """The default session, once a wrapper resolved it."""
    if self.session_ref is None:
      self.session_ref = weakref.ref(session)

  def release(self):
    """Releases the graphs, under the lock (a wrapper's clear_cache, the
    reaper and jax.clear_caches may release at once: a review's find)."""
    self.forget()  # (also where the session went: a front kept alone held its executables)
    session = None if self.session_ref is None else self.session_ref()
    if session is None:  # gone, and its graphs with it
      return
    with self.lock:
      for gid in {gid for gid, _ in self.graphs.values()}:
        if isinstance(gid, int):
          try:
            session.release(gid)
          except Exception:  # pylint: disable=broad-except
            pass  # released already (the session's own release)
      self.graphs.clear()

  def forget(self):
    """The fronts run none of these graphs' executables: the next call of
    each signature takes the Python path (which finds a released graph)."""
    if self.front is not None:
      self.front.clear()


def graph_released(session, gid):
  """A graph released by hand (Session.release): the fronts of the
  functions it served stop running its executable."""
  with _ALL_LOCK:
    everything = list(_ALL)
  for sigs in everything:
    if sigs.session_ref is not None and sigs.session_ref() is session and \
        any(g == gid for g, _ in list(sigs.graphs.values())):
      sigs.forget()


_ALL = weakref.WeakSet()  # every Signatures alive: jax.clear_caches() releases them
_ALL_LOCK = threading.Lock()  # (a WeakSet changed while listed raised: a review's find)


class _JaxCaches:
  """Registered with jax's cache management, so that jax.clear_caches()
  releases every js.jit graph as it drops jax.jit's executables: the next
  call traces and compiles again (a function reading a global changed since
  ran its old graph: a break-it find)."""

  @staticmethod
  def _all():
    with _ALL_LOCK:
      return list(_ALL)

  def cache_clear(self):
    for sigs in self._all():
      sigs.release()  # (under its lock: not while another thread compiles for it)

  def cache_info(self):
    return functools._CacheInfo(0, 0, None, len(self._all()))  # pylint: disable=protected-access

  def cache_keys(self):
    return [key for sigs in self._all() for key in list(sigs.graphs)]


_CLEARED = _JaxCaches()  # held here: jax's registry holds it weakly
register_cache(_CLEARED, "jaxsession.jit graphs")


def acquire(fn, statics, session):
  """The Signatures of (fn, statics, session) for one more wrapper (give it
  back with `dropped`, from the wrapper's finalizer)."""
  key = (statics, id(session))
  with _LOCK:
    if not _REAPER:
      _REAPER.append(threading.Thread(target=_reap_forever, daemon=True,
                                      name="jaxsession.jit releases"))
      _REAPER[0].start()
    entry = _BY_FN.get(id(fn))
    if entry is None or entry[0]() is not fn:  # (a dead function's id again)
      try:
        table = {}
        ref = weakref.ref(fn, functools.partial(_fn_died, id(fn), table))
      except TypeError:  # not weakly referable: this wrapper's own, never shared
        sigs = Signatures(session, None, None, key)
        sigs.wrappers = 1
        return sigs
      entry = _BY_FN[id(fn)] = (ref, table)
    ref, table = entry
    sigs = table.get(key)
    if sigs is None or (session is not None and sigs.session_ref() is not session):
      if sigs is not None:  # a dead session's id again: what it parked went with it,
        _PARK.pop(id(sigs), None)  # and once replaced here, no death would find it
      sigs = table[key] = Signatures(session, id(fn), ref, key)
    sigs.wrappers += 1
    _PARK.pop(id(sigs), None)
    return sigs


def _queue(item, dropped_=_DROPPED, wake=_WAKE):
  """Queues `item` for the background thread; takes no lock (the module
  docstring). Its queues are bound here: at interpreter exit the module's
  globals are gone before the last finalizers run."""
  dropped_.append(item)
  wake.put(None)


def dropped(sigs, queue_=_queue):
  """A wrapper's finalizer."""
  queue_(sigs)


def _fn_died(fn_id, table, ref, queue_=_queue):
  """The function's weakref callback: its parked graphs (`table`'s: a new
  function may hold its id in _BY_FN already) can never be found again."""
  queue_((fn_id, table, ref))


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
        item = _DROPPED.popleft()
        if isinstance(item, tuple):  # a function died: what of it is parked goes
          fn_id, table, ref = item
          out.extend(s for s in list(table.values()) if _PARK.pop(id(s), None) is not None)
          entry = _BY_FN.get(fn_id)
          if entry is not None and entry[0] is ref:
            del _BY_FN[fn_id]
          continue
        item.wrappers -= 1
        if item.wrappers == 0:
          if item.findable:
            _PARK[id(item)] = item
          else:  # nobody can make a wrapper of it again
            out.append(item)
      while len(_PARK) > PARKED:
        out.append(_PARK.popitem(last=False)[1])
      for sigs in out:
        entry = _BY_FN.get(sigs.fn_id)
        if entry is None or entry[0] is not sigs.fn_ref:
          continue
        if entry[1].get(sigs.key) is sigs:
          del entry[1][sigs.key]
        if not entry[1]:
          del _BY_FN[sigs.fn_id]
    for sigs in out:  # outside the lock: a release takes the session's
      sigs.release()
