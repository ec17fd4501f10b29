"""What a run raises where jax_debug_nans (infs) finds a nan (inf): the
graph replayed op by op on the run's inputs, as jax.jit re-runs a function,
to name the node (or the state leaf passed through) that makes it, and the
step of a sunk run. The executor and loop_sink call `special_value`."""
import jax

from jaxsession.errors import HostOpError, InputError
from jaxsession.graph.ir import Literal
from jaxsession.graph.lowering import graph_consts, interpret, kernel_fn
from jaxsession.runtime import callbacks, debug_flags
from jaxsession.runtime.build import SPECIAL_VALUE


def passed_special(where, layout, leaves, kinds=None):
  """The FloatingPointError naming a state leaf the step returns as it came
  that holds a nan (inf), or None. `leaves`: the state's, in state order;
  `kinds`: what to look for (debug_flags.special_in's)."""
  for i, name in layout.passed:
    what = debug_flags.special_in(leaves[i], kinds)
    if what is not None:
      return special(
          f"{where}: {name} holds {what}, a state leaf the step returns as it "
          f"came (jax_debug_{what}s checks every output, as jax.jit does); the state "
          "is unchanged", what)
  return None


def special_value(where, graph, layout, user_leaves, exc, sunk=None):
  """The FloatingPointError for a nan (inf) jax_debug_nans (infs) found in a
  run (`exc`: jax's, or an inner one of ours): the graph's nodes are
  replayed eagerly on the run's inputs, as jax.jit re-runs a function op by
  op, to name the first node that makes one. The run's state is read from
  its slots (`layout`), which a failed run leaves as they were - not from
  what the run was given, which its executables may have donated (flags
  switched on after compile: the run worked on copies). `sunk`: (steps, per
  user leaf whether it is stacked) of a sunk run, replayed step by step
  (each step's slice of the stacked leaves, the state carried), naming the
  step of the whole run."""
  what = getattr(exc, "special", None) or (exc.args[1] if len(exc.args) > 1 else "nan")
  kinds = debug_flags.checked_kinds()  # read before the replay turns the checks off
  if graph.replays_specials:  # else its caller's to explain (js.jit: as jax.jit does)
    error = _replayed(where, graph, layout, user_leaves, kinds, sunk)
    if error is not None:
      return error
  if getattr(exc, "special", None):
    return exc  # an inner run's error, already in these words
  return special(  # the state is the slots' own, untouched (Runner.call)
      f"{where}: an executable ({exc.args[0] if exc.args else '?'}) produced {what} "
      f"(jax_debug_{what}s); the state is unchanged", what)


def _replayed(where, graph, layout, user_leaves, kinds, sunk):
  """special_value's error naming the node (or the state leaf) that makes a
  nan (inf), found by replaying the run; None where the replay finds none
  or cannot run."""
  try:
    with debug_flags.checks_off():  # the replay checks each node's outputs itself
      state = list(layout.leaves_of(layout.gather()))
      passed = passed_special(where, layout, state, kinds)  # packed: in an output
      if sunk is None:
        steps, slices = 1, lambda t: list(user_leaves)
      else:
        steps, stacked = sunk
        slices = lambda t: [x[t] if s else x for x, s in zip(user_leaves, stacked)]  # noqa: E731
      for t in range(steps):
        found, state = _replay(graph, state, slices(t), kinds)
        if found is not None:
          node, kind = found
          return special(f"{where}: node {node.id} '{node.op}'"
                          + (f" at {node.source}" if node.source else "")
                          + (f", step {t} of the {steps} steps" if sunk else "")
                          + f" produced {kind} (jax_debug_{kind}s)", kind)
      if passed is not None:  # no node made it: a leaf returned as it came holds it
        return passed
  except HostOpError:  # (a RuntimeError: not the replay's own failure)
    raise
  except (InputError, KeyError, TypeError, ValueError, RuntimeError):
    pass  # the replay could not run: name the executable
  return None


def special(message, what):
  """A FloatingPointError that says which flag found it (`special`), so a
  sunk run made of several calls can replay the whole run."""
  error = FloatingPointError(message)
  error.special = what
  return error


class _Found(Exception):
  """The replay's stop: `node` made a value of `kind`."""

  def __init__(self, node, kind):
    super().__init__(kind)
    self.node, self.kind = node, kind


def _replay(graph, state, user, kinds):
  """One step of the graph op by op, each node's outputs checked for the
  `kinds` ('nan', 'inf') the flags were on for - by the replay itself, not
  by jax's checks, which a thread's earlier `with jax.debug_nans(...)` block
  may have left off for jitted kernels: ((node, kind) or None, the new
  state leaves)."""
  env = dict(graph_consts(graph))
  env.update(zip([v.id for v in graph.inputs if v.kind != "const"], state + user))

  def call(node, ins):
    try:
      outs = jax.block_until_ready(kernel_fn(node)(node, *ins))
    except (FloatingPointError, SPECIAL_VALUE):  # jax's checks, if still on
      raise _Found(node, kinds[0] if kinds else "nan") from None
    except Exception as exc:
      # a callback raising as it runs again: its error, as jax.jit's
      # de-optimized call raises it
      if node.place == "host" or node.props.may_fail:
        raise HostOpError(f"host kernel {node.kernel.name} of {callbacks.where(node)} "
                          f"raised {type(exc).__name__}: {exc} (as the run was replayed "
                          "to find its nan or inf)") from exc
      raise
    for out in outs:
      kind = debug_flags.special_in(out, kinds)
      if kind is not None:
        raise _Found(node, kind)
    return outs
  try:
    interpret(graph.nodes, env, call)
  except _Found as found:
    return (found.node, found.kind), state
  updates = dict((s.id, new) for s, new in graph.state_updates())
  new = [updates.get(s.id, s) for s in graph.inputs_of_kind("state")]
  return None, [v.value if isinstance(v, Literal) else env[v.id] for v in new]
