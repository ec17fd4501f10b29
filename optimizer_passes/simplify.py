"""simplify (Optimize): algebraic identities, one rule a line.

Each rewrite checks that the replacement has the root's shape and dtype, so
broadcasting identities (a scalar x*1 feeding a vector) are left alone.
Needs nothing before it; DCE afterwards drops what the rules orphan (the rule
engine drops the matched nodes itself when nobody else reads them).
"""
import numpy as np

from jaxsession.optimizer_passes.pattern import Pat, Rule, RewritePass

x = Pat.var("x")


def same_type(a, b):
  return tuple(a.aval.shape) == tuple(b.aval.shape) and a.aval.dtype == b.aval.dtype


def keep_x(r, x):
  """The root computes x itself (when its type is x's)."""
  return x if same_type(r.root.outputs[0], x) else None


def compose_transposes(r, x, inner):
  """transpose(transpose(x, p1), p2) = transpose(x, p1[p2]); identity -> x."""
  p1 = inner.producer.params["permutation"]
  p2 = r.root.params["permutation"]
  perm = tuple(p1[i] for i in p2)
  if perm == tuple(range(len(perm))):
    return x
  return r.emit("transpose", r.root.prim, {**r.root.params, "permutation": perm}, [x],
                [r.root.outputs[0].aval])


def convert_round_trip(r, x, inner):
  """A -> B -> A is x when A -> B loses nothing."""
  a, b = x.aval.dtype, inner.aval.dtype
  try:
    exact = np.can_cast(a, b, "safe") or (a == np.bool_)
  except TypeError:  # extended dtypes (keys) never round-trip here
    return None
  return x if exact and r.root.outputs[0].aval.dtype == a and same_type(
      r.root.outputs[0], x) else None


def reshape_chain(r, x, inner):
  """reshape(reshape(x)) is one reshape of x (row-major order is kept)."""
  if inner.producer.params.get("dimensions") or r.root.params.get("dimensions"):
    return None
  if tuple(r.root.outputs[0].aval.shape) == tuple(x.aval.shape):
    return x
  return r.emit("reshape", r.root.prim, dict(r.root.params), [x], [r.root.outputs[0].aval])


def broadcast_chain(r, x, inner):
  """broadcast(broadcast(x, d1), d2) = broadcast(x, d2[d1])."""
  d1 = inner.producer.params["broadcast_dimensions"]
  d2 = r.root.params["broadcast_dimensions"]
  dims = tuple(d2[d] for d in d1)
  return r.emit("broadcast_in_dim", r.root.prim,
                {**r.root.params, "broadcast_dimensions": dims}, [x],
                [r.root.outputs[0].aval])


SIMPLIFY_RULES = [
    Rule(Pat("mul", x, Pat.lit(1)), keep_x),                          # x*1 -> x
    Rule(Pat("add", x, Pat.lit(0)), keep_x),                          # x+0 -> x
    Rule(Pat("add_any", x, Pat.lit(0)), keep_x),                      # x+0 -> x
    Rule(Pat("sub", x, Pat.lit(0)), keep_x),                          # x-0 -> x
    Rule(Pat("div", x, Pat.lit(1)), keep_x),                          # x/1 -> x
    Rule(Pat("pow", x, Pat.lit(1)), keep_x),                          # x**1 -> x
    Rule(Pat("integer_pow", x, params={"y": 1}), keep_x),             # x**1 -> x
    Rule(Pat("max", x, Pat.lit(-np.inf)), keep_x),                    # max(x, -inf) -> x
    Rule(Pat("neg", Pat("neg", x)), keep_x),                          # -(-x) -> x
    Rule(Pat("not", Pat("not", x)), keep_x),                          # ~~x -> x
    Rule(Pat("transpose", Pat("transpose", x, name="inner")),
         compose_transposes),                                         # T(T(x)) -> x or one T
    Rule(Pat("convert_element_type", Pat("convert_element_type", x, name="inner")),
         convert_round_trip),                                         # A->B->A -> x if exact
    Rule(Pat("reshape", Pat("reshape", x, name="inner")),
         reshape_chain),                                              # reshape chain -> one
    Rule(Pat("broadcast_in_dim", Pat("broadcast_in_dim", x, name="inner")),
         broadcast_chain),                                            # bcast(bcast) -> one
]


def Simplify():
  return RewritePass("simplify", SIMPLIFY_RULES, doc=__doc__)
