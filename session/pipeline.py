"""The stage pipeline, in one place.

    Optimize -> SelectKernel -> HardwareOptimize -> AssignStream -> AllocateMemory -> Build

Each stage is a flat list of passes; a comment says where order matters. The
Session calls the stages in this order (Session.compile); Build is not a graph
pass - it turns the final graph into executables (runtime.build).
"""
import contextlib
import gc

from jaxsession.errors import KernelSelectError, PartitionError
from jaxsession.kernels import registry
from jaxsession.optimizer_passes import reduce_precision as precision
from jaxsession.optimizer_passes.adam_fusion import FuseAdam
from jaxsession.optimizer_passes.bn_fusion import FuseBatchNormRelu
from jaxsession.optimizer_passes.base import FunctionPass, GraphOptimizer, PassManager
from jaxsession.optimizer_passes.cse import CommonSubexpressionElimination
from jaxsession.optimizer_passes.dce import DeadCodeElimination
from jaxsession.optimizer_passes.fold import FoldConstants
from jaxsession.optimizer_passes.fusion import fusion_passes
from jaxsession.optimizer_passes.norm_fusion import norm_fusion_passes
from jaxsession.optimizer_passes.nops import RemoveNops
from jaxsession.optimizer_passes.placement import PlaceNodes, placement_reason
from jaxsession.optimizer_passes.reorder import ReorderForPartitions
from jaxsession.optimizer_passes.transfers import InsertTransfers
from jaxsession.optimizer_passes.simplify import Simplify
from jaxsession.runtime import memory, partition, streams
from jaxsession.runtime.allreduce import PlanAllReduce

STAGES = ("Optimize", "SelectKernel", "HardwareOptimize", "AssignStream",
          "AllocateMemory", "Build")


DEVICE_BACKENDS = ("xla", "pallas")


def select_kernels(graph, ctx):
  """SelectKernel: writes `node.kernel` on every node (XLA or, on GPU, Pallas
  kernels; host kernels are chosen by placement, which knows where a node runs).
  A node no device kernel takes gets its host kernel if it has one; else it
  may run narrowed from int64 to int32 where exact."""
  changed = False
  for node in list(graph.nodes):
    try:
      kernel = registry.select_kernel(node, ctx.platform, backends=DEVICE_BACKENDS)
    except KernelSelectError as error:
      kernel = _host_only(node) or _narrow_to_int32(graph, node, ctx, error)
      changed |= kernel.backend != "host"
    changed |= node.kernel is not kernel
    node.kernel = kernel
  return changed


def _host_only(node):
  """A host kernel for a node no device kernel takes (place_nodes then puts
  it on the host), or None."""
  try:
    kernel = registry.select_kernel(node, "host", backends=("host",))
  except KernelSelectError:
    return None
  node.notes.append(f"kernel {kernel.name}: no device kernel takes this node")
  return kernel


def _narrow_to_int32(graph, node, ctx, error):
  """Reduce precision: int64 -> int32 casts around `node`, if exact; else the
  original error, with the reason the rule did not apply."""
  refusal = precision.narrowing_refusal(node, graph.const_values)
  if refusal is None:
    try:
      kernel = registry.select_kernel(precision.narrowed_view(node), ctx.platform,
                                      backends=DEVICE_BACKENDS)
    except KernelSelectError as narrowed_error:
      refusal = f"no kernel takes the int32 form either:\n{narrowed_error}"
  if refusal is not None:
    raise KernelSelectError(f"{error}\nreduce precision (int64 -> int32) not applied: "
                            f"{refusal}") from None
  precision.insert_casts(graph, node)
  return kernel


def partition_nodes(graph, ctx):
  """Splits the placed nodes into partitions; writes them on the graph."""
  parts = partition.partition_graph(graph)
  device = [p for p in parts if p.place == "device"]
  if len(device) > 1 and getattr(ctx.options, "partition_or_error", False):
    host = [n for n in graph.nodes if n.place == "host" and n.op != "transfer_d2h"]
    raise PartitionError(
        f"graph {graph.name} needs {len(device)} device partitions "
        f"(partition_or_error is set); {len(host)} node(s) run on the host:\n"
        + "\n".join(f"  node {n.id} '{n.op}'{' at ' + n.source if n.source else ''}: "
                    f"{placement_reason(n)}" for n in host)
        + "\npartitions:\n" + "\n".join(f"  {p.describe()}" for p in parts))
  graph.partitions = parts
  return len(parts) > 1


def assign_streams(graph, ctx):
  return streams.assign_streams(graph, graph.partitions, ctx.platform)


def plan_memory(graph, ctx):
  graph.memory = memory.plan_memory(graph, graph.partitions,
                                    getattr(ctx.options, "donate_state", True), ctx.platform)
  return False  # annotates the graph; no node changes


