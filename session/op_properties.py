"""One table of op properties, read by every pass and by the runtime.

For each node it answers the questions a rewrite or a plan has to ask before it
drops, merges, evaluates, moves or donates around the node:

  pure           no effect outside its outputs: may be dropped when unused (DCE)
  deterministic  the same inputs give the same outputs: may be merged (CSE) or
                 evaluated once (folding)
  may_fail       can raise at run time after its inputs were consumed (user
                 callbacks): no donated buffer may reach it, and its failure is
                 a HostOpError
  user_code      runs the user's Python: never at compile time
  effects        has JAX effects (ordered I/O, debug printing): keeps its place
  control_flow   carries sub-jaxprs (scan/while/cond): not evaluated at compile

A control-flow node's properties are those of everything inside it: a
`pure_callback` in a `scan` body makes the `scan` may_fail and user_code,
exactly as it makes a top-level node (JAX lifts effects out of sub-jaxprs the
same way, `jax/_src/core.py`). The rules are per primitive name; a primitive
without a rule is pure and deterministic unless its equation carries effects.
"""
import dataclasses

from jax.extend import core as jcore


@dataclasses.dataclass(frozen=True)
class OpProps:
  pure: bool = True
  deterministic: bool = True
  may_fail: bool = False
  user_code: bool = False
  effects: bool = False
  control_flow: bool = False

  @property
  def foldable(self):
    """May be evaluated at compile time (constant folding)."""
    return (self.deterministic and not self.user_code and not self.effects
            and not self.control_flow)

  def join(self, other):
    """The properties of a node that runs both `self` and `other`."""
    return OpProps(pure=self.pure and other.pure,
                   deterministic=self.deterministic and other.deterministic,
                   may_fail=self.may_fail or other.may_fail,
                   user_code=self.user_code or other.user_code,
                   effects=self.effects or other.effects,
                   control_flow=self.control_flow or other.control_flow)

  def describe(self):
    flags = [name for name, on in (("impure", not self.pure),
                                   ("nondeterministic", not self.deterministic),
                                   ("may_fail", self.may_fail), ("user_code", self.user_code),
                                   ("effects", self.effects)) if on]
    return ",".join(flags) or "pure"


PLAIN = OpProps()
_CALLBACK = OpProps(deterministic=False, may_fail=True, user_code=True)
_EFFECTFUL_CALLBACK = OpProps(pure=False, deterministic=False, may_fail=True,
                              user_code=True, effects=True)
_CONTROL_FLOW = OpProps(control_flow=True)

# primitive name -> its own properties (before looking inside sub-jaxprs).
# pure_callback is pure in JAX's sense (dropped when unused) but it runs user
# code, which may raise and must never run at compile time; two calls are
# never merged, since nothing promises the callback is deterministic.
OP_RULES = {
    "pure_callback": _CALLBACK,
    "io_callback": _EFFECTFUL_CALLBACK,
    "debug_callback": _EFFECTFUL_CALLBACK,
    "debug_print": _EFFECTFUL_CALLBACK,
    "rng_uniform": OpProps(deterministic=False),   # XLA's stateful RNG: each call differs
    "scan": _CONTROL_FLOW,
    "while": _CONTROL_FLOW,
    "cond": _CONTROL_FLOW,
}

_EFFECTS = OpProps(pure=False, deterministic=False, effects=True)


def _sub_jaxprs(params):
  """The jaxprs a primitive's params carry (scan's body, cond's branches...)."""
  for value in params.values():
    items = value if isinstance(value, (tuple, list)) else (value,)
    for item in items:
      if isinstance(item, jcore.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jcore.Jaxpr):
        yield item


_CACHE = {}  # id(jaxpr) -> (jaxpr, props); the jaxpr is kept so its id stays its own


def jaxpr_props(jaxpr):
  """The joined properties of every equation in `jaxpr`, at any depth."""
  hit = _CACHE.get(id(jaxpr))
  if hit is not None and hit[0] is jaxpr:
    return hit[1]
  props = PLAIN
  for eqn in jaxpr.eqns:
    props = props.join(primitive_props(eqn.primitive.name, eqn.params, eqn.effects))
  _CACHE[id(jaxpr)] = (jaxpr, props)
  return props


def primitive_props(name, params, effects=()):
  """Properties of one primitive application, sub-jaxprs included."""
  props = OP_RULES.get(name, PLAIN)
  if effects:
    props = props.join(_EFFECTS)
  for sub in _sub_jaxprs(params):
    props = props.join(jaxpr_props(sub))
  return props


def node_props(node):
  """Properties of a KernelGraph node. A fused op (no primitive) is made of
  pure deterministic arithmetic unless its params carry sub-jaxprs."""
  return primitive_props(node.op, node.params, node.effects)
