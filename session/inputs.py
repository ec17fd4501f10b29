"""Call signatures and the one leaf check.

An `ArgSpec` is what a graph's `run` takes at each position: one pytree
each (its treedef, leaf paths and avals with weak types, under a mesh each
leaf's NamedSharding), built complete once compile has traced the function
and never changed after. `check_leaf` is the one check of a leaf against
what was compiled - used by `run`, `set_state`, compile's examples,
`state_from`, `run_op` and buckets - and every message about a bad leaf is
written here once; each names the argument, the pytree path, what was
expected and what came.
"""
import contextlib
import dataclasses
from typing import Any, Tuple

import jax
import numpy as np
from jax import tree_util

from jaxsession.errors import InputError
from jaxsession.graph.ir import aval_str
from jaxsession.runtime import sharding
from jaxsession.runtime.executor import per_arg
from jaxsession.runtime.state import relaid, session_device

_PY_SCALARS = (bool, int, float, complex)

# What to do with a pytree leaf that is not an array (a module's function,
# string or object field): jax traces arrays and scalars only.
_NOT_ARRAY_HINT = (
    "jax traces only arrays and scalars. A pytree's non-array fields (functions, strings, "
    "other objects) must be static: mark them as static fields (pytree metadata, not "
    "children), or split them off before compile and close over them in fn (as "
    "equinox.partition / equinox.filter do), or make the pytree a state argument, whose "
    "non-array leaves are kept static; a whole non-array argument goes in static_argnums")


def leaf_aval(x, place="a leaf", type_only=False):
  """The aval jax.jit sees for leaf `x` (dtype canonicalised, Python scalars
  weakly typed). InputError naming `place` for a Python scalar out of its
  type's range or a leaf that is not an array at all, and, unless only the
  type is wanted (`type_only`, as jax.jit's `lower` takes them), for a
  deleted array, a jax.ShapeDtypeStruct (a type where a value is needed) or
  a tracer (the session runs on concrete arrays)."""
  if not type_only:
    if isinstance(x, jax.core.Tracer):
      raise InputError(f"{place} is a tracer ({x.aval.str_short()}): the session runs its "
                       "compiled executables on concrete arrays, not inside jax.jit, grad "
                       "or vmap; call the function itself inside the trace, or call the "
                       "session outside it")
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted():
      raise InputError(f"{place}: the array has been deleted (donated or freed)")
    if isinstance(x, jax.ShapeDtypeStruct):
      raise InputError(f"{place} is a jax.ShapeDtypeStruct ({x.dtype}{list(x.shape)}), a "
                       "type where a value is needed: pass an array (a state argument's "
                       "example is its initial value)")
  try:
    return jax.api_util.shaped_abstractify(x)
  except (TypeError, OverflowError, ValueError) as exc:
    detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if isinstance(x, _PY_SCALARS):
      raise InputError(f"{place} is a Python {type(x).__name__} {x!r} that no array type "
                       f"of jax holds: {detail}") from None
    hint = "" if hasattr(x, "dtype") else f". {_NOT_ARRAY_HINT}"
    raise InputError(f"{place} is a {type(x).__name__}, not an array ({detail}){hint}") from None


def check_aval(place, got, want, leading=None, note=""):
  """InputError unless aval `got` has `want`'s dtype and shape (with
  `leading` steps on a new first axis)."""
  shape = tuple(want.shape) if leading is None else (leading,) + tuple(want.shape)
  if tuple(got.shape) != shape or got.dtype != want.dtype:
    expect = aval_str(want) if leading is None else (
        f"{want.str_short(short_dtypes=True).split('[')[0]}{list(shape)} "
        f"(steps={leading} on a leading axis of {aval_str(want)})")
    raise InputError(f"{place}: expected {expect}, got {aval_str(got)}{note}")


def weak_type_error(place, weak, against, why, remedy):
  """The InputError for a leaf whose weak type (`weak`: is it weakly typed)
  differs from `against`'s."""
  return InputError(f"{place} is {'weakly' if weak else 'strongly'} typed, {against} is "
                    f"{'strongly' if weak else 'weakly'} typed: {why}. {remedy}")


