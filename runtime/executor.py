"""The executor: runs a built graph and commits its state only at the end.

Every runner does the same four things per call, in `Runner.call`: hold the
locks of its state slots, read the state leaves, execute, and write the new
leaves back - only after the whole execution succeeded, so a failed call
leaves the state as it was. What differs is `execute`:
  * SingleRunner: the graph is one device partition - one ahead-of-time
    compiled executable call, whose own argument check runs before anything
    is consumed (no warm-up, no tracing at run time, never a recompile);
  * PlanRunner: several partitions - eval_jaxpr's loop over the built steps
    (device executables and host functions), values freed at last use.
The loop-sunk runners (loop_sink.py) are the same with N steps per call.
"""
import jax
from jax import tree_util

from jaxsession.ir import Literal
from jaxsession.lowering import graph_consts, lower_nodes
from jaxsession.runtime import callbacks
from jaxsession.runtime.build import compile_fn, shape_struct
from jaxsession.runtime.state import slots_lock


# What an AOT executable's call raises for arguments that do not fit (type,
# Python int range, device): raised before it runs or consumes anything, so
# the runner conforms the arguments (or raises InputError) and calls again.
ARG_MISMATCH = (TypeError, OverflowError, ValueError)


class StateLayout:
  """How state leaves travel: which are donated, kept and updated, and the
  (slot, leaf index) each flat state leaf lives in."""

  def __init__(self, graph, plan, leaf_slots):
    states = graph.inputs_of_kind("state")
    donated = plan.donated_ids()
    self.leaf_slots = leaf_slots
    self.num_state = len(states)
    # outputs[:num_outputs] hold new state values (0 for a graph that only reads)
    self.num_outputs = len(graph.state_updates())
    self.donated_idx = [i for i, s in enumerate(states) if s.id in donated]
    self.kept_idx = [i for i, s in enumerate(states) if s.id not in donated]
    self.updated_idx = [i for i, (s, new) in enumerate(graph.state_updates())
                        if new is not s]
    self.state_avals = [s.aval for s in states]
    self._donated_refs = [leaf_slots[i] for i in self.donated_idx]
    self._kept_refs = [leaf_slots[i] for i in self.kept_idx]
    self._updated_refs = [leaf_slots[i] for i in self.updated_idx]
    self.slots = list(dict.fromkeys(slot for slot, _ in leaf_slots))

  def gather(self):
    """The current (donated, kept) state leaves, read from the slots."""
    return (tuple(slot.leaves[j] for slot, j in self._donated_refs),
            tuple(slot.leaves[j] for slot, j in self._kept_refs))

  def gather_all(self):
    return [slot.leaves[j] for slot, j in self.leaf_slots]

  def commit(self, updated):
    """Writes the new values of the updated leaves (in updated_idx order)."""
    if len(self._updated_refs) == 1:  # the common one-leaf case, without a dict
      (slot, j), = self._updated_refs
      leaves = list(slot.leaves)
      leaves[j] = updated[0]
      slot.leaves = tuple(leaves)
      return
    changed = {}
    for (slot, j), value in zip(self._updated_refs, updated):
      changed.setdefault(slot, list(slot.leaves))[j] = value
    for slot, leaves in changed.items():
      slot.leaves = tuple(leaves)

  def merge(self, donated, kept):
    leaves = [None] * self.num_state
    for i, x in zip(self.donated_idx, donated):
      leaves[i] = x
    for i, x in zip(self.kept_idx, kept):
      leaves[i] = x
    return leaves

  def structs(self):
    return (tuple(shape_struct(self.state_avals[i]) for i in self.donated_idx),
            tuple(shape_struct(self.state_avals[i]) for i in self.kept_idx))


def arg_structs(spec, leading=None):
  """ShapeDtypeStruct pytrees for the run arguments (optionally with a leading
  steps axis)."""
  lead = () if leading is None else (leading,)
  out = []
  for treedef, avals in zip(spec.treedefs, spec.avals):
    leaves = [jax.ShapeDtypeStruct(lead + tuple(a.shape), a.dtype,
                                   weak_type=getattr(a, "weak_type", False)) for a in avals]
    out.append(tree_util.tree_unflatten(treedef, leaves))
  return out


def graph_body(graph, layout, rest_tree, recorder):
  """fn(state_leaves, args) -> (updated state leaves, user outputs), the
  graph's consts embedded, every callback recording its exception in
  `recorder`."""
  body = lower_nodes(callbacks.instrumented(graph.nodes, recorder),
                     [v for v in graph.inputs if v.kind != "const"], graph.outputs,
                     graph_consts(graph))
  k = layout.num_outputs

  def step(state, args):
    outs = body(*state, *tree_util.tree_leaves(args))
    return ([outs[i] for i in layout.updated_idx],
            tree_util.tree_unflatten(rest_tree, outs[k:]))
  return step


class Runner:
  """Locks, state in, execute, state out. Subclasses define `execute(args)
  -> (new values of the updated leaves, user outputs)`; it must not change
  the slots itself."""

  def __init__(self, layout, spec):
    self.layout = layout
    self.spec = spec
    self.lock = slots_lock(layout.slots)

  def call(self, args):
    with self.lock:
      new, out = self.execute(args)
      if new:
        self.layout.commit(new)
    return out


