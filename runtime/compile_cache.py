"""The compile cache: executables reused by what they compute, not by who asked.

A second `compile` of the same program with the same avals and options must
not pay XLA again. The Python function object says nothing (a new closure
each call, or the same function traced for other shapes), so the key is a
`fingerprint` of the KernelGraph after the whole pipeline: every decision an
executable depends on - ops, params, kernels, places, partitions, input avals,
constants, literals, outputs, donation - and nothing it does not (value and
node ids, source lines, names).

    fp = fingerprint(graph, spec.avals, options_key(options), platform)
    exe = build.compile_fn(fn, structs, donate, cache=executables, key=(fp, "partition", 0))

`ExecutableCache` is the in-memory store (LRU, thread-safe, one compile per
key, entries pinned by the live graphs that use them); `RecordingCache` wraps
it for one Build, pins what it finds for that graph and records each lookup
(hit or miss, seconds) for the compile report. `enable_persistent_cache` turns on JAX's
own on-disk cache, so that a new process skips XLA compilation as well.
"""
import collections
import dataclasses
import enum
import hashlib
import itertools
import os
import re
import threading
import time
import types
import weakref

import jax
import numpy as np
from jax.extend import core as jcore

from jaxsession.graph import settings
from jaxsession.graph.ir import Literal, Value, aval_str

# SessionOptions fields that never change an executable (dumps, checks,
# caches, bookkeeping); every other field - including ones added later - is
# part of the key, so a new option is safe by default.
NOT_EXECUTABLE_OPTIONS = frozenset({
    "save_graphs", "verify_graphs", "run_op_cache_size", "compilation_cache_dir",
    "recompile_warn_limit", "precompile_buckets", "enable_profiling", "compile_cache_size",
    "checkpoint_keep"})

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


# -- the fingerprint --------------------------------------------------------
def options_key(options):
  """The SessionOptions fields that change executables, as canonical text."""
  if options is None:
    return ()
  if dataclasses.is_dataclass(options):
    names = [f.name for f in dataclasses.fields(options)]
  else:
    names = sorted(vars(options))
  return tuple((name, canonical(getattr(options, name))) for name in names
               if name not in NOT_EXECUTABLE_OPTIONS)


def jax_settings():
  """The jax configuration an executable depends on (tracing and lowering:
  settings.traced_values, and the caller's compute type and xla_metadata,
  which tag every op bound under them), as the caller has it, a `with`
  block's included (an executable compiled inside a metadata block served
  the same program compiled outside it: a review's find)."""
  ctx = settings.caller()
  return tuple((name, repr(value)) for name, value in settings.traced_values()) + (
      ("equation context", "-" if ctx is None else settings.describe(ctx)),
      ("jax", jax.__version__))


