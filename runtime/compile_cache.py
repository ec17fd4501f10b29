"""The compile cache: executables reused by what they compute, not by who asked.

A second `compile` of the same program with the same avals and options must
not pay XLA again. Executables are keyed by runtime/fingerprint.py's
`fingerprint` of the KernelGraph after the whole pipeline and
`executable_key` of each one's arguments:

    fp = fingerprint(graph, spec.avals, options_key(options), platform)
    exe, recorder, notes = build.compile_recorded(fn, recorder, structs, donate,
                                                  cache=executables, key=(fp, "partition", 0))

`ExecutableCache` is the in-memory store (LRU, thread-safe, one compile per
key, entries pinned by the live graphs that use them); `RecordingCache` wraps
it for one Build, pins what it finds for that graph and records each lookup
(hit or miss, seconds) for the compile report. `enable_persistent_cache` turns on JAX's
own on-disk cache, so that a new process skips XLA compilation as well.
"""
import collections
import dataclasses
import os
import threading
import time

import jax

from jaxsession.runtime import interrupts

# -- the in-memory store ------------------------------------------------------
CacheInfo = collections.namedtuple("CacheInfo", "hits misses size maxsize")


class DoNotStore:
  """What a compile thunk returns for a value that must not be cached (an op
  with effects): get_or_compile hands back `.value`, stores nothing and
  counts no miss."""
  __slots__ = ("value",)

  def __init__(self, value):
    self.value = value


class _Pending:
  """A compile in flight: later askers of the same key wait for it."""

  def __init__(self):
    self.done = False  # under the cache's lock, notified by its `_finished`
    self.ok = False
    self.value = None


class ExecutableCache:
  """A bounded LRU map key -> executable (or any compiled value).

  `get_or_compile(key, thunk)` returns (value, hit). Thread-safe: the lock
  guards the map only; compiles run outside it, and two threads asking for
  the same missing key compile it once (the second waits for the first and
  counts a hit; if the first fails, or its value is not to be stored, the
  second compiles itself). maxsize=None: unbounded; 0: nothing is kept.

  Owners: a lookup given `owner` (a graph id) pins its entry for that owner
  until `release_owner(owner)`; pinned entries are never evicted and do not
  count against `maxsize`, which bounds the unpinned ones - executables no
  live graph uses. So a Session's cache shares executables between live
  graphs and keeps `maxsize` more after their graphs are released.
  """

  def __init__(self, maxsize=128):
    if maxsize is not None and (isinstance(maxsize, bool) or not isinstance(maxsize, int)
                                or maxsize < 0):
      raise ValueError(f"ExecutableCache: maxsize must be an int >= 0 or None, got "
                       f"{maxsize!r}")
    self.maxsize = maxsize
    self.hits = 0
    self.misses = 0
    self._entries = collections.OrderedDict()
    self._pending = {}
    self._pins = collections.defaultdict(set)    # key -> owners
    self._owned = collections.defaultdict(set)   # owner -> keys
    self._lock = threading.Lock()
    self._finished = threading.Condition(self._lock)  # notified as a compile ends

  def _pin(self, key, owner):
    if owner is not None and key in self._entries:
      self._pins[key].add(owner)
      self._owned[owner].add(key)

  def _evict(self):
    """Drops the least recently used unpinned entries beyond maxsize."""
    if self.maxsize is None:
      return
    unpinned = [k for k in self._entries if not self._pins.get(k)]
    for k in unpinned[:max(0, len(unpinned) - self.maxsize)]:
      del self._entries[k]

  def release_owner(self, owner):
    """Unpins every entry `owner` pinned; those no other owner pins become
    evictable (beyond maxsize, at once)."""
    with self._lock:
      for key in self._owned.pop(owner, ()):
        pins = self._pins.get(key)
        if pins is not None:
          pins.discard(owner)
          if not pins:
            del self._pins[key]
      self._evict()

  def get_or_compile(self, key, compile_thunk, owner=None):
    while True:
      mine = []  # the _Pending this call registered, once it did
      try:
        found = self._claim(key, owner, mine)
        if mine:
          return self._store(key, mine[0], compile_thunk(), owner)
      except BaseException:
        if mine:  # failed, or a Ctrl-C: waiters are told, and compile themselves
          self._abandon(key, mine[0])
        raise
      if not isinstance(found, _Pending):
        return found
      interrupts.wait_for(self._finished, lambda: found.done)
      if found.ok:
        with self._lock:
          self.hits += 1
          self._pin(key, owner)
        return found.value, True
      # the compile we waited for failed or was not stored: compile here

  # _claim, _store and _abandon change what other threads wait on: a Ctrl-C
  # waits for their end (raised inside, it left a compile registered that
  # no one would finish, and every later compile of the program waited for
  # it for good: a break-it find)
  @interrupts.critical
  def _claim(self, key, owner, mine):
    """(value, True) for a cached key; else the compile in flight to wait
    for, or a new one this call registers (appended to `mine`)."""
    lending = interrupts.lend()
    try:
      with self._lock:
        if key in self._entries:
          self._entries.move_to_end(key)
          self.hits += 1
          self._pin(key, owner)
          return self._entries[key], True
        pending = self._pending.get(key)
        if pending is None:
          pending = self._pending[key] = _Pending()
          mine.append(pending)
        return pending
    finally:
      left_critical = True
      interrupts.leave(lending)

  @interrupts.critical
  def _store(self, key, pending, value, owner):
    lending = interrupts.lend()
    try:
      store = not isinstance(value, DoNotStore)
      with self._lock:
        del self._pending[key]
        if store:
          self.misses += 1
          if self.maxsize is None or self.maxsize > 0 or owner is not None:
            self._entries[key] = value
            self._entries.move_to_end(key)
            self._pin(key, owner)
            self._evict()
          pending.value, pending.ok = value, True
        self._finish(pending)
      return (value if store else value.value), False
    finally:
      left_critical = True
      interrupts.leave(lending)

  @interrupts.critical
  def _abandon(self, key, pending):
    lending = interrupts.lend()
    try:
      with self._lock:
        if not pending.done:
          self.misses += 1
          if self._pending.get(key) is pending:
            del self._pending[key]
          self._finish(pending)
    finally:
      left_critical = True
      interrupts.leave(lending)

  def _finish(self, pending):
    """Under the lock: the compile `pending` stands for is over."""
    pending.done = True
    self._finished.notify_all()

  def get(self, key, default=None):
    """The cached value without compiling or counting (marks it recently used)."""
    with self._lock:
      if key not in self._entries:
        return default
      self._entries.move_to_end(key)
      return self._entries[key]

  def __contains__(self, key):
    with self._lock:
      return key in self._entries

  def __len__(self):
    with self._lock:
      return len(self._entries)

  def clear(self):
    with self._lock:
      self._entries.clear()

  def cache_info(self):
    with self._lock:
      return CacheInfo(self.hits, self.misses, len(self._entries), self.maxsize)


