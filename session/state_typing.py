"""Whether state values of other weak types change the programs that read them.

A graph's state leaves are bound in the weak types its program has
(StateSlot.weak_types), whatever the value set_state, replace_state or
restore is given. jax.jit compiles for the weak types it is given, and where
they change the arithmetic (mixed precision: a weak Python float times a
bfloat16 array stays bfloat16, a strong float32 one does not) it would run
another program from then on. So a value whose weak types differ from the
program's is checked: every graph that reads the slots it goes to is traced
again on types (no user code runs on values) with those weak types all
together, as jax.jit would see them - and, where the graph updates its
state, the later steps the returned weak types lead to
(tracing.follow_steps) - and the value is refused (InputError naming a leaf)
where one computes other arithmetic. Answers are kept per graph and pattern.

The question is asked when such a value comes. Asked at compile, leaf by
leaf, it cost a trace of the whole program per scalar state leaf: compile
time quadratic in their number (benchmarks/compile.py's bfloat16 program over
300 scalar state leaves: 19.4x jax.jit's compile time then, 1.3x now).
"""
import jax
from jax import tree_util

from jaxsession import tracing
from jaxsession.graph import settings
from jaxsession.inputs import weak_type_error


def _struct(x):
  """x's type, its layout kept (under a mesh the trace reads it)."""
  aval = jax.typeof(x)
  sharding = x.sharding if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) else None
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type,
                              sharding=sharding)


GONE = tracing.GONE  # other_step's answer where the graph's function is gone


class GraphTyping:
  """One graph's program, to be traced again on other state weak types: its
  function on types (`wrapped`: no example value kept), its state and run
  argument types, the digest of its arithmetic (tracing.arithmetic)."""

  def __init__(self, wrapped, state_structs, dyn_structs, base, updates):
    self.wrapped = wrapped
    self.state = tuple(state_structs)
    self.dyn = list(dyn_structs)
    self.base = base
    self.updates = updates
    self._answers = {}  # frozenset of ((arg, leaf), weak) -> other_step's answer
    self.settings = settings.snapshot()  # traced again under its compile's settings

  @classmethod
  def make(cls, wrapped, closed, state_args, dyn_args, updates):
    """The typing of a graph with state, or None where no weak type can
    change its program (tracing.weak_type_is_moot) or it has no state."""
    if not state_args or tracing.weak_type_is_moot(closed.jaxpr):
      return None
    structs = lambda tree: tree_util.tree_map(_struct, tree)
    return cls(wrapped, [structs(a) for a in state_args], [structs(a) for a in dyn_args],
               tracing.arithmetic(closed.jaxpr), updates)

  def other_step(self, flips):
    """`flips`: {(state arg, leaf): weak type}. The first run (1: the next
    one) whose program computes other arithmetic than the graph's where
    those state leaves are so typed; 0 where none does; -1 where the weak
    types each step returns still change after tracing.MAX_TRACED_STEPS
    (jax.jit's later programs not vouched for); GONE where the function
    cannot be traced again (tracing.types_fn)."""
    key = frozenset(flips.items())
    step = self._answers.get(key)
    if step is None:
      with settings.restored(self.settings):
        step = self._answers[key] = self._trace(flips)
    return step

  def _trace(self, flips):
    state = [tracing.with_weak(arg, [(j, weak) for (at, j), weak in flips.items() if at == k],
                               keep_sharding=True) for k, arg in enumerate(self.state)]
    answer, shapes = tracing.retrace(self.wrapped, state, self.dyn, self.base)
    if answer is not tracing.SAME:  # (a trace that raises: another program too)
      return GONE if answer is tracing.GONE else 1
    out = shapes[0]
    if not self.updates:
      return 0
    try:
      later = tracing.follow_steps(self.wrapped, self.base, state, out, self.dyn,
                                   {tracing.state_flags(state)})
    except tracing.StillChanging:
      return -1
    return 0 if later is None else later[0] + 1


def refused(flips):
  """`flips`: [(slot, leaf, weak type)], leaves given values typed otherwise
  than their slots' programs have them. None where every graph reading those
  slots computes its arithmetic with them, at its next run and later ones;
  else (n, step): flips[n] changes a graph's program on its own (None where
  only together), from run `step` on (GraphTyping.other_step's)."""
  graphs = {}
  for n, (slot, j, weak) in enumerate(flips):
    for typing, k in tuple(slot.typings.values()):  # released graphs drop out
      graphs.setdefault(id(typing), (typing, []))[1].append((n, k, j, weak))
  for typing, mine in graphs.values():
    step = typing.other_step({(k, j): weak for _, k, j, weak in mine})
    if step:
      alone = next((n for n, k, j, weak in mine if typing.other_step({(k, j): weak})), None)
      return alone, step
  return None


def refusal_error(place, weak, step, together=""):
  """The InputError for a value typed `weak` at `place` (its leaf typed the
  other way in the program) that changes the program from run `step` on."""
  remedy = "Pass " + ("an array of that dtype" if weak else
                      "a Python scalar (or jnp.asarray of one)") + "."
  return weak_type_error(place, weak, "the value it was compiled for", why(step, together),
                         remedy)


def why(step, together=""):
  """What a refused weak type changes (refused's `step`)."""
  if step is GONE:
    text = ("whether that changes the program cannot be checked: the graph's function, a "
            "method of an object since collected, cannot be traced again")
  elif step == 1:
    text = "here the weak type changes the program (jax.jit would compile another one)"
  elif step > 1:
    text = (f"jax.jit would compute other arithmetic from the {_nth(step)} run after it on "
            "(the weak types each step returns hand the change on)")
  else:
    text = (f"the weak types its steps return still change after {tracing.MAX_TRACED_STEPS} "
            "steps, so jax.jit's later programs are not vouched for")
  return text + (f", together with {together}" if together else "")


def _nth(n):
  return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"
