"""Loop sink: N steps of a graph in one dispatch.

For a graph that is one device partition, the N steps become one `lax.scan`
inside one executable: the state is the carry, the per-step arguments are
scanned over their leading axis and the outputs come back stacked. A graph with
host partitions cannot live inside one executable; it runs its plan N times
on a private copy of the leaves the plan donates, and commits only after the
last step, so a failure at any step leaves the session's state as it was.
"""
import numbers

import jax
from jax import lax, tree_util

from jaxsession.errors import InputError
from jaxsession.runtime import callbacks
from jaxsession.runtime.build import compile_fn
from jaxsession.runtime.executor import (Runner, arg_structs, graph_body,
                                         runtime_failure)
from jaxsession.runtime.state import owned_copy


class SunkRunner(Runner):
  """One executable that runs `steps` steps of a single-partition graph."""

  def __init__(self, graph, spec, rest_tree, layout, steps):
    super().__init__(layout, spec)
    self.steps = steps
    self.partition = graph.partitions[0] if graph.partitions else None
    self.recorder = callbacks.ErrorRecorder()
    step = graph_body(graph, layout, rest_tree, self.recorder)

    def sunk(donated, kept, *stacked):
      def one_step(state, xs):
        new, out = step(list(state), xs)
        state = list(state)
        for i, x in zip(layout.updated_idx, new):
          state[i] = lax.convert_element_type(x, state[i].dtype)
        return tuple(state), out
      state = tuple(layout.merge(donated, kept))
      final, ys = lax.scan(one_step, state, tuple(stacked), length=steps)
      return tuple(final[i] for i in layout.updated_idx), ys

    self.exe = compile_fn(
        sunk, (*layout.structs(), *arg_structs(spec, steps)),
        donate_argnums=(0,) if layout.donated_idx else ())

  def execute(self, args):
    args = self.spec.conform(args, leading=self.steps)
    try:
      return self.exe(*self.layout.gather(), *args)
    except jax.errors.JaxRuntimeError as exc:
      raise runtime_failure(self.partition, self.recorder, exc)


class SteppedRunner(Runner):
  """`steps` runs of a multi-partition plan, stacked; all-or-nothing."""

  def __init__(self, plan_runner, steps):
    super().__init__(plan_runner.layout, plan_runner.spec)
    self.inner = plan_runner
    self.steps = steps

  def execute(self, args):
    inner, layout = self.inner, self.layout
    args = self.spec.conform(args, leading=self.steps)
    # The plan donates some leaves to its executables: those get a private copy,
    # so the slots' buffers survive a failure at any step.
    state = layout.gather_all()
    for i in layout.donated_idx:
      state[i] = owned_copy(state[i])
    outs = []
    for t in range(self.steps):
      new, out = inner.step_once(state, tree_util.tree_map(lambda x: x[t], args))
      for i, x in zip(layout.updated_idx, new):
        state[i] = x
      outs.append(out)
    stacked = tree_util.tree_map(lambda *xs: jax.numpy.stack(xs), *outs)
    return [state[i] for i in layout.updated_idx], stacked


def check_steps(steps):
  """`steps` as an int, checked before anything is built: a positive integer
  (Python or numpy), not a bool, a float or a string."""
  if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
    raise InputError(f"run: steps must be a positive int, got {steps!r} "
                     f"({type(steps).__name__})")
  return int(steps)
