"""The executor: one path for every run.

    Runner.call(args):  lock -> gather the state -> run the program -> commit

A program (runtime/build.py's Program, its `run`) is fn(*state, *args) ->
(new values of the updated state leaves, user outputs). Build makes it:
  * one device partition: one Op, the executable - `exe(*state, *args)`;
  * several partitions: its Ops written out as straight-line Python
    (codegen.py) over registers, values freed at their last use;
  * run(steps=N) (loop_sink.py): the single executable's steps scanned in
    one executable, or a plan run N times on private copies of the leaves.
The state goes in and comes back in its layout's form
(runtime/state_layout.py). The commit writes the slots only after the whole
program succeeded, so a failed call leaves the state as it was; a Ctrl-C in
between waits for the commit (runtime/interrupts.py).
"""
import threading

import jax
import numpy as np
from jax import tree_util

from jaxsession.graph import settings
from jaxsession.graph.ir import Literal
from jaxsession.graph.lowering import (graph_consts, interpret, kernel_fn, lower_nodes,
                                       read_literal)
from jaxsession.jax_api import ARRAY, placed
from jaxsession.runtime import (bitwise, callbacks, codegen, debug_flags, horizontal, interrupts,
                                sharding)
from jaxsession.runtime.build import (RECOVERABLE, SPECIAL_VALUE, Op, Program, checked,
                                      compile_recorded, h2d_refused_before_run, host_op,
                                      memory_analysis, named, recovery, waited)
from jaxsession.runtime.dispatch import fast_call
from jaxsession.runtime.state import (done_running, private_copy, refuse_reentry,
                                      running_user_code, slots_lock, with_weak_type)
from jaxsession.runtime.state_layout import kept_layouts
from jaxsession.runtime import specials

_pending = interrupts.pending
def _private(state):
  """Copies of the state leaves (layouts kept), for a run whose executables
  donate them while jax_debug_nans/infs may raise after they consumed them:
  the slots keep their own buffers, whatever the run raises (copied without
  a computation, which the flags would check: a nan already in the state is
  the run's to report)."""
  return jax.tree.map(private_copy, state)

def arg_structs(spec, leading=None):
  """ShapeDtypeStruct pytrees for the run arguments (optionally with a leading
  steps axis: `leading` as ArgSpec.conform takes it), with their shardings
  under a mesh."""
  out = []
  for i, (treedef, avals) in enumerate(zip(spec.treedefs, spec.avals)):
    steps = per_arg(leading, len(spec.avals))[i]
    lead = () if steps is None else (steps,)
    shardings = spec.shardings[i] if spec.shardings else [None] * len(avals)
    if steps is not None:
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

  def step(state, args):
    outs = body(*state, *tree_util.tree_leaves(args))
    new = [outs[i] for i in layout.updated_idx]
    return new, tree_util.tree_unflatten(rest_tree, outs[k:])
  return step


def per_arg(leading, n):
  """`leading` - steps on every run argument's new first axis, or a tuple of
  one steps-or-None per argument (run's in_axes) - as that tuple of n."""
  return leading if isinstance(leading, tuple) else (leading,) * n


def leaf_steps(spec, leading):
  """Per flat run leaf: whether it carries the steps (`leading` as
  ArgSpec.conform takes it)."""
  lead = per_arg(leading, len(spec.avals))
  return [lead[i] is not None for i, avals in enumerate(spec.avals) for _ in avals]


def executable_program(exe, recorder, graph, layout, spec, hooks=None, leading=None,
                       steps=None):
  """The Program of one executable that takes (*state, *args) in the
  layout's form - a single-partition graph, or its loop-sunk steps
  (`leading`: the steps; a refused call conformed with them) - with its one Op. Its run is
  the executable's own call: Runner.call recovers a refusal or failure
  (`recover`), so a run pays no Python frame of the program's."""
  call = fast_call(exe)
  partition = graph.partitions[0] if graph.partitions else None
  if partition is not None and partition.may_fail and layout.slots:
    call = waited(call)  # a callback's failure before the state is committed
  if hooks is not None:  # all the steps of a sunk run: one partition event
    call = hooks.timed(call, 0, first=True, last=True, device=True)
  def conform(args):
    return spec.conform(args, leading=leading)

  def failure(exc, state, args):
    if isinstance(exc, SPECIAL_VALUE):
      return specials.special_value(spec.where, graph, layout, tree_util.tree_leaves(args), exc,
                           None if leading is None else (steps, leaf_steps(spec, leading)))
    if not isinstance(exc, jax.errors.JaxRuntimeError):
      conform(args)  # a deleted argument, refused before running: InputError naming it
      return exc
    return runtime_failure(partition, recorder, exc)
  op = Op(call, (), (), partition=0)
  program = Program([op], [], 0, 0, [], frozenset(), frozenset(), [],
                    {0: memory_analysis(exe)}, {0: exe}, call, RECOVERABLE,
                    recovery(call, conform, failure), recorders=(recorder,))
  return program


