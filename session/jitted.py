"""jaxsession.jit: a drop-in for jax.jit's common form, run through a Session.

    f = js.jit(fn, static_argnums=(), static_argnames=(), session=None)
    y = f(x, n=3)

The first call with a new argument signature compiles, in the session (the
given one, or one default Session per process), the program jax.jit traces
of `fn` (jax.jit's own trace, from its cache: `fn` is traced as often as
under jax.jit, with .lower/.trace/.eval_shape and calls under a trace
around), and later calls with that signature `run` it. A signature is what
jax.jit's cache tells apart: the values of the static arguments, the pytree
structure of the others (keyword arguments included) and each leaf's type,
shape, dtype and weak type. The output keeps `fn`'s pytree, as jax.jit's
does. A wrapper is called through jax.jit's own C++ call object
(jax_api.cpp_front; not with a static position counted from the end): where
a signature's graph is one executable with nothing around it, taking no
dynamic keyword argument, the signature check and the run are C++'s, as in
a jax.jit call; every other call takes this module's Python path
(tests/jit_front_test.py; benchmarks/dispatch.py's js.jit rows).

Called under a trace (inside grad, vmap, another jit: a tracer among the
arguments), it traces `fn` inline as jax.jit does - it *is* jax.jit there -
and under `jax.disable_jit()` it calls `fn` op by op, as jax.jit does. Its
`lower`, `trace` and `eval_shape` are jax.jit's own, of the same function
and statics (flax's `tabulate` lowers through them); anything else jax.jit
offers is an AttributeError naming jax.jit. Every wrapper of one function with the same
statics and session shares its graphs, as jax.jit's cache is keyed by the
function (`js.jit(f)(x)` wrapped anew at each call compiles once); they are
kept a while after its last wrapper goes (session/jit_cache.py). Outputs are
committed to their device where jax.jit's are: where an argument the
program uses (as jax.jit's DCE tells) was. A call a session cannot run as
jax.jit does - arguments committed to other devices or sharded, a jax.Ref
(or another leaf that is no array, as flax's hijax Variables) taken or
closed over, a 64-bit array after x64 was turned off, an unhashable
function - is jax.jit's call. `jax.clear_caches()` releases every graph, as it drops
jax.jit's executables. Given `donate_argnums`/`donate_argnames`, a call
that donates an array is jax.jit's (which donates it), one that donates
none (an empty pytree there) the session's. Given any other jax.jit option
(shardings, inline, ...) `jit` returns jax.jit itself.
"""
import functools
import inspect
import keyword
import numbers
import threading
import types
import weakref

from absl import logging
import jax
import numpy as np
from jax import tree_util
from jax.core import ShapedArray

from jaxsession import jit_cache, jit_commits, tracing
from jaxsession import jit_placement as placement
from jaxsession.graph import settings
from jaxsession.errors import InputError, UnknownGraphError
from jaxsession.runtime.dispatch import ordered
# _top_level: True outside every trace (vmap with an axis name, grad, jit, ...);
# where jax lacks the internal API, tracer arguments alone tell a trace
from jaxsession.jax_api import ARRAY, api_boundary, check_valid_dtype, cpp_front, \
    deoptimized, fastpath, real_jit, trace_state_clean as _top_level


_DEFAULT = []                 # the process's default Session, made on first use
_DEFAULT_LOCK = threading.Lock()


def default_session():
  """The Session `jit` compiles in when none is given (one per process)."""
  with _DEFAULT_LOCK:
    if not _DEFAULT:
      from jaxsession.session import Session  # pylint: disable=import-outside-toplevel
      _DEFAULT.append(Session())
    return _DEFAULT[0]


def _as_tuple(nums, what, kind):
  if nums is None:
    return ()
  if isinstance(nums, kind):
    return (nums,)
  try:
    nums = tuple(nums)
  except TypeError:
    raise InputError(f"jaxsession.jit: {what} must be {kind.__name__}s, got {nums!r}") from None
  for n in nums:
    if not isinstance(n, kind) or isinstance(n, bool):
      raise InputError(f"jaxsession.jit: {what} must be {kind.__name__}s, got {n!r}")
  return nums