def check_leaf(place, x, want, weak=None, leading=None, note="", type_only=False):
  """The one leaf check: `x`'s aval, or InputError naming `place` when `x` is
  not an array value (leaf_aval), does not have `want`'s shape and dtype
  (check_aval), or - with `weak` given, where the weak type changes the
  program - is not typed as weakly as `weak` says."""
  got = leaf_aval(x, place, type_only=type_only)
  # the weak type named alone where it is all that differs (a Python int for
  # an int8 leaf differs in dtype too: expected i8[], got i32[]~)
  if weak is not None and is_weak(x) != weak and got.dtype == want.dtype:
    raise weak_type_error(place, not weak, "the value it was compiled for",
                          "here the weak type changes the program (jax.jit would compile "
                          "another one)", "Pass " + ("a Python scalar (or jnp.asarray of "
                                                     "one)" if weak else
                                                     "an array of that dtype") + ".")
  if weak is not None and is_weak(x) and not weak and got.dtype != want.dtype:
    raise InputError(f"{place}: the Python scalar {x!r} is a weakly typed {aval_str(got)} to "
                     f"jax.jit, which here computes otherwise than the {aval_str(want)} "
                     "compiled (jax.jit would compile another program); pass an array of "
                     f"dtype {np.dtype(want.dtype).name}")
  check_aval(place, got, want, leading, note)
  return got


def paths_of(tree):
  return [tree_util.keystr(path) for path, _ in tree_util.tree_flatten_with_path(tree)[0]]


@dataclasses.dataclass(frozen=True)
class Flat:
  """One checked example argument: its treedef, leaves, paths and avals."""
  treedef: Any
  leaves: Tuple[Any, ...]
  paths: Tuple[str, ...]
  avals: Tuple[Any, ...]


def example_place(where, position, path, state=False):
  return (f"{where}: example argument at position {position}"
          f"{' (a state argument)' if state else ''}, path {path or '(root)'}")


def flatten_example(where, position, arg, state=False):
  """A compile example checked leaf by leaf (InputError naming the position
  and path): a run argument's example gives only its type (it may be a
  jax.ShapeDtypeStruct), a state argument's is its initial value - or a
  jax.ShapeDtypeStruct too, a leaf left unset until set_state or restore."""
  pairs, treedef = tree_util.tree_flatten_with_path(arg)
  paths = tuple(tree_util.keystr(p) for p, _ in pairs)
  leaves = tuple(x for _, x in pairs)
  avals = tuple(leaf_aval(x, example_place(where, position, path, state),
                          type_only=not state or isinstance(x, jax.ShapeDtypeStruct))
                for path, x in zip(paths, leaves))
  if state:
    for path, aval in zip(paths, avals):
      if aval.dtype == jax.dtypes.float0:
        raise InputError(f"{example_place(where, position, path, state)}: a float0 leaf "
                         "(the gradient jax.grad(..., allow_int=True) gives an integer) "
                         "holds no values to keep on the device; pass it as a run "
                         "argument or leave it out of the state")
  return Flat(treedef, leaves, paths, avals)


def check_one_device(where, position, flat, state=False):
  """InputError for an example leaf sharded over several devices, given to a
  session without a mesh (its graphs run on one device)."""
  for path, x in zip(flat.paths, flat.leaves):
    sharding = getattr(x, "sharding", None)
    if isinstance(x, jax.Array) and sharding is not None and len(sharding.device_set) > 1:
      raise InputError(f"{example_place(where, position, path, state)}: sharded over "
                       f"{len(sharding.device_set)} devices ({sharding}); this session runs "
                       "on one device: compile under SessionOptions(mesh=...), or pass "
                       "one-device arrays")


def is_weak(x):
  """Whether jax would see `x` as weakly typed (numpy scalars, although
  np.float64 subclasses float, are strongly typed)."""
  if isinstance(x, (bool, np.generic, np.ndarray)):
    return False
  if isinstance(x, (int, float, complex)):
    return True
  return bool(getattr(x, "weak_type", False))


