"""The executor: runs a built graph and commits its state only at the end.

Every runner does the same four things per call, in `Runner.call`: hold the
locks of its state slots, read the state leaves, execute, and write the new
leaves back - only after the whole execution succeeded, so a failed call
leaves the state as it was. What differs is `execute`:
  * SingleRunner: the graph is one device partition - one ahead-of-time
    compiled executable call, whose own argument check runs before anything
    is consumed (no warm-up, no tracing at run time, never a recompile);
  * PlanRunner: several partitions - eval_jaxpr's loop over the built
    Program (device executables and host functions) on registers, values
    freed at last use.
The loop-sunk runners (loop_sink.py) are the same with N steps per call.
"""
import jax
import numpy as np
from jax import tree_util

from jaxsession.ir import Literal
from jaxsession.lowering import graph_consts, lower_nodes
from jaxsession.runtime import callbacks, codegen, interrupts, sharding
from jaxsession.runtime.build import ARG_MISMATCH, compile_recorded, fast_call, shape_struct
from jaxsession.runtime.state import slots_lock


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
    self.state_shardings = [s.sharding for s in states]  # None without a mesh
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
    def struct(i):
      return shape_struct(self.state_avals[i], self.state_shardings[i])
    return (tuple(struct(i) for i in self.donated_idx),
            tuple(struct(i) for i in self.kept_idx))


def arg_structs(spec, leading=None):
  """ShapeDtypeStruct pytrees for the run arguments (optionally with a leading
  steps axis), with their shardings under a mesh."""
  lead = () if leading is None else (leading,)
  out = []
  for i, (treedef, avals) in enumerate(zip(spec.treedefs, spec.avals)):
    shardings = spec.shardings[i] if spec.shardings else [None] * len(avals)
    if leading is not None:
      shardings = [s if s is None else sharding.stacked(s) for s in shardings]
    leaves = [jax.ShapeDtypeStruct(lead + tuple(a.shape), a.dtype, sharding=s,
                                   weak_type=getattr(a, "weak_type", False))
              for a, s in zip(avals, shardings)]
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
  keep = [layout.state_shardings[i] for i in layout.updated_idx]

  def step(state, args):
    outs = body(*state, *tree_util.tree_leaves(args))
    new = [outs[i] for i in layout.updated_idx]
    if any(s is not None for s in keep):  # under a mesh: new state keeps its layout,
      new = [x if s is None else jax.lax.with_sharding_constraint(x, s)  # so it is
             for x, s in zip(new, keep)]                                 # donated in place
    return new, tree_util.tree_unflatten(rest_tree, outs[k:])
  return step


_MISSING = object()


