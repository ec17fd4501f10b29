"""Build: each device partition -> one compiled XLA executable; each host node
-> a host function; the whole plan -> a `Program` the executor runs.

Nothing here runs op by op in steady state, and nothing here runs user code:
executables are compiled ahead of time for exactly the argument types of the
graph. Everything the executor needs per run is decided here, once: every
value gets a register, every op the registers it reads and writes and those
to clear after it (the values' last uses), each executable the intermediates
donated to it, each output whether it must be copied.
"""
import dataclasses
from typing import Any, Callable, List, Tuple

import jax
import numpy as np

from jaxsession.jax_api import placed, real_jit, transfer_refused
from jaxsession.graph import liveness
from jaxsession.errors import HostOpError
from jaxsession.graph.ir import Literal, aval_str
from jaxsession.graph.lowering import const_input, kernel_fn, lower_nodes
from jaxsession.graph.op_properties import is_transfer
from jaxsession.runtime import callbacks
from jaxsession.runtime.dispatch import fast_call
from jaxsession.runtime.fingerprint import executable_key
from jaxsession.runtime.state import private_copy

try:  # what an executable's output check raises under jax_debug_nans/infs
  from jax._src.api_util import InternalFloatingPointError as SPECIAL_VALUE
except ImportError:  # an internal API: jax raises FloatingPointError itself
  SPECIAL_VALUE = FloatingPointError

# What an AOT executable's call raises for arguments that do not fit (type,
# Python int range, device): raised before it runs or consumes anything.
ARG_MISMATCH = (TypeError, OverflowError, ValueError)


def shape_struct(aval, sharding=None):
  """The ShapeDtypeStruct an executable is compiled for (weak type kept;
  under a mesh, the value's NamedSharding)."""
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding,
                              weak_type=getattr(aval, "weak_type", False))


def compile_fn(fn, arg_structs, donate_argnums=(), compiler_options=None, out_shardings=None,
               rewrite=None):
  """jit + lower + compile, ahead of time, for exactly these argument types.
  Its call checks the argument types before it runs or consumes anything.
  `out_shardings` (a prefix of fn's outputs, None where XLA chooses): the
  layouts outputs must have - jit's own out_shardings, never a
  with_sharding_constraint, which XLA partitions otherwise (other bits than
  jax.jit with the same out_shardings: tests/spmd_test.py, ZeRO-1).
  `rewrite(closed_jaxpr, out_tree)` (runtime/horizontal.py's Rewrite), when
  given, sees fn as traced and returns the function to trace in its place,
  or None to lower fn's trace as it is. (Through the compile cache:
  `compile_recorded`.)"""
  def traced(f):
    jitted = real_jit(f, donate_argnums=donate_argnums) if out_shardings is None else \
        real_jit(f, donate_argnums=donate_argnums, out_shardings=out_shardings)
    return jitted.trace(*arg_structs)

  def compile_now():
    step = traced(fn)
    if rewrite is not None:
      replacement = rewrite(step.jaxpr, step.out_tree)
      if replacement is not None:  # named as fn: the name names the executable
        replacement.__name__ = replacement.__qualname__ = getattr(fn, "__name__", "step")
        step = traced(replacement)
    return step.lower().compile(compiler_options=compiler_options or None)
  return compile_now()


def named(fn, name):
  """`fn` named `name` (the user's function's, the graph's): jax names the
  executable, its HLO's op names (jit(train_step)/...) and its errors after
  the traced function, as under jax.jit (they named the session's own)."""
  fn.__name__ = fn.__qualname__ = name or "step"
  return fn


def out_structs(exe):
  """A compiled executable's outputs as ShapeDtypeStructs, weak types and
  layouts kept, in the pytree it returns them in. (Compiled.out_info drops
  the weak types, and raises for an executable with ordered effects.)"""
  try:
    avals = exe._executable.out_avals  # pylint: disable=protected-access
  except AttributeError:  # an internal API: out_info, weak types lost
    return exe.out_info
  shardings = jax.tree_util.tree_leaves(exe.output_shardings)
  return jax.tree_util.tree_unflatten(exe.out_tree, [
      jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type, sharding=s)
      for a, s in zip(avals, shardings)])


