"""CSE: finds nodes that compute the same op with the same params on the
same inputs (or on inputs it found the same), and marks them as one value
for the session's own decisions, without merging them: each later copy's
outputs get `Value.same_as`, the first copy's value, and a note. The fusion
patterns read marked values as one (graph/ir.py `same_value`, the pattern
DSL's captures): a LayerNorm whose mean is written twice fuses, and the
fused node reads the first copy; a copy nothing reads after that is DCE's.

The program XLA is handed keeps every other duplicate, as jax.jit's
program has them, for XLA's CSE to merge: its simplifier rewrites by an
operand's identity and its number of readers before that CSE runs (a dot
read by one transpose becomes the swapped dot, y * c + y * c is factored,
x * x is taken as non-negative), so duplicates merged here gave other bits
(judges' finds and a fuzzer's: 101 of 8,932 programs written with
duplicates differed from jax.jit while this pass merged).

Only deterministic nodes are marked (op_properties): two `rng_uniform` draws
or two callbacks are two values, not one. Opaque nodes (an optimization
barrier, a kept jit call) are not marked, nor constant subexpressions
(computed from literals and consts alone: XLA folds them whole), nor what
makes a divisor (graph/divisors.py: XLA rewrites a division by what makes
its divisor). Not under a mesh (see `run`). The pass never changes the
graph: it reports no change, and marks afresh on each sweep. Runs after
DCE (fewer nodes to hash) and before the fusions, which read its marks.
"""
from jaxsession.graph.divisors import divisor_cone
from jaxsession.graph.ir import Literal, param_key
from jaxsession.optimizer_passes.base import Pass, PassResult

NOTE = "cse: computes what node {} computes"


def node_key(node):
  """(op, params, inputs) of `node` - an input by the first value that
  computes the same - or None when it cannot be hashed."""
  try:
    params = param_key(node.params)
  except TypeError:
    return None
  inputs = tuple(v.key() if isinstance(v, Literal) else (v.same_as or v).id
                 for v in node.inputs)
  return (node.op, params, inputs, id(node.ctx))  # (contexts are interned by jax)


class CommonSubexpressionElimination(Pass):
  name = "cse"

  def run(self, graph, ctx):
    for node in graph.nodes:  # afresh: the graph may have changed since
      for out in node.outputs:
        out.same_as = None
      if node.notes:
        node.notes[:] = [n for n in node.notes if not n.startswith("cse: ")]
    if graph.mesh is not None:
      # Under a mesh XLA's SPMD partitioner and its own CSE see the program
      # jax.jit gives them: a merged value with several readers partitioned
      # and fused otherwise inside a sunk run's loop (14 of 19 AdamW state
      # leaves 1-5 ulps off jax.jit's scan, a model applied twice; a break-it
      # find, when this pass merged). Fusions take no duplicates there.
      return PassResult(False)
    seen = {}
    constant = {v.id for v in graph.inputs_of_kind("const")}
    divisors = divisor_cone(graph.nodes)[0]
    for node in graph.nodes:
      if not node.props.deterministic or node.props.opaque or node.id in divisors:
        continue
      if all(isinstance(v, Literal) or v.id in constant for v in node.inputs):
        constant.update(out.id for out in node.outputs)
        continue
      key = node_key(node)
      if key is None:
        continue
      first = seen.setdefault(key, node)
      if first is node:
        continue
      for old, new in zip(node.outputs, first.outputs):
        new.same_as = new
        old.same_as = new
      node.notes.append(NOTE.format(first.id) + ": both left to XLA, whose CSE merges "
                        "them as in jax.jit's program; fusions read them as one value")
    return PassResult(False)
