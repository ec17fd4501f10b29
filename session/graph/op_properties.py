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

Beside the effects, `OpFacts` holds every other per-op fact a pass or the
runtime reads (`facts(op)`): commutative, an addition, elementwise,
approximated by XLA:CPU (rounded by the kernel's size), reduces,
range-preserving, its numpy implementation (one function, read by constant
folding and by the host kernels), the batch-axis rule it takes, whether it is
a transfer, and a DCE rule where dropping dead outputs needs more than a flag.
Primitives' facts are in `OP_TABLE` below; a fused op registers its own
(`register_op`) next to its kernel, so a new fusion touches its own files.
"""
import dataclasses
from typing import Callable, Optional, Tuple
import weakref

import numpy as np
from jax.extend import core as jcore


@dataclasses.dataclass(frozen=True)
class OpProps:
  pure: bool = True
  deterministic: bool = True
  may_fail: bool = False
  user_code: bool = False
  effects: bool = False
  control_flow: bool = False
  opaque: bool = False  # a value XLA must not see through (never folded)

  @property
  def foldable(self):
    """May be evaluated at compile time (constant folding)."""
    return (self.deterministic and not self.user_code and not self.effects
            and not self.control_flow and not self.opaque)

  def join(self, other):
    """The properties of a node that runs both `self` and `other`."""
    return OpProps(pure=self.pure and other.pure,
                   deterministic=self.deterministic and other.deterministic,
                   may_fail=self.may_fail or other.may_fail,
                   user_code=self.user_code or other.user_code,
                   effects=self.effects or other.effects,
                   control_flow=self.control_flow or other.control_flow,
                   opaque=self.opaque or other.opaque)

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
_EFFECTS = OpProps(pure=False, deterministic=False, effects=True)

BATCH_RULE_NAMES = ("identity", "rows", "matmul_bias_add")


@dataclasses.dataclass(frozen=True)
class OpFacts:
  """Everything the passes and the runtime know of one op by its name."""
  props: OpProps = PLAIN          # its own effects (node_props adds its sub-jaxprs')
  commutative: bool = False       # op(a, b) is op(b, a) bit for bit: patterns try both orders
  add: bool = False               # a + b (add, add_any): what x+0 and AddN rewrite
  elementwise: bool = False       # each output element from the same element of each operand
                                  # (operands at the output's rank, or scalars): batch rule
  reduces: bool = False           # sums or takes extrema over axes (the all-reduce plan)
  range_preserving: bool = False  # integer results are values of its inputs (narrowing)
  numpy: Optional[Callable] = None  # fn(*arrays, **params) -> array: the op in numpy
  fold: Optional[str] = None      # when folding may use `numpy`: "exact" (data movement,
                                  # any dtype) or "ieee" (real floats, no NaN in the result)
  host: bool = False              # `numpy` is its host kernel on small integer/bool values
  batch: Optional[str] = None     # a batch-axis rule of BATCH_RULE_NAMES; None: the
                                  # primitive's own rule in runtime/batch_axis.py, or it mixes
  transfer: Optional[str] = None  # "d2h" or "h2d": a value moved between places
  dce: Optional[Callable] = None  # dce(node, used_outputs) -> DceResult or None (no change)
  contracts: Tuple[int, ...] = ()  # operands a matmul/convolution contracts (XLA copies a
                                  # slice before it: packed state stays out, runtime/packing.py)
  fused_through: bool = False     # moves its operand's elements without arithmetic, and
                                  # XLA fuses and rewrites through it: a divisor's broadcast
                                  # (graph/divisors.py), a product broadcast, sliced or
                                  # transposed into an add (move_into_readers.py)
  approximated: bool = False      # XLA:CPU computes it by a polynomial or a library call,
                                  # rounded by the kernel's size (vector width, remainder loop):
                                  # never merged across leaves (runtime/horizontal.py)


@dataclasses.dataclass(frozen=True)
class DceResult:
  """What a DCE rule keeps of a node: the inputs still read, the new params
  and effects, and which outputs stay (a kept output may be unused: a carry
  another carry needs)."""
  used_inputs: list
  params: dict
  effects: object
  kept_outputs: list


def _jax_dce(node, used_outputs):
  """JAX's own DCE rule (`pe.dce_rules`) for `node`'s primitive, on an
  equation made of fresh variables: it drops dead outputs and what only they
  compute inside the sub-jaxprs; effectful equations inside are kept."""
  # jax exports no public form of these rules; they are what jax.jit's DCE runs
  from jax._src import core as jax_core
  from jax._src.interpreters import partial_eval as pe
  rule = pe.dce_rules.get(node.prim)
  if rule is None:
    return None
  invars = [jax_core.Var(v.aval) for v in node.inputs]
  outvars = [jax_core.Var(v.aval) for v in node.outputs]
  eqn = jax_core.new_jaxpr_eqn(invars, outvars, node.prim, node.params, node.effects)
  used_inputs, new_eqn = rule(list(used_outputs), eqn)
  if new_eqn is None:
    return None
  kept_in = {id(v) for v in new_eqn.invars}
  kept_out = {id(v) for v in new_eqn.outvars}
  return DceResult([id(v) in kept_in for v in invars], dict(new_eqn.params),
                   new_eqn.effects, [id(v) in kept_out for v in outvars])


def _while_dce(node, used_outputs):
  """A while's carries that no used output, no other kept carry and not its
  condition need are dropped (JAX has no rule for while): the carry set grows
  to a fixed point, then body and condition lose what only the dropped ones
  computed. Effectful equations inside keep their operands alive."""
  from jax._src import core as jax_core
  from jax._src.interpreters import partial_eval as pe
  p = node.params
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cond, body = p["cond_jaxpr"], p["body_jaxpr"]
  _, cond_used = pe.dce_jaxpr(cond.jaxpr, [True], instantiate=False)
  used = [u or c for u, c in zip(used_outputs, cond_used[cn:])]
  while True:
    _, body_used = pe.dce_jaxpr(body.jaxpr, used, instantiate=False)
    grown = [u or b for u, b in zip(used, body_used[bn:])]
    if grown == used:
      break
    used = grown
  if all(used):
    return None
  new_body, body_in = pe.dce_jaxpr(body.jaxpr, used, instantiate=[False] * bn + used)
  new_cond, cond_in = pe.dce_jaxpr(cond.jaxpr, [True], instantiate=[False] * cn + used)
  params = dict(p, cond_nconsts=sum(cond_in[:cn]), body_nconsts=sum(body_in[:bn]),
                cond_jaxpr=jax_core.ClosedJaxpr(new_cond, cond.consts),
                body_jaxpr=jax_core.ClosedJaxpr(new_body, body.consts))
  return DceResult(list(cond_in[:cn]) + list(body_in[:bn]) + used, params, node.effects, used)


def _ufunc(fn):
  return lambda *xs, **_: fn(*xs)


def _broadcast_in_dim(x, shape, broadcast_dimensions, **_):
  """lax.broadcast_in_dim: operand axis k becomes output axis
  broadcast_dimensions[k], in any order (a decreasing order transposes)."""
  dims = list(broadcast_dimensions)
  order = sorted(range(len(dims)), key=dims.__getitem__)
  x = np.transpose(np.asarray(x), order)  # operand axes in the order of their output axes
  placed = sorted(dims)
  expanded = np.reshape(x, [x.shape[placed.index(i)] if i in placed else 1
                            for i in range(len(shape))])
  return np.broadcast_to(expanded, shape)


def _select_n(which, *cases, **_):
  """lax.select_n: cases[which], elementwise (a scalar `which` picks a whole
  case); any number of cases (np.choose takes at most 64)."""
  # XLA clamps a selector out of range to the first or last case
  which = np.clip(np.asarray(which).astype(np.intp), 0, len(cases) - 1)
  stacked = np.stack(cases)
  if which.ndim == 0:
    return stacked[which]
  return np.take_along_axis(stacked, which[None], axis=0)[0]


def _reshape(x, new_sizes, dimensions=None, **_):
  return np.reshape(x if dimensions is None else np.transpose(x, dimensions), new_sizes)


# the primitives of a nested jit: the importer keeps them as calls
CALLS = ("jit", "pjit")

# the ops that divide by their second operand: XLA rewrites a division by
# what makes its divisor and how many read it (optimizer_passes/cse.py does
# not mark them, runtime/horizontal.py leaves them as jax.jit has them)
DIVIDES = ("div", "rem")


def rewritten_through_one_reader(maker, reader):
  """Whether XLA's simplifier rewrites `reader` (an op name) through the
  `maker` op of its operand only where that operand has no other reader:
  the transpose of a dot, computed as the dot of the swapped operands (a
  reduction of it then sums in that layout's order); products by one
  factor added, factored; a reshape or transpose sunk below its
  elementwise reader (a reduction then sums in another order).
  move_into_readers.py, which changes how many read a value, keeps it so
  for these pairs; a division by what makes its divisor is
  graph/divisors.py's."""
  if maker == "dot_general":
    return reader == "transpose"
  if maker == "mul":  # a * c + b * c factored to (a + b) * c
    return reader in ("add", "sub")
  if maker in ("reshape", "transpose"):  # sunk below its elementwise reader (ReshapeMover)
    return facts(reader).elementwise
  return False


def _facts(*names, **facts):
  return {name: OpFacts(**facts) for name in names}


def _ufunc_facts(table, **facts):
  return {name: OpFacts(numpy=_ufunc(ufunc), **facts) for name, ufunc in table.items()}


# Elementwise primitives with no other fact (the batch rule reads `elementwise`),
# then those XLA:CPU approximates.
_ELEMENTWISE = (
    "abs ceil clz complex conj copy_p floor imag integer_pow is_finite nextafter "
    "population_count real reduce_precision rem round shift_left shift_right_arithmetic "
    "shift_right_logical sign sqrt square stop_gradient threefry2x32 random_seed "
    "random_fold_in").split()

# Elementwise primitives XLA:CPU approximates: jax.jit itself gives other bits
# for exp over a 7- and a 56-element array (1 ulp), atan 2 ulps (break-it
# rounds); the rest by the same kind of code, unmeasured.
_APPROXIMATED = (
    "acos acosh asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt cos cosh digamma erf "
    "erf_inv erfc exp exp2 expm1 igamma igamma_grad_a igammac lgamma log log1p logistic "
    "polygamma pow random_gamma_grad regularized_incomplete_beta rsqrt sin sinh tan tanh "
    "zeta").split()

# primitive name -> its facts. The numpy functions are bit-identical to XLA
# where `fold` says so (tests/rewrites_exact_test.py checks them on +-0.0,
# +-inf, NaN and subnormals) and on the integer/bool values host kernels take
# (two's complement wrap-around, as XLA). max and min fold with XLA: numpy's
# max(-0.0, 0.0) is -0.0, XLA's is 0.0.
OP_TABLE = {
    "pure_callback": OpFacts(props=_CALLBACK),
    # pure_callback is pure in JAX's sense (dropped when unused) but it runs
    # user code, which may raise and must never run at compile time; two calls
    # are never merged, since nothing promises the callback is deterministic.
    **_facts("io_callback", "debug_callback", "debug_print", props=_EFFECTFUL_CALLBACK),
    "rng_uniform": OpFacts(props=OpProps(deterministic=False)),  # each call differs
    # what XLA must not see through (lax.optimization_barrier): never folded
    "optimization_barrier": OpFacts(props=OpProps(opaque=True)),
    # a nested jit the importer keeps as a call (session/graph/importer.py):
    # XLA compiles it as a called computation, and nothing folds into it;
    # its dead outputs go by jax's own rule (a pure_callback only they read
    # runs no more than under jax.jit)
    **_facts(*CALLS, props=OpProps(opaque=True), dce=_jax_dce),
    "scan": OpFacts(props=_CONTROL_FLOW, dce=_jax_dce),
    "cond": OpFacts(props=_CONTROL_FLOW, dce=_jax_dce),
    "while": OpFacts(props=_CONTROL_FLOW, dce=_while_dce),
    **_facts(*_ELEMENTWISE, elementwise=True),
    **_facts(*_APPROXIMATED, elementwise=True, approximated=True),
    "add": OpFacts(numpy=_ufunc(np.add), add=True, commutative=True, elementwise=True,
                   fold="ieee", host=True),
    "add_any": OpFacts(add=True, commutative=True, elementwise=True),
    "mul": OpFacts(numpy=_ufunc(np.multiply), commutative=True, elementwise=True, fold="ieee",
                   host=True),
    **_ufunc_facts({"sub": np.subtract, "neg": np.negative}, elementwise=True, fold="ieee",
                   host=True),
    "div": OpFacts(numpy=_ufunc(np.divide), elementwise=True, fold="ieee"),
    **_ufunc_facts({"max": np.maximum, "min": np.minimum}, commutative=True, elementwise=True,
                   range_preserving=True, host=True),
    **_ufunc_facts({"and": np.bitwise_and, "or": np.bitwise_or, "eq": np.equal,
                    "ne": np.not_equal}, commutative=True, elementwise=True, host=True),
    **_ufunc_facts({"xor": np.bitwise_xor, "not": np.invert, "lt": np.less, "le": np.less_equal,
                    "gt": np.greater, "ge": np.greater_equal}, elementwise=True, host=True),
    "clamp": OpFacts(elementwise=True, range_preserving=True),
    "copy": OpFacts(elementwise=True, range_preserving=True),
    "convert_element_type": OpFacts(
        elementwise=True, host=True, numpy=lambda x, new_dtype, **_: x.astype(new_dtype)),
    "select_n": OpFacts(elementwise=True, range_preserving=True, host=True,
                        numpy=_select_n),
    "broadcast_in_dim": OpFacts(range_preserving=True, fused_through=True,
                                numpy=_broadcast_in_dim, fold="exact",
                                host=True),
    "reshape": OpFacts(range_preserving=True, fused_through=True, numpy=_reshape, fold="exact",
                       host=True),
    "squeeze": OpFacts(range_preserving=True, fused_through=True, fold="exact", host=True,
                       numpy=lambda x, dimensions, **_: np.squeeze(x, tuple(dimensions))),
    "transpose": OpFacts(range_preserving=True, fused_through=True, fold="exact",
                         numpy=lambda x, permutation, **_: np.transpose(x, permutation)),
    "concatenate": OpFacts(range_preserving=True, fused_through=True, host=True,
                           numpy=lambda *xs, dimension, **_: np.concatenate(xs, dimension)),
    # data movement XLA fuses an elementwise producer into (a product sliced
    # or transposed, then added: an FMA under jax.jit, a break-it find)
    **_facts("slice", "dynamic_slice", "gather", "rev", "expand_dims",
             range_preserving=True, fused_through=True),
    **_facts("pad", "split", fused_through=True),
    "sort": OpFacts(range_preserving=True),
    **_facts("reduce_max", "reduce_min", reduces=True, range_preserving=True),
    "reduce_sum": OpFacts(reduces=True),
    "dot_general": OpFacts(reduces=True, contracts=(0, 1)),
    "conv_general_dilated": OpFacts(contracts=(0, 1)),
}
_NO_FACTS = OpFacts()


def register_op(name, **facts):
  """Declares the facts of a fused (or otherwise new) op `name`; called next
  to the op's kernel. Registering again replaces them."""
  batch = facts.get("batch")
  if batch is not None and batch not in BATCH_RULE_NAMES:
    raise ValueError(f"batch rule of {name} must be one of {BATCH_RULE_NAMES}, got {batch!r}")
  OP_TABLE[name] = OpFacts(**facts)
  return OP_TABLE[name]


def unregister_op(name):
  """Forgets the facts `register_op` declared for `name`."""
  OP_TABLE.pop(name, None)


def ops_with(**wanted):
  """The names of the ops whose facts have every field of `wanted` equal to
  the value given (e.g. ops_with(add=True)), in table order."""
  return tuple(name for name, f in OP_TABLE.items()
               if all(getattr(f, k) == v for k, v in wanted.items()))


def facts(op):
  """The OpFacts of primitive or fused-op name `op` (no facts: all false)."""
  return OP_TABLE.get(op, _NO_FACTS)


def known(op):
  """Whether `op` has an entry in the table."""
  return op in OP_TABLE


def is_transfer(op, kind=None):
  """Whether `op` moves a value between places (of `kind` "d2h"/"h2d", if given)."""
  transfer = facts(op).transfer
  return transfer is not None and (kind is None or transfer == kind)


def home(value):
  """Where a Value lives: its producer's place (a transfer's result: the side
  it copies to); graph inputs and state on the device; None for a constant
  (read on either side for free). The one answer of insert_transfers, the
  graph's invariants and the memory plan's device_resident."""
  if value.producer is None:
    return None if value.kind == "const" else "device"
  kind = facts(value.producer.op).transfer
  return value.producer.place if kind is None else "host" if kind == "d2h" else "device"


def transfer_op(kind):
  """The name of the op that moves a value `kind` ("d2h" or "h2d")."""
  return next(name for name, f in OP_TABLE.items() if f.transfer == kind)


def sub_jaxprs(params):
  """The jaxprs a primitive's params carry (scan's body, cond's branches...)."""
  for value in params.values():
    items = value if isinstance(value, (tuple, list)) else (value,)
    for item in items:
      if isinstance(item, jcore.ClosedJaxpr):
        yield item.jaxpr
      elif isinstance(item, jcore.Jaxpr):
        yield item


def contracts_inside(params):
  """Whether a primitive's sub-jaxprs (at any depth) contract anything."""
  return any(facts(eqn.primitive.name).contracts or contracts_inside(eqn.params)
             for sub in sub_jaxprs(params) for eqn in sub.eqns)


def moves_or_maps(op, params):
  """Whether op `op` is elementwise arithmetic or data movement XLA fuses
  through (fused_through), or a call (jnp.pad's nested jit) whose body is
  made of such ops alone, at any depth."""
  fact = facts(op)
  if fact.elementwise or fact.fused_through:
    return True
  return op in CALLS and all(moves_or_maps(eqn.primitive.name, eqn.params)
                             for sub in sub_jaxprs(params) for eqn in sub.eqns)


# jaxpr -> its joined props; weak, so that a released jaxpr (and the arrays
# its ClosedJaxpr holds) is not kept alive by having been asked about.
_CACHE = weakref.WeakKeyDictionary()


def jaxpr_props(jaxpr):
  """The joined properties of every equation in `jaxpr`, at any depth."""
  props = _CACHE.get(jaxpr)
  if props is not None:
    return props
  props = PLAIN
  for eqn in jaxpr.eqns:
    props = props.join(primitive_props(eqn.primitive.name, eqn.params, eqn.effects))
  _CACHE[jaxpr] = props
  return props


def primitive_props(name, params, effects=()):
  """Properties of one primitive application, sub-jaxprs included."""
  props = facts(name).props
  if effects:
    props = props.join(_EFFECTS)
  for sub in sub_jaxprs(params):
    props = props.join(jaxpr_props(sub))
  return props


def node_props(node):
  """Properties of a KernelGraph node. A fused op (no primitive) is made of
  pure deterministic arithmetic unless its params carry sub-jaxprs."""
  return primitive_props(node.op, node.params, node.effects)