def _resolve_statics(fn, argnums, argnames, what="static"):
  """(static positions, static names), one completed from the other through
  fn's signature where it is None, as jax.jit does (a static name of a
  positional parameter makes that position static, and the other way round;
  given both, jax.jit takes them as they are: so does this, a review's find)."""
  complete_nums, complete_names = argnums is None, argnames is None
  argnums = _as_tuple(argnums, f"{what}_argnums", numbers.Integral)
  argnames = _as_tuple(argnames, f"{what}_argnames", str)
  try:
    params = list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):  # no signature (a builtin): take them as given
    return frozenset(argnums), frozenset(argnames)
  positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  names = set(argnames)
  nums = set(argnums)
  for i, p in enumerate(positional):
    if complete_nums and p.name in names and p.kind != p.POSITIONAL_ONLY:
      nums.add(i)
    if complete_names and i in nums and p.kind != p.POSITIONAL_ONLY:  # (not a
      names.add(p.name)  # negative position, as jax.jit: a review's find)
  return frozenset(nums), frozenset(names)


_PY_SCALARS = (bool, int, float, complex)
# A Python int, float or complex is keyed as the weakly typed scalar array of
# the default dtype that jax.jit takes it for: one signature, as in its cache
# (flax's TrainState step, a Python 0 and then the step's int32 output, was
# compiled twice: a break-it find); a bool as a strong bool scalar
_PY_KEYS = {(t, x64): (ARRAY, jax.core.ShapedArray((), np.dtype(names[x64]),
                                                   weak_type=t is not bool), None)
            for t, names in ((int, ("int32", "int64")), (float, ("float32", "float64")),
                             (complex, ("complex64", "complex128")), (bool, ("bool", "bool")))
            for x64 in (False, True)}
_NO_STATICS = ((), ())


class _Traced(Exception):
  """A tracer among the arguments: the call is jax.jit's, traced inline."""


class _OtherStatics(Exception):
  """jax.jit's trace took other arguments as static than this signature."""


def _leaf_key(x):
  """What a leaf contributes to the signature, (kind, aval, the sharding of
  a committed array or None): jax.jit compiles anew for a new type, shape,
  dtype or weak type (a Python scalar is weak), and runs where a committed
  argument is. A jax array's aval is jax's own, interned: the key of an
  array is ~0.07 µs (a tuple of its shape, dtype and weak type was ~0.4 µs,
  js.jit's per-leaf cost; benchmarks/dispatch.py's js.jit rows)."""
  if type(x) is ARRAY:
    return (ARRAY, x.aval, x.sharding if x._committed else None)  # pylint: disable=protected-access
  if type(x) in _PY_SCALARS:
    x64 = jax.config.jax_enable_x64
    if type(x) is int:  # out of the default int's range: jax.jit's OverflowError,
      bits = 64 if x64 else 32  # naming the argument's path
      if not -(1 << (bits - 1)) <= x < (1 << (bits - 1)):
        raise TypeError("to jax.jit")
    return _PY_KEYS[type(x), x64]
  if isinstance(x, jax.core.Tracer):
    raise _Traced
  if isinstance(x, jax.Array):
    return (type(x), x.aval, x.sharding if x.committed else None)
  if isinstance(x, jax.ShapeDtypeStruct):  # a type, no value: jax.jit's TypeError
    raise TypeError("to jax.jit")
  # numpy arrays and scalars, anything else jax takes (custom element types); not
  # a JAX type: a TypeError, on which __call__ hands the call to jax.jit
  aval = jax.api_util.shaped_abstractify(x)
  if type(aval) is not ShapedArray:  # a jax.Ref, flax's hijax Variable...: jax.jit's to run
    raise TypeError("to jax.jit")  # (a Variable had no dtype to check: a break-it find)
  check_valid_dtype(aval.dtype)  # np.datetime64 and np.void abstractify (a break-it find)
  # a numpy value as the uncommitted array jax.jit takes it for: one graph for
  # np.float32(1) and jnp.float32(1), as in jax.jit's cache
  return (ARRAY if isinstance(x, (np.ndarray, np.generic)) else type(x), aval, None)


AOT = ("lower", "trace", "eval_shape")  # jax.jit's, forwarded as they are