def fingerprint(graph, spec_avals, options_key=(), platform="cpu", extra=()):
  """sha256 (hex) of the optimised KernelGraph and what its executables
  depend on besides it.

  Values are numbered by order of appearance (inputs, then node outputs in
  execution order), so two traces of one program - which number their values
  differently - get one fingerprint. Parameters are canonical text: sub-jaxprs
  equation by equation, arrays by the hash of their bytes with dtype and
  shape, floats by their exact bits (-0.0 is not 0.0), callables by identity
  (see `canonical`), so two different callbacks in the same structure never
  share an executable.
  """
  writer = _Writer()
  numbers = {}
  memo = {}  # id(jaxpr) -> text: a body several nodes carry is written once
  avals = {}  # id(aval) -> (aval, text): avals are shared objects; text is slow
  kernels = {}  # id(kernel) -> (kernel, text)
  params_memo = {}  # the params' (name, id(value)) -> (values, text): nodes share objects

  def params_text(params):
    # 1400 jnp.where calls share one jaxpr, sharding tuple, mesh...: their
    # params are written once (the values are kept, so their ids stay theirs)
    key = tuple([(k, id(v)) for k, v in params.items()])
    hit = params_memo.get(key)
    if hit is None or any(a is not b for a, b in zip(hit[0], params.values())):
      hit = params_memo[key] = (tuple(params.values()), canonical(dict(params), memo))
    return hit[1]

  def define(value):
    numbers[value.id] = len(numbers)
    hit = avals.get(id(value.aval))
    if hit is None or hit[0] is not value.aval:
      hit = avals[id(value.aval)] = (value.aval, _aval_text(value.aval))
    return f"v{numbers[value.id]}:{hit[1]}"

  def kernel_text(kernel):
    if kernel is None:
      return "-"
    hit = kernels.get(id(kernel))
    if hit is None:
      text = f"{kernel.name}/{kernel.backend}/{_callable_text(kernel.fn)}"
      hit = kernels[id(kernel)] = (kernel, text)
    return hit[1]

  def ref(value):
    if isinstance(value, Literal):
      return _literal_text(value.value, value.aval)
    if isinstance(value, Value) and value.id in numbers:
      return f"v{numbers[value.id]}"
    return "?"

  writer.put("platform", str(platform), "options", canonical(options_key),
             "jax", canonical(jax_settings()), "spec", canonical(spec_avals),
             "extra", canonical(extra), "updates_state", str(graph.updates_state))
  for value in graph.inputs:
    writer.put("input", value.kind, define(value))
    if value.kind == "const":
      writer.put(_array_text(graph.const_values.get(value.id)))
  position = {}
  for i, node in enumerate(graph.nodes):
    position[id(node)] = i
    writer.put(
        "node", node.op, "prim" if node.prim is not None else "fused",
        params_text(node.params), "in", ",".join(ref(v) for v in node.inputs),
        "out", ",".join(define(v) for v in node.outputs),
        "effects", ",".join(sorted(map(str, node.effects or ()))),
        "kernel", kernel_text(node.kernel), "place", str(node.place), "stream", str(node.stream),
        "settings", _settings_text(node.ctx, memo))
  writer.put("outputs", ",".join(ref(v) for v in graph.outputs))
  for part in graph.partitions or ():
    writer.put("partition", str(part.index), part.place, str(part.stream),
               ",".join(str(position.get(id(n), "?")) for n in part.nodes),
               "in", ",".join(ref(v) for v in part.inputs),
               "out", ",".join(ref(v) for v in part.outputs),
               "prefetch", ",".join(ref(v) for v in part.prefetch),
               "may_fail", str(part.may_fail), "overlaps", canonical(list(part.overlaps)))
  plan = graph.memory
  if plan is not None:
    for decision in list(plan.donations) + list(plan.intermediate_donations):
      writer.put("donation", ref(decision.state), str(decision.donated),
                 str(decision.partition))
  return writer.hexdigest()


class _Writer:
  """sha256 over a stream of text tokens (separated, so tokens cannot run
  into each other)."""

  def __init__(self):
    self._hash = hashlib.sha256()

  def put(self, *tokens):
    self._hash.update("\x1f".join(tokens).encode("utf-8", "backslashreplace"))
    self._hash.update(b"\x1e")

  def hexdigest(self):
    return self._hash.hexdigest()


