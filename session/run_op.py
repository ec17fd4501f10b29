"""Single-op mode (MindSpore's RunOp): one primitive, or one small function,
run eagerly through a graph of its own, its executable cached.

    ops = OpRunner("cpu")
    y = ops.run(jax.lax.sin_p, x, accuracy=None)        # a primitive and its params
    z = ops.run(jax.lax.add_p, x, 2.0)                  # Python scalars: weak, as jax.jit
    w = ops.run(f, x, axis=0)                           # a callable; params are static kwargs

A primitive becomes a one-node KernelGraph (its output avals from the
primitive's own shape rule), a callable the graph of its jaxpr; either goes
through the RunOp pipeline (`run_op_passes`: kernel selection only - one op
has nothing to fuse, fold or place) and is compiled ahead of time as one
executable, whose result equals `prim.bind(*args, **params)` (or `fn` under
`jax.jit`) bit for bit: the default kernel binds the same primitive.

The executable is cached by (op, input avals with weak types, params) in a
bounded LRU; ops with effects or user code (callbacks, debug printing) are
never cached - they are traced and compiled again at every call, since
nothing promises that running them twice is running them once.
"""
import dataclasses
import functools
import types
import threading
from typing import Any, Callable, List

import jax
import numpy as np
from jax import tree_util
from jax.extend import core as jcore

from jaxsession import gc_pause
from jaxsession.graph import importer, settings
from jaxsession.errors import InputError, KernelSelectError
from jaxsession.inputs import leaf_aval
from jaxsession.graph.ir import KernelGraph, aval_str
from jaxsession.graph.lowering import graph_consts, lower_nodes
from jaxsession.graph.op_properties import jaxpr_props, primitive_props
from jaxsession.optimizer_passes.base import PassContext, PassManager
from jaxsession.optimizer_passes.select_kernels import SelectKernels
from jaxsession.runtime import callbacks
from jaxsession.runtime.build import (ARG_MISMATCH, SPECIAL_VALUE, checked, compile_fn,
                                      shape_struct)
from jaxsession.runtime.dispatch import fast_call
from jaxsession.runtime.compile_cache import CacheInfo, DoNotStore, ExecutableCache
from jaxsession.runtime.state import session_device


def run_op_passes():
  """The RunOp stage pipeline, in order: kernel selection only. A single op
  has nothing to simplify, fuse or fold, one executable needs no placement
  or partitions, and its memory is XLA's."""
  return [SelectKernels()]


@dataclasses.dataclass
class _CompiledOp:
  """A built op: the executable's call and how to hand back its outputs."""
  name: str
  call: Callable
  unpack: Callable          # list of outputs -> what run returns
  nodes: List[Any]          # for naming a failing callback
  recorder: Any
  user_code: bool


