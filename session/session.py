"""Session: compile a JAX function through the stage pipeline, then run it
step after step with its state resident on the device."""
import dataclasses
import time
from typing import Any, Dict, List

import jax
from jax import tree_util
from jax.extend import core as jcore

from jaxsession import importer, pipeline
from jaxsession.errors import InputError, UnknownGraphError
from jaxsession.inputs import ArgSpec, leaf_aval, paths_of
from jaxsession.ir import aval_str
from jaxsession.dump import GraphDumper
from jaxsession.optimizer_passes.base import PassContext
from jaxsession.options import SessionOptions
from jaxsession.report import CompileReport, PartitionInfo, count_kernels
from jaxsession.runtime import build, executor, loop_sink, memory
from jaxsession.runtime.state import StateSlot, check_matches, owned_copy


@dataclasses.dataclass
class _Entry:
  """A compiled graph and everything `run` needs."""
  name: str
  graph: Any
  report: CompileReport
  runner: Any
  spec: ArgSpec
  slots: List[StateSlot]
  make_sunk: Any            # steps -> runner
  sunk: Dict[int, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    self.call = self.runner.call  # run's hot path: one attribute, one call


def _as_tuple(nums, what, nargs):
  nums = (nums,) if isinstance(nums, int) else tuple(nums or ())
  for i in nums:
    if not isinstance(i, int) or not -nargs <= i < nargs:
      raise InputError(f"compile: {what} entry {i!r} is not a position of the "
                       f"{nargs} example arguments")
  return tuple(i % nargs for i in nums)


class Session:
  """A graph-mode session. See DESIGN.md for the contract:

      sess = Session()
      gid = sess.compile(train_step, params, opt_state, batch, state_argnums=(0, 1))
      loss = sess.run(gid, batch)
  """

  def __init__(self, options=None):
    self.options = options or SessionOptions()
    unknown = set(self.options.disabled_passes) - set(pipeline.optional_pass_names())
    if unknown:
      raise InputError(f"SessionOptions.disabled_passes: unknown pass(es) "
                       f"{sorted(unknown)}; passes that can be disabled: "
                       f"{pipeline.optional_pass_names()}")
    self.platform = self.options.platform or jax.default_backend()
    try:
      jax.devices(self.platform)
    except RuntimeError as exc:
      raise InputError(f"SessionOptions.platform={self.platform!r} is not available "
                       f"here: {exc}") from None
    self._graphs = {}

  # -- compile ------------------------------------------------------------
  def compile(self, fn, *example_args, state_argnums=(), static_argnums=(),
              state_from=None, name=None):
    """Traces `fn` on the example args, runs the pipeline, returns a graph id.

    `fn` returns a tuple whose first len(state_argnums) items are the new
    values of the state args; `run` returns the rest.
    """
    start = time.perf_counter()
    if isinstance(fn, jcore.ClosedJaxpr):
      fn = _closed_jaxpr_fn(fn)
    nargs = len(example_args)
    state_nums = _as_tuple(state_argnums, "state_argnums", nargs)
    static_nums = _as_tuple(static_argnums, "static_argnums", nargs)
    if set(state_nums) & set(static_nums):
      raise InputError(f"compile: positions {sorted(set(state_nums) & set(static_nums))} "
                       "are in both state_argnums and static_argnums")
    name = name or getattr(fn, "__name__", "graph")
    gid = len(self._graphs)  # graphs are never removed; a failed compile uses no id
    dyn_nums = [i for i in range(nargs) if i not in state_nums and i not in static_nums]
    state_args = [example_args[i] for i in state_nums]
    dyn_args = [example_args[i] for i in dyn_nums]
    mode = {}
    wrapped = _stateful_fn(fn, example_args, state_nums, dyn_nums, mode)
    closed, out_shape = jax.make_jaxpr(wrapped, return_shape=True)(tuple(state_args),
                                                                  *dyn_args)
    if mode.get("updates"):
      _check_new_state(name, state_nums, state_args, out_shape[0])
    rest_tree = tree_util.tree_structure(out_shape[1])
    kinds, labels = _input_labels(state_nums, state_args, dyn_nums, dyn_args)
    graph = importer.import_jaxpr(closed, name=name, input_kinds=kinds, input_names=labels)
    graph.updates_state = bool(mode.get("updates"))
    nodes_imported = len(graph.nodes)

    slots = self._bind_state(name, state_nums, state_args, state_from)
    spec = ArgSpec(f"run(graph {gid} '{name}')", dyn_nums, dyn_args)
    ctx = PassContext(platform=self.platform, options=self.options,
                      verify=self.options.verify_graphs)
    optimizer = pipeline.graph_optimizer(self.options.disabled_passes)
    dumper = None
    if self.options.save_graphs:
      dumper = GraphDumper(self.options.save_graphs, f"{gid:03d}_{name}")
      dumper.write("import", graph.dump())
      ctx.instruments.append(dumper)

    # The pipeline, in MindSpore GPUSession's order.
    with pipeline.gc_paused():
      self._optimize(optimizer, graph, ctx)
      self._select_kernel(optimizer, graph, ctx)
      self._hardware_optimize(optimizer, graph, ctx)
      self._assign_stream(optimizer, graph, ctx)
      self._allocate_memory(optimizer, graph, ctx)
    leaf_slots = [(slot, j) for slot in slots for j in range(len(slot.leaves))]
    runner, make_sunk = self._build(graph, spec, rest_tree, leaf_slots, dyn_args)

    if dumper:
      dumper.write_execution_order(graph)
    report = CompileReport(
        graph_name=name, passes=list(ctx.records),
        partitions=[PartitionInfo(p.place, len(p.nodes), p.stream, p.reason)
                    for p in graph.partitions],
        memory=memory.MemoryReport(graph.memory), donations=graph.memory.donations,
        kernels=count_kernels(graph), nodes_imported=nodes_imported,
        nodes_final=len(graph.nodes), compile_seconds=time.perf_counter() - start)
    self._graphs[gid] = _Entry(name, graph, report, runner, spec, slots, make_sunk)
    return gid

  def _optimize(self, optimizer, graph, ctx):
    """Graph passes that keep semantics (DCE, CSE, folding, simplification,
    nop removal, user passes), swept to a fixed point."""
    optimizer.run_stage("Optimize", graph, ctx)

  def _select_kernel(self, optimizer, graph, ctx):
    """One kernel per node, by backend, platform and dtype."""
    optimizer.run_stage("SelectKernel", graph, ctx)

  def _hardware_optimize(self, optimizer, graph, ctx):
    """Placement (device or host) and partitioning."""
    optimizer.run_stage("HardwareOptimize", graph, ctx)

  def _assign_stream(self, optimizer, graph, ctx):
    """The queue of each partition and node."""
    optimizer.run_stage("AssignStream", graph, ctx)

  def _allocate_memory(self, optimizer, graph, ctx):
    """Liveness, donation of session-owned state, peak estimate."""
    optimizer.run_stage("AllocateMemory", graph, ctx)

  def _build(self, graph, spec, rest_tree, leaf_slots, example_args):
    """One executable per device partition; the runner for `run` and a factory
    of loop-sunk runners for `run(..., steps=N)`."""
    consts = tuple(owned_copy(graph.const_values[v.id])
                   for v in graph.inputs_of_kind("const"))
    layout = executor.StateLayout(graph, graph.memory, leaf_slots)
    parts = graph.partitions
    if len(parts) <= 1 and all(p.place == "device" for p in parts):
      part = parts[0] if parts else None
      runner = executor.FastRunner(graph, graph.memory, spec, rest_tree, consts, part,
                                   layout, example_args)
      make_sunk = lambda steps: loop_sink.SunkRunner(graph, spec, rest_tree, consts,
                                                     layout, steps)
      return runner, make_sunk
    steps = build.build_steps(graph, parts, graph.memory)
    runner = executor.PlanRunner(graph, steps, spec, rest_tree, consts, layout)
    return runner, lambda n: loop_sink.SteppedRunner(runner, n)

  def _bind_state(self, name, state_nums, state_args, state_from):
    if state_from is None:
      slots = []
      for k, (i, arg) in enumerate(zip(state_nums, state_args)):
        leaves, treedef = tree_util.tree_flatten(arg)
        slots.append(StateSlot(f"{name}:state{k}(arg {i})", treedef,
                               [leaf_aval(x) for x in leaves],
                               [owned_copy(x) for x in leaves]))
      return slots
    source = self._entry(state_from)
    if len(state_args) > len(source.slots):
      raise InputError(f"compile({name}): {len(state_args)} state args but graph "
                       f"{state_from} ('{source.name}') has {len(source.slots)} state slots")
    for k, arg in enumerate(state_args):
      leaves, treedef = tree_util.tree_flatten(arg)
      check_matches(source.slots[k], treedef, [leaf_aval(x) for x in leaves],
                    f"compile({name}): state arg {k} (position {state_nums[k]}) "
                    f"shared from graph {state_from}")
    return source.slots[:len(state_args)]

  # -- run ----------------------------------------------------------------
  def run(self, graph_id, *args, steps=None):
    """Runs one step (or `steps` steps, loop-sunk) and returns fn's non-state
    outputs. State advances only if the whole call succeeds."""
    try:
      entry = self._graphs[graph_id]
    except (KeyError, TypeError):
      entry = self._entry(graph_id)  # raises UnknownGraphError
    if steps is None:
      return entry.call(args)
    runner = entry.sunk.get(steps)
    if runner is None:
      runner = entry.sunk[loop_sink.check_steps(steps)] = entry.make_sunk(steps)
    return runner(args)

  # -- state --------------------------------------------------------------
  def get_state(self, graph_id):
    """The state args' current values, one pytree each (the session's own
    buffers are copied, so later runs cannot invalidate what you hold)."""
    entry = self._entry(graph_id)
    return tuple(tree_util.tree_unflatten(s.treedef, [owned_copy(x) for x in s.leaves])
                 for s in entry.slots)

  def set_state(self, graph_id, *values):
    """Replaces the state args' values; checks every value before changing any."""
    entry = self._entry(graph_id)
    if len(values) != len(entry.slots):
      raise InputError(f"set_state(graph {graph_id} '{entry.name}'): expected "
                       f"{len(entry.slots)} value(s), one per state arg, got {len(values)}")
    new = []
    for k, (slot, value) in enumerate(zip(entry.slots, values)):
      leaves, treedef = tree_util.tree_flatten(value)
      where = f"set_state(graph {graph_id} '{entry.name}'): value {k}"
      if treedef != slot.treedef:
        check_matches(slot, treedef, [], where)
      for path, leaf, aval in zip(paths_of(value), leaves, slot.avals):
        got = leaf_aval(leaf)
        if got.shape != aval.shape or got.dtype != aval.dtype:
          raise InputError(f"{where} at path {path or '(root)'}: expected "
                           f"{aval_str(aval)}, got {aval_str(got)}")
      new.append(tuple(owned_copy(x) for x in leaves))
    for slot, leaves in zip(entry.slots, new):
      slot.leaves = leaves

  # -- introspection --------------------------------------------------------
  def graph(self, graph_id):
    """The KernelGraph after the whole pipeline."""
    return self._entry(graph_id).graph

  def report(self, graph_id):
    """What compile decided and why (passes, partitions, memory)."""
    return self._entry(graph_id).report

  def _entry(self, graph_id):
    try:
      return self._graphs[graph_id]
    except (KeyError, TypeError):
      raise UnknownGraphError(f"graph id {graph_id!r} was not returned by this "
                              f"session's compile (known ids: {sorted(self._graphs)})"
                              ) from None


def _closed_jaxpr_fn(closed):
  run = jcore.jaxpr_as_fun(closed)

  def closed_jaxpr(*args):
    outs = run(*args)
    return outs[0] if len(outs) == 1 else tuple(outs)
  return closed_jaxpr


def _stateful_fn(fn, example_args, state_nums, dyn_nums, mode):
  """fn as f(state_tuple, *dynamic) -> (new_state_tuple, rest).

  With state args, fn either updates them (returns a tuple whose first k items
  have the state args' pytree structures) or only reads them (an eval step
  that shares a train step's state); `mode["updates"]` records which.
  """
  k = len(state_nums)
  state_trees = [tree_util.tree_structure(example_args[i]) for i in state_nums]

  def session_step(state, *dyn):
    full = list(example_args)  # static args stay as given
    for i, x in zip(state_nums, state):
      full[i] = x
    for i, x in zip(dyn_nums, dyn):
      full[i] = x
    out = fn(*full)
    mode["updates"] = bool(k) and isinstance(out, (tuple, list)) and len(out) >= k and (
        tree_util.tree_structure(out[0]) == state_trees[0])
    if not mode["updates"]:
      return (), out
    rest = tuple(out[k:])
    return tuple(out[:k]), (None if not rest else rest[0] if len(rest) == 1 else rest)
  return session_step


def _check_new_state(name, state_nums, state_args, new_state):
  for k, (i, old, new) in enumerate(zip(state_nums, state_args, new_state)):
    where = f"compile({name}): the new value of state arg {k} (position {i})"
    old_leaves, old_tree = tree_util.tree_flatten(old)
    new_leaves, new_tree = tree_util.tree_flatten(new)
    if old_tree != new_tree:
      raise InputError(f"{where} has pytree structure {new_tree}, the arg has {old_tree}")
    for path, a, b in zip(paths_of(old), old_leaves, new_leaves):
      a = leaf_aval(a)
      if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        raise InputError(f"{where} at path {path or '(root)'} is "
                         f"{b.dtype}{list(b.shape)}, the arg is {aval_str(a)}")


def _input_labels(state_nums, state_args, dyn_nums, dyn_args):
  kinds, labels = [], []
  for k, (i, arg) in enumerate(zip(state_nums, state_args)):
    for path in paths_of(arg):
      kinds.append("state")
      labels.append(f"state {k} (arg {i}){path}")
  for i, arg in zip(dyn_nums, dyn_args):
    for path in paths_of(arg):
      kinds.append("input")
      labels.append(f"arg {i}{path}")
  return kinds, labels
