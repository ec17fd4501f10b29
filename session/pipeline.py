"""The stage pipeline, in one place.

    Optimize -> SelectKernel -> HardwareOptimize -> AssignStream -> AllocateMemory -> Build

Each stage is a flat list of passes; a comment says where order matters. The
Session calls the stages in this order (Session.compile); Build is not a graph
pass - it turns the final graph into executables (runtime.build).
"""
from jaxsession.errors import PartitionError
from jaxsession.kernels import registry
from jaxsession.optimizer_passes.base import FunctionPass, PassManager
from jaxsession.optimizer_passes.cse import CommonSubexpressionElimination
from jaxsession.optimizer_passes.dce import DeadCodeElimination
from jaxsession.optimizer_passes.placement import PlaceNodes
from jaxsession.runtime import memory, partition, streams

STAGES = ("Optimize", "SelectKernel", "HardwareOptimize", "AssignStream",
          "AllocateMemory", "Build")


def select_kernels(graph, ctx):
  """SelectKernel: writes `node.kernel` on every node (XLA kernels; the host
  kernels are chosen by placement, which knows where a node will run)."""
  changed = False
  for node in graph.nodes:
    kernel = registry.select_kernel(node, ctx.platform, backends=("xla",))
    changed |= node.kernel is not kernel
    node.kernel = kernel
  return changed


def partition_nodes(graph, ctx):
  """Splits the placed nodes into partitions; writes them on the graph."""
  parts = partition.partition_graph(graph)
  device = [p for p in parts if p.place == "device"]
  if len(device) > 1 and getattr(ctx.options, "partition_or_error", False):
    raise PartitionError(
        f"graph {graph.name} needs {len(device)} device partitions "
        "(partition_or_error is set):\n" + "\n".join(f"  {p.describe()}" for p in parts))
  graph.partitions = parts
  return len(parts) > 1


def assign_streams(graph, ctx):
  return streams.assign_streams(graph, graph.partitions)


def plan_memory(graph, ctx):
  graph.memory = memory.plan_memory(graph, graph.partitions,
                                    getattr(ctx.options, "donate_state", True))
  return False  # annotates the graph; no node changes


def stage_managers():
  """The passes of every graph stage, in order."""
  return [
      PassManager("Optimize", [
          DeadCodeElimination(),             # grad jaxprs carry dead forward eqns
          CommonSubexpressionElimination(),  # after DCE: fewer nodes to hash
      ]),
      PassManager("SelectKernel", [FunctionPass("select_kernels", select_kernels)]),
      PassManager("HardwareOptimize", [
          PlaceNodes(),                                          # needs kernels
          FunctionPass("partition_nodes", partition_nodes),      # needs places
      ]),
      PassManager("AssignStream", [FunctionPass("assign_streams", assign_streams)]),
      PassManager("AllocateMemory", [FunctionPass("plan_memory", plan_memory)]),
  ]


def stage_manager(stage):
  return next(m for m in stage_managers() if m.stage == stage)


def optimize_pass_names():
  """The passes SessionOptions.disabled_passes may name: the Optimize stage's.
  The other stages' passes make the decisions every graph needs."""
  return stage_manager("Optimize").names()