class OpRunner:
  """Runs primitives and small functions one at a time (MindSpore's RunOp),
  with an LRU cache of `cache_size` executables (0: none kept).
  Thread-safe: the cache compiles each key once."""

  def __init__(self, platform, cache_size=128):
    if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 0:
      raise InputError(f"OpRunner: cache_size must be an int >= 0, got {cache_size!r}")
    self.platform = platform
    self._cache = ExecutableCache(cache_size)
    self._lock = threading.Lock()
    self.uncached_runs = 0  # calls that built an op without caching it (effects)

  def cache_info(self):
    """(hits, misses, size, maxsize), as functools.lru_cache reports."""
    return self._cache.cache_info()

  def clear(self):
    self._cache.clear()

  def run(self, op, /, *args, **params):
    """Runs `op` (a jax Primitive, or a callable) on `args` and returns what
    `op.bind(*args, **params)` (or `jax.jit(partial(op, **params))(*args)`)
    returns. InputError for arguments or params the op does not take."""
    if isinstance(op, jcore.Primitive):
      key, build = self._primitive(op, args, params)
      leaves = args
    elif callable(op):
      key, build, leaves = self._function(op, args, params)
    else:
      raise InputError(f"run_op: expected a jax Primitive or a callable, got "
                       f"{type(op).__name__}")
    if key is None:  # effects or user code: never cached
      compiled = build().value
    else:
      # keyed by the device too: an executable runs where it was compiled; and by
      # the jax settings, as jax.jit's cache (under another threefry_partitionable
      # it gave the first setting's bits: a break-it find)
      compiled, _ = self._cache.get_or_compile((key, session_device(), settings.trace_key()),
                                               build)
    return self._execute(compiled, leaves)

  # -- building ----------------------------------------------------------------
  def _primitive(self, prim, args, params):
    name = prim.name
    avals = [_arg_aval(name, i, x) for i, x in enumerate(args)]
    effectful = _runs_user_code(primitive_props(name, params))

    def build():
      try:
        outs, effects = prim.abstract_eval(*avals, **params)  # (avals, effects)
      except Exception as exc:  # pylint: disable=broad-except
        raise InputError(f"run_op({name}): the primitive rejects "
                         f"{_describe(avals)} with params {_param_names(params)}: "
                         f"{type(exc).__name__}: {exc}") from exc
      outs = list(outs) if prim.multiple_results else [outs]
      graph = KernelGraph(f"run_op_{name}")
      inputs = [graph.add_input(a, name=f"arg {i}") for i, a in enumerate(avals)]
      node = graph.add_node(name, prim, params, inputs, outs, effects)
      graph.outputs = list(node.outputs)
      unpack = list if prim.multiple_results else _first
      return self._compile(name, graph, avals, unpack, effectful or bool(effects)
                           or _runs_user_code(node.props))
    key = None if effectful else ("primitive", prim, _avals_key(avals), _freeze(params))
    return key, build

  def _function(self, fn, args, params):
    name = getattr(fn, "__name__", type(fn).__name__)
    leaves, in_tree = tree_util.tree_flatten(args)
    avals = _leaf_avals(name, args, leaves)
    frozen = []
    for k, v in sorted(params.items()):
      try:
        frozen.append((k, _freeze(v, by_identity=False)))
      except TypeError:
        raise InputError(f"run_op({name}): keyword argument {k!r} is a "
                         f"{type(v).__name__}, which is not hashable; a function's params "
                         "are static (as jax.jit's static_argnames): pass arrays as "
                         "positional arguments") from None
    target = functools.partial(fn, **params) if params else fn

    def build():
      structs = [shape_struct(a) for a in avals]
      try:
        closed, out_shape = jax.make_jaxpr(
            lambda *flat: target(*tree_util.tree_unflatten(in_tree, flat)),
            return_shape=True)(*structs)
      except InputError:
        raise
      except Exception as exc:  # pylint: disable=broad-except
        raise InputError(f"run_op({name}): tracing the function on {_describe(avals)} "
                         f"raised {type(exc).__name__}: {exc}") from exc
      graph = importer.import_jaxpr(closed, name=f"run_op_{name}")
      out_tree = tree_util.tree_structure(out_shape)
      effectful = bool(closed.effects) or _runs_user_code(jaxpr_props(closed.jaxpr))
      return self._compile(name, graph, avals,
                           lambda outs: tree_util.tree_unflatten(out_tree, outs), effectful)
    # a plain function or bound method by its own equality (identity, and the
    # same object's method); any other callable by identity: two that compare
    # equal may trace otherwise (a frozen dataclass Scale(2) == Scale(2.0))
    own = fn if isinstance(fn, (types.FunctionType, types.MethodType,
                                types.BuiltinFunctionType)) else _ByIdentity(fn)
    return ("function", own, in_tree, _avals_key(avals), tuple(frozen)), build, leaves

  def _compile(self, name, graph, avals, unpack, effectful):
    """The RunOp pipeline and Build for a graph of one op: kernels, lowering,
    one executable. An effectful op comes back wrapped in DoNotStore."""
    ctx = PassContext(platform=self.platform, verify=True)
    with gc_pause.paused():
      PassManager("SelectKernel", run_op_passes()).run(graph, ctx)
    host = [n for n in graph.nodes if n.kernel is not None and n.kernel.backend == "host"]
    if host:
      raise InputError(f"run_op({name}): node {host[0].id} '{host[0].op}' has only "
                       f"a host kernel ({host[0].kernel.name}); run it in a Session graph")
    recorder = callbacks.ErrorRecorder()
    inputs = [v for v in graph.inputs if v.kind != "const"]
    body = lower_nodes(callbacks.instrumented(graph.nodes, recorder), inputs, graph.outputs,
                       graph_consts(graph))
    try:
      exe = compile_fn(lambda *xs: body(*xs), [shape_struct(a) for a in avals])
    except (TypeError, ValueError, KernelSelectError) as exc:  # params its lowering rejects
      raise InputError(f"run_op({name}): compiling it for {_describe(avals)} raised "
                       f"{type(exc).__name__}: {exc}") from exc
    compiled = _CompiledOp(name, fast_call(exe), unpack, list(graph.nodes), recorder,
                           effectful)
    if effectful:
      with self._lock:
        self.uncached_runs += 1
      return DoNotStore(compiled)
    return compiled

  # -- running -----------------------------------------------------------------
  def _execute(self, compiled, leaves):
    try:  # refused before it ran: an array on another device? moved, retried once
      outs = checked(compiled.call, lambda xs: [_on_session_device(x) for x in xs])((), leaves)
    except ARG_MISMATCH as exc:
      raise InputError(f"run_op({compiled.name}): the arguments do not fit the compiled "
                       f"op: {type(exc).__name__}: {exc}") from None
    except SPECIAL_VALUE as exc:  # jax_debug_nans/infs: jax's private error
      what = exc.args[1] if len(exc.args) > 1 else "nan"
      raise FloatingPointError(f"run_op({compiled.name}) produced {what} "
                               f"(jax_debug_{what}s)") from None
    except jax.errors.JaxRuntimeError as exc:
      if not compiled.user_code:
        raise
      raise callbacks.callback_failure(compiled.nodes, 0, exc, compiled.recorder)
    return compiled.unpack(list(outs))


