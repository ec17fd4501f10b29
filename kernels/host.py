"""Host kernels: code that runs between executables, not inside them."""
import functools
import logging as std_logging
import sys

import jax
import numpy as np
from jax import tree_util
from jax.extend import core as jcore

from jaxsession.graph import op_properties
from jaxsession.jax_api import ARRAY, placed
from jaxsession.kernels.registry import register_kernel


def _on_cpu(x):
  return isinstance(x, jax.Array) and next(iter(x.devices())).platform == "cpu"


_CANONICAL = {}  # (numpy dtype, x64) -> jax's canonical dtype


def canonical_result(value, aval, i):
  """A callback result as jax.jit takes it: np.asarray, the canonical dtype
  (float64 -> float32 without x64), then the exact declared shape and dtype,
  refused with jax.jit's own error (its type and text: JAX's
  python_callback_test matches the text)."""
  arr = np.asarray(value)
  key = (arr.dtype, jax.config.jax_enable_x64)  # x64 can be switched at run time
  try:
    canonical = _CANONICAL[key]
  except KeyError:
    canonical = _CANONICAL[key] = jax.dtypes.canonicalize_dtype(arr.dtype)
  if arr.dtype != canonical:
    arr = arr.astype(canonical)
  if arr.shape != aval.shape:
    raise RuntimeError(f"Incorrect output shape for return value #{i}: "
                       f"Expected: {aval.shape}, Actual: {arr.shape}")
  if arr.dtype != aval.dtype:
    raise RuntimeError(f"Incorrect output dtype for return value #{i}: "
                       f"Expected: {aval.dtype}, Actual: {arr.dtype}")
  return arr


def _miscounted(got, count):
  """jax.jit's error for a callback returning `got` results, not `count`."""
  return RuntimeError("Mismatched number of outputs from callback. "
                      f"Expected: {count}, Actual: {got}")


@functools.lru_cache(maxsize=None)
def _cpu():
  return jax.local_devices(backend="cpu")[0]


def _callback_args(args):
  """Device values reach a host node through a d2h transfer, which leaves
  them jax.Arrays on the CPU; another host kernel's results are numpy, and
  a callback takes jax.Arrays on the CPU, as under jax.jit."""
  for a in args:
    if not isinstance(a, jax.Array):  # copies: the producer may reuse its buffer
      # a private copy: device_put may read its source after it returns
      return jax.device_put([np.array(a) for a in args], _cpu())
  return args


@functools.lru_cache(maxsize=None)
def _cpu_backend():
  return jax.default_backend() == "cpu"  # fixed once the backends are up


def _call_on_cpu(callback, args):
  """The callback with the CPU as default device (as jax.jit runs it); the
  context is skipped when the CPU is the default device already."""
  if jax.config.jax_default_device is None and _cpu_backend():
    return callback(*args)
  with jax.default_device(_cpu()):
    return callback(*args)


@register_kernel("pure_callback", backend="host", name="host:pure_callback")
def run_pure_callback(node, *args):
  """Calls the user's callback as jax.jit does: on jax.Arrays on the CPU
  device, with the CPU as default device; results converted and checked the
  way jax.jit checks them."""
  return prepare_pure_callback(node)(*args)


def _direct(callback, num_args):
  """The user's function itself when jax's flat wrapper would only repack
  positional array arguments (its in_tree is ((leaf, ...), {})): one tree
  round trip less a call. Results are flattened by the kernel's run."""
  func, in_tree = getattr(callback, "callback_func", None), getattr(callback, "in_tree", None)
  if func is None or in_tree is None:  # an internal jax structure changed: the wrapper
    return callback
  try:
    args, kwargs = tree_util.tree_unflatten(in_tree, list(range(num_args)))
  except Exception:
    return callback
  if kwargs or list(args) != list(range(num_args)):
    return callback
  return func


# jax's record of a failed callback, which jax.jit logs where its executable
# runs one (stdlib logging: the logger is jax's own, for handlers set on it)
_JAX_CALLBACK_LOG = std_logging.getLogger("jax._src.callback")


def _failed():
  """Logs the exception being handled, a callback's, as jax.jit logs it
  ("jax.pure_callback failed", with the traceback) before it propagates (a
  JAX test suite's find: the record was missing)."""
  _JAX_CALLBACK_LOG.exception("jax.pure_callback failed")