def single_program(graph, spec, rest_tree, layout, cache=None, key=None, hooks=None):
  """A graph that is one device partition: one ahead-of-time compiled
  executable, whose own argument check runs before it runs or consumes
  anything (no warm-up, no tracing at run time, never a recompile). `cache`
  and `key` (the graph's fingerprint, runtime/fingerprint.py): the
  executable is looked up before it is traced; the key adds the output
  pytree and the state layout, which shape it beyond the graph."""
  recorder = callbacks.ErrorRecorder()
  step = graph_body(graph, layout, rest_tree, recorder)
  n = len(layout.structs())
  # no state: the executable returns the user outputs alone, not beside an
  # empty state tuple (~0.8 µs a call less here: benchmarks/dispatch.py)
  bare = not layout.slots
  if key is not None:
    key = (key, "single", rest_tree, layout.key(), bare)

  def whole_step(*xs):
    new, out = step(layout.leaves_of(xs[:n]), xs[n:])
    return out if bare else (layout.returned(new, xs[:n]), out)
  # packed write-backs fused horizontally (not under a mesh: laid out per leaf)
  packed = [] if bare or any(s is not None for s in layout.state_shardings) else \
      layout.packed_returns()
  exe, recorder, notes = compile_recorded(
      named(whole_step, graph.name), recorder, (*layout.structs(), *arg_structs(spec)),
      layout.donate_argnums(), cache, key, graph.compiler_options,
      None if bare else kept_layouts(layout),
      horizontal.Rewrite(packed) if packed else None)
  graph.memory.horizontal = list(notes)
  program = executable_program(exe, recorder, graph, layout, spec, hooks)
  program.bare = bare
  return program