_NARROW = {np.dtype(jax.numpy.bfloat16): 7, np.dtype(np.float16): 10}  # mantissa bits
_THROUGH_F32 = {}  # (platform, dtype) -> whether XLA there converts float64 through float32


def _through_f32(dtype, device):
  """Whether XLA on `device`'s platform converts a float64 to `dtype`
  (bfloat16, float16) through float32 - two roundings - or at once. It
  depends on the machine: this CPU with AVX512-FP16 converts to float16 at
  once and to bfloat16 through float32, others through float32 both (a test
  passed on one machine and failed on the next), so XLA is asked, once, with
  a value the two ways round apart (1 + half an ulp + a little: through
  float32 the little is lost and the tie goes to even, 1). Asked in a
  context of its own: no context mesh, the platform's first device, x64,
  transfers allowed, compiled and called outside any trace around the run
  (a review's finds: each of those failed the first run)."""
  platform = getattr(device, "platform", device) or jax.default_backend()
  key = (platform, dtype)
  found = _THROUGH_F32.get(key)
  if found is None:
    probe = jax.local_devices(backend=platform)[0]
    value = np.float64(1 + 2.0 ** -(_NARROW[dtype] + 1) + 2.0 ** -30)
    with sharding.replaced_context(None, probe), jax.enable_x64(True), \
        jax.transfer_guard("allow"):
      convert = jax.jit(lambda v: v.astype(dtype)).lower(
          jax.ShapeDtypeStruct((), np.float64)).compile()
      got = np.asarray(convert(value), np.float64)  # (a device_put is traced in a trace)
    found = _THROUGH_F32[key] = bool(got == 1.0)
  return found


def python_scalar(x, dtype, device=None):
  """`x` (a Python scalar) as a 0-d array of `dtype`, converted the way jax.jit
  converts it (a float rounds to the float type), or None when jax.jit would
  trace another program for it or the value would change: a float for an
  int or a complex (jax.jit traces a weak float), an int for a float or
  complex (a weak int: int arithmetic), an int past the range of the leaf's
  int or of the default int (jax.jit's OverflowError), a bool for anything
  but a bool."""
  dtype = np.dtype(dtype)
  kind = ("f" if jax.numpy.issubdtype(dtype, jax.numpy.floating) else
          "c" if jax.numpy.issubdtype(dtype, jax.numpy.complexfloating) else dtype.kind)
  if isinstance(x, bool) or kind == "b":
    return np.asarray(x, dtype) if isinstance(x, bool) and kind == "b" else None
  if isinstance(x, int):
    if kind in "iu":  # and in the default int's range, where jax.jit raises OverflowError
      info, weak = np.iinfo(dtype), np.iinfo(jax.dtypes.canonicalize_dtype(np.int64))
      return np.asarray(x, dtype) if max(info.min, weak.min) <= x <= min(info.max,
                                                                          weak.max) else None
    return None
  if isinstance(x, float):
    if kind != "f":  # a weak float to jax.jit, not a complex: sqrt(-4.0) is nan there
      return None
    # jax.jit takes a Python float as a weak float of the default width
    # (float32 without x64), then converts: two roundings, reproduced here;
    # XLA may convert a float64 to bfloat16 or float16 through float32 (a third)
    with np.errstate(over="ignore"):
      x = np.asarray(x, jax.dtypes.canonicalize_dtype(np.float64))
      if x.dtype == np.float64 and dtype in _NARROW and _through_f32(dtype, device):
        x = x.astype(np.float32)
      return np.asarray(x, dtype)
  return np.asarray(x, dtype) if kind == "c" else None


def _no_context(device):  # pylint: disable=unused-argument
  return contextlib.nullcontext()