def settle_new_nodes(graph, ctx):
  """After a pass in SelectKernel or a later stage: completes, for the nodes
  it created, what the earlier stages decided for every other node - a kernel,
  a place (the device), and the partitions, streams and memory plan when they
  were already made - so every node has a kernel whichever pass made it."""
  if "SelectKernel/select_kernels" not in ctx.history:
    return  # a user pass ahead of select_kernels: it selects for every node
  for node in graph.nodes:
    if node.kernel is None:
      node.kernel = registry.select_kernel(node, ctx.platform, backends=DEVICE_BACKENDS)
  if "HardwareOptimize/place_nodes" not in ctx.history:
    return  # place_nodes will place them
  for node in graph.nodes:
    if node.place is None:
      node.place = "device"
  if "HardwareOptimize/insert_transfers" in ctx.history:
    InsertTransfers().run(graph, ctx)  # a new node may read across places
  if graph.partitions is None:
    return
  partitioned = [n for p in graph.partitions for n in p.nodes]
  if len(partitioned) == len(graph.nodes) and all(
      a is b for a, b in zip(partitioned, graph.nodes)):
    return
  had_streams = any(p.stream is not None for p in graph.partitions)
  partition_nodes(graph, ctx)
  if had_streams:
    assign_streams(graph, ctx)
  if graph.memory is not None:
    plan_memory(graph, ctx)


def default_passes():
  """The built-in passes of every graph stage, in order."""
  return {
      # Swept to a fixed point: each pass can expose work for another.
      "Optimize": [
          DeadCodeElimination(),             # grad jaxprs carry dead forward eqns
          CommonSubexpressionElimination(),  # after DCE: fewer nodes to hash
          FoldConstants(),
          Simplify(),
          RemoveNops(),
          *fusion_passes(),                  # after the cleanups strip form noise
          *norm_fusion_passes(),
          FuseAdam(),
      ],
      "SelectKernel": [FunctionPass("select_kernels", select_kernels, required=True)],
      "HardwareOptimize": [
          FuseBatchNormRelu(),                                             # selects its kernels
          PlanAllReduce(),                      # under a mesh with allreduce_bucket_bytes only
          PlaceNodes(),                                                    # needs kernels
          ReorderForPartitions(),                                          # needs places
          InsertTransfers(),                                               # on the final order
          FunctionPass("partition_nodes", partition_nodes, required=True),  # needs transfers
      ],
      "AssignStream": [FunctionPass("assign_streams", assign_streams, required=True)],
      "AllocateMemory": [FunctionPass("plan_memory", plan_memory, required=True)],
  }


GRAPH_STAGES = STAGES[:-1]  # Build makes executables, not graph changes
_USER_PASSES = []  # (stage, pass, before, after), in registration order


def _insert(passes, pass_, before, after, stage):
  names = [p.name for p in passes]
  if pass_.name in names:
    raise ValueError(f"stage {stage} already has a pass named {pass_.name!r}")
  anchor = before or after
  if anchor is None:
    passes.append(pass_)
    return
  if anchor not in names:
    raise ValueError(f"stage {stage} has no pass {anchor!r} to put {pass_.name!r} "
                     f"{'before' if before else 'after'}; its passes: {names}")
  passes.insert(names.index(anchor) + (0 if before else 1), pass_)


def stage_passes():
  """Built-in and user passes of every graph stage, in order."""
  stages = default_passes()
  for stage, pass_, before, after in _USER_PASSES:
    _insert(stages[stage], pass_, before, after, stage)
  return stages


def register_pass(pass_, stage="Optimize", before=None, after=None):
  """Adds a user pass (an optimizer_passes.Pass) to a stage: at the end, or
  `before=` / `after=` a named pass of that stage. Every Session compiled
  afterwards runs it; `unregister_pass(name)` takes it out again."""
  if stage not in GRAPH_STAGES:
    raise ValueError(f"stage must be one of {list(GRAPH_STAGES)}, got {stage!r}")
  if before is not None and after is not None:
    raise ValueError("give before= or after=, not both")
  _insert(stage_passes()[stage], pass_, before, after, stage)  # validates
  _USER_PASSES.append((stage, pass_, before, after))
  return pass_


def unregister_pass(name):
  _USER_PASSES[:] = [entry for entry in _USER_PASSES if entry[1].name != name]


@contextlib.contextmanager
def gc_paused():
  """Python's cyclic GC off while the pipeline builds and rewrites a graph:
  the graph's objects are all alive anyway, and a collection scans the whole
  heap, so on big graphs GC alone made the passes superlinear."""
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if enabled:
      gc.enable()


def graph_optimizer(disabled=()):
  """A GraphOptimizer over every graph stage (Optimize to a fixed point)."""
  stages = stage_passes()
  return GraphOptimizer([PassManager(stage, stages[stage], fixed_point=(stage == "Optimize"),
                                     settle=None if stage == "Optimize" else settle_new_nodes)
                         for stage in GRAPH_STAGES], disabled)


def optional_pass_names():
  """The passes SessionOptions.disabled_passes may name. The required ones
  (kernels, placement, partitions, streams, memory) decide what every graph needs."""
  return [p.name for passes in stage_passes().values() for p in passes if not p.required]