def plan_program(graph, program, spec, rest_tree, layout):
  """Sets `program.run` (and `run_flat`, the loop sink's step) of a built
  multi-partition Program: the user leaves flattened (the structure
  checked, the leaves no executable checks first conformed), the plan
  (codegen.py), the outputs as run returns them. A refusal by the first
  executable, before anything ran, reruns the plan on conformed leaves."""
  plan = codegen.generate(program)
  treedefs = list(spec.treedefs)
  leaf = tree_util.tree_structure(0)
  bare = [treedef == leaf for treedef in treedefs]
  all_bare = all(bare)
  flat_index = [(i, j) for i, avals in enumerate(spec.avals) for j in range(len(avals))]
  literal_outputs = {i: bool(getattr(v.aval, "weak_type", False))  # output -> its weak type
                     for i, v in enumerate(graph.outputs) if isinstance(v, Literal)}
  plain_outputs = not (program.copy_at or program.host_outputs or literal_outputs)
  copy_weak = {i: bool(getattr(graph.outputs[i].aval, "weak_type", False))
               for i in program.copy_at}
  keep = [(i, s) for i in layout.updated_idx
          if (s := _kept_layout(graph, layout, i)) is not None]
  base, user_checked = program.num_state, program.user_checked
  bare_run = not layout.slots  # Program.bare: run returns the user outputs alone
  updated, k, single_output = layout.updated_idx, layout.num_outputs, rest_tree == leaf

  def user_leaves(args):
    """The flat user leaves, the pytree structure checked."""
    spec.check_arity(args)
    leaves = []
    for arg, treedef in zip(args, treedefs):
      flat, got = tree_util.tree_flatten(arg)
      if got != treedef:
        spec.conform(args)  # raises InputError naming the argument
      leaves.extend(flat)
    for reg, i, j in user_checked:
      leaves[reg - base] = spec.conform_leaf(i, j, leaves[reg - base])
    h2d_refused_before_run(leaves)
    return leaves

  def conform_leaves(xs):
    return ([spec.conform_leaf(i, j, x) for (i, j), x in zip(flat_index, xs[0])],)

  def failure(exc, state, xs, replay=True):
    if isinstance(exc, SPECIAL_VALUE):
      return specials.special_value(spec.where, graph, layout, xs[0], exc) if replay else exc
    if not isinstance(exc, jax.errors.JaxRuntimeError):
      conform_leaves(xs)  # refused before running: InputError naming it
    return exc
  # run_flat: a step of a sunk run, which replays the whole run (a step's own
  # replay ran its callbacks once more: a break-it find)
  stepwise = checked(plan, conform_leaves, lambda exc, state, xs: failure(exc, state, xs, False))
  recover = recovery(plan, conform_leaves, failure)

  # a host-made output: a CPU array, on the graph's device where that is one
  # (jax.jit's callback result is in its executable's output there); under a
  # mesh replicated over it, as jax.jit returns it (a break-it find: on
  # device 0 alone, a sum with another output of the run failed)
  host = spec.device if spec.device.platform == "cpu" else jax.local_devices(backend="cpu")[0]
  if graph.mesh is not None:
    host = jax.sharding.NamedSharding(graph.mesh, jax.sharding.PartitionSpec())

  def output(n, out):
    if n in literal_outputs:
      # a fresh array per run, typed as jax.jit returns it (2.0: weak f32)
      if graph.mesh is not None:
        return with_weak_type(placed(np.asarray(out), host), literal_outputs[n])
      return with_weak_type(jax.numpy.asarray(out), literal_outputs[n])
    if n in program.host_outputs:  # made on the host: stays there, a copy of the
      # callback's buffer, which the callback may reuse (jax.jit copies too);
      # device_put may read its source after it returns: give it a private copy
      return placed(np.array(out), host)
    if n in program.copy_at:  # a graph input returned (a weak Python scalar conformed
      return with_weak_type(jax.numpy.array(out, copy=True), copy_weak[n])  # to an array)
    return out

  # outputs no executable made (a host op's, moved to the device or not)
  host_made = [n for n, v in enumerate(graph.outputs) if not isinstance(v, Literal)
               and v.producer is not None and v.producer.place == "host"]
  maybe_special, special_on = debug_flags.MAYBE, debug_flags.on

  def finish(outs, leaves, replay=True):
    if host_made and maybe_special[0] and special_on():
      _check_host_made(spec.where, graph, layout, leaves, outs, host_made, replay)
    if keep:  # new state made on the host, laid out as its slot
      outs = list(outs)
      for i, s in keep:
        if getattr(outs[i], "sharding", None) != s:
          outs[i] = placed(outs[i], s)
    if plain_outputs:
      return outs
    return [output(n, out) for n, out in enumerate(outs)]
  post = finish if keep or not plain_outputs or host_made else None
  if post is not None:  # its conversions as the plan's, under the x64 it was built under (a
    post = settings.as_built(post)  # host-made float64 output was narrowed: a review's find)

  def run_flat(state, leaves):
    outs = stepwise((state,), (leaves,))
    return outs if post is None else post(outs, leaves, False)

  def run(*xs):
    state, args = xs[:base], xs[base:]
    if all_bare and len(args) == len(bare):
      for arg in args:  # the usual call: array arguments, nothing to flatten
        if type(arg) is not ARRAY and not isinstance(arg, jax.Array):  # ARRAY: jax_api.py
          leaves = user_leaves(args)
          break
      else:
        leaves = list(args)
        for reg, i, j in user_checked:
          leaves[reg - base] = spec.conform_leaf(i, j, leaves[reg - base])
    else:
      leaves = user_leaves(args)
    try:  # checked(plan, ...), inlined: a frame less a run
      outs = plan(state, leaves)
    except RECOVERABLE as exc:
      outs = recover(exc, (state,), (leaves,))
    if post is not None:
      outs = post(outs, leaves)
    out = outs[-1] if single_output else tree_util.tree_unflatten(rest_tree, outs[k:])
    if bare_run:  # no state: the user outputs alone, as a bare executable returns them
      return out
    return tuple(map(outs.__getitem__, updated)) if updated else (), out
  program.run, program.run_flat = run, run_flat
  program.bare = bare_run
  if bare_run and all_bare and not user_checked and post is None and single_output and \
      ARRAY is not None:  # the usual stateless plan: the run generated with it (codegen)
    program.run = codegen.generate(program, direct=(
        run, lambda exc, user: recover(exc, ((),), (list(user),))[-1]))
  return program


