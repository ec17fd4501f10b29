"""What makes a division's divisor: XLA rewrites a division by it (a / sqrt(b)
into a * rsqrt(b), a / broadcast(s) into a * (1 / s) where s has one
reader), so a pass that changes what makes a divisor, or how many read it,
changes the bits. CSE leaves that cone unmerged; a scalar state leaf in it
is returned by the executable as jax.jit's returns it (KernelGraph.
passed_state), and so is a scalar a partition's divisor is made of that
another partition reads too (runtime/partition.py: Partition.witnesses).

A nested jit is inlined by XLA, so its divisions count as the graph's own:
the cone goes into a call's body and out of it again through the operands
its divisors are made of (a break-it find: `jit(lambda x, t: x / t)(x, t)`
beside a callback reading t was off by an ulp in a quarter of the elements,
where `x / t` written out was not)."""
import weakref

from jax.extend import core as jcore

from jaxsession.graph.op_properties import CALLS, DIVIDES, facts, moves_or_maps


def divisor_cone(nodes):
  """(ids of the nodes among `nodes` (a graph's, or a partition's) that make
  a divisor of div or rem, the divisions themselves among them, and the
  calls (nested jits) that divide inside; the ids of the values from outside
  them they read - a graph's inputs, or a partition's), followed through
  elementwise and reshaping ops and into and out of calls."""
  made_here = {out.id for node in nodes for out in node.outputs}
  cone, outside, stack = set(), set(), []
  for node in nodes:
    if node.op in DIVIDES and len(node.inputs) > 1:
      cone.add(node.id)
      stack.append(node.inputs[1])
    elif node.op in CALLS:
      divisors = _body_divisors(node.params)
      if divisors:
        cone.add(node.id)
        stack.extend(node.inputs[i] for i in divisors)
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
    if _followed(node.op, node.params):  # XLA's rewrites see through a broadcast
      stack.extend(node.inputs)  # or reshape to what made the divisor; a transfer is
      # the value itself (a review's find); an inlined call of such ops is them
  return cone, outside


def _followed(op, params):
  return moves_or_maps(op, params) or facts(op).transfer is not None


# a call's body jaxpr -> the positions of its inputs its divisors are made of;
# weak, as op_properties' cache
_BODY = weakref.WeakKeyDictionary()


def _body_divisors(params):
  """The positions of a call's operands that a divisor inside its body (at
  any depth of nested calls) is made of."""
  closed = params.get("jaxpr")
  jaxpr = getattr(closed, "jaxpr", closed)
  if jaxpr is None:
    return ()
  found = _BODY.get(jaxpr)
  if found is None:
    found = _BODY[jaxpr] = _jaxpr_divisors(jaxpr)
  return found


def _jaxpr_divisors(jaxpr):
  producer = {id(var): eqn for eqn in jaxpr.eqns for var in eqn.outvars}
  position = {id(var): i for i, var in enumerate(jaxpr.invars)}
  stack, seen, found = [], set(), set()
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in DIVIDES and len(eqn.invars) > 1:
      stack.append(eqn.invars[1])
    elif name in CALLS:
      stack.extend(eqn.invars[i] for i in _body_divisors(eqn.params))
  while stack:
    var = stack.pop()
    if isinstance(var, jcore.Literal) or id(var) in seen:
      continue
    seen.add(id(var))
    if id(var) in position:
      found.add(position[id(var)])
    eqn = producer.get(id(var))
    if eqn is not None and _followed(eqn.primitive.name, eqn.params):
      stack.extend(eqn.invars)
  return tuple(sorted(found))
