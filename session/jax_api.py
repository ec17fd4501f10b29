"""jax's own APIs as the session uses them: jax.jit as jax defines it,
whatever `jax.jit` is rebound to later; the concrete array type; a transfer
guard's refusal, and the session's own moves past it.

A user may route their code through the session with `jax.jit = jaxsession.jit`
(JAX's own test suite is run that way: benchmarks/jax_suite.py); the
session's own compiles (Build, constant folding, layouts) must not route back
into themselves, so they call this one.
"""
import functools
import importlib.util
import os

import jax

try:
  from jax._src.api import jit as real_jit  # the function `jax.jit` is bound to
except ImportError:  # an internal path: the public name, as it is at import
  from jax import jit as real_jit

try:  # the concrete type of a jax.Array: on a hot path, `type(x) is ARRAY or
  # isinstance(x, jax.Array)` - the type test is ~0.2 µs cheaper than isinstance
  from jax._src.array import ArrayImpl as ARRAY
except ImportError:  # an internal path: the isinstance alone decides
  ARRAY = None


try:  # the caller's context meshes (jax.set_mesh), read without a public call's
  # ~0.5 µs: a set_state of the decode reset reads them
  from jax._src import config as _config

  def context_meshes():
    """(concrete, abstract) context mesh of this thread, None where unset."""
    return _config.device_context.value, _config.abstract_mesh_context_manager.value
  # whether no jax transformation traces now: jax.set_mesh runs only there
  from jax._src.core import trace_state_clean
except ImportError:  # an internal path: the public calls
  def trace_state_clean():
    return True  # (unknown: as outside a trace)

  def context_meshes():
    concrete, abstract = jax.sharding.get_mesh(), jax.sharding.get_abstract_mesh()
    return (None if concrete.empty else concrete), (None if abstract.empty else abstract)


try:  # TypeError for a dtype no JAX array holds (datetime64, void), as jax.jit raises it
  from jax._src.dtypes import check_valid_dtype
except ImportError:  # an internal path: numeric kinds and jax's extended dtypes
  def check_valid_dtype(dtype):
    if dtype.kind not in "biufc" and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended) \
        and dtype.name not in {"bfloat16", "float8_e4m3fn", "float8_e5m2", "int4", "uint4"}:
      raise TypeError(f"Dtype {dtype} is not a valid JAX array type")


try:  # jax.clear_caches() calls cache_clear() of what is registered here
  from jax._src.util import register_cache
except ImportError:  # an internal path: jax.clear_caches() leaves js.jit's graphs
  def register_cache(cache, for_what):  # pylint: disable=unused-argument
    pass


try:  # the type of a jax.Ref's aval
  from jax._src.state.types import AbstractRef
except ImportError:  # an internal path: no Ref is told apart (isinstance of () is False)
  AbstractRef = ()


try:  # jax.jit's answer to a nan (inf) its debug flags found in an output
  from jax._src.api_util import InternalFloatingPointError as _Special
  from jax._src.api_util import maybe_recursive_nan_check as _deoptimized
except ImportError:  # an internal path: the same steps, in the session's words
  _Special = None


try:  # jax's traceback filtering: frames of the folders it excludes are left out
  # of a traceback below an api_boundary (JAX_TRACEBACK_FILTERING)
  from jax._src.traceback_util import api_boundary, register_exclusion as _exclude
except ImportError:  # an internal path: tracebacks keep every frame
  def api_boundary(fn):
    return fn

  def _exclude(path):  # pylint: disable=unused-argument
    pass


def hide_frames(*names):
  """jax's traceback filtering leaves out the frames of these packages' or
  modules' code, as it leaves out jax's own: an error inside a function
  jaxsession.jit traces shows the frames jax.jit's shows (JAX's
  errors_test), and jax's source locations name the user's line."""
  for name in names:
    spec = importlib.util.find_spec(name)
    if spec is not None:
      for place in spec.submodule_search_locations or [spec.origin]:
        _exclude(os.path.abspath(place))


try:  # jax.jit's own C++ call object (jax/_src/pjit.py's _cpp_pjit makes it)
  from jax._src import core as _core, dtypes as _dtypes, sharding_impls as _shardings
  from jax._src import tree_util as _jtu
  from jax._src.interpreters import pxla as _pxla
  from jax._src.lib import _jax as _jaxlib
  _FRONT_KEYS = _pxla.JitGlobalCppCacheKeys()  # no shardings, donation or options
except ImportError:  # an internal path: every call takes the Python path
  _jaxlib = None


def front_cache():
  """The executables of the C++ fronts made with it (`cpp_front`), per
  signature: one function's, shared by its fronts, as many signatures as
  jax.jit's cache keeps (at 8, a function called at 20 shapes took the
  Python path at every call). None without fronts."""
  return None if _jaxlib is None else _jaxlib.PjitFunctionCache(capacity=4096)


