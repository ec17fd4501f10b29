"""Build: each device partition -> one compiled XLA executable; each host
partition -> a function over its host kernels. Nothing here runs op by op in
steady state, and nothing here runs user code: executables are compiled ahead
of time for exactly the argument types of the graph."""
import dataclasses
from typing import Callable, List

import jax
import numpy as np

from jaxsession.errors import HostOpError
from jaxsession.ir import Literal, aval_str
from jaxsession.lowering import kernel_fn, lower_nodes
from jaxsession.runtime import callbacks


def shape_struct(aval):
  """The ShapeDtypeStruct an executable is compiled for (weak type kept)."""
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype,
                              weak_type=getattr(aval, "weak_type", False))


def compile_fn(fn, arg_structs, donate_argnums=()):
  """jit + lower + compile, ahead of time, for exactly these argument types.
  Its call checks the argument types before it runs or consumes anything."""
  return jax.jit(fn, donate_argnums=donate_argnums).lower(*arg_structs).compile()


@dataclasses.dataclass
class Step:
  """One partition ready to run: fn(*arrays) -> list of arrays."""
  partition: object
  fn: Callable
  in_ids: List[int]
  out_ids: List[int]
  free_after: List[int] = dataclasses.field(default_factory=list)


def host_callable(nodes, in_values, out_values):
  """Runs host kernels; a raising kernel, or one whose result does not fit
  the node's aval, becomes HostOpError naming the node."""
  fns = [kernel_fn(n) for n in nodes]

  def read(env, value):
    return value.value if isinstance(value, Literal) else env[value.id]

  def run_host(*arrays):
    env = {v.id: a for v, a in zip(in_values, arrays)}
    for node, fn in zip(nodes, fns):
      try:
        outs = fn(node, *[read(env, v) for v in node.inputs])
        _check_results(node, outs)
      except Exception as exc:
        raise HostOpError(f"host kernel {node.kernel.name} of {callbacks.where(node)} "
                          f"raised {type(exc).__name__}: {exc}") from exc
      env.update((o.id, r) for o, r in zip(node.outputs, outs))
    return [read(env, v) for v in out_values]
  return run_host


def _check_results(node, outs):
  if len(outs) != len(node.outputs):
    raise TypeError(f"returned {len(outs)} results for {len(node.outputs)} outputs")
  for i, (out, value) in enumerate(zip(outs, node.outputs)):
    shape, dtype = np.shape(out), getattr(out, "dtype", None)
    if tuple(shape) != tuple(value.aval.shape) or dtype != value.aval.dtype:
      raise TypeError(f"result {i} is {dtype}{list(shape)}, the node's output is "
                      f"{aval_str(value.aval)}")


def device_inputs(part):
  """The values a device partition takes as arguments: its inputs but the
  graph's consts, which its executable embeds."""
  return [v for v in part.inputs if v.kind != "const"]


def build_device_step(part, donated_ids, consts):
  """Compiles one device partition; its donated inputs are the state leaves
  the memory plan gave to this partition. A failing callback inside it raises
  HostOpError with the user's exception as the cause."""
  recorder = callbacks.ErrorRecorder()
  inputs = device_inputs(part)
  body = lower_nodes(callbacks.instrumented(part.nodes, recorder), inputs, part.outputs,
                     {v.id: consts[v.id] for v in part.inputs if v.kind == "const"})
  donate = tuple(i for i, v in enumerate(inputs) if v.id in donated_ids)
  exe = compile_fn(lambda *xs: body(*xs), [shape_struct(v.aval) for v in inputs], donate)
  if not part.may_fail:
    return exe

  def run_device(*arrays):
    try:
      return exe(*arrays)
    except jax.errors.JaxRuntimeError as exc:
      raise callbacks.callback_failure(part.nodes, part.index, exc, recorder)
  return run_device


def build_steps(graph, partitions, plan):
  """Every partition as a Step, with the values to forget after each."""
  donated_to = {d.state.id: d.partition for d in plan.donations if d.donated}
  steps = []
  for part in partitions:
    if part.place == "host":
      fn, inputs = host_callable(part.nodes, part.inputs, part.outputs), part.inputs
    else:
      mine = {vid for vid, index in donated_to.items() if index == part.index}
      fn, inputs = build_device_step(part, mine, graph.const_values), device_inputs(part)
    steps.append(Step(part, fn, [v.id for v in inputs], [v.id for v in part.outputs]))
  keep = {v.id for v in graph.outputs if not isinstance(v, Literal)}
  last = {}
  for i, step in enumerate(steps):
    for vid in step.in_ids:
      last[vid] = i
  for vid, i in last.items():
    if vid not in keep:
      steps[i].free_after.append(vid)
  return steps