def compile_recorded(fn, recorder, arg_structs, donate_argnums=(), cache=None, key=None,
                     compiler_options=None, out_shardings=None, rewrite=None):
  """(executable, recorder, notes) for `fn`, whose callbacks leave their
  exceptions in `recorder` (a callbacks.ErrorRecorder). A cached executable
  keeps calling the callbacks it was compiled with, so the recorder is cached
  with it: on a hit, this returns the recorder that executable writes to,
  which the runner must read instead of its own. `notes`: what `rewrite`
  (compile_fn's) wrote on its `notes`, cached alike. With `cache` (a
  compile_cache.ExecutableCache or RecordingCache) and `key` (the graph's
  fingerprint and which of its executables this is), it is looked up under
  `key` + the argument types + the donation before anything is traced, and
  stored after a compile."""
  def compile_now():
    exe = compile_fn(fn, arg_structs, donate_argnums, compiler_options=compiler_options,
                     out_shardings=out_shardings, rewrite=rewrite)
    return exe, recorder, tuple(getattr(rewrite, "notes", ()))
  if cache is None or key is None:
    return compile_now()
  key = (*key, "recorded") if isinstance(key, tuple) else (key, "recorded")
  value, _ = cache.get_or_compile(executable_key(key, arg_structs, donate_argnums),
                                  compile_now)
  return value


def recovery(call, conform, failure=None):
  """recover(exc, lead, args): what a refused or failed `call(*lead, *args)`
  becomes. An executable's call checks its arguments before it runs or
  consumes anything; a call it refused (ARG_MISMATCH) is retried once with
  conform(args), which converts what converts exactly (Python scalars, an
  array on another device) and raises InputError naming what does not fit.
  `failure(exc, lead, args)`, when given, is the error to raise for a
  RuntimeError of the call, or for a nan (inf) that jax_debug_nans (infs)
  found in its outputs (jax raises its private InternalFloatingPointError).
  `RECOVERABLE` is what it handles. Every executable call that can be
  refused recovers through here: wrapped by `checked`, or caught where the
  call is made (Runner.call, which then needs no frame of its own)."""
  def recover(exc, lead, args):
    if isinstance(exc, ARG_MISMATCH):
      args = conform(args)
      try:  # the retry fails as the first call would have: through `failure`
        return call(*lead, *args)
      except RECOVERABLE as again:
        if failure is None or isinstance(again, ARG_MISMATCH):
          raise
        raise failure(again, lead, args) from again
    if failure is None:
      raise exc
    raise failure(exc, lead, args)
  return recover


RECOVERABLE = (*ARG_MISMATCH, RuntimeError, SPECIAL_VALUE)


def h2d_refused_before_run(leaves):
  """Under a transfer guard that refuses implicit host-to-device transfers,
  a host value among a plan's user leaves (numpy, a Python scalar) is
  refused before any op runs, by the implicit transfer jax.jit makes of it
  before its executable runs: the plan would hand it to a host op with no
  transfer, or transfer it after a callback ran. One config read otherwise,
  on the path of arguments that are not all jax.Arrays."""
  guard = jax.config.jax_transfer_guard_host_to_device or jax.config.jax_transfer_guard
  if guard in ("disallow", "disallow_explicit"):
    for x in leaves:
      if not isinstance(x, jax.Array):
        jax.numpy.asarray(x)  # raises jax's own error, as jax.jit does