class Runner:
  """Locks, state in, execute, state out. Subclasses define `execute(args)
  -> (new values of the updated leaves, user outputs)`; it must not change
  the slots itself.

  `profile`: None, or the hooks of a profiler (`profiler.GraphHooks`).
  Setting it picks the call path once - the profiled one records the run
  and times each partition (blocking on its outputs), the plain one is the
  runner's own - so an unprofiled call pays nothing, not even a check. It
  replaces `self.call`: whoever holds a bound `runner.call` (the Session's
  entry) must take it again after setting `profile`."""
  _profile = None
  steps = None                       # the steps each call runs (loop-sunk runners)
  _PROFILED = ("call",)              # attributes the profiled path replaces

  def __init__(self, layout, spec):
    self.layout = layout
    self.spec = spec
    self.lock = slots_lock(layout.slots)

  @property
  def profile(self):
    return self._profile

  @profile.setter
  def profile(self, hooks):
    if hooks is self._profile:
      return
    if "_plain" not in self.__dict__:  # the unprofiled paths, as first built
      self._plain = {name: self.__dict__.get(name, _MISSING) for name in self._PROFILED}
    for name, value in self._plain.items():
      if value is _MISSING:
        self.__dict__.pop(name, None)  # back to the class's method
      else:
        setattr(self, name, value)
    self._profile = hooks
    if hooks is not None:
      self._profile_paths(hooks)
      self.call = hooks.run_call(self.call, self.steps)

  def _profile_paths(self, hooks):
    """Replaces the partition-level paths with timed ones (`profile` wraps
    the run around `self.call` afterwards)."""

  def call(self, args):
    with self.lock:
      interrupts.depth += 1  # a Ctrl-C waits for the commit (runtime/interrupts.py)
      try:
        new, out = self.execute(args)
        if new:
          self.layout.commit(new)
      finally:
        interrupts.depth -= 1
        if interrupts.pending and not interrupts.depth:
          interrupts.deliver()
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
  Profiled, the same closure runs around the timed executable.
  """
  _PROFILED = ("call", "run_exe")

  def __init__(self, graph, spec, rest_tree, partition, layout, cache=None, key=None):
    """`cache` and `key` (the graph's fingerprint, runtime/compile_cache.py):
    the executable is looked up before it is traced; the key adds the output
    pytree and the state layout, which shape it beyond the graph."""
    super().__init__(layout, spec)
    self.partition = partition
    self.recorder = callbacks.ErrorRecorder()
    step = graph_body(graph, layout, rest_tree, self.recorder)
    everything = list(range(layout.num_state))
    if key is not None:
      key = (key, "single", rest_tree, tuple(layout.donated_idx), tuple(layout.kept_idx),
             tuple(layout.updated_idx), layout.num_outputs)
    if not layout.num_state:
      self.exe, self.recorder = compile_recorded(
          lambda *args: step([], args)[1], self.recorder, arg_structs(spec), (), cache, key,
          graph.compiler_options)
      self.kind = "bare"
      self.call = self._bare_call(fast_call(self.exe))
    elif layout.donated_idx == everything == layout.updated_idx:
      sizes = [len(slot.leaves) for slot in layout.slots]

      def slotwise_step(slot_leaves, *args):
        new, out = step([x for leaves in slot_leaves for x in leaves], args)
        return _split(new, sizes), out
      donated_s, _ = layout.structs()
      self.exe, self.recorder = compile_recorded(
          slotwise_step, self.recorder, (_split(donated_s, sizes), *arg_structs(spec)),
          (0,), cache, key, graph.compiler_options)
      self.kind = "slotwise"
      self.call = self._slotwise_call(fast_call(self.exe))
    else:
      def whole_step(donated, kept, *args):
        new, out = step(layout.merge(donated, kept), args)
        return tuple(new), out
      self.exe, self.recorder = compile_recorded(
          whole_step, self.recorder, (*layout.structs(), *arg_structs(spec)),
          (0,) if layout.donated_idx else (), cache, key, graph.compiler_options)
      self.kind = "general"
    self.run_exe = self.exe  # what `execute` calls (the profiler times it)

  def _profile_paths(self, hooks):
    if self.kind == "bare":
      self.call = self._bare_call(hooks.partition_call(0, fast_call(self.exe)))
    elif self.kind == "slotwise":
      self.call = self._slotwise_call(hooks.partition_call(0, fast_call(self.exe)))
    else:
      self.run_exe = hooks.partition_call(0, self.exe)

  def execute(self, args):
    donated, kept = self.layout.gather()
    try:
      return self.run_exe(donated, kept, *args)
    except ARG_MISMATCH:  # checked before anything ran or was donated
      return self.run_exe(donated, kept, *self.spec.conform(args))
    except RuntimeError as exc:
      raise self._failure(exc, args)

  def _failure(self, exc, args):
    """The error to raise for a RuntimeError of the call: a deleted argument
    (the call refuses it before running) is an InputError; a failure while
    running, the callback's HostOpError or the error itself."""
    if not isinstance(exc, jax.errors.JaxRuntimeError):
      self.spec.conform(args)  # raises InputError naming a deleted array
      return exc
    return runtime_failure(self.partition, self.recorder, exc)

  def _bare_call(self, exe):
    conform, failure = self.spec.conform, self._failure

    def call(args):
      try:
        return exe(*args)
      except ARG_MISMATCH:
        return exe(*conform(args))
      except RuntimeError as exc:
        raise failure(exc, args)
    return call

  def _slotwise_call(self, exe):
    conform, failure = self.spec.conform, self._failure
    slots, lock = tuple(self.layout.slots), self.lock
    if len(slots) == 1:  # one state arg: no tuple building at all
      slot, = slots

      def call(args):
        with lock:
          interrupts.depth += 1
          try:
            try:
              new, out = exe((slot.leaves,), *args)
            except ARG_MISMATCH:
              new, out = exe((slot.leaves,), *conform(args))
            except RuntimeError as exc:
              raise failure(exc, args)
            slot.leaves = new[0]
          finally:
            interrupts.depth -= 1
            if interrupts.pending and not interrupts.depth:
              interrupts.deliver()
        return out
      return call

    def call(args):
      with lock:
        interrupts.depth += 1
        try:
          current = tuple([slot.leaves for slot in slots])
          try:
            new, out = exe(current, *args)
          except ARG_MISMATCH:
            new, out = exe(current, *conform(args))
          except RuntimeError as exc:
            raise failure(exc, args)
          for slot, leaves in zip(slots, new):
            slot.leaves = leaves
        finally:
          interrupts.depth -= 1
          if interrupts.pending and not interrupts.depth:
            interrupts.deliver()
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
  """Several partitions: the Program written out as straight-line Python
  (codegen.py), values deleted at their last use.

  Device executables are launched through their C++ call; the first one
  checks the user leaves it reads itself (a mismatch is conformed and
  retried before anything ran), the others are conformed up front.
  `observer(partition index)`, when set, is called after each partition
  (tests sample live memory there); unset, it costs nothing. A profiled
  runner runs the plan's profiled variant (and no observer)."""
  _PROFILED = ("call", "plan")

  def __init__(self, graph, program, spec, rest_tree, layout):
    super().__init__(layout, spec)
    self.program = program
    self.rest_tree = rest_tree
    self.observer = None
    self.plan = codegen.generate(program, spec.conform_leaf)
    self._observed = None
    self.treedefs = list(spec.treedefs)
    leaf = tree_util.tree_structure(0)
    self._bare = [treedef == leaf for treedef in self.treedefs]
    self._literal_outputs = {i for i, v in enumerate(graph.outputs) if isinstance(v, Literal)}
    self._plain_outputs = not (program.copy_at or program.host_outputs
                               or self._literal_outputs)
    self._single_output = rest_tree == leaf  # run returns it bare
    self._all_bare = all(self._bare)
    keep = [(i, layout.state_shardings[i]) for i in layout.updated_idx
            if layout.state_shardings[i] is not None]
    self._keep = keep or None
    if not layout.slots:
      self.call = self._stateless_call

  def _profile_paths(self, hooks):
    self.plan = hooks.plan(self.program, self.spec.conform_leaf)

  def user_leaves(self, args):
    """The flat user leaves, the pytree structure checked; leaves that no
    executable checks first are conformed here."""
    if len(args) != len(self.treedefs):
      self.spec.check_arity(args)
    leaves = []
    for arg, treedef, bare in zip(args, self.treedefs, self._bare):
      if bare and isinstance(arg, jax.Array):
        leaves.append(arg)
        continue
      flat, got = tree_util.tree_flatten(arg)
      if got != treedef:
        self.spec.conform(args)  # raises InputError naming the argument
      leaves.extend(flat)
    if self.program.user_checked:
      base = self.program.num_state
      for reg, i, j in self.program.user_checked:
        leaves[reg - base] = self.spec.conform_leaf(i, j, leaves[reg - base])
    return leaves

  def run_flat(self, state_leaves, user_leaves):
    if self.observer is None:
      outs = self.plan(state_leaves, user_leaves, None)
    else:
      if self._observed is None:
        self._observed = codegen.generate(self.program, self.spec.conform_leaf, True)
      outs = self._observed(state_leaves, user_leaves, self.observer)
    if self._keep is not None:  # new state made on the host, laid out as its slot
      outs = list(outs)
      for i, s in self._keep:
        if getattr(outs[i], "sharding", None) != s:
          outs[i] = jax.device_put(outs[i], s)
    if self._plain_outputs:
      return outs
    return [self._output(k, out) for k, out in enumerate(outs)]

  def _output(self, k, out):
    if k in self._literal_outputs:
      return jax.numpy.asarray(out)  # a fresh array per run, as jax.jit returns
    if k in self.program.host_outputs:  # made on the host: stays there, a copy of
      # the callback's buffer, which the callback may reuse (jax.jit copies too)
      # device_put may read its source after it returns: give it a private copy
      return jax.device_put(np.array(out), jax.local_devices(backend="cpu")[0])
    return jax.numpy.array(out, copy=True) if k in self.program.copy_at else out

  def step_once(self, state_leaves, args):
    """One run on the given state leaves; returns (new values of the updated
    leaves, user outputs) without committing anything."""
    outs = self.run_flat(state_leaves, self.user_leaves(args))
    return ([outs[i] for i in self.layout.updated_idx],
            tree_util.tree_unflatten(self.rest_tree, outs[self.layout.num_outputs:]))

  def execute(self, args):
    return self.step_once(self.layout.gather_all(), args)

  def _stateless_call(self, args):
    """call for a graph without state: no locks, nothing to commit."""
    if self._all_bare and len(args) == len(self._bare):
      for arg in args:  # the usual call: array arguments, nothing to flatten
        if not isinstance(arg, jax.Array):
          leaves = self.user_leaves(args)
          break
      else:
        leaves = self.user_leaves(args) if self.program.user_checked else list(args)
    else:
      leaves = self.user_leaves(args)
    outs = self.run_flat([], leaves)
    if self._single_output:
      return outs[-1]
    return tree_util.tree_unflatten(self.rest_tree, outs)

  def call(self, args):
    """Runner.call with execute and step_once inlined: run's hot path."""
    layout = self.layout
    with self.lock:
      interrupts.depth += 1
      try:
        outs = self.run_flat(layout.gather_all(), self.user_leaves(args))
        if layout.updated_idx:
          layout.commit([outs[i] for i in layout.updated_idx])
      finally:
        interrupts.depth -= 1
        if interrupts.pending and not interrupts.depth:
          interrupts.deliver()
    if self._single_output:
      return outs[-1]
    return tree_util.tree_unflatten(self.rest_tree, outs[layout.num_outputs:])