def prepare_pure_callback(node):
  """run_pure_callback for one node, with everything read from the node
  once (the executor calls this form: ~3 µs less a call, measured here)."""
  avals = list(node.params["result_avals"])
  callback = _direct(node.params["callback"], len(node.inputs))
  count = len(avals)

  config, cpu_backend = jax.config, _cpu_backend()
  dtype0, shape0 = (np.dtype(avals[0].dtype), tuple(avals[0].shape)) if avals else (None, None)

  def run(*args):  # _callback_args and _call_on_cpu inlined: this is run's hot path
    for a in args:
      if type(a) is not ARRAY and not isinstance(a, jax.Array):  # ARRAY: jax_api.py
        args = _callback_args(args)
        break
    try:  # (free until raised)
      if cpu_backend and config.jax_default_device is None:
        results = callback(*args)
      else:
        results = _call_on_cpu(callback, args)
    except Exception:
      _failed()
      raise
    results = [results] if isinstance(results, np.ndarray) else tree_util.tree_leaves(results)
    if len(results) != count:
      raise _miscounted(len(results), count)
    if count == 1:
      out = results[0]
      # Already what jax.jit would make of it (a numpy array of the declared,
      # hence canonical, dtype and shape): nothing to convert or check.
      if type(out) is np.ndarray and out.dtype == dtype0 and out.shape == shape0:
        return [_private(out, 4)]  # held by `results` and `out`
      return [_private(canonical_result(out, avals[0], 0), 2)]
    # indexed, not zipped: zip keeps its last tuple, one reference more
    return [_private(canonical_result(results[i], avals[i], i), 3)  # held by `results`
            for i in range(count)]
  if len(node.inputs) != 1 or count != 1:
    return run

  def run_one(a):  # one array in, one out (most callbacks): run's checks, unrolled
    if type(a) is not ARRAY or not cpu_backend or config.jax_default_device is not None:
      return run(a)
    try:
      out = callback(a)
    except Exception:
      _failed()
      raise
    if type(out) is np.ndarray and out.dtype == dtype0 and out.shape == shape0:
      return [_private(out, 3)]  # held by `out`
    results = tree_util.tree_leaves(out)
    if len(results) != 1:
      raise _miscounted(len(results), 1)
    return [_private(canonical_result(results[0], avals[0], 0), 2)]
  return run_one


def _private(x, ours):
  """`x`, a callback's result, where only the session holds it, else a copy:
  the callback may write into or return again the buffer it returned (a
  buffer it keeps and refills), and an executable on the CPU reads a numpy
  argument in place, after the run returns - jax.jit copies each result.
  `ours`: what sys.getrefcount counts when nothing else holds x (its
  argument here, this parameter, and the caller's references); an array that
  does not own its memory (a view) is copied too."""
  if type(x) is np.ndarray and x.flags.owndata and sys.getrefcount(x) <= ours:
    return x
  return np.array(x, copy=True)


run_pure_callback.prepare = prepare_pure_callback  # checks its results itself


# -- transfers ----------------------------------------------------------------
# Transfer nodes (inserted by HardwareOptimize where a value crosses places)
# run in the executor, between executables, never inside one. Each moves its
# operand as it is: the batch-axis rule is the identity.
op_properties.register_op("transfer_d2h", transfer="d2h", batch="identity")
op_properties.register_op("transfer_h2d", transfer="h2d", batch="identity")

@register_kernel("transfer_d2h", backend="host", name="host:d2h")
def device_to_host(node, x):
  """A device value for host readers: a jax.Array on the CPU device, whole,
  as a callback under jax.jit gets it. On the CPU platform the device buffer
  is host memory already, and nothing is copied; a value laid out over a
  mesh is gathered onto that one device (a copy of its own: the callback may
  keep it, and the state's buffers are taken over by its update)."""
  if _on_cpu(x) and len(x.sharding.device_set) == 1:
    return [x]
  # (device_put of a replicated value to one of its devices keeps that
  # replica's buffer, even with may_alias=False: gathered through numpy)
  return [jax.device_put(np.array(x), _cpu())]  # np.array reads the early copy