def moved_on_refusal(fn, positions, shardings):
  """retry(exc, *args) for an executable `fn` whose arguments at `positions`
  are host partitions' results: where a transfer guard refused their
  implicit transfer, they are moved explicitly (the placement's transfer,
  which jax.jit makes inside its executable, past the guard) and `fn` runs
  again; the user's own arguments still pass the guard as they come. Any
  other error is raised as it is. Written in the plan's `except` clause, so
  a run the guard lets through pays nothing (runtime/codegen.py)."""
  def retry(exc, *args):
    if not transfer_refused(exc):
      raise exc
    args = list(args)
    for i in positions:
      args[i] = placed(args[i], None if shardings is None else shardings[i])
    return fn(*args)
  return retry


def checked(call, conform, failure=None):
  """fn(lead, args) -> call(*lead, *args), recovering (see `recovery`)."""
  recover = recovery(call, conform, failure)

  def run(lead, args):
    try:
      return call(*lead, *args)
    except RECOVERABLE as exc:
      return recover(exc, lead, args)
  return run


@dataclasses.dataclass
class Op:
  """One step of a Program: fn(*registers[ins]) -> values for registers[outs]."""
  fn: Callable
  ins: Tuple[int, ...]
  outs: Tuple[int, ...]
  frees: Tuple[int, ...] = ()
  prefetch: Tuple[int, ...] = ()   # registers to start copying to the host
  partition: int = 0
  error: Callable = None           # host ops: exc -> the HostOpError to raise
  transfer: int = None             # a transfer node's id, where the op runs one
  host_ins: Tuple[int, ...] = ()   # device ops: the positions of ins a host op made
  in_shardings: tuple = ()         # device ops: the layout each of ins is taken in
  node: Any = None                 # host ops: the node it runs


@dataclasses.dataclass
class Program:
  """A built plan. Registers: state leaves, then user leaves, then constants
  and literals (prefilled in `template`), then every other value."""
  ops: List[Op]
  template: list
  num_state: int
  num_user: int
  outputs: List[int]           # the register of each graph output
  copy_at: frozenset           # outputs to copy (a graph input, or repeated)
  host_outputs: frozenset      # outputs made on the host (returned as CPU arrays)
  user_checked: List[Tuple]    # (register, arg, leaf) conformed before the run
  analyses: dict               # partition index -> compiled.memory_analysis()
  executables: dict = dataclasses.field(default_factory=dict)  # partition index -> exe
  run: Callable = None         # fn(*state, *args) -> (new state leaves, user outputs)
                               # (the user outputs alone where `bare`)
  recoverable: tuple = ()      # what run may raise that `recover` handles
  recover: Callable = None     # fn(exc, state, args): a refused run retried, or its error
  run_flat: Callable = None    # a plan's: fn(state leaves, user leaves) -> outputs
  bare: bool = False           # run returns the user outputs alone (no state)
  recorders: tuple = ()        # its executables' callbacks.ErrorRecorders

  def call(self, state, args):
    """run(*state, *args), a refusal or failure recovered: for a caller other
    than Runner.call, whose closure does the same inline."""
    try:
      return self.run(*state, *args)
    except self.recoverable as exc:
      return self.recover(exc, state, args)


def host_op(node):
  """(fn, error) for one host node: fn runs its kernel on arrays and checks
  the results against the node's avals (a kernel with a `prepare` form
  checks them itself); error(exc) is the HostOpError naming the node that
  the executor raises from whatever fn raised."""
  kernel = kernel_fn(node)
  prepare = getattr(kernel, "prepare", None)

  def error(exc):
    return HostOpError(f"host kernel {node.kernel.name} of {callbacks.where(node)} "
                       f"raised {type(exc).__name__}: {exc}")
  if prepare is not None:
    return prepare(node), error
  avals = [(tuple(o.aval.shape), o.aval.dtype) for o in node.outputs]

  def run_host(*arrays):
    outs = kernel(node, *arrays)
    if len(outs) != len(avals):
      raise TypeError(f"returned {len(outs)} results for {len(avals)} outputs")
    for i, (out, (shape, dtype)) in enumerate(zip(outs, avals)):
      if getattr(out, "shape", None) != shape or getattr(out, "dtype", None) != dtype:
        raise TypeError(f"result {i} is {getattr(out, 'dtype', None)}"
                        f"{list(np.shape(out))}, the node's output is "
                        f"{aval_str(node.outputs[i].aval)}")
    return outs
  return run_host, error