def canonical(x, memo=None):
  """Canonical text of a parameter value: equal text means the same
  executable. Jaxprs are written equation by equation (their pretty print
  hides callback addresses), arrays by a hash of their bytes, callables by
  identity (`_callable_text`), objects whose repr shows an address by id."""
  memo = {} if memo is None else memo
  if isinstance(x, (np.ndarray, np.generic, jax.Array)):  # first: np.float64 is a float
    return _array_text(x)
  if x is None or isinstance(x, (bool, str)):
    return f"{type(x).__name__}:{x!r}"
  if isinstance(x, int) and not isinstance(x, enum.Enum):
    return f"{type(x).__name__}:{x!r}"
  if isinstance(x, float):
    return f"float:{x.hex()}"
  if isinstance(x, complex):
    return f"complex:{x.real.hex()},{x.imag.hex()}"
  if isinstance(x, np.dtype):
    return f"dtype:{x}"
  if isinstance(x, type):
    if issubclass(x, np.generic) or hasattr(x, "dtype"):  # np.float32, jnp.float32
      try:
        return f"dtype:{np.dtype(x)}"
      except TypeError:
        pass
    return f"type:{x.__module__}.{x.__qualname__}"
  if isinstance(x, enum.Enum):
    return f"enum:{type(x).__qualname__}.{x.name}"
  if isinstance(x, jcore.ClosedJaxpr):
    consts = ",".join(canonical(c, memo) for c in x.consts)
    return f"closed{{{_jaxpr_text(x.jaxpr, memo)} consts[{consts}]}}"
  if isinstance(x, jcore.Jaxpr):
    return _jaxpr_text(x, memo)
  if isinstance(x, jcore.Primitive):
    return f"prim:{x.name}{identity(x)}"
  if isinstance(x, jax.sharding.Mesh):  # its repr leaves out the devices
    ids = [getattr(d, "id", d) for d in x.devices.flat]
    return f"mesh:{x.axis_names}:{x.devices.shape}:{ids}"
  if isinstance(x, jax.sharding.NamedSharding):
    return f"named:{canonical(x.mesh, memo)}:{x.spec}:{x.memory_kind}"
  if hasattr(x, "_fields") and isinstance(x, tuple):  # NamedTuple (dimension numbers)
    return (f"{type(x).__qualname__}(" + ",".join(
        f"{f}={canonical(getattr(x, f), memo)}" for f in x._fields) + ")")
  if isinstance(x, (tuple, list)):
    inner = ",".join(canonical(v, memo) for v in x)
    return f"({inner})" if isinstance(x, tuple) else f"[{inner}]"
  if isinstance(x, dict):
    items = sorted((canonical(k, memo), canonical(v, memo)) for k, v in x.items())
    return "{" + ",".join(f"{k}:{v}" for k, v in items) + "}"
  if isinstance(x, (set, frozenset)):
    return "set{" + ",".join(sorted(canonical(v, memo) for v in x)) + "}"
  if hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "str_short"):
    return f"aval:{_aval_text(x)}"
  if hasattr(x, "callback_func"):  # jax's _FlatCallback: the user's function + tree
    return (f"callback({_callable_text(x.callback_func)},"
            f"{canonical(getattr(x, 'in_tree', None), memo)})")
  if callable(x) and not hasattr(x, "_fields"):
    return _callable_text(x)
  text = repr(x)
  if _ADDRESS.search(text) or text.startswith("<"):  # says nothing but its address
    return f"obj:{type(x).__module__}.{type(x).__qualname__}{identity(x)}"
  return f"{type(x).__qualname__}:{text}"


def _callable_text(fn):
  """A callable by identity, with its qualname. A plain Python function is
  what decides its behaviour - its code (which names its module and line),
  globals, defaults and closure cells, each by identity - so a lambda
  written inside the traced function, a new object at every trace, is one
  callback, while two functions with other code, or closures over other
  cells (`make(2)` and `make(3)`), never compare equal. The ids stay valid
  while an executable calling the function is cached: it keeps the function
  alive, and with it the code, globals and cells."""
  if isinstance(fn, types.MethodType):
    return f"method({_callable_text(fn.__func__)},self{identity(fn.__self__)})"
  if hasattr(fn, "func") and hasattr(fn, "args") and hasattr(fn, "keywords"):  # partial
    return (f"partial({_callable_text(fn.func)},{canonical(tuple(fn.args))},"
            f"{canonical(dict(fn.keywords))})")
  qualname = getattr(fn, "__qualname__", type(fn).__qualname__)
  name = f"{getattr(fn, '__module__', '?')}.{qualname}"
  if isinstance(fn, types.FunctionType):
    cells = ",".join(identity(cell) for cell in fn.__closure__ or ())
    return (f"fn:{name}/code{identity(fn.__code__)}/globals{identity(fn.__globals__)}/"
            f"cells[{cells}]/{canonical(fn.__defaults__)}/{canonical(fn.__kwdefaults__)}")
  return f"fn:{name}{identity(fn)}"


_tokens = {}  # id(obj) -> (weak reference to obj, token)
_token_counter = itertools.count()
_tokens_lock = threading.RLock()  # a weakref callback may run inside `identity` (GC)


def identity(x):
  """Text naming `x` itself: a token never given to another object in this
  process (an id is reused once its object dies), or the id where `x`
  cannot be weakly referenced (dicts, cells: module globals live as long as
  their module, and a function's cells as long as it does - a cached
  executable that calls it keeps it alive)."""
  with _tokens_lock:
    hit = _tokens.get(id(x))
    if hit is not None and hit[0]() is x:
      return f"#{hit[1]}"
    key = id(x)
    try:
      ref = weakref.ref(x, lambda r: _forget(key, r))
    except TypeError:
      return f"@{key}"
    token = next(_token_counter)
    _tokens[key] = (ref, token)
    return f"#{token}"


