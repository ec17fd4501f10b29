"""The stage pipeline, in one place: the table PIPELINE.

    Optimize -> SelectKernel -> HardwareOptimize -> AssignStream -> AllocateMemory -> Build

Each graph stage is a flat list of passes (optimizer_passes/, one module a
pass); a comment says where order matters. A stage's `required` passes are its
decisions (kernels; places, transfers, partitions; streams; the memory plan)
and come last in it: a user pass (`register_pass`) runs before them, so the
nodes it makes are decided by the ordinary passes that follow. After every
stage `KernelGraph.verify` checks what the stages so far decided
(optimizer_passes.base.GraphOptimizer). `run_pipeline` is the one way the
stages are run (Session.compile; `clean_probe` runs two of Optimize's passes
on a trace that is analysed, never compiled); Build is not a graph pass - it
turns the final graph into executables (session/build_stage.py).
"""
from jaxsession import gc_pause
from jaxsession.optimizer_passes.adam_fusion import FuseAdam
from jaxsession.optimizer_passes.assign_streams import AssignStreams
from jaxsession.optimizer_passes.base import GraphOptimizer, PassManager
from jaxsession.optimizer_passes.bn_fusion import FuseBatchNormRelu
from jaxsession.optimizer_passes.cse import CommonSubexpressionElimination
from jaxsession.optimizer_passes.dce import DeadCodeElimination
from jaxsession.optimizer_passes.fold import FoldConstants
from jaxsession.optimizer_passes.fusion import FuseAddN, FuseGelu, FuseMatmulBias, FuseSoftmax
from jaxsession.optimizer_passes.move_into_readers import MoveIntoReaders
from jaxsession.optimizer_passes.nops import RemoveNops
from jaxsession.optimizer_passes.norm_fusion import FuseLayerNorm, FuseNormAffine, FuseRmsNorm
from jaxsession.optimizer_passes.partition_nodes import PartitionNodes
from jaxsession.optimizer_passes.placement import PlaceNodes
from jaxsession.optimizer_passes.plan_allreduce import PlanAllReduce
from jaxsession.optimizer_passes.plan_memory import PlanMemory
from jaxsession.optimizer_passes.reorder import ReorderForPartitions
from jaxsession.optimizer_passes.select_kernels import SelectKernels
from jaxsession.optimizer_passes.simplify import Simplify
from jaxsession.optimizer_passes.transfers import InsertTransfers

# stage -> its passes, in the order they run (passes hold no state: one
# instance serves every compile)
PIPELINE = {
    # Swept to a fixed point (FIXED_POINT): each pass can expose work for another.
    "Optimize": (
        DeadCodeElimination(),             # grad jaxprs carry dead forward eqns
        CommonSubexpressionElimination(),  # after DCE: fewer nodes to hash
        FoldConstants(),
        Simplify(),
        RemoveNops(),
        FuseSoftmax(),                     # the fusions after the cleanups strip form noise
        FuseGelu(),
        FuseMatmulBias(),
        FuseAddN(),
        FuseLayerNorm(),
        FuseRmsNorm(),
        FuseNormAffine(),                  # after the norms: absorbs into them
        FuseAdam(),
    ),
    "SelectKernel": (
        SelectKernels(),
    ),
    "HardwareOptimize": (
        FuseBatchNormRelu(),       # MindSpore's hardware-stage fusion
        PlanAllReduce(),           # under a mesh with allreduce_bucket_bytes only
        PlaceNodes(),              # picks the kernels of the nodes the two above made
        ReorderForPartitions(),    # needs places
        MoveIntoReaders(),         # on the kept order: jax.jit's bits across host work
        InsertTransfers(),         # on the final order
        PartitionNodes(),          # needs transfers
    ),
    "AssignStream": (
        AssignStreams(),
    ),
    "AllocateMemory": (
        PlanMemory(),
    ),
}
FIXED_POINT = ("Optimize",)
# Optimize's identities, alone and in this order, on a trace that is analysed
# and never compiled (`clean_probe`)
PROBE_CLEANUPS = ("simplify", "dce")
STAGES = (*PIPELINE, "Build")
GRAPH_STAGES = tuple(PIPELINE)  # Build makes executables, not graph changes
_USER_PASSES = []  # (stage, pass, before, after), in registration order