# host kernels that run the user's code, which may keep the arrays it is given
USER_CODE = frozenset({"pure_callback", "jit"})


def fresh_arguments(fn, positions):
  """`fn`, given its own copies of the arrays at `positions`. A callback
  may keep what it gets (a history, a snapshot of the parameters), as it
  may under jax.jit, whose callbacks get arrays of their own; these are the
  state's buffers, which the update of this run or a later one (of any
  graph sharing them) takes over, deleting them under the callback (a
  break-it find). A device value read on the host is never donated
  (memory.py), so nothing else needs a copy."""
  def run(*args):
    args = list(args)
    for i in positions:
      if isinstance(args[i], jax.Array):
        args[i] = private_copy(args[i])
    return fn(*args)
  return run


def device_inputs(part):
  """The values a device partition takes as arguments: its inputs but the
  graph's consts, which its executable embeds. A host value read through a
  transfer_h2d node is passed as it is: the call copies it to the device."""
  return [v for v in part.inputs if v.kind != "const"]


def _arg_struct(value, layouts=None):
  """The struct a partition input is compiled for; under a mesh with its
  layout (`layouts`: value id -> sharding; host values come replicated)."""
  sharding = None if layouts is None else layouts.get(value.id)
  if value.producer is not None and value.producer.place == "host":
    return jax.ShapeDtypeStruct(value.aval.shape, value.aval.dtype,  # numpy: never weak
                                sharding=sharding)
  return shape_struct(value.aval, sharding)


def waited(call):
  """`call`, then a wait for its outputs. A callback inside an executable
  runs when the executable does: with inputs still in flight (an argument
  moved from another device) that is after the call returned, and the
  callback's failure would show only where the outputs are read - after a
  stateful run committed them as the state (measured: 17 of 30 runs under
  load). So where the graph has state, its partitions with callbacks are
  waited for; the state they read is not donated (memory.py), and a failure
  leaves it as it was. A stateless graph is not waited for: it returns as
  jax.jit's call does, and its callback's failure is jax's JaxRuntimeError
  where the output is read (waiting lost the asynchronous dispatch, and a
  callback waiting on what the caller does after the call deadlocked: a
  review's find)."""
  def run(*args):
    outs = call(*args)
    jax.block_until_ready(outs)
    return outs
  return run


def build_device_step(part, donated_ids, consts, cache=None, key=None, layouts=None,
                      fixed=None, compiler_options=None, wait=False, name=None):
  """Compiles one device partition with the values donated to it; returns
  (the call, the compiled executable). A failing callback inside it raises
  HostOpError with the user's exception as the cause (with `wait`, before
  the call returns: `waited`). With `cache` and `key` (the graph's
  fingerprint), the executable is looked up first under (key, "partition",
  index)."""
  recorder = callbacks.ErrorRecorder()
  inputs = device_inputs(part)
  body = lower_nodes(callbacks.instrumented(part.nodes, recorder), inputs,
                     part.outputs + part.witnesses,  # (the witnesses: returned, dropped)
                     {v.id: consts[v.id] for v in part.inputs if v.kind == "const"})
  donate = tuple(i for i, v in enumerate(inputs) if v.id in donated_ids)
  # outputs whose layout is fixed (new state under a mesh) keep it, so the
  # slot keeps its layout and is donated in place
  out_shardings = [fixed.get(v.id) for v in part.outputs + part.witnesses] if fixed else None
  exe, recorder, _ = compile_recorded(named(lambda *xs: body(*xs), name), recorder,
                                   [_arg_struct(v, layouts) for v in inputs], donate, cache,
                                   None if key is None else (key, "partition", part.index),
                                   compiler_options, out_shardings)
  call = fast_call(exe)
  if not part.may_fail:
    return call, exe, recorder
  if wait:  # a stateful graph: the failure before the commit (waited)
    call = waited(call)

  def run_device(*arrays):
    try:
      return call(*arrays)
    except jax.errors.JaxRuntimeError as exc:
      if transfer_refused(exc):  # nothing ran: the plan moves its inputs (moved_on_refusal)
        raise
      raise callbacks.callback_failure(part.nodes, part.index, exc, recorder)
  return run_device, exe, recorder