def cpp_front(fn, cache_miss, cache, static_argnums=(), static_argnames=()):
  """jax.jit's C++ call object of `fn` (no donation): a call whose
  signature - the static arguments' values, the pytree, each leaf's type,
  shape, dtype, weak type, sharding and commitment, jax's jit-keyed
  settings, the trace state - has an executable in `cache` runs it in C++,
  as jax.jit's call does; any other call returns `cache_miss(*args,
  **kwargs)`, which answers (outputs, `fastpath(...)` for the signature or
  None, False). Under jax.disable_jit() it calls fn. None where this jax
  lacks one."""
  if cache is None:
    return None
  try:
    front = _jaxlib.pjit(getattr(fn, "__name__", type(fn).__name__), fn, cache_miss,
                         list(static_argnums), list(static_argnames), _FRONT_KEYS,
                         _jtu.dispatch_registry, _pxla.cc_shard_arg, cache)
    front._fun = fn  # pylint: disable=protected-access  (jax_debug_nans' check of an
    # output the front made calls fn op by op, as jax.jit's: it reads this)
    try:  # fn's name and doc, as jax.jit's object carries them
      functools.update_wrapper(front, fn)
    except Exception:  # pylint: disable=broad-except  (a callable without them)
      pass
    return front
  except Exception:  # pylint: disable=broad-except  (an internal API changed)
    return None


def fastpath(compiled, outs, num_args):
  """What a C++ front needs to run `compiled` (a jax.stages.Compiled whose
  call, on the signature's `num_args` flat arguments, gave `outs`) itself
  at the signature's later calls - as jax.jit's own executables hand it
  theirs - or None where jax would not (effects, host callbacks, outputs of
  other than jax's array type, another pytree or other types than the
  executable's own)."""
  # pylint: disable=protected-access
  try:
    exe, params = compiled._executable, compiled._params
    call = exe.unsafe_call
    if not (isinstance(exe, _pxla.MeshExecutable) and isinstance(call, _pxla.ExecuteReplicated)
            and not call.has_unordered_effects and not call.ordered_effects
            and not call.has_host_callbacks and not getattr(exe, "_mut", None)
            and not params.is_high and _jtu.tree_structure(outs) == params.out_tree):
      return None
    flat, tree = _pxla.reflatten_outputs_for_dispatch(params.out_tree, _jtu.tree_leaves(outs))
    if not all(type(x) is ARRAY for x in flat) or [
        (x.shape, x.dtype) for x in flat] != [(a.shape, a.dtype) for a in exe.out_avals]:
      return None  # (outputs the executable did not make as they are)
    const_args = exe.shard_const_args(params.const_args)
    kept = exe._kept_var_idx
    in_shardings = [  # a key array's, as its buffer holds it (jax's own rule)
        _shardings.physical_sharding(a, s) if a is not _core.abstract_token
        and _dtypes.issubdtype(a.dtype, _dtypes.extended) else s
        for s, a in zip(exe._in_shardings, exe.in_avals)]
    return _pxla.MeshExecutableFastpathData(
        exe.xla_executable, tree, in_shardings, exe._out_shardings,
        [x.aval for x in flat], [x._committed for x in flat],
        [i in kept for i in range(len(const_args) + num_args)],
        exe._dispatch_in_layouts, const_args)
  except Exception:  # pylint: disable=broad-except  (an internal API changed)
    return None


def deoptimized(fn, args, kwargs, name, kind):
  """Raises what jax.jit raises where jax_debug_nans (infs) finds `kind` in
  an output of jit(`fn`) (`name`: "jit(f)"): it says so on stdout, calls fn
  itself on the arguments, op by op, and raises the FloatingPointError (or
  ZeroDivisionError) of the op that made it, else its own error saying the
  de-optimized function made none."""
  if _Special is not None:
    _deoptimized(_Special(name, kind), fn, args, kwargs)
  print("Invalid nan value encountered in the output of a jax.jit function. "
        "Calling the de-optimized version.")
  fn(*args, **kwargs)
  raise FloatingPointError(f"{name} produced {kind}; the de-optimized function did not")


def transfer_refused(exc):
  """Whether a transfer guard (jax.transfer_guard) refused a transfer: an
  executable's implicit one of an argument, before it ran anything, or an
  explicit device_put. jax says so in the error's text alone."""
  text = str(exc) if isinstance(exc, jax.errors.JaxRuntimeError) else ""
  return "Disallowed" in text and "transfer" in text


def placed(x, where=None):
  """jax.device_put(x, where) of a value the session moves itself (a host
  partition's result returned, or made state and laid out as its slot: the
  transfer jax.jit makes inside its executable, where no guard sees it),
  past a transfer guard that refuses explicit transfers too."""
  try:
    return jax.device_put(x, where)
  except jax.errors.JaxRuntimeError as exc:
    if not transfer_refused(exc):
      raise
    with jax.transfer_guard("allow"):
      return jax.device_put(x, where)


__all__ = ["real_jit", "ARRAY", "transfer_refused", "placed", "check_valid_dtype"]