@register_kernel("transfer_h2d", backend="xla", name="xla:h2d")
def host_to_device(node, x):
  """A host value for device readers: the executable's argument, so the call
  that runs it copies it in (the cheapest copy JAX offers: ~1 µs against
  ~28 µs for jax.device_put on CPU, measured here); inside the executable it
  is the value itself."""
  return [x]


@register_kernel("transfer_h2d", backend="host", name="host:h2d")
def host_to_device_put(node, x):
  """A host value that becomes state (which lives on the device) with no
  device reader to carry it: an explicit jax.device_put."""
  # the default device, the session's; a copy even on CPU: the callback may
  # reuse the buffer it returned, and the state must not change with it
  # (past a transfer guard: the session's own move, as jax.jit's inside its executable)
  return [placed(np.array(x))]  # a private copy: device_put may read it after it returns


# -- small integer computations -------------------------------------------------
# Shape and index arithmetic on host values stays on the host: numpy computes
# integer and bool ops exactly as XLA does (two's complement wrap-around).

def _numpy_op(op, params, args, dtype):
  """The op table's numpy implementation of `op` on `args`, as `dtype`."""
  with np.errstate(over="ignore"):
    out = op_properties.facts(op).numpy(*[np.asarray(a) for a in args], **params)
  return np.asarray(out, dtype=dtype)


def _wrapping(op):
  """The op table's numpy implementation of an op as its host kernel."""
  def kernel(node, *args):
    return [_numpy_op(op, node.params, args, node.outputs[0].aval.dtype)]
  return kernel


def _small_integer(node):
  """Host integer kernels take integer/bool values of at most 1024 elements."""
  for value in list(node.inputs) + list(node.outputs):
    why = _small_aval(value.aval)
    if why:
      return f"{value} {why}"
  return None


def _small_aval(aval):
  """Why `aval` is not an integer/bool of at most SMALL_ELEMENTS, or None."""
  kind = np.dtype(aval.dtype).kind if hasattr(aval, "dtype") else "?"
  if kind not in "iub":
    return f"is {getattr(aval, 'dtype', aval)}, not an integer or bool"
  if int(np.prod(aval.shape, dtype=np.int64)) > SMALL_ELEMENTS:
    return f"has more than {SMALL_ELEMENTS} elements"
  return None


SMALL_ELEMENTS = 1024

# Every op whose `host` fact is set runs its numpy implementation (the one
# constant folding uses too) as a host kernel on small integer/bool values.
for _op in op_properties.ops_with(host=True):
  register_kernel(_op, backend="host", name=f"host:{_op}",
                  accepts=_small_integer)(_wrapping(_op))


# A nested jit the importer keeps as a call (jnp.where is one) runs on the
# host where its body does: every equation one of the kernels above takes,
# on small integer/bool values, computed by the same numpy implementations.
def _host_body(jaxpr):
  """Why `jaxpr` cannot run on these kernels, or None."""
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in op_properties.CALLS:
      why = _host_body(eqn.params["jaxpr"].jaxpr)
    elif not op_properties.facts(name).host or eqn.effects:
      why = f"its body's '{name}' has no host kernel"
    elif any(_small_aval(v.aval) for v in (*eqn.invars, *eqn.outvars)):
      why = f"its body's '{name}' is not on small integer/bool values"
    else:
      why = None
    if why:
      return why
  return None


def _call_accepts(node):
  return _small_integer(node) or _host_body(node.params["jaxpr"].jaxpr)


def _run_body(closed, args):
  env = dict(zip(closed.jaxpr.constvars, closed.consts))
  env.update(zip(closed.jaxpr.invars, args))
  read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
  for eqn in closed.jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    if eqn.primitive.name in op_properties.CALLS:
      outs = _run_body(eqn.params["jaxpr"], ins)
    else:
      outs = [_numpy_op(eqn.primitive.name, eqn.params, ins, eqn.outvars[0].aval.dtype)]
    env.update(zip(eqn.outvars, outs))
  return [np.asarray(read(v)) for v in closed.jaxpr.outvars]


@register_kernel("jit", backend="host", name="host:call", accepts=_call_accepts)
def call_on_host(node, *args):
  return _run_body(node.params["jaxpr"], args)
