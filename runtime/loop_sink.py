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
from jaxsession.runtime.build import callback_failure, compile_fn
from jaxsession.runtime.executor import Runner, arg_structs, const_structs, graph_body
from jaxsession.runtime.state import owned_copy


class SunkRunner(Runner):
  """One executable that runs `steps` steps of a single-partition graph."""

  def __init__(self, graph, spec, rest_tree, consts, layout, steps):
    self.layout = layout
    self.spec = spec
    self.consts = consts
    self.steps = steps
    self.partition = graph.partitions[0] if graph.partitions else None
    step = graph_body(graph, layout, rest_tree)

    def sunk(donated, kept, consts, *stacked):
      def one_step(state, xs):
        new, out = step(list(state), consts, xs)
        state = list(state)
        for i, x in zip(layout.updated_idx, new):
          state[i] = lax.convert_element_type(x, state[i].dtype)
        return tuple(state), out
      state = tuple(layout.merge(donated, kept))
      final, ys = lax.scan(one_step, state, tuple(stacked), length=steps)
      return tuple(final[i] for i in layout.updated_idx), ys

    self.exe = compile_fn(
        sunk, (*layout.structs(), const_structs(consts), *arg_structs(spec, steps)),
        donate_argnums=(0,) if layout.donated_idx else ())

  def call(self, args):
    args = self.spec.conform(args, leading=self.steps)
    try:
      new, out = self.exe(*self.layout.gather(), self.consts, *args)
    except jax.errors.JaxRuntimeError as exc:
      if self.partition is None or not self.partition.may_fail:
        raise
      raise callback_failure(self.partition, exc) from exc
    self.layout.commit(new)
    return out


class SteppedRunner(Runner):
  """`steps` runs of a multi-partition plan, stacked; all-or-nothing."""

  def __init__(self, plan_runner, steps):
    self.inner = plan_runner
    self.steps = steps

  def call(self, args):
    inner = self.inner
    args = inner.spec.conform(args, leading=self.steps)
    # The plan may donate the leaves it is given: run on a private copy.
    state = [owned_copy(x) for x in inner.layout.gather_all()]
    outs = []
    for t in range(self.steps):
      state, out = inner.step_once(state, tree_util.tree_map(lambda x: x[t], args))
      outs.append(out)
    inner.layout.commit([state[i] for i in inner.layout.updated_idx])
    return tree_util.tree_map(lambda *xs: jax.numpy.stack(xs), *outs)


def check_steps(steps):
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
    raise InputError(f"run: steps must be a positive int, got {steps!r}")
  return steps