def _check_host_made(where, graph, layout, leaves, outs, host_made, replay=True):
  """Under jax_debug_nans (infs): raises special_value's error (with
  `replay`, else unexplained: a sunk run's step) where an output a host op
  made (no executable's, which jax checks) holds a nan (inf), before
  anything is committed - jax.jit checks every output of its executable, a
  callback's result among them (a JAX test suite's find)."""
  for n in host_made:
    kind = debug_flags.special_in(outs[n])
    if kind is not None:
      found = specials.special(f"{where}: output {n}, made by a host op, holds {kind} "
                       f"(jax_debug_{kind}s); the state is unchanged", kind)
      raise specials.special_value(where, graph, layout, leaves, found) if replay else found


def _kept_layout(graph, layout, i):
  """The layout new state value i must have as it is committed, where the
  plan's output may not have it: under a mesh, its slot's; without one, a
  value made on the host (put on jax's default device at the call, maybe
  another one) goes to its slot's device. None: as the plan returns it."""
  if layout.state_shardings[i] is not None:
    return layout.state_shardings[i]
  new = graph.outputs[i]
  if not isinstance(new, Literal) and new.producer is not None and new.producer.place == "host":
    return jax.sharding.SingleDeviceSharding(layout.leaf_slots[i][0].device)
  return None


class Runner:
  """Runs one program of a graph against its state slots: `call(args)`, the
  one call path (`call_path`)."""

  def __init__(self, program, layout, where="run", user_code=False):
    self.program = program
    self.layout = layout
    self.lock = slots_lock(layout.slots)
    self.call = call_path(program, layout, self.lock, where, user_code)

  @property
  def exe(self):
    """The executable of a single-partition graph (None for a plan)."""
    return self.program.executables.get(0) if self.layout.one_executable else None


def call_path(program, layout, lock, where="run", user_code=False):
  """call(args): lock -> gather the state -> run the program -> commit -> the
  user outputs. A closure over what it reads (cells, not attribute lookups).
  A single executable's run is its own call, whose refusal or failure is
  recovered here (build.recovery): no Python frame of the program's.
  Under jax_debug_nans/infs the leaves the step returns as they came are
  checked before the commit, as jax.jit checks every output (`where` names
  the run in that error)."""
  run, recoverable, recover = program.run, program.recoverable, program.recover
  gather, commit = layout.gather, layout.commit
  acquire, release = lock.acquire, lock.release
  stateless, donates, bare = not layout.slots, bool(layout.donate_argnums()), program.bare
  maybe_special, special_on = debug_flags.MAYBE, debug_flags.on
  # WholeSlots of one slot, the usual training step: gather and commit inline
  one = layout.slots[0] if layout.whole and len(layout.slots) == 1 else None
  passed = layout.passed
  recorders = program.recorders

  if stateless:  # nothing to lock, gather, lose or commit: a Ctrl-C raises at once
    if bare:  # one executable, returning the user outputs alone
      def call(args):
        try:
          return run(*args)
        except recoverable as exc:
          return recover(exc, (), args)
    else:
      def call(args):
        try:
          return run(*args)[1]
        except recoverable as exc:
          return recover(exc, (), args)[1]
    return call

  getsignal, sigint, ours, lend, give_back, lent_by = (interrupts.getsignal, interrupts.SIGINT,
      interrupts.ours, interrupts.lend, interrupts.give_back, interrupts.lent_by)
  term, hup = interrupts.TERM, interrupts.HUP

  @interrupts.critical  # a Ctrl-C waits for the commit and the unlock
  def call(args):
    # ours for the user's SIGINT handler, before the lock (interrupts.lend)
    # (a Python handler on SIGTERM / SIGHUP is lent too: the defaults are ints)
    lending = (getsignal(sigint) is not ours[0] or callable(getsignal(term))
               or callable(getsignal(hup))) and lend()
    try:
      if not acquire(False):  # a lock's acquire/release: ~0.2 µs less a run than `with`
        refuse_reentry(lock, where)  # (a callback of this thread's run: never acquired)
        acquire()
      marked = None
      try:
        if user_code:  # its callbacks may call back into the session: on this
          marked = running_user_code(lock)  # thread, or on XLA's (the recorders')
          running = (lock, threading.get_ident())
          for recorder in recorders:
            recorder.running.append(running)
        special = maybe_special[0] and special_on()
        if donates and special:  # on after compile: the executables still donate,
          state = _private(gather())  # and jax raises after they consumed the state
        else:
          state = None if one else gather()
        if state is None:  # one slot's storage, one donated argument
          try:
            new, out = run((one.storage,), *args)
          except recoverable as exc:
            new, out = recover(exc, ((one.storage,),), args)
        else:
          try:
            new, out = run(*state, *args)
          except recoverable as exc:
            new, out = recover(exc, state, args)
        if special and passed:
          _check_passed(layout, where)
        if one:
          one.storage = new[0]
        else:
          commit(new)
      finally:
        if marked is not None:
          done_running(marked)
          for recorder in recorders:
            recorder.running.remove(running)
        release()
    finally:
      left_critical = True  # the commit and the unlock done (interrupts.critical)
      if lending or lent_by[0] is not None and interrupts.owed_by_caller():
        give_back()  # the user's handler back, then a Ctrl-C of the run raised by it
      if _pending:
        interrupts.deliver()
    return out
  return call