def _forget(key, ref):
  with _tokens_lock:
    if _tokens.get(key, (None,))[0] is ref:
      del _tokens[key]


def _jaxpr_text(jaxpr, memo):
  """A jaxpr equation by equation, its variables numbered by appearance."""
  key = id(jaxpr)
  if key in memo:
    return memo[key][1]
  names = {}

  def var(v):
    if isinstance(v, jcore.Literal):
      return _literal_text(v.val, v.aval)
    if type(v).__name__ == "DropVar":
      return f"_:{_aval_text(v.aval)}"
    if v not in names:
      names[v] = len(names)
      return f"a{names[v]}:{_aval_text(v.aval)}"
    return f"a{names[v]}"

  parts = ["const(" + ",".join(var(v) for v in jaxpr.constvars) + ")",
           "in(" + ",".join(var(v) for v in jaxpr.invars) + ")"]
  for eqn in jaxpr.eqns:
    ins = ",".join(var(v) for v in eqn.invars)
    params = canonical(dict(eqn.params), memo)
    effects = ",".join(sorted(map(str, eqn.effects)))
    outs = ",".join(var(v) for v in eqn.outvars)
    parts.append(f"{eqn.primitive.name}{params}({ins})->({outs})!{effects}"
                 f"!{_settings_text(getattr(eqn, 'ctx', None), memo)}")
  parts.append("out(" + ",".join(var(v) for v in jaxpr.outvars) + ")")
  text = "{" + ";".join(parts) + "}"
  memo[key] = (jaxpr, text)  # the jaxpr is kept so its id stays its own
  return text


def _settings_text(ctx, memo):
  """The jax settings an equation (a node) binds under, which change its
  bits (graph/settings.py; jax interns contexts, so each is written once)."""
  if ctx is None:
    return "-"
  key = ("settings", id(ctx))
  if key not in memo:
    memo[key] = (ctx, settings.describe(ctx))
  return memo[key][1]


def _aval_text(aval):
  text = aval_str(aval)
  sharding = getattr(aval, "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is not None and any(p is not None for p in spec):
    text += f"@{spec}"
  return text


def _literal_text(value, aval):
  arr = np.asarray(value)
  return (f"lit:{type(value).__name__}:{arr.dtype}:{arr.tobytes().hex()}"
          f":{_aval_text(aval)}")


def _array_text(x):
  if x is None:
    return "array:None"
  try:
    arr = np.asarray(x)
  except Exception:  # an extended dtype (PRNG keys): by its data
    arr = np.asarray(jax.random.key_data(x))
  digest = hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest()
  return f"array:{arr.dtype}:{list(arr.shape)}:{getattr(x, 'dtype', arr.dtype)}:{digest}"


def executable_key(key, arg_structs, donate_argnums=()):
  """The cache key of one executable: the caller's key (graph fingerprint
  and which executable of the graph), the argument types it is compiled for
  (pytree, shapes, dtypes, weak types, shardings) and the donated positions."""
  leaves, treedef = jax.tree_util.tree_flatten(arg_structs)
  types_ = tuple((tuple(leaf.shape), str(leaf.dtype), bool(getattr(leaf, "weak_type", False)),
                  canonical(getattr(leaf, "sharding", None))) for leaf in leaves)
  return (key, treedef, types_, tuple(donate_argnums))


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
    self.done = threading.Event()
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
      with self._lock:
        if key in self._entries:
          self._entries.move_to_end(key)
          self.hits += 1
          self._pin(key, owner)
          return self._entries[key], True
        pending = self._pending.get(key)
        compiles_here = pending is None
        if compiles_here:
          pending = self._pending[key] = _Pending()
      if compiles_here:
        return self._compile(key, pending, compile_thunk, owner), False
      pending.done.wait()
      if pending.ok:
        with self._lock:
          self.hits += 1
          self._pin(key, owner)
        return pending.value, True
      # the compile we waited for failed or was not stored: compile here

  def _compile(self, key, pending, compile_thunk, owner=None):
    try:
      value = compile_thunk()
    except BaseException:
      with self._lock:
        self.misses += 1
        del self._pending[key]
      pending.done.set()
      raise
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
    if not store:
      pending.done.set()
      return value.value
    pending.value, pending.ok = value, True
    pending.done.set()
    return value

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
