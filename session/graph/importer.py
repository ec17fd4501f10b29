"""Import a ClosedJaxpr into a KernelGraph.

Call primitives whose body is an ordinary function (`jit`, `closed_call`,
`custom_jvp_call`, `custom_vjp_call`, `remat`) are inlined: the session executes
the program and never differentiates it again, so their custom derivative rules
and rematerialisation hints have nothing left to say. Control flow (`scan`,
`while`, `cond`) stays as single nodes that carry their sub-jaxprs. Consts of
the jaxpr (at any depth) become `const` inputs; literals stay literals.
"""
import jax
from jax.extend import core as jcore

from jaxsession.graph import op_properties
from jaxsession.graph.ir import KernelGraph, Literal


def _inner_jit(params):
  return params["jaxpr"]


def _inner_call(params):
  return params["call_jaxpr"]


# primitive name -> how to find the body to inline (a Jaxpr or ClosedJaxpr)
INLINE_RULES = {
    "jit": _inner_jit,
    "pjit": _inner_jit,
    "closed_call": _inner_call,
    "core_call": _inner_call,
    "custom_jvp_call": _inner_call,
    "custom_vjp_call": _inner_call,
    "custom_vjp_call_jaxpr": lambda params: params["fun_jaxpr"],
    "remat2": _inner_jit,
    "checkpoint": _inner_jit,
}


def source_of(eqn):
  """`file:line (function)` of the user frame that emitted `eqn`, or None."""
  info = getattr(eqn, "source_info", None)
  if info is None:
    return None
  try:
    from jax._src import source_info_util  # no public API for frames
    frame = source_info_util.user_frame(info.traceback)
  except Exception:  # source info is decoration; never fail an import on it
    return None
  if frame is None:
    return None
  return f"{frame.file_name.rsplit('/', 1)[-1]}:{frame.start_line} ({frame.function_name})"


def import_jaxpr(closed_jaxpr, name="graph", input_kinds=None, input_names=None):
  """Builds a KernelGraph from `closed_jaxpr`.

  input_kinds/input_names: per jaxpr invar, its kind ("input" or "state") and a
  readable name (argument index and pytree path) for dumps and errors.
  """
  jaxpr = closed_jaxpr.jaxpr
  graph = KernelGraph(name)
  n = len(jaxpr.invars)
  kinds = input_kinds or ["input"] * n
  names = input_names or [None] * n
  env = {}
  for var, kind, label in zip(jaxpr.invars, kinds, names):
    env[var] = graph.add_input(var.aval, kind=kind, name=label)
  _bind_consts(graph, env, jaxpr.constvars, closed_jaxpr.consts)
  _import_eqns(graph, env, jaxpr.eqns, {})
  graph.outputs = [_read(env, v) for v in jaxpr.outvars]
  return graph


def _bind_consts(graph, env, constvars, consts):
  for var, value in zip(constvars, consts):
    env[var] = graph.add_input(var.aval, kind="const", name=f"const {var}",
                               const_value=value)


def _read(env, atom):
  if isinstance(atom, jcore.Literal):
    return Literal(atom.val, atom.aval)
  return env[atom]


# A nested jit is a called computation for XLA, and XLA fuses across a call
# boundary otherwise than without one: inlined, jax.nn.relu before a width-1
# dense layer let XLA fuse the dot into a loop fusion jax.jit's program does
# not have (1 ulp off), and a literal operand became a constant its
# simplifier and folder see (jax.random.gamma(key, 2.0) drew other bits).
# So a nested jit stays one node, the call itself, lowered as jax.jit lowers
# it - unless jax inlines it too (`inline=True` and no constant operand: the
# session's passes then see its body), or its body has callbacks or effects
# (inlined, so that its host work is placed between executables).
KEPT_CALLS = ("jit", "pjit")


def _kept_call(eqn, inputs, memo):
  if eqn.primitive.name not in KEPT_CALLS:
    return False
  if eqn.params.get("inline", False) and not any(_constant(v, memo) for v in inputs):
    return False  # jax.jit inlines it too (optax's tree utilities)
  props = op_properties.jaxpr_props(eqn.params["jaxpr"].jaxpr)
  return not (props.user_code or props.effects)


def _constant(value, memo):
  """Whether `value` is known at compile time: a literal, a constant, or
  made from those alone by deterministic nodes (`jnp.full(8, 1.5)`).
  `memo` (value id -> bool) is the whole import's: a value's producer never
  changes, so each value is decided once, and the walk is a loop, not a
  recursion (a chain of 11k equations with a nested jit per layer)."""
  stack = [value]
  while stack:
    v = stack[-1]
    if isinstance(v, Literal) or v.id in memo:
      stack.pop()
      continue
    node = v.producer
    if node is None or not (node.props.foldable or node.props.opaque):
      memo[v.id] = node is None and v.kind == "const"
      stack.pop()
      continue
    pending = [u for u in node.inputs if not isinstance(u, Literal) and u.id not in memo]
    if pending:
      stack.extend(pending)
      continue
    memo[v.id] = all(isinstance(u, Literal) or memo[u.id] for u in node.inputs)
    stack.pop()
  return isinstance(value, Literal) or memo[value.id]


def _import_eqns(graph, env, eqns, memo):
  for eqn in eqns:
    inputs = [_read(env, v) for v in eqn.invars]
    inner = INLINE_RULES.get(eqn.primitive.name)
    if inner is not None and not _kept_call(eqn, inputs, memo):
      outs = _inline(graph, inner(eqn.params), inputs, memo)
      for var, value in zip(eqn.outvars, outs):
        env[var] = value
      continue
    node = graph.add_node(eqn.primitive.name, eqn.primitive, eqn.params, inputs,
                          [v.aval for v in eqn.outvars], eqn.effects, source_of(eqn))
    for var, value in zip(eqn.outvars, node.outputs):
      env[var] = value  # DropVars are harmless keys: nobody reads them


def _inline(graph, body, inputs, memo):
  """Imports `body` (Jaxpr or ClosedJaxpr) with its invars bound to `inputs`."""
  if isinstance(body, jcore.ClosedJaxpr):
    jaxpr, consts = body.jaxpr, body.consts
  else:
    jaxpr, consts = body, ()
  env = {}
  _bind_consts(graph, env, jaxpr.constvars, consts)
  # A body's invars may be fewer than its call's operands only for
  # custom_jvp/vjp with num_consts, where the consts lead the operands.
  for var, value in zip(jaxpr.invars, inputs[len(inputs) - len(jaxpr.invars):]):
    env[var] = value
  _import_eqns(graph, env, jaxpr.eqns, memo)
  return [_read(env, v) for v in jaxpr.outvars]