def _check_passed(layout, where):
  """Raises jax.jit's FloatingPointError for a nan (inf) in a state leaf the
  step returns as it came - an output of jax.jit, which checks it, but of
  no executable here - before the commit: the state stays as it was. Not
  under jax.disable_jit(), where jax.jit checks only what ops make."""
  if jax.config.jax_disable_jit:
    return
  with debug_flags.checks_off():  # a packed slot's leaves: slices, unchecked
    leaves = layout.leaves_of(layout.gather())
  error = specials.passed_special(where, layout, leaves)
  if error is not None:
    raise error


def eager_program(graph, spec, rest_tree, layout, steps=None, leading=None):
  """The Program that runs the graph op by op (each node's kernel bound
  eagerly), for runs under `jax.disable_jit()`, where jax.jit runs its
  function op by op too and an ahead-of-time executable refuses to run.
  Nothing is donated; `steps` runs that many steps on the stacked args
  (`leading`: which are stacked, as ArgSpec.conform takes it; default all)
  and commits once, as a sunk run does."""
  leading = steps if leading is None else leading
  consts = graph_consts(graph)
  in_ids = [v.id for v in graph.inputs if v.kind != "const"]
  k, n = layout.num_outputs, len(layout.structs())

  # a host node runs as the plan runs it (build.host_op: its results checked,
  # whatever it raises a HostOpError naming the node); the others eagerly
  hosts = {id(node): host_op(node) for node in graph.nodes if node.place == "host"}

  def call(node, args):
    host = hosts.get(id(node))
    if host is None:
      return kernel_fn(node)(node, *args)
    try:
      return host[0](*args)
    except Exception as exc:
      raise host[1](exc) from exc

  def one_step(leaves, user):
    env = dict(consts)
    env.update(zip(in_ids, [*leaves, *user]))
    read = lambda v: read_literal(v) if isinstance(v, Literal) else env[v.id]  # noqa: E731
    interpret(graph.nodes, env, call)
    # a host result (a transfer to the device is the value itself here) placed
    # as the plan's transfer places it: kept as numpy, an x64 graph's float64
    # new state was narrowed where it was next read with x64 off (a break-it find)
    return [placed(np.array(x)) if type(x) is np.ndarray else x
            for x in map(read, graph.outputs)]

  def run(*xs):
    leaves = layout.leaves_of(xs[:n])
    user = tree_util.tree_leaves(spec.conform(xs[n:], leading=leading))
    if steps is None:
      outs = one_step(leaves, user)
      return layout.returned([outs[i] for i in layout.updated_idx], xs[:n]), \
          tree_util.tree_unflatten(rest_tree, outs[k:])
    stacked_leaf = leaf_steps(spec, leading)
    per_step = []
    for t in range(steps):
      outs = one_step(leaves, [x[t] if s else x for x, s in zip(user, stacked_leaf)])
      for i in layout.updated_idx:
        leaves[i] = outs[i]
      per_step.append(outs[k:])
    stacked = [bitwise.stack(column) for column in zip(*per_step)]
    return layout.returned([leaves[i] for i in layout.updated_idx], xs[:n]), \
        tree_util.tree_unflatten(rest_tree, stacked)
  return Program([], [], 0, 0, [], frozenset(), frozenset(), [], {}, {}, run)


def runtime_failure(partition, recorder, exc):
  """A runtime error of a partition with callbacks is the callback's failure
  (HostOpError); any other runtime error stays what it is."""
  if partition is None or not partition.may_fail:
    return exc
  return callbacks.callback_failure(partition.nodes, partition.index, exc, recorder)