class _CallSlot:
  """Jitted.__call__: on a wrapper, jax.jit's C++ call object (cpp_front)
  itself - a call runs no Python frame of this module's around it, so a
  traceback through it is what jax.jit's is (JAX's errors_test) - else the
  Python path behind jax's traceback filtering boundary; on the class, a
  method taking the wrapper first (`type(f).__call__(f, x)`, as jax.jit's)."""

  def __get__(self, wrapper, owner=None):
    if wrapper is None:
      return self
    front = wrapper._front  # pylint: disable=protected-access
    return front if front is not None else wrapper._python_call  # pylint: disable=protected-access

  def __call__(self, wrapper, /, *args, **kwargs):
    return self.__get__(wrapper)(*args, **kwargs)


class Jitted:
  """What `jit` returns: call it as `fn`."""

  def __init__(self, fn, static_argnums, static_argnames, session, donate_argnums=None,
               donate_argnames=None):
    if not callable(fn):  # jax.jit's own TypeError ("Expected a callable value, got 3")
      real_jit(fn)
      raise TypeError(f"Expected a callable value, got {fn!r}")
    from jaxsession.session import Session  # pylint: disable=import-outside-toplevel
    if session is not None and not isinstance(session, Session):
      raise InputError(f"jaxsession.jit: session must be a jaxsession.Session or None, got "
                       f"{type(session).__name__}")
    # first: the __dict__ it copies from fn may be another wrapper's (jax.grad
    # and jax.vmap of a js.jit function forward it), whose own attributes
    # must not replace this one's (a break-it find: the inner function ran);
    # nor may it hide this class's methods (equinox's filter_jit has a
    # `_signature` field: a break-it find, "'Signature' object is not callable")
    functools.update_wrapper(self, fn, updated=())
    self.__dict__.update((k, v) for k, v in getattr(fn, "__dict__", {}).items()
                         if not hasattr(Jitted, k))
    self._fn = fn
    # jax.jit(fn, ...), for calls under a trace; made first, so that statics
    # of the wrong type, or that the signature does not have, raise jax's own
    # TypeError or ValueError, as jax.jit does (a break-it find: InputError);
    # the statics as given, None where not: jax.jit (whose default it is) then
    # completes the one from the other, as _resolve_statics does (given (),
    # a static passed the other way was traced: a user's find)
    self._donate = {k: v for k, v in (("donate_argnums", donate_argnums),
                                      ("donate_argnames", donate_argnames)) if v is not None}
    self._traced = real_jit(fn, static_argnums=static_argnums,
                            static_argnames=static_argnames, **self._donate)
    self._static_nums, self._static_names = _resolve_statics(fn, static_argnums,
                                                             static_argnames)
    # a call that donates no array runs in the session (equinox's filter_jit
    # donates its first argument, an empty dict unless asked to: routed, it
    # was jax.jit's); one that does is jax.jit's, which donates
    self._donated = _resolve_statics(fn, donate_argnums, donate_argnames, "donate") \
        if self._donate else None
    self._argnums, self._argnames = static_argnums, static_argnames
    self._session = session  # held here; the shared graphs hold it weakly
    self._sigs = jit_cache.acquire(fn, (self._static_nums, self._static_names,
                                        self._donated), session)
    weakref.finalize(self, jit_cache.dropped, self._sigs)
    # a call of a signature whose graph the front runs itself costs what jax.jit's
    # does (benchmarks/dispatch.py's js.jit rows); the front passes it the
    # dynamic arguments alone, as the graph takes them (a static position from
    # the end is found per call: the Python path's)
    self._front = None if any(i < 0 for i in self._static_nums) else cpp_front(
        fn, _front_miss(weakref.ref(self), self._traced), self._sigs.front,
        sorted(self._static_nums), sorted(self._static_names))

  @property
  def session(self):
    """The Session this wrapper compiles in."""
    if self._session is None:
      self._session = default_session()
      self._sigs.bind(self._session)
    return self._session

  @property
  def graph_ids(self):
    """The graphs compiled for this wrapper's function in its session (shared
    by its wrappers with the same statics), one per signature. Each is run
    by this wrapper with its signature's argument types only, weak types
    included: a `session.run` of one by hand with other weak types is not
    guarded (tracing.keyed_by_weak_types)."""
    sigs = self._sigs
    with sigs.lock:  # a compile in another thread adds to them
      gids = list(dict.fromkeys(g for g, _ in sigs.graphs.values() if g is not _JAX))
    live = self.session._graphs  # pylint: disable=protected-access
    return tuple(g for g in gids if g in live)  # not those released by hand since

  def clear_cache(self):
    """Releases the graphs compiled for this function in this session (the
    ones its wrappers with these statics share), as jax.jit's clear_cache
    drops its executables (its trace too: the graphs are compiled from
    it; a review's find); the next call traces and compiles again."""
    self._traced.clear_cache()
    self._sigs.release()  # (under its lock: not while another thread compiles for it)

  def __get__(self, obj, objtype=None):  # a jitted method: bound as jax.jit binds it,
    # a method (__self__, __name__, .lower(obj, ...) through __func__: a break-it find)
    return self if obj is None else types.MethodType(self, obj)

  def __getattr__(self, name):
    if name.startswith("__") or name in ("_fn", "_sigs", "_session", "_traced", "_front",
                                         "graph_ids"):
      raise AttributeError(name)
    if name in AOT:  # jax.jit's own, of fn and these statics
      return getattr(self._traced, name)
    raise AttributeError(f"jaxsession.jit offers calling, clear_cache and {', '.join(AOT)} "
                         f"only; for '{name}' use jax.jit(fn).{name}")

  def __copy__(self):  # a function: copy.copy and copy.deepcopy give it back
    return self

  def __deepcopy__(self, memo):
    return self

  def __reduce__(self):  # pickled as jax.jit's is: the function and its statics,
    # compiled again where it is loaded (in the default Session there: a Session,
    # its executables and locks are no picklable value)
    return (functools.partial(jit, **self._donate), (self._fn, self._argnums,
                                                     self._argnames))

  def _split(self, args, kwargs):
    """(static key, dynamic positional args, dynamic keyword args)."""
    if not (self._static_nums or self._static_names):
      return _NO_STATICS, args, kwargs
    n = len(args)
    if any(i < -n for i in self._static_nums):  # jax.jit's ValueError (it was taken
      raise TypeError("to jax.jit")  # as absent: a break-it find)
    nums = {i % n for i in self._static_nums if -n <= i < n}
    static_pos = tuple((i, args[i]) for i in sorted(nums))
    dyn_args = tuple(a for i, a in enumerate(args) if i not in nums)
    static_kw = tuple(sorted((k, v) for k, v in kwargs.items() if k in self._static_names))
    dyn_kw = {k: v for k, v in kwargs.items() if k not in self._static_names}
    statics = (static_pos, static_kw)
    hash(statics)  # unhashable: a TypeError, on which __call__ hands the call to jax.jit
    return statics, dyn_args, dyn_kw

  __call__ = _CallSlot()

  @api_boundary
  def _python_call(self, /, *args, **kwargs):  # (a keyword argument may be named self)
    return self._call(args, kwargs)

  def _call(self, args, kwargs, fast=None):
    """The call in Python: the signature, compiled on first use, and its run.
    `fast` (a list, from the C++ front's miss): gets the front's data for
    the signature where the front may run it itself - a graph whose one
    executable is the whole graph, with nothing around it (Runner.exe,
    Entry.direct), no dynamic keyword arguments (the front would pass them
    after the positional ones; the graph takes them first, its signature
    naming them before fn's *args)."""
    if jax.config.jax_disable_jit:  # jax.jit runs fn op by op here
      return self._fn(*args, **kwargs)
    if jax.config.jax_debug_key_reuse:  # jax.jit's checks of the keys it consumes
      return self._under_trace()(*args, **kwargs)  # (a judge's find: none ran)
    # (each hand-over to jax.jit is made outside the except clause that found it:
    # inside, the internal exception was chained into jax.jit's traceback)
    try:
      statics, dyn_args, dyn_kw = self._split(args, kwargs)
    except TypeError:  # an unhashable static: jax.jit's own ValueError, naming it
      statics = None
    if statics is None or not _top_level():  # or under a trace (even with concrete
      return self._under_trace()(*args, **kwargs)  # arguments: vmap's axis name): inline
    leaves, treedef = tree_util.tree_flatten((dyn_args, dyn_kw))
    # the trace-time configuration is part of the signature, as in jax.jit's
    # cache (threefry_partitionable, dtype and rank promotion, the mesh...)
    try:
      leaf_keys = tuple(map(_leaf_key, leaves))
    except (TypeError, _Traced):  # a tracer; a leaf of no JAX type, a type without a
      # value, an int past the default int: jax.jit's own error, naming fn and the
      leaf_keys = None  # path (or its run, if it takes it)
    if leaf_keys is None:
      return self._under_trace()(*args, **kwargs)
    # a static's type too, as jax.jit's cache keys it: 2 and 2.0 are equal and
    # hash alike, yet trace other programs (a fuzzer's find)
    types = tuple(type(v) for _, v in statics[0] + statics[1]) if statics != _NO_STATICS else ()
    key = ((statics, types), treedef, leaf_keys, _trace_context(),
           _concrete_mesh())  # jax.set_mesh's devices: the abstract mesh has no order
    sigs = self._sigs
    try:
      entry = sigs.graphs.get(key, _MISSING)
    except Exception:  # pylint: disable=broad-except  # a static whose __eq__ raises:
      entry = None  # jax.jit's ValueError naming it
    if entry is None:
      return self._under_trace()(*args, **kwargs)
    if entry is _MISSING:
      with sigs.lock:
        entry = sigs.graphs.get(key)
        if entry is None:
          entry = sigs.graphs[key] = self._signature(key, statics, args, dyn_args, dyn_kw)
    gid, committed = entry
    if gid is _JAX:  # arguments committed elsewhere, jax.Refs, ... (_signature):
      if committed is _DONATES and fast is not None:  # jax.jit's executable, to the front
        return self._donating(key, args, kwargs, dyn_args, dyn_kw, len(leaves), fast)
      return self._under_trace()(*args, **kwargs)  # jax.jit runs them as it does
    try:
      if dyn_kw:  # keyword args first, in key order (call_order)
        out = self.session.run(gid, *[dyn_kw[k] for k in sorted(dyn_kw)], *dyn_args)
      else:
        out = self.session.run(gid, *dyn_args)
    except UnknownGraphError:  # released by hand (session.release of a graph_ids
      with sigs.lock:          # entry): compiled again, as on first use
        for stale in [k for k, (g, _) in sigs.graphs.items() if g == gid]:
          del sigs.graphs[stale]
      return self._call(args, kwargs, fast)
    except InputError:  # a deleted (donated) argument: jax.jit's RuntimeError
      if not any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
        raise
      out = _MISSING
    except FloatingPointError as exc:  # jax_debug_nans (infs) found one in an output:
      if getattr(exc, "special", None) is None:  # jax.jit's de-optimized call
        raise
      deoptimized(self._fn, args, kwargs, f"jit({_name(self._fn)})", exc.special)
    if out is _MISSING:
      return self._under_trace()(*args, **kwargs)
    if committed is not None:  # (the front commits its outputs as these are)
      out = jit_commits.as_jit(out, committed)
    if fast is not None and not dyn_kw:  # (the front passes keyword arguments last,
      # the graph takes them first). One executable that is the whole graph: a
      # plan's device partition beside a host op is one executable too, and ran
      # without the host op (a review's find)
      entry = self.session._graphs.get(gid)  # pylint: disable=protected-access
      exe = None if entry is None or entry.direct is None else entry.runner.exe
      # (one at a time on CPU devices: its call, not the front's; a judge's find)
      if exe is not None and not ordered(exe) and placement.laid_out_for(exe, leaves):
        fast.append(fastpath(exe, out, len(leaves)))
    return out

  def _signature(self, key, statics, args, dyn_args, dyn_kw):
    """(graph id or _JAX, whether jax.jit commits the outputs) of a new
    signature. Arguments committed to the session's device and uncommitted
    ones trace one program (jax.jit traces it once: a break-it find): the
    graph of the signature with every argument uncommitted serves both."""
    if placement.placed_elsewhere(key[2], self.session, key[4]) or _jax_only(self._fn, key[2]):
      return _JAX, None
    if placement.donates(self._donated, args, dyn_kw):
      return _JAX, _DONATES
    sigs = self._sigs
    home = key[:2] + (tuple(k[:2] + (None,) for k in key[2]),) + key[3:]
    gid = sigs.graphs.get(home, (None,))[0]
    if gid is _JAX:  # the uncommitted signature is jax.jit's (a jax.Ref closed over):
      return _JAX, None  # so is this one (it looked for that graph: a judge's find)
    if gid is None:
      try:
        gid = self._compile(statics, args, dyn_args, dyn_kw)
      except (tracing.MutableArrays, _OtherStatics):  # a jax.Ref it closes over, statics
        return _JAX, None  # split otherwise than jax.jit's: jax.jit runs it
    leaves = tree_util.tree_leaves(([dyn_kw[k] for k in sorted(dyn_kw)], dyn_args))
    graph = self.session.graph(gid)
    if home != key and home not in sigs.graphs:  # (nothing committed: the program's
      # own layouts alone commit; False here lost them where a committed call came
      # first, a review's find)
      sigs.graphs[home] = (gid, jit_commits.to_fix(graph, [False] * len(leaves)))
    if placement.off_the_programs_devices(self.session.executables(gid), key[2]):
      return _JAX, None  # (the graph serves the uncommitted signature: compiled once)
    return gid, jit_commits.to_fix(graph, [isinstance(x, jax.Array) and x.committed
                                           for x in leaves])

  def _under_trace(self):
    return self._traced

  def _donating(self, key, args, kwargs, dyn_args, dyn_kw, n, fast):
    """A signature's first call that donates arrays: jax.jit's executable of
    it (from jax.jit's caches) runs it, and goes to the C++ front, which runs
    the later ones as jax.jit's own call does (through Python they cost twice
    jax.jit's dispatch: a judge's find). One the front cannot run (effects,
    host callbacks) is jax.jit's call from then on."""
    if jax.config.jax_debug_nans or jax.config.jax_debug_infs:  # jax.jit's call and
      return self._traced(*args, **kwargs)  # its de-optimized one (a judge's find)
    compiled = self._traced.lower(*args, **kwargs).compile()
    out = compiled(*dyn_args, **dyn_kw)  # (without the statics)
    data = fastpath(compiled, out, n)
    if data is None:
      self._sigs.graphs[key] = (_JAX, None)
    fast.append(data)
    return out

  def _compile(self, statics, args, dyn_args, dyn_kw):
    """The session graph of one signature. Its function takes the dynamic
    keyword args (in key order), then the dynamic positional ones, one
    session argument each, under a signature of fn's names (the graph's
    inputs are named so). It evaluates the program jax.jit traced of fn:
    jax.jit's own trace, from its cache - once per signature, shared with
    .lower/.trace/.eval_shape and with calls under a trace (the session
    traced fn again: a break-it find) - so tracing errors are jax.jit's
    own, and no user code runs in the session's trace. The program is held
    for the compile alone (tracing again after it: FunctionGone)."""
    fn, n = self._fn, len(args)
    (static_pos, static_kw) = statics
    static_at = dict(static_pos)
    keys = sorted(dyn_kw)
    k = len(keys)
    kwargs = {**dict(static_kw), **dyn_kw}
    held = {}  # jax.jit's trace, made when the session traces `call`: after its checks

    def call(*dyn):
      if "traced" not in held:
        if "done" in held:
          raise tracing.FunctionGone(f"jaxsession.jit({_name(fn)}): its program is "
                                     "traced once, at compile")
        held["traced"] = self._traced.trace(*args, **kwargs)  # (its errors: jax.jit's)
      traced = held["traced"]
      if traced.in_tree != tree_util.tree_structure((tuple(dyn_args), dyn_kw)):
        raise _OtherStatics  # jax.jit split the statics otherwise: its call
      leaves = tree_util.tree_leaves((dyn[k:], dict(zip(keys, dyn[:k]))))
      # constants jax hoisted to arguments (a tracer leaked from another trace:
      # the session's trace holds it as a constant and says so, as jax.jit)
      hoisted = getattr(traced, "_consts", ())
      outs = jax.core.eval_jaxpr(traced.jaxpr.jaxpr, traced.jaxpr.consts, *hoisted, *leaves)
      return tree_util.tree_unflatten(traced.out_tree, outs)
    params = tracing.arg_parameters(fn, [i for i in range(n) if i not in static_at])
    tracing.signed(call, fn, _keyword_parameters(fn, keys, {p.name for p in params}) + params)
    try:  # (its signatures key every leaf's weak type: nothing for run to guard)
      with tracing.keyed_by_weak_types():
        return self.session.compile(call, *[dyn_kw[key] for key in keys], *dyn_args,
                                    updates_state=False, name=_name(fn))
    finally:
      call.__dict__.pop("__wrapped__", None)
      held.clear()
      held["done"] = True


