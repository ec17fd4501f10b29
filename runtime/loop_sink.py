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
  """One executable that runs `steps` steps of a single-partition graph.
  Profiled, the executable is one partition event for all the steps."""
  _PROFILED = ("call", "run_exe")

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
      new = [final[i] for i in layout.updated_idx]
      keep = [layout.state_shardings[i] for i in layout.updated_idx]
      # under a mesh: the carry's layout is XLA's choice; the slots keep theirs
      return tuple(x if s is None else lax.with_sharding_constraint(x, s)
                   for x, s in zip(new, keep)), ys

    self.exe = compile_fn(
        sunk, (*layout.structs(), *arg_structs(spec, steps)),
        donate_argnums=(0,) if layout.donated_idx else (),
        compiler_options=graph.compiler_options)
    self.run_exe = self.exe  # what `execute` calls (the profiler times it)

  def _profile_paths(self, hooks):
    self.run_exe = hooks.partition_call(0, self.exe)  # all the steps: one event

  def execute(self, args):
    args = self.spec.conform(args, leading=self.steps)
    try:
      return self.run_exe(*self.layout.gather(), *args)
    except jax.errors.JaxRuntimeError as exc:
      raise runtime_failure(self.partition, self.recorder, exc)


MAX_COMPILED_STEPS = 256  # split/stack executables up to this many steps


class SteppedRunner(Runner):
  """`steps` runs of a multi-partition plan, stacked; all-or-nothing.

  Its cost is the plan's, N times, plus one executable per argument leaf
  that splits it into steps and one that stacks all the outputs (compiled
  once; ~2 µs a step on CPU, measured here); it saves only `run`'s per-call
  checks. The arguments are checked once, up front."""

  def __init__(self, plan_runner, steps):
    super().__init__(plan_runner.layout, plan_runner.spec)
    self.inner = plan_runner
    self.steps = steps
    structs = tree_util.tree_leaves(arg_structs(self.spec, steps))
    compiled = steps <= MAX_COMPILED_STEPS  # beyond: N-output executables compile slowly
    self.splitters = [compile_fn(lambda a: [a[t] for t in range(steps)], [st])
                      if compiled else list for st in structs]
    self.stacker = None if compiled else self._stack_eagerly
    # Its partitions are the inner runner's (its plan's profiled variant
    # records them); this runner records the run around them.
    self.profile = plan_runner.profile

  @staticmethod
  def _stack_eagerly(*columns):
    return [jax.numpy.stack(column) for column in columns]

  def _stack(self, outs):
    columns = list(zip(*outs))
    if self.stacker is self._stack_eagerly:
      return self._stack_eagerly(*columns)
    flat = [x for column in columns for x in column]
    if self.stacker is None and len({isinstance(getattr(x, "sharding", None),
                                                jax.sharding.NamedSharding) for x in flat}) > 1:
      self.stacker = self._stack_eagerly  # under a mesh with host outputs: one
      return self._stack_eagerly(*columns)  # executable cannot take both kinds
    if self.stacker is None:
      structs = [jax.ShapeDtypeStruct(  # under a mesh, as the plan laid them out
          jax.numpy.shape(x), x.dtype, weak_type=getattr(x, "weak_type", False),
          sharding=x.sharding if isinstance(getattr(x, "sharding", None),
                                            jax.sharding.NamedSharding) else None)
          for x in flat]
      sizes = [len(column) for column in columns]

      def stack(*xs):
        it = iter(xs)
        return [jax.numpy.stack([next(it) for _ in range(n)]) for n in sizes]
      self.stacker = compile_fn(stack, structs)
    return self.stacker(*flat)

  def execute(self, args):
    inner, layout = self.inner, self.layout
    args = self.spec.conform(args, leading=self.steps)
    columns = [split(leaf) for split, leaf in zip(self.splitters, tree_util.tree_leaves(args))]
    # The plan donates some leaves to its executables: those get a private copy,
    # so the slots' buffers survive a failure at any step.
    state = layout.gather_all()
    for i in layout.donated_idx:
      state[i] = owned_copy(state[i], self.layout.state_shardings[i])
    outs = []
    for t in range(self.steps):
      flat = inner.run_flat(state, [column[t] for column in columns])
      for k in layout.updated_idx:  # outputs[:num_outputs] are the state's new values
        state[k] = flat[k]
      outs.append(flat[layout.num_outputs:])
    stacked = self._stack(outs) if outs[0] else []
    return ([state[k] for k in layout.updated_idx],
            tree_util.tree_unflatten(inner.rest_tree, stacked))


def check_steps(steps):
  """`steps` as an int, checked before anything is built: a positive integer
  (Python or numpy), not a bool, a float or a string."""
  if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < 1:
    raise InputError(f"run: steps must be a positive int, got {steps!r} "
                     f"({type(steps).__name__})")
  return int(steps)
