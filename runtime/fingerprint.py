"""The compile cache's key: what an executable computes, as text.

The Python function object says nothing (a new closure each call, or the
same function traced for other shapes), so a graph's key is a `fingerprint`
of the KernelGraph after the whole pipeline: every decision an executable
depends on - ops, params, kernels, places, partitions, input avals,
constants, literals, outputs, donation, the jax settings it was built under
- and nothing it does not (value and node ids, source lines, names).
`executable_key` adds one executable's argument types and donations;
`canonical` is the text of any parameter value, `identity` of an object
that has no value to compare (a callback, a primitive). The store that
holds the executables is compile_cache.py.
"""
import dataclasses
import enum
import hashlib
import itertools
import re
import threading
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