@dataclasses.dataclass
class CacheUse:
  """What one compile got from the cache: `report.cache`."""
  hits: int = 0
  misses: int = 0
  seconds: float = 0.0        # spent in lookups and the compiles they ran
  lookups: list = dataclasses.field(default_factory=list)  # (what, hit, seconds)

  @property
  def hit(self):
    """Every executable of the graph came from the cache."""
    return self.misses == 0 and self.hits > 0

  def describe(self):
    state = "hit" if self.hit else "miss" if not self.hits else "partial hit"
    return (f"compile cache {state}: {self.hits} executable(s) reused, {self.misses} "
            f"compiled, {self.seconds:.3f} s")


class RecordingCache:
  """An ExecutableCache as one Build sees it: the same `get_or_compile`,
  with every lookup recorded in `use` (a CacheUse) for the report."""

  def __init__(self, cache, owner=None):
    self.cache = cache
    self.owner = owner  # the graph id its entries are pinned for
    self.use = CacheUse()
    self._lock = threading.Lock()

  def get_or_compile(self, key, compile_thunk):
    start = time.perf_counter()
    value, hit = self.cache.get_or_compile(key, compile_thunk, self.owner)
    seconds = time.perf_counter() - start
    with self._lock:
      if hit:
        self.use.hits += 1
      else:
        self.use.misses += 1
      self.use.seconds += seconds
      self.use.lookups.append((_label(key), hit, seconds))
    return value, hit


def _label(key):
  """Which executable of the graph a key names: ("single",), ("partition", i)."""
  inner = key[0] if isinstance(key, tuple) and key else None  # executable_key's caller key
  if not isinstance(inner, tuple) or len(inner) < 2:
    return ()
  if inner[1] == "partition" and len(inner) > 2:
    return ("partition", inner[2])
  return (inner[1],) if isinstance(inner[1], str) else ()


# -- JAX's persistent cache -----------------------------------------------------
_PERSISTENT_FLAGS = (("jax_persistent_cache_min_compile_time_secs", 0.0),
                     ("jax_persistent_cache_min_entry_size_bytes", 0))
_persistent_lock = threading.Lock()


def enable_persistent_cache(path):
  """Turns on JAX's persistent compilation cache in `path`, storing every
  executable (no minimum compile time or size), so a new process that
  compiles the same program loads it from disk instead of running XLA.

  This is a process-wide JAX setting (`jax_compilation_cache_dir` and the two
  thresholds in `jax.config`): it affects every `jax.jit` and every Session
  in the process, not only the Session that asked. Idempotent; a call with
  another path moves the cache there (JAX's cache object is reset). Returns
  the absolute path.
  """
  if not isinstance(path, (str, os.PathLike)):
    raise TypeError(f"enable_persistent_cache: path must be a str or os.PathLike, got "
                    f"{type(path).__name__}")
  path = os.path.abspath(os.fspath(path))
  with _persistent_lock:
    os.makedirs(path, exist_ok=True)
    for name, value in _PERSISTENT_FLAGS:
      if name in jax.config.values:  # older or newer jax may lack one
        if jax.config.values[name] != value:
          jax.config.update(name, value)
    current = jax.config.values.get("jax_compilation_cache_dir")
    if current == path:
      return path
    jax.config.update("jax_compilation_cache_dir", path)
    if current is not None:  # JAX initialises its cache object once: start again
      try:
        from jax.experimental.compilation_cache import compilation_cache
        compilation_cache.reset_cache()
      except Exception:  # pylint: disable=broad-except
        pass  # an older jax: the new dir takes effect in new processes
  return path
