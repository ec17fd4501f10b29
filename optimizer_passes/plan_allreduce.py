"""plan_allreduce (HardwareOptimize): under a mesh with
`SessionOptions(allreduce_bucket_bytes=...)`, rewrites every sum over the
sharded batch axis into per-device partial sums and bucketed all-reduces
(runtime/allreduce.py); elsewhere it changes nothing.

Runs before place_nodes, which picks the kernels of the nodes it makes.
"""
from jaxsession.optimizer_passes.base import Pass, PassResult
from jaxsession.runtime import allreduce


class PlanAllReduce(Pass):
  name = "plan_allreduce"

  def run(self, graph, ctx):
    return PassResult(allreduce.plan_allreduce(graph, ctx.options))