def _front_miss(wrapper, traced):
  """The C++ front's call where it has no executable for the signature: the
  wrapper's Python call (held weakly: the wrapper holds its front); once the
  wrapper is gone (its `__call__` kept alone), jax.jit's call (`traced`)."""
  @api_boundary
  def cache_miss(*args, **kwargs):
    alive = wrapper()
    if alive is None:
      return traced(*args, **kwargs), None, False
    fast = []
    out = alive._call(args, kwargs, fast)  # pylint: disable=protected-access
    return out, (fast[0] if fast else None), False
  return cache_miss


def _keyword_parameters(fn, keys, taken):
  """A positional-only inspect.Parameter per keyword argument: its own name
  where fn names it, else (fn's **kwargs) `<kwargs>_<key>`; none repeats
  `taken` or another."""
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    params = ()
  own = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
  var = next((p.name for p in params if p.kind == p.VAR_KEYWORD), "kwargs")
  out, taken = [], set(taken)
  for i, key in enumerate(keys):
    name = key if key in own else f"{var}_{key}"
    if not name.isidentifier() or keyword.iskeyword(name):
      name = f"{var}_{i}"
    while name in taken:
      name = "_" + name
    taken.add(name)
    out.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY))
  return out


_trace_context = settings.trace_key


try:  # the caller's jax.set_mesh mesh, devices included (~0.07 µs a call)
  from jax._src.mesh import get_concrete_mesh as _concrete_mesh
