"""Pass infrastructure, the pattern DSL, and the graph passes."""
from jaxsession.optimizer_passes.base import (FunctionPass, GraphOptimizer, Pass, PassContext,
                                              PassManager, PassRecord, PassResult,
                                              run_to_fixed_point)
from jaxsession.optimizer_passes.pattern import Match, Pat, RewritePass, Rewriter, Rule

__all__ = ["FunctionPass", "GraphOptimizer", "Pass", "PassContext", "PassManager",
           "PassRecord", "PassResult", "run_to_fixed_point", "Match", "Pat",
           "RewritePass", "Rewriter", "Rule"]
