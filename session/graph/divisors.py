"""What makes a division's divisor: XLA rewrites a division by it (a / sqrt(b)
into a * rsqrt(b), a / broadcast(s) into a * (1 / s) where s has one
reader), so a pass that changes what makes a divisor, or how many read it,
changes the bits. CSE leaves that cone unmerged; a scalar state leaf in it
is returned by the executable as jax.jit's returns it (KernelGraph.
passed_state), and so is a scalar a partition's divisor is made of that
another partition reads too (runtime/partition.py: Partition.witnesses)."""
from jaxsession.graph.op_properties import DIVIDES, facts


def divisor_cone(nodes):
  """(ids of the nodes among `nodes` (a graph's, or a partition's) that make
  a divisor of div or rem, the divisions themselves among them; the ids of
  the values from outside them they read - a graph's inputs, or a
  partition's), followed through elementwise and reshaping ops."""
  made_here = {out.id for node in nodes for out in node.outputs}
  cone, outside, stack = set(), set(), []
  for node in nodes:
    if node.op in DIVIDES and len(node.inputs) > 1:
      cone.add(node.id)
      stack.append(node.inputs[1])
  while stack:
    value = stack.pop()
    if not hasattr(value, "producer"):  # a literal
      continue
    if value.id not in made_here:
      outside.add(value.id)
      continue
    node = value.producer
    if node.id in cone:
      continue
    cone.add(node.id)
    fact = facts(node.op)  # XLA's rewrites see through a broadcast or reshape to what
    if fact.elementwise or fact.fused_through or fact.transfer:  # made the divisor; a
      stack.extend(node.inputs)  # transfer is the value itself (a review's find)
  return cone, outside
