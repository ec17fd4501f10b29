"""Argument specs: what `run` expects at each position, and the errors that
name exactly what is wrong (argument index, pytree path, expected and actual)."""
import jax
import numpy as np
from jax import tree_util

from jaxsession.errors import InputError
from jaxsession.ir import aval_str
from jaxsession.runtime import sharding
from jaxsession.runtime.state import session_device

_PY_SCALARS = (bool, int, float, complex)


def leaf_aval(x):
  """The aval jax would see for leaf `x` (dtype canonicalised)."""
  try:
    return jax.api_util.shaped_abstractify(x)
  except TypeError as exc:
    raise InputError(f"{type(x).__name__} is not an array type: {exc}") from None


def paths_of(tree):
  return [tree_util.keystr(path) for path, _ in tree_util.tree_flatten_with_path(tree)[0]]


def is_weak(x):
  """Whether jax would see `x` as weakly typed (numpy scalars, although
  np.float64 subclasses float, are strongly typed)."""
  if isinstance(x, (bool, np.generic, np.ndarray)):
    return False
  if isinstance(x, (int, float, complex)):
    return True
  return bool(getattr(x, "weak_type", False))


def python_scalar(x, dtype):
  """`x` (a Python scalar) as a 0-d array of `dtype`, converted the way jax.jit
  converts it (a float rounds to the float type), or None when jax.jit would
  trace another program for it or the value would change: a float for an
  int, an int for a float or complex (jax.jit traces a weak int: int
  arithmetic), an int past the int's range, a bool for anything but a bool."""
  dtype = np.dtype(dtype)
  kind = ("f" if jax.numpy.issubdtype(dtype, jax.numpy.floating) else
          "c" if jax.numpy.issubdtype(dtype, jax.numpy.complexfloating) else dtype.kind)
  if isinstance(x, bool) or kind == "b":
    return np.asarray(x, dtype) if isinstance(x, bool) and kind == "b" else None
  if isinstance(x, int):
    if kind in "iu":
      info = np.iinfo(dtype)
      return np.asarray(x, dtype) if info.min <= x <= info.max else None
    return None
  if isinstance(x, float):
    if kind not in "fc":
      return None
    # jax.jit takes a Python float as a weak float of the default width
    # (float32 without x64), then converts: two roundings, reproduced here
    with np.errstate(over="ignore"):
      return np.asarray(np.asarray(x, jax.dtypes.canonicalize_dtype(np.float64)), dtype)
  return np.asarray(x, dtype) if kind == "c" else None


class ArgSpec:
  """The positional arguments a graph's `run` takes: one pytree each."""

  def __init__(self, where, positions, example_args):
    self.where = where                  # "run(graph 'name')"
    self.positions = list(positions)    # each argument's position in fn
    self.weak_sensitive = []  # [(arg, leaf, compiled weak type)], set by compile
    self.shardings = None     # under a mesh: [[NamedSharding per leaf] per argument]
    self.local_pieces = False  # many processes: run gets each process's local piece
    self.treedefs = []
    self.avals = []
    self.paths = []
    for i, arg in enumerate(example_args):
      leaves, treedef = tree_util.tree_flatten(arg)
      self.treedefs.append(treedef)
      self.paths.append(paths_of(arg))
      avals = []
      for path, x in zip(self.paths[-1], leaves):
        try:
          avals.append(leaf_aval(x))
        except InputError as exc:
          raise InputError(f"{where}: example argument at position {self.positions[i]}, "
                           f"path {path or '(root)'}: {exc}") from None
      self.avals.append(avals)

  def weak_guard(self, call):
    """`call`, refusing a scalar whose weak type differs from the compiled one
    where that changes the program (jax.jit would compile another one)."""
    def guarded(args):
      for i, j, weak in self.weak_sensitive:
        if i < len(args):
          leaves = tree_util.tree_leaves(args[i])
          if j < len(leaves) and is_weak(leaves[j]) != weak:
            raise InputError(
                f"{self.where}: {self._arg_name(i)} at path {self.paths[i][j] or '(root)'}"
                f" is {'weakly' if not weak else 'strongly'} typed; the graph was compiled "
                f"for a {'weakly typed value (a Python scalar)' if weak else 'strongly typed array'}"
                " and here the weak type changes the result's dtype (jax.jit would compile "
                "another program). Pass " + ("a Python scalar" if weak else
                                              "an array of that dtype") + ".")
      return call(args)
    return guarded

  def _arg_name(self, i):
    return f"argument {i} (position {self.positions[i]} of the function)"

  def check_arity(self, args):
    if len(args) != len(self.treedefs):
      raise InputError(
          f"{self.where}: expected {len(self.treedefs)} positional argument(s) "
          f"(the function's positions {self.positions}; state and static arguments "
          f"are not passed to run), got {len(args)}")

  def conform(self, args, leading=None):
    """Returns `args` with Python scalars converted where that is exact; raises
    InputError naming the first argument that does not fit. With `leading`,
    every leaf must carry that many steps on a new leading axis."""
    self.check_arity(args)
    fixed = []
    for i, arg in enumerate(args):
      leaves, treedef = tree_util.tree_flatten(arg)
      if treedef != self.treedefs[i]:
        raise InputError(f"{self.where}: {self._arg_name(i)} has pytree structure "
                         f"{treedef}, expected {self.treedefs[i]}")
      new_leaves = [self._conform_leaf(i, j, x, leading) for j, x in enumerate(leaves)]
      fixed.append(tree_util.tree_unflatten(treedef, new_leaves))
    return tuple(fixed)

  def conform_leaf(self, i, j, x):
    """Leaf `j` of argument `i`, conformed as `conform` does (InputError if
    it does not fit)."""
    return self._conform_leaf(i, j, x, None)

  def _conform_leaf(self, i, j, x, leading):
    want = self.avals[i][j]
    shape = tuple(want.shape) if leading is None else (leading,) + tuple(want.shape)
    place = f"{self.where}: {self._arg_name(i)} at path {self.paths[i][j] or '(root)'}"
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
    if isinstance(x, _PY_SCALARS) and leading is None and shape == ():
      converted = python_scalar(x, want.dtype)
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
    try:
      got = leaf_aval(x)
    except InputError as exc:
      raise InputError(f"{place}: {exc}") from None
    if isinstance(x, jax.Array) and x.is_deleted():
      raise InputError(f"{place}: the array has been deleted (donated or freed)")
    if tuple(got.shape) != shape or got.dtype != want.dtype:
      expect = f"{aval_str(want)}" if leading is None else (
          f"{want.str_short(short_dtypes=True).split('[')[0]}{list(shape)} "
          f"(steps={leading} on a leading axis of {aval_str(want)})")
      raise InputError(f"{place}: expected {expect}, got {aval_str(got)}{piece}")
    if target is not None:  # under a mesh: laid out as compiled
      if isinstance(x, jax.Array) and x.sharding != target:
        return jax.device_put(x, target)
      return x
    if isinstance(x, jax.Array) and x.committed:
      device = session_device()
      if x.devices() != {device}:  # the executables run on the session's device
        return jax.device_put(x, device)
    return x