except ImportError:  # an internal API: the public form (~0.4 µs)
  _concrete_mesh = jax.sharding.get_mesh


_JAX = "jax.jit"  # a signature jax.jit itself runs (see jit_placement)
_DONATES = "donates"  # ... because it donates arrays: its executable goes to the front
_MISSING = object()  # _call's marker: no graph for the signature yet; a call for jax.jit


def _jax_only(fn, leaf_keys):
  """Whether jax.jit runs this signature, a session not: a 64-bit array
  made while x64 was on, now off (jax.jit converts it to 32 bits; the
  session's executable refused its type: a break-it find), or a function
  jax.jit cannot key its cache by (unhashable: its TypeError, where this
  ran it: a break-it find). (A leaf that is no array - a jax.Ref - is
  jax.jit's call at _leaf_key.)"""
  try:
    hash(fn)
  except TypeError:
    return True
  return any(not jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended) and
             jax.dtypes.canonicalize_dtype(aval.dtype) != aval.dtype
             for _, aval, _ in leaf_keys)


def _name(fn):
  return tracing.fn_name(fn)


_NO_FN = object()  # jit(static_argnums=...): a decorator; jit(None) is jax.jit's TypeError


def jit(fn=_NO_FN, static_argnums=None, static_argnames=None, session=None, **jax_options):
  """A drop-in for `jax.jit(fn, static_argnums, static_argnames)` that
  compiles per argument signature in `session` (default: one Session per
  process) and runs there; see the module docstring. `jit(static_argnums=..)`
  without fn returns a decorator. `donate_argnums`/`donate_argnames`: a call
  donating an array is jax.jit's (see the module docstring). With any other
  option of jax.jit's (shardings, `inline`, ...: what libraries pass when
  `jax.jit = jaxsession.jit` routes a whole program) it is jax.jit itself,
  given those options; jax.jit refuses the ones it does not know. The
  statics default to None, as jax.jit's: jax.jit completes one from the
  other only where that one is None (given (), `static_argnums=1` with the
  argument passed by name traced it: a review's find)."""
  donated = {k: jax_options.pop(k) for k in ("donate_argnums", "donate_argnames")
             if k in jax_options}
  if jax_options:
    jax_options.update(donated)
    if session is not None:
      raise InputError(f"jaxsession.jit: session= with jax.jit's options "
                       f"{sorted(jax_options)}, which only jax.jit takes (it runs outside "
                       "any session)")
    logging.log_first_n(logging.INFO, "jaxsession.jit: options %s are jax.jit's; "
                        "such functions run as jax.jit", 1, sorted(jax_options))
    return real_jit(fn, static_argnums=static_argnums, static_argnames=static_argnames,
                    **jax_options) if fn is not _NO_FN else functools.partial(
                        jit, static_argnums=static_argnums, static_argnames=static_argnames,
                        **jax_options)
  if fn is _NO_FN:
    return lambda f: Jitted(f, static_argnums, static_argnames, session, **donated)
  return Jitted(fn, static_argnums, static_argnames, session, **donated)
