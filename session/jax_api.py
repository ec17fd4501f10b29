"""jax's own APIs as the session uses them: jax.jit as jax defines it,
whatever `jax.jit` is rebound to later; the concrete array type; a transfer
guard's refusal, and the session's own moves past it.

A user may route their code through the session with `jax.jit = jaxsession.jit`
(JAX's own test suite is run that way: benchmarks/jax_suite.py); the
session's own compiles (Build, constant folding, layouts) must not route back
into themselves, so they call this one.
"""
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