class ArgSpec:
  """The positional arguments a graph's `run` takes: one pytree each.

  Built complete once (compile builds it after tracing) and frozen:
  `where` names the graph in every message ("run(graph 3 'step')"),
  `positions` each argument's position in fn, `treedefs`, `paths` and
  `avals` (with weak types) per argument and leaf, `shardings` (under a
  mesh: a NamedSharding per leaf, per argument, else None), `local_pieces`
  (many processes: run gets each process's piece of the batch) and
  `weak_sensitive` ([(argument, leaf, compiled weak type)] where a weak type
  changes the program), `device` (the device its executables run on, jax's
  default one at compile), `context` (context(device) is the context
  manager the moves `conform` makes run in: the session's own,
  spmd.own_context, where the caller's context mesh is another).
  The examples may be arrays or jax.ShapeDtypeStructs.
  """

  def __init__(self, where, positions, example_args, shardings=None, local_pieces=False,
               weak_sensitive=(), context=None):
    flats = [flatten_example(where, p, a) for p, a in zip(positions, example_args)]
    values = dict(
        where=where, positions=tuple(positions),
        treedefs=tuple(f.treedef for f in flats), paths=tuple(f.paths for f in flats),
        avals=tuple(f.avals for f in flats),
        shardings=None if shardings is None else tuple(tuple(row) for row in shardings),
        local_pieces=bool(local_pieces), weak_sensitive=tuple(weak_sensitive),
        # the graph's device: the default one at its compile
        device=session_device(), context=context or _no_context)
    for name, value in values.items():
      object.__setattr__(self, name, value)

  def __setattr__(self, name, value):
    raise AttributeError(f"ArgSpec is frozen (built complete once, at compile): {name}")

  def place(self, i, j):
    """Where leaf `j` of argument `i` is, for messages."""
    return (f"{self.where}: argument {i} (position {self.positions[i]} of the function) "
            f"at path {self.paths[i][j] or '(root)'}")

  def weak_guard(self, call, leading=None):
    """`call`, refusing a scalar whose weak type differs from the compiled one
    where that changes the program (jax.jit would compile another one);
    `leading`: a sunk run's steps (as conform takes it), whose stacked
    arguments are checked as its steps (a scan over them)."""
    sensitive = self.weak_sensitive
    if not sensitive:
      return call

    def guarded(args):
      if len(args) != len(self.treedefs):  # named as such, not as a weak type (a judge's find)
        self.check_arity(args)
      lead = per_arg(leading, len(args))
      for i, j, weak in sensitive:
        leaves = tree_util.tree_leaves(args[i])
        if j >= len(leaves) or is_weak(leaves[j]) == weak or \
            tree_util.tree_structure(args[i]) != self.treedefs[i]:  # (conform names it)
          continue
        if lead[i] is None:
          check_leaf(self.place(i, j), leaves[j], self.avals[i][j], weak=weak)
        elif leaf_aval(leaves[j], self.place(i, j)).dtype == self.avals[i][j].dtype:
          raise weak_type_error(  # (another dtype: conform's error names it)
              f"{self.place(i, j)} (stacked steps)", not weak, "the value it was compiled for",
              "here the weak type changes the program (jax.jit's lax.scan over these steps "
              "would compile another one)", "Compile with an example typed as the steps are "
              "(" + ("a Python scalar" if not weak else "an array of that dtype") + ").")
      return call(args)
    return guarded

  def check_arity(self, args):
    if len(args) != len(self.treedefs):
      raise InputError(
          f"{self.where}: expected {len(self.treedefs)} positional argument(s) "
          f"(the function's positions {list(self.positions)}; state and static arguments "
          f"are not passed to run), got {len(args)}")

  def conform(self, args, leading=None):
    """Returns `args` with Python scalars converted where that is exact; raises
    InputError naming the first argument that does not fit. With `leading`
    (steps), every leaf must carry that many steps on a new leading axis;
    `leading` may also be one steps-or-None per argument (run's in_axes)."""
    self.check_arity(args)
    lead = per_arg(leading, len(args))
    fixed = []
    for i, arg in enumerate(args):
      leaves, treedef = tree_util.tree_flatten(arg)
      if treedef != self.treedefs[i]:
        raise InputError(f"{self.where}: argument {i} (position {self.positions[i]} of the "
                         f"function) has pytree structure {treedef}, expected "
                         f"{self.treedefs[i]}")
      new_leaves = [self.conform_leaf(i, j, x, lead[i], lead) for j, x in enumerate(leaves)]
      fixed.append(tree_util.tree_unflatten(treedef, new_leaves))
    return tuple(fixed)

  def _unstacked(self, i, x, want, leading, lead):
    """What an error says of leaf `x` of argument `i` passed without the
    steps (a sunk run): how to pass the argument as it is every step
    (`lead`: every argument's steps-or-None, as run's in_axes gave them)."""
    if leading is None or tuple(np.shape(x)) != tuple(want.shape):
      return ""
    lead = lead or (leading,) * len(self.treedefs)
    axes = ", ".join("None" if k == i or lead[k] is None else "0"
                     for k in range(len(self.treedefs)))
    axes = f"({axes},)" if len(self.treedefs) == 1 else f"({axes})"
    if len(self.avals[i]) > 1:
      return (f" (the steps go on every leaf of argument {i}; for the same value every "
              f"step, pass the whole argument as it is with in_axes={axes})")
    return f" (the same value every step: in_axes={axes})"

  def conform_leaf(self, i, j, x, leading=None, lead=None):
    """Leaf `j` of argument `i`, conformed as `conform` does: a Python
    scalar converted where exact, an array moved to the compiled layout or
    the graph's device; InputError if it does not fit."""
    want = self.avals[i][j]
    place = self.place(i, j)
    target, piece = None, ""
    if self.shardings is not None:
      target = self.shardings[i][j]
      target = target if leading is None else sharding.stacked(target)
      if self.local_pieces and not isinstance(x, _PY_SCALARS):
        piece = (f" (assembled from this process's piece of shape {tuple(np.shape(x))}; "
                 f"each of the {jax.process_count()} processes passes its own rows)")
        try:
          x = sharding.global_array(x, target)
        except (ValueError, TypeError) as exc:
          raise InputError(f"{place}: this process's piece (shape "
                           f"{np.shape(x)}) does not make the global "
                           f"{aval_str(want)} laid out as {target.spec}: {exc}") from None
    # (a type test, as jax's own: np.float64 subclasses float but is strongly
    # typed, and was converted as a weak Python float - a break-it find)
    if type(x) in _PY_SCALARS and leading is None and want.shape == ():
      converted = python_scalar(x, want.dtype, self.device)
      if converted is None and type(x) is int and jax.numpy.issubdtype(want.dtype,
                                                                        jax.numpy.inexact):
        raise InputError(f"{place}: Python int {x!r} where {aval_str(want)} was compiled: "
                         "jax.jit would trace int arithmetic for it (another program); "
                         f"pass {float(x)!r} or an array of that dtype")
      if converted is None:
        raise InputError(f"{place}: Python scalar {x!r} does not fit {aval_str(want)} "
                         "(jax.jit would compile another program for it; pass an array "
                         "of that dtype)")
      return converted
    check_leaf(place, x, want, leading=leading,
               note=piece or self._unstacked(i, x, want, leading, lead))
    x = relaid(x, self.device if target is None else None)  # (a committed int4: refused)
    if target is not None:  # under a mesh: laid out as compiled
      if isinstance(x, jax.Array) and x.sharding != target:
        return self._moved(x, target)
      return x
    if isinstance(x, jax.Array):
      device = self.device
      if x.committed and x.devices() != {device}:  # the executables run on the graph's device
        return self._moved(x, device)
      kind = getattr(x.sharding, "memory_kind", None)
      if kind is not None and kind != device.default_memory().kind:
        # in host memory (pinned_host, unpinned_host): the executables were
        # compiled for the device's default memory (jax.jit would compile
        # another program for it): moved there
        return self._moved(x, jax.sharding.SingleDeviceSharding(device))
    return x

  def _moved(self, x, where):
    """jax.device_put(x, where) in the session's context: under a caller's
    context mesh of the same devices in another order, a move to the
    session mesh was jax's raw error (a break-it find)."""
    with self.context(self.device):
      return jax.device_put(x, where)