def _insert(passes, pass_, before, after, stage):
  """Puts a user pass into `passes` (a stage's list): before=/after= a named
  pass, else at the end - and never among the stage's decisions (its
  required passes): at the latest just before the first of them."""
  names = [p.name for p in passes]
  if pass_.name in names:
    raise ValueError(f"stage {stage} already has a pass named {pass_.name!r}")
  anchor = before or after
  if anchor is not None and anchor not in names:
    raise ValueError(f"stage {stage} has no pass {anchor!r} to put {pass_.name!r} "
                     f"{'before' if before else 'after'}; its passes: {names}")
  decisions = next((i for i, p in enumerate(passes) if p.required), len(passes))
  at = decisions if anchor is None else names.index(anchor) + (0 if before else 1)
  passes.insert(min(at, decisions), pass_)


def stage_passes():
  """Built-in and user passes of every graph stage, in order."""
  stages = {stage: list(passes) for stage, passes in PIPELINE.items()}
  for stage, pass_, before, after in _USER_PASSES:
    _insert(stages[stage], pass_, before, after, stage)
  return stages


def register_pass(pass_, stage="Optimize", before=None, after=None):
  """Adds a user pass (an optimizer_passes.Pass) to a stage: at the end of
  the stage's rewrites, or `before=` / `after=` a named pass of that stage.
  It always runs before the stage's decisions (its required passes: an
  anchor among them puts it just before the first), so the kernels, places,
  transfers and partitions of the nodes it makes in Optimize, SelectKernel
  or HardwareOptimize are decided as every other node's; in AssignStream and
  AllocateMemory, which remake none of those, a new node is a PassError.
  Every Session compiled afterwards runs it; `unregister_pass(name)` takes it
  out again."""
  if stage not in GRAPH_STAGES:
    raise ValueError(f"stage must be one of {list(GRAPH_STAGES)}, got {stage!r}")
  if before is not None and after is not None:
    raise ValueError("give before= or after=, not both")
  _insert(stage_passes()[stage], pass_, before, after, stage)  # validates
  _USER_PASSES.append((stage, pass_, before, after))
  return pass_


def unregister_pass(name):
  _USER_PASSES[:] = [entry for entry in _USER_PASSES if entry[1].name != name]


def graph_optimizer(disabled=()):
  """A GraphOptimizer over every graph stage of the table, in order; each
  stage's passes keep the invariants of the stages before it."""
  stages = stage_passes()
  return GraphOptimizer([PassManager(stage, stages[stage], fixed_point=stage in FIXED_POINT,
                                     holds=GRAPH_STAGES[:i])
                         for i, stage in enumerate(GRAPH_STAGES)], disabled)


def clean_probe(graph):
  """PROBE_CLEANUPS on a traced graph that is analysed, not compiled (the
  buckets' padding analysis, session/bucketed.py: a dead case of a select is
  no dependence on the batch size - jnp's negative index normalisation of
  x[jnp.arange(B), labels] adds B there), as the compile's Optimize has them."""
  passes = {p.name: p for p in PIPELINE["Optimize"]}
  for name in PROBE_CLEANUPS:
    passes[name].run(graph, None)


def run_pipeline(graph, ctx):
  """Every graph stage on `graph`, in the table's order (the imported graph
  checked first, each stage's invariants after it); what ran is in
  `ctx.records`."""
  disabled = ctx.options.disabled_passes
  with gc_pause.paused():  # (gc_pause.py)
    graph_optimizer(disabled).run(graph, ctx)


def optional_pass_names():
  """The passes SessionOptions.disabled_passes may name. The required ones
  (kernels, placement, transfers, partitions, streams, memory) decide what
  every graph needs."""
  return [p.name for passes in stage_passes().values() for p in passes if not p.required]
