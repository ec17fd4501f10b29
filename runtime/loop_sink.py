"""Loop sink: N steps of a graph in one dispatch.

For a graph that is one device partition, the N steps become one `lax.scan`
inside one executable: the state is the carry, the per-step arguments are
scanned over their leading axis and the outputs come back stacked. A graph with
host partitions cannot live inside one executable; it runs its plan N times
on a private copy of the state, so a failure at any step still leaves the
session's state as it was.
"""
import jax
from jax import lax, tree_util

from jaxsession.errors import InputError
from jaxsession.lowering import lower_graph
from jaxsession.runtime.build import compile_fn, shape_struct
from jaxsession.runtime.executor import StateLayout, _offsets
from jaxsession.runtime.state import owned_copy


def _stacked_structs(spec, steps):
  structs = [jax.ShapeDtypeStruct((steps,) + tuple(a.shape), a.dtype,
                                  weak_type=getattr(a, "weak_type", False))
             for a in spec.flat_avals()]
  return [tree_util.tree_unflatten(t, structs[o:o + len(a)]) for t, a, o in _offsets(spec)]


class SunkRunner:
  """One executable that runs `steps` steps of a single-partition graph."""

  def __init__(self, graph, plan, spec, rest_tree, consts, steps):
    self.layout = layout = StateLayout(graph, plan)
    self.spec = spec
    self.consts = consts
    self.steps = steps
    body = lower_graph(graph)
    k = layout.num_state

    def sunk(donated, kept, consts, *stacked):
      def one_step(state, xs):
        outs = body(*state, *tree_util.tree_leaves(xs), *consts)
        new = list(state)
        for i in layout.updated_idx:
          new[i] = lax.convert_element_type(outs[i], state[i].dtype)
        return tuple(new), tuple(outs[k:])
      state = tuple(layout.merge(donated, kept))
      final, ys = lax.scan(one_step, state, stacked, length=steps)
      return (tuple(final[i] for i in layout.updated_idx),
              tree_util.tree_unflatten(rest_tree, list(ys)))

    self.exe = compile_fn(sunk, (*layout.structs(consts), *_stacked_structs(spec, steps)),
                          donate_argnums=(0,) if layout.donated_idx else ())

  def __call__(self, state_leaves, args):
    args = self.spec.conform(args, leading=self.steps)
    donated, kept = self.layout.split(state_leaves)
    new, out = self.exe(donated, kept, self.consts, *args)
    updated = [None] * self.layout.num_state
    for i, x in zip(self.layout.updated_idx, new):
      updated[i] = x
    return updated, out


class SteppedRunner:
  """`steps` runs of a multi-partition plan, stacked; all-or-nothing."""

  def __init__(self, plan_runner, steps):
    self.inner = plan_runner
    self.steps = steps

  def __call__(self, state_leaves, args):
    args = self.inner.spec.conform(args, leading=self.steps)
    state = [owned_copy(x) for x in state_leaves]  # the plan may donate these
    outs = []
    for t in range(self.steps):
      step_args = tree_util.tree_map(lambda x: x[t], args)
      updated, out = self.inner(state, step_args)
      state = [new if new is not None else old for new, old in zip(updated, state)]
      outs.append(out)
    stacked = tree_util.tree_map(lambda *xs: jax.numpy.stack(xs), *outs) if outs else None
    return state, stacked


def check_steps(steps):
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise InputError(f"run: steps must be a positive int, got {steps!r}")
  return steps