class SingleRunner(Runner):
  """A graph that is one device partition: one executable call per run.

  The executable is compiled ahead of time; its call checks the argument
  types before it runs or consumes anything (a mismatch is retried once with
  the arguments conformed, which raises InputError if they do not fit). The
  call `run` makes is a closure chosen once for the graph's shape of state:
    * bare: no state - the arguments go straight in;
    * slotwise: the usual training step, every state leaf donated and
      updated - whole slots go in as tuples and come back replaced whole;
    * general: (donated leaves, kept leaves, *args).
  """

  def __init__(self, graph, spec, rest_tree, partition, layout):
    super().__init__(layout, spec)
    self.partition = partition
    self.recorder = callbacks.ErrorRecorder()
    step = graph_body(graph, layout, rest_tree, self.recorder)
    everything = list(range(layout.num_state))
    if not layout.num_state:
      self.exe = compile_fn(lambda *args: step([], args)[1], arg_structs(spec))
      self.call = self._bare_call()
    elif layout.donated_idx == everything == layout.updated_idx:
      sizes = [len(slot.leaves) for slot in layout.slots]

      def slotwise_step(slot_leaves, *args):
        new, out = step([x for leaves in slot_leaves for x in leaves], args)
        return _split(new, sizes), out
      donated_s, _ = layout.structs()
      self.exe = compile_fn(slotwise_step, (_split(donated_s, sizes), *arg_structs(spec)),
                            donate_argnums=(0,))
      self.call = self._slotwise_call()
    else:
      def whole_step(donated, kept, *args):
        new, out = step(layout.merge(donated, kept), args)
        return tuple(new), out
      self.exe = compile_fn(whole_step, (*layout.structs(), *arg_structs(spec)),
                            donate_argnums=(0,) if layout.donated_idx else ())

  def execute(self, args):
    donated, kept = self.layout.gather()
    try:
      return self.exe(donated, kept, *args)
    except ARG_MISMATCH:  # checked before anything ran or was donated
      return self.exe(donated, kept, *self.spec.conform(args))
    except jax.errors.JaxRuntimeError as exc:
      raise runtime_failure(self.partition, self.recorder, exc)

  def _failure(self, exc):
    return runtime_failure(self.partition, self.recorder, exc)

  def _bare_call(self):
    exe, conform, failure = self.exe, self.spec.conform, self._failure

    def call(args):
      try:
        return exe(*args)
      except ARG_MISMATCH:
        return exe(*conform(args))
      except jax.errors.JaxRuntimeError as exc:
        raise failure(exc)
    return call

  def _slotwise_call(self):
    exe, conform, failure = self.exe, self.spec.conform, self._failure
    slots, lock = tuple(self.layout.slots), self.lock
    if len(slots) == 1:  # one state arg: no tuple building at all
      slot, = slots

      def call(args):
        with lock:
          try:
            new, out = exe((slot.leaves,), *args)
          except ARG_MISMATCH:
            new, out = exe((slot.leaves,), *conform(args))
          except jax.errors.JaxRuntimeError as exc:
            raise failure(exc)
          slot.leaves = new[0]
        return out
      return call

    def call(args):
      with lock:
        current = tuple([slot.leaves for slot in slots])
        try:
          new, out = exe(current, *args)
        except ARG_MISMATCH:
          new, out = exe(current, *conform(args))
        except jax.errors.JaxRuntimeError as exc:
          raise failure(exc)
        for slot, leaves in zip(slots, new):
          slot.leaves = leaves
      return out
    return call


def _split(items, sizes):
  it = iter(items)
  return tuple(tuple(next(it) for _ in range(n)) for n in sizes)


def runtime_failure(partition, recorder, exc):
  """A runtime error of a partition with callbacks is the callback's failure
  (HostOpError); any other runtime error stays what it is."""
  if partition is None or not partition.may_fail:
    return exc
  return callbacks.callback_failure(partition.nodes, partition.index, exc, recorder)


class PlanRunner(Runner):
  """Several partitions: device executables with host steps between them."""

  def __init__(self, graph, steps, spec, rest_tree, layout):
    super().__init__(layout, spec)
    self.steps = steps
    self.rest_tree = rest_tree
    self.consts = graph_consts(graph)
    self.state_ids = [v.id for v in graph.inputs_of_kind("state")]
    self.input_ids = [v.id for v in graph.inputs_of_kind("input")]
    self.outputs = list(graph.outputs)
    # An output that is a graph input, or that appears more than once, would
    # hand the same buffer to two owners (a slot and the caller, or two
    # slots); a later donation of one would invalidate the other. Copy it.
    seen, self.copy_at = set(), set()
    for i, v in enumerate(self.outputs):
      if isinstance(v, Literal):
        continue
      if v.producer is None or v.id in seen:
        self.copy_at.add(i)
      seen.add(v.id)

  def run_flat(self, state_leaves, user_leaves):
    env = dict(zip(self.state_ids, state_leaves))
    env.update(zip(self.input_ids, user_leaves))
    env.update(self.consts)  # host steps read them; device steps embed them
    for step in self.steps:
      outs = step.fn(*[env[i] for i in step.in_ids])
      env.update(zip(step.out_ids, outs))
      for vid in step.free_after:
        del env[vid]
    return [self._output(i, v, env) for i, v in enumerate(self.outputs)]

  def _output(self, i, value, env):
    if isinstance(value, Literal):
      return jax.numpy.asarray(value.value, value.aval.dtype)
    out = env[value.id]
    if not isinstance(out, jax.Array):  # made on the host: outputs are jax.Arrays
      return jax.device_put(out)
    return jax.numpy.array(out, copy=True) if i in self.copy_at else out

  def step_once(self, state_leaves, args):
    """One run on the given state leaves; returns (new values of the updated
    leaves, user outputs) without committing anything."""
    outs = self.run_flat(state_leaves, tree_util.tree_leaves(args))
    return ([outs[i] for i in self.layout.updated_idx],
            tree_util.tree_unflatten(self.rest_tree, outs[self.layout.num_outputs:]))

  def execute(self, args):
    # Host steps may run before the first executable checks its arguments:
    # check them all here, before any work.
    return self.step_once(self.layout.gather_all(), self.spec.conform(args))
