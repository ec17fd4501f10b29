"""What makes a division's divisor: XLA rewrites a division by it (a / sqrt(b)
into a * rsqrt(b), a / broadcast(s) into a * (1 / s) where s has one
reader), so a pass that changes what makes a divisor, or how many read it,
changes the bits. CSE leaves that cone unmerged; a scalar state leaf in it
is returned by the executable as jax.jit's returns it (KernelGraph.
passed_state)."""
from jaxsession.graph.op_properties import DIVIDES, facts

def divisor_cone(graph):
  """(ids of the nodes that make a divisor of div or rem, the divisions
  themselves among them; ids of the graph inputs they read), followed
  through elementwise and reshaping ops."""
  nodes, inputs, stack = set(), set(), []
  for node in graph.nodes:
    if node.op in DIVIDES and len(node.inputs) > 1:
      nodes.add(node.id)
      stack.append(node.inputs[1])
  while stack:
    value = stack.pop()
    if not hasattr(value, "producer"):  # a literal
      continue
    node = value.producer
    if node is None:
      inputs.add(value.id)
      continue
    if node.id in nodes:
      continue
    nodes.add(node.id)
    if facts(node.op).elementwise or facts(node.op).fused_through:  # XLA's rewrites see
      # through a broadcast or reshape to what made the divisor
      stack.extend(node.inputs)
  return nodes, inputs
