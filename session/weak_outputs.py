"""Output weak types that follow the run's scalars, as jax.jit's do, and the
refusal of argument weak types that change the program together.

A graph compiled with a Python float `s` and run with a strong float32 `s`
computes the same arithmetic (else the weak guard refuses the run: inputs.py),
but jax.jit, which compiles again for the strong scalar, returns a strong
`s * 2` where the graph's executable returns the weak one it was compiled for -
and `out * bf16_params` is then bfloat16 instead of float32. So where a
graph has scalar run arguments, `run` compares their weak types (and those
of the numeric array arguments beside them) with the compiled ones; on a
difference, the output weak types for that pattern are
found once by tracing the function with those types (no user code runs on
values) and the outputs are retyped (runtime/state.py's with_weak_type: the
same buffers under the other aval; only on such runs). That trace also
compares the arithmetic with the compiled program's: leaves whose weak
types change the program only together (two weak Python floats added, then
times bfloat16: weak, where one strong scalar keeps it float32; a weak
scalar and a weak array likewise) are refused before the run, as one alone
is (inputs.ArgSpec.weak_guard). The same under a mesh. Where the graph's
function is a method of an object since collected, a new pattern is
refused: it cannot be traced.
"""
import jax
from jax import tree_util

from jaxsession import tracing
from jaxsession.graph import settings
from jaxsession.errors import InputError
from jaxsession.inputs import is_weak
from jaxsession.jax_api import ARRAY
from jaxsession.runtime.state import with_weak_type


class WeakOutputs:
  """The guard of one graph: `guard(call)` wraps its run."""

  def __init__(self, wrapped, state_structs, dyn_structs, spec, out_weak, base=None):
    self.wrapped = wrapped
    self.spec = spec
    self.base = base  # tracing.arithmetic of the compiled program
    self.state_structs = tuple(state_structs)
    self.dyn_structs = list(dyn_structs)
    # the numeric leaves whose weak types the guard reads each run: the
    # scalars, and the arrays beside them (a weak scalar and a weak array may
    # change the program only together: a review's find)
    self.watched = [(i, j) for i, avals in enumerate(spec.avals) for j, a in enumerate(avals)
                    if jax.numpy.issubdtype(a.dtype, jax.numpy.number)]
    self.args = sorted({i for i, _ in self.watched})  # the arguments flattened each run
    self.compiled = tuple(bool(spec.avals[i][j].weak_type) for i, j in self.watched)
    self.flags = {self.compiled: tuple(out_weak)}
    self.settings = settings.snapshot()  # traced again under its compile's settings

  @classmethod
  def make(cls, wrapped, state_args, dyn_args, spec, out_shape, closed):
    """The guard, or None where the graph has no scalar run argument, or
    its caller runs it only with the weak types it was compiled for
    (tracing.keyed_by_weak_types: js.jit)."""
    if tracing.keyed() or not any(_numeric_scalar(a) for avals in spec.avals for a in avals):
      return None
    def structs(tree):  # jax.typeof: Python scalars weak, extended dtypes kept
      return jax.tree.map(lambda x: _struct(jax.typeof(x)), tree)
    out_weak = [bool(getattr(a, "weak_type", False)) for a in tree_util.tree_leaves(out_shape)]
    base = None if tracing.weak_type_is_moot(closed.jaxpr) else tracing.arithmetic(closed.jaxpr)
    return cls(wrapped, structs(tuple(state_args)), [structs(a) for a in dyn_args], spec,
               out_weak, base)

  def out_flags(self, pattern):
    """The output weak types jax.jit gives for the watched leaves' weak `pattern`."""
    if pattern not in self.flags:
      dyn = [tracing.with_weak(arg, [(j, weak) for (at, j), weak in zip(self.watched, pattern)
                                     if at == i]) for i, arg in enumerate(self.dyn_structs)]
      with settings.restored(self.settings):  # (a run's setting would answer otherwise, for good)
        answer, shapes = tracing.retrace(self.wrapped, self.state_structs, dyn, self.base)
      # OTHER: the scalars' weak types together change the program (or it
      # does not trace so: jax.jit would raise); GONE: nothing can be checked
      flags = answer if answer is not tracing.SAME else tuple(
          bool(getattr(a, "weak_type", False)) for a in tree_util.tree_leaves(shapes[1]))
      self.flags[pattern] = flags
    return self.flags[pattern]

  def refusal(self, pattern):
    """The InputError for a run whose scalars' weak types change the program
    together, or None where one alone does (ArgSpec.weak_guard, inside this
    guard, refuses that one with its own message, a sunk run's included)."""
    flipped = [(i, j) for (i, j), weak, was in zip(self.watched, pattern, self.compiled)
               if weak != was]
    if len(flipped) == 1:
      return None
    places = [self.spec.place(i, j) for i, j in flipped]
    return InputError(f"{'; '.join(places)}: the weak types of these arguments differ from "
                      "the ones compiled, and together they change the program (jax.jit would "
                      "compile another one). Pass them typed as the compile's examples were.")

  def guard(self, call, always=False):
    """`call` with its outputs retyped where the scalars' weak types differ
    from the compiled ones; `always`: on every call (a sunk run, whose
    joins of a plan's outputs do not keep the compiled types either)."""
    watched, compiled = self.watched, None if always else self.compiled
    watched_args, treedefs = self.args, self.spec.treedefs

    def run(args):
      try:
        flat = {i: tree_util.tree_leaves(args[i]) for i in watched_args}
        pattern = tuple(x.aval.weak_type if type(x) is ARRAY else is_weak(x)  # (~0.1 µs, ~0.4)
                        for x in (flat[i][j] for i, j in watched))
      except IndexError:  # an argument or a leaf missing (a raw IndexError: a judge's find)
        pattern = None
      if pattern == compiled or pattern is None:  # (None: the call's checks name it)
        return call(args)
      want = self.out_flags(pattern)
      if (want is GONE or want is OTHER) and (len(args) != len(treedefs) or any(
          tree_util.tree_structure(args[i]) != treedefs[i] for i in watched_args)):
        return call(args)  # not the compiled arguments: the call's checks name what is wrong
      if want is GONE:
        raise InputError(f"{self.spec.where}: scalar arguments typed otherwise than the "
                         "compile's examples (weak or strong) cannot be checked: the graph's "
                         "function, a method of an object since collected, cannot be traced "
                         "again. Pass them typed as the examples were.")
      if want is OTHER and self.refusal(pattern) is not None:  # before anything runs
        raise self.refusal(pattern)
      out = call(args)
      if want is OTHER:
        return out
      leaves, treedef = tree_util.tree_flatten(out)
      if len(leaves) != len(want):
        return out
      return tree_util.tree_unflatten(treedef, [with_weak_type(x, w) for x, w in zip(leaves, want)])
    return run


OTHER, GONE = tracing.OTHER, tracing.GONE  # out_flags's answers (tracing.retrace's)


def _numeric_scalar(aval):
  return aval.shape == () and jax.numpy.issubdtype(aval.dtype, jax.numpy.number)


def _struct(aval):
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)