def _first(outs):
  return outs[0]


def _runs_user_code(props):
  return props.effects or props.user_code


def _arg_aval(name, i, x):
  """The aval jax.jit sees for argument `i` of a primitive (Python scalars
  weakly typed); InputError for what is not an array value."""
  return leaf_aval(x, f"run_op({name}): argument {i}")


def _leaf_avals(name, args, leaves):
  """The avals of a function's argument leaves; InputError naming the
  argument and pytree path of one that is not an array value (the paths
  are worked out only then)."""
  try:
    return [_arg_aval(name, "", x) for x in leaves]
  except InputError:
    for path, x in tree_util.tree_flatten_with_path(args)[0]:  # raises, naming the path
      _arg_aval(name, f"{path[0].idx} at path {tree_util.keystr(path[1:]) or '(root)'}", x)
    raise


def _on_session_device(x):
  if isinstance(x, jax.Array) and x.committed and x.devices() != {session_device()}:
    return jax.device_put(x, session_device())
  return x


def _avals_key(avals):
  # dtype objects, not their names: str(np.dtype) is a Python call (~2 µs a leaf)
  return tuple((a.shape, a.dtype, a.weak_type) for a in avals)


def _describe(avals):
  return "(" + ", ".join(aval_str(a) for a in avals) + ")"


def _param_names(params):
  return "{" + ", ".join(sorted(params)) + "}"


class _ByIdentity:
  """An unhashable param (a list of jaxprs' holder, a mutable object) as a
  key part: equal only to itself. The key holds it, so its id stays its own."""
  __slots__ = ("obj",)

  def __init__(self, obj):
    self.obj = obj

  def __hash__(self):
    return id(self.obj)

  def __eq__(self, other):
    return isinstance(other, _ByIdentity) and other.obj is self.obj


def _freeze(x, by_identity=True):
  """`x` as a hashable key part that is equal only for params that compile
  alike: types kept (1, 1.0 and True differ), floats by their bits (-0.0 is
  not 0.0), arrays by value. Unhashable objects by identity, or TypeError
  when `by_identity` is False."""
  if isinstance(x, (np.ndarray, np.generic)):  # first: np.float64 is a float
    arr = np.asarray(x)
    return ("array", type(x), arr.dtype.str, arr.shape, arr.tobytes())
  if x is None or isinstance(x, (bool, int, str)):
    return (type(x), x)
  if isinstance(x, float):
    return (float, x.hex())
  if isinstance(x, complex):
    return (complex, x.real.hex(), x.imag.hex())
  if isinstance(x, jax.Array):
    try:
      arr = np.asarray(x)
    except Exception:  # pylint: disable=broad-except  (extended dtypes: by identity)
      return _ByIdentity(x)
    return ("jax.Array", str(x.dtype), arr.shape, arr.tobytes(), bool(x.weak_type))
  if isinstance(x, (tuple, list)):
    return (type(x), tuple(_freeze(v, by_identity) for v in x))
  if isinstance(x, dict):
    items = [(_freeze(k, by_identity), _freeze(v, by_identity)) for k, v in x.items()]
    return (dict, tuple(sorted(items, key=repr)))
  if isinstance(x, (set, frozenset)):
    return (frozenset, frozenset(_freeze(v, by_identity) for v in x))
  try:
    hash(x)
  except TypeError:
    if not by_identity:
      raise
    return _ByIdentity(x)
  return (type(x), x)


__all__ = ["OpRunner", "run_op_passes", "CacheInfo"]
