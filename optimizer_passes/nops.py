"""remove_nops (Optimize): MindSpore's HideNopNode - ops that return their
operand unchanged go, their readers read the operand. Each moves data only,
so the values are the operand's bits; the node goes only when its output has
the operand's aval, weak type included (a convert to its own dtype that makes
a value weak, or strong, stays). Needs nothing before it."""
from jaxsession.optimizer_passes.pattern import Pat, Rule, RewritePass
from jaxsession.optimizer_passes.simplify import keep_x

x = Pat.var("x")


def _identity_perm(perm):
  return tuple(perm) == tuple(range(len(perm)))


def _whole_slice(r, x):
  p = r.root.params
  full = (all(s == 0 for s in p["start_indices"])
          and tuple(p["limit_indices"]) == tuple(x.aval.shape)
          and (p.get("strides") is None or all(s == 1 for s in p["strides"])))
  return keep_x(r, x) if full else None


NOP_RULES = [
    Rule(Pat("reshape", x, params={"dimensions": None}), keep_x),       # same-shape reshape
    Rule(Pat("convert_element_type", x), keep_x),                       # to its own aval
    Rule(Pat("copy", x), keep_x),                                       # copy
    Rule(Pat("stop_gradient", x), keep_x),                              # no gradients here
    Rule(Pat("copy_p", x), keep_x),                                     # copy
    Rule(Pat("transpose", x, params={"permutation": _identity_perm}), keep_x),
    Rule(Pat("broadcast_in_dim", x,
             params={"broadcast_dimensions": _identity_perm}), keep_x),  # same-shape bcast
    Rule(Pat("squeeze", x, params={"dimensions": ()}), keep_x),         # squeeze nothing
    Rule(Pat("slice", x), _whole_slice),                                # x[:]
]


class RemoveNops(RewritePass):
  """Optimize: drops ops that return their operand unchanged (module docstring)."""
  name = "remove_nops"
  rules = NOP_RULES