def build_program(graph, partitions, plan, spec, platform, cache=None, key=None, hooks=None):
  """The Program for a multi-partition graph (its `run` is the executor's).
  On the CPU platform a device->host transfer is no op at all: its value
  shares the register of the device value (the device buffer is host
  memory). `cache` and `key` (the graph's fingerprint): see
  build_device_step. `hooks` (a profiler's GraphHooks): each op's function
  is wrapped in its timing, once, here."""
  regs, template = {}, []

  def register(value, fill=None):
    regs[value.id] = len(template)
    template.append(fill)
    return regs[value.id]

  for value in graph.inputs_of_kind("state") + graph.inputs_of_kind("input"):
    register(value)
  for value in graph.inputs_of_kind("const"):
    register(value, const_input(graph.const_values[value.id], value.aval))
  user_leaf = {}  # register -> (arg, leaf)
  num_state = len(graph.inputs_of_kind("state"))
  flat = [(i, j) for i, avals in enumerate(spec.avals) for j in range(len(avals))]
  for k, ij in enumerate(flat):
    user_leaf[num_state + k] = ij

  literals = {}  # id(literal) -> register

  def reg_of(value):
    if isinstance(value, Literal):
      if id(value) not in literals:
        literals[id(value)] = len(template)
        template.append(np.asarray(value.value, value.aval.dtype))
      return literals[id(value)]
    return regs[value.id] if value.id in regs else register(value)

  ops, analyses, executables, recorders = [], {}, {}, []
  layouts, fixed = _mesh_layouts(graph)
  for part in partitions:
    if part.place == "device":
      fn, exe, recorder = build_device_step(
          part, plan.donated_to(part.index), graph.const_values, cache, key, layouts, fixed,
          graph.compiler_options, wait=bool(graph.inputs_of_kind("state")),
          name=f"{graph.name}_partition{part.index}")
      recorders.append(recorder)
      if layouts is not None:  # later partitions take these values as laid out here
        layouts.update((v.id, s) for v, s in zip(
            part.outputs, jax.tree_util.tree_leaves(exe.output_shardings)))
      analyses[part.index] = memory_analysis(exe)
      executables[part.index] = exe
      inputs = device_inputs(part)
      # a register each witness is written to, never read (cleared at once)
      dropped = tuple(range(len(template), len(template) + len(part.witnesses)))
      template.extend([None] * len(part.witnesses))
      ops.append(Op(fn, tuple(reg_of(v) for v in inputs),
                    tuple(reg_of(v) for v in part.outputs) + dropped,
                    prefetch=tuple(reg_of(v) for v in part.prefetch), partition=part.index,
                    host_ins=tuple(i for i, v in enumerate(inputs) if v.producer is not None
                                   and v.producer.place == "host"),
                    in_shardings=_input_shardings(exe)))
      continue
    for node in part.nodes:
      if is_transfer(node.op, "d2h") and platform == "cpu" and layouts is None:
        regs[node.outputs[0].id] = reg_of(node.inputs[0])  # the same buffer: no op
        continue  # (under a mesh the value is gathered onto one device: the kernel)
      ins = tuple(reg_of(v) for v in node.inputs)
      fn, error = host_op(node)
      ops.append(Op(fn, ins, tuple(reg_of(v) for v in node.outputs), partition=part.index,
                    error=error, transfer=node.id if is_transfer(node.op) else None,
                    node=node))
  outputs = [reg_of(v) for v in graph.outputs]
  _set_frees(ops, outputs)
  for op in ops:  # the state's buffers, which an update takes over (donated)
    if op.node is not None and op.node.op in USER_CODE:
      fresh = tuple(i for i, r in enumerate(op.ins) if r < num_state)
      if fresh:
        op.fn = fresh_arguments(op.fn, fresh)
        note = (f"argument(s) {list(fresh)} given to the user's code as copies each run: "
                "the state's own buffers, which an update takes over (donated)")
        if note not in op.node.notes:
          op.node.notes.append(note)
  copy_at, seen = set(), set()
  # a state leaf returned as it came stays in its slot: nothing to copy
  passed = set(graph.passed_state())
  for i, value in enumerate(graph.outputs):
    if isinstance(value, Literal) or i in passed:
      continue
    if value.producer is None or value.id in seen:
      copy_at.add(i)
    seen.add(value.id)
  host_outputs = {i for i, v in enumerate(graph.outputs)
                  if not isinstance(v, Literal) and v.producer is not None
                  and v.producer.place == "host" and not is_transfer(v.producer.op, "h2d")}
  # The first op, an executable, checks the user leaves it reads before it
  # runs or consumes anything (a refusal reruns the plan on conformed
  # leaves: executor.plan_program); every other leaf is conformed before the
  # run (host ops would take it as it comes, a later executable would refuse
  # it after work was done, and a leaf nothing reads would pass unchecked,
  # where one executable's own check refuses it).
  first = set(ops[0].ins) if ops and partitions[0].place == "device" else set()
  checked = sorted(r for r in user_leaf if r not in first)
  if hooks is not None:
    for k, op in enumerate(ops):
      op.fn = hooks.timed(op.fn, op.partition,
                          first=k == 0 or ops[k - 1].partition != op.partition,
                          last=k + 1 == len(ops) or ops[k + 1].partition != op.partition,
                          device=op.error is None, transfer=op.transfer)
  return Program(ops, template, num_state, len(flat), outputs, frozenset(copy_at),
                 frozenset(host_outputs), [(r,) + user_leaf[r] for r in checked], analyses,
                 executables, recorders=tuple(recorders))


