"""Build: each device partition -> one compiled XLA executable; each host
partition -> a numpy function. Nothing here runs op by op in steady state."""
import dataclasses
from typing import Callable, List

import jax

from jaxsession.errors import HostOpError
from jaxsession.ir import Literal
from jaxsession.lowering import kernel_fn, lower_nodes


def shape_struct(aval):
  """The ShapeDtypeStruct an executable is compiled for (weak type kept)."""
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype,
                              weak_type=getattr(aval, "weak_type", False))


def compile_fn(fn, arg_structs, donate_argnums=()):
  """jit + lower + compile, ahead of time, for exactly these argument types."""
  return jax.jit(fn, donate_argnums=donate_argnums).lower(*arg_structs).compile()


class SignatureMismatch(TypeError):
  """Raised while tracing when a call's argument types differ from the types the
  executable was built for (so jit never quietly compiles a second program)."""


def _signature(tree):
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return treedef, [(tuple(x.shape), x.dtype) for x in leaves]


def dispatch_fn(fn, arg_structs, donate_argnums, warm_args):
  """A `jax.jit` of `fn` already compiled for `arg_structs`, for the fastest
  dispatch there is (jit's C++ path; an AOT executable's call is ~1 µs slower).

  The executable is built by one call on `warm_args` (copies the caller does
  not need back: donated ones are consumed). A later call with other argument
  types retraces, and the trace raises SignatureMismatch before anything runs
  or is donated. Only for programs without callbacks: the warm-up runs it once.
  """
  expected = _signature(tuple(arg_structs))

  def guarded(*args):
    if _signature(args) != expected:
      raise SignatureMismatch("argument types differ from the executable's")
    return fn(*args)

  jitted = jax.jit(guarded, donate_argnums=donate_argnums)
  jax.block_until_ready(jitted(*warm_args))
  return jitted


@dataclasses.dataclass
class Step:
  """One partition ready to run: fn(*arrays) -> list of arrays."""
  partition: object
  fn: Callable
  in_ids: List[int]
  out_ids: List[int]
  free_after: List[int] = dataclasses.field(default_factory=list)


def where(node):
  return f"node {node.id} '{node.op}'" + (f" at {node.source}" if node.source else "")


def host_callable(nodes, in_values, out_values):
  """Runs host kernels on numpy arrays; a raising kernel becomes HostOpError."""
  fns = [kernel_fn(n) for n in nodes]

  def read(env, value):
    return value.value if isinstance(value, Literal) else env[value.id]

  def run_host(*arrays):
    env = {v.id: a for v, a in zip(in_values, arrays)}
    for node, fn in zip(nodes, fns):
      try:
        outs = fn(node, *[read(env, v) for v in node.inputs])
      except Exception as exc:
        raise HostOpError(f"host kernel {node.kernel.name} of {where(node)} raised "
                          f"{type(exc).__name__}: {exc}") from exc
      env.update((o.id, r) for o, r in zip(node.outputs, outs))
    return [read(env, v) for v in out_values]
  return run_host


def build_device_step(part, donated_ids):
  """Compiles one device partition; its donated inputs are the state leaves
  the memory plan gave to this partition."""
  body = lower_nodes(part.nodes, part.inputs, part.outputs)
  donate = tuple(i for i, v in enumerate(part.inputs) if v.id in donated_ids)
  exe = compile_fn(lambda *xs: body(*xs), [shape_struct(v.aval) for v in part.inputs],
                   donate)
  return exe


def build_steps(graph, partitions, plan):
  """Every partition as a Step, with the values to forget after each."""
  donated = {d.state.id for d in plan.donations if d.donated}
  donated_to = {d.state.id: d.partition for d in plan.donations if d.donated}
  steps = []
  for part in partitions:
    mine = {vid for vid in donated if donated_to[vid] == part.index}
    if part.place == "host":
      fn = host_callable(part.nodes, part.inputs, part.outputs)
    else:
      fn = wrap_device_errors(build_device_step(part, mine), part)
    steps.append(Step(part, fn, [v.id for v in part.inputs], [v.id for v in part.outputs]))
  keep = {v.id for v in graph.outputs if not isinstance(v, Literal)}
  last = {}
  for i, step in enumerate(steps):
    for vid in step.in_ids:
      last[vid] = i
  for vid, i in last.items():
    if vid not in keep:
      steps[i].free_after.append(vid)
  return steps


def callback_failure(part, exc):
  """The HostOpError for a callback that failed inside device partition `part`:
  names the callback nodes and the user's exception, keeps `exc` as the cause."""
  culprits = ", ".join(where(n) for n in part.nodes if n.props.user_code) or (
      "an effectful node")
  lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
  user_error = next((ln for ln in reversed(lines) if not ln.startswith(("File", "^"))),
                    lines[0] if lines else type(exc).__name__)
  error = HostOpError(f"a callback in device partition #{part.index} ({culprits}) "
                      f"raised: {user_error}")
  error.__cause__ = exc
  return error


def wrap_device_errors(exe, part):
  """A device executable; if it contains callbacks, their failures name them."""
  if not part.may_fail:
    return exe

  def run_device(*arrays):
    try:
      return exe(*arrays)
    except jax.errors.JaxRuntimeError as exc:
      raise callback_failure(part, exc) from exc
  return run_device