def _mesh_layouts(graph):
  """Under a mesh: (value id -> layout of every value a partition reads,
  value id -> layout a new state value must keep); (None, None) without.
  Graph inputs carry theirs; a host value reaches an executable replicated;
  a device partition's outputs are laid out as its executable returns them
  (filled in as partitions are compiled, in order)."""
  if graph.mesh is None:
    return None, None
  replicated = jax.sharding.NamedSharding(graph.mesh, jax.sharding.PartitionSpec())
  layouts = {v.id: v.sharding for v in graph.inputs if v.sharding is not None}
  for node in graph.nodes:
    if node.place == "host":
      for o in node.outputs:  # written on the value too, for dump()
        layouts[o.id] = o.sharding = replicated
  states = graph.inputs_of_kind("state")
  fixed = {new.id: state.sharding for state, new in zip(states, graph.outputs)
           if not isinstance(new, Literal) and new is not state and state.sharding is not None}
  return layouts, fixed


def _set_frees(ops, outputs):
  """Each register is cleared after the last op that reads it, unless it is a
  graph output (the value is then held only as long as something needs it);
  one made but never read is cleared right away (session/graph/liveness.py)."""
  frees = liveness.analyze(((op.ins, op.outs) for op in ops), keep=outputs).frees()
  for op, free in zip(ops, frees):
    op.frees = tuple(free)


def _input_shardings(exe):
  """The layout each argument of `exe` is taken in; None where this jax
  cannot say (a moved host value then goes to the default device)."""
  try:
    return tuple(exe.input_shardings[0])
  except Exception:  # pylint: disable=broad-except
    return None


def memory_analysis(exe):
  try:
    return exe.memory_analysis()
  except Exception:  # a backend without it: the session's estimate stands
    return None
