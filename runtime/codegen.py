"""Straight-line Python for a built Program (torch.fx's GraphModule idea).

A generic loop over registers costs ~1 µs per op in list comprehensions and
zips; the same plan written out as Python statements on local variables
costs a fraction of that. So Build writes each plan out once:

    def plan(state, user):
        r0, = state
        r1, = user
        r2, = f0(r1)                        # partition 0 (device)
        del r1
        try:
            r3, = f1(r2)                    # partition 1 (host)
        except Exception as exc:
            raise e1(exc) from exc          # HostOpError naming the node
        del r2
        ...
        return [r5, r0]

Each register is deleted after its last reader (graph outputs excepted), and
prefetched values start their copy to the host right after the executable
that makes them. The op functions are the Program's as built - a profiled
graph's are already wrapped in their timing (profiler.GraphHooks.timed) - so
a profiled plan needs no variant of its own. The one other form is the
direct one (`generate(..., direct=...)`): a stateless plan of array
arguments with one output, written with its run's argument check and
recovery around the same statements (`_ops`). Under jax.disable_jit() a
plan raises OpByOp before its first op (Session.run then runs the graph op
by op). A plan runs under the x64 setting it was built under: its host ops
convert what crosses (a callback's results, a value placed on the device)
as jax does under that setting (an x64 graph run with x64 off narrowed its
float64 host results, and refused them: a break-it find).
"""
import jax

from jaxsession.jax_api import ARRAY
from jaxsession.runtime import interrupts
from jaxsession.runtime.build import RECOVERABLE, moved_on_refusal


class OpByOp(Exception):
  """A plan does not start under jax.disable_jit(): its executables refuse to
  run there, the first refusing after the ones before it ran (and their host
  ops, the user's callbacks, which then ran again op by op). Session.run
  catches it and runs the graph op by op, as jax.jit runs its function there."""

  def __init__(self):
    super().__init__("jax.disable_jit() is on: the plan's executables do not run "
                     "there; the graph runs op by op")


def _names(regs):
  return ", ".join(f"r{r}" for r in regs) + ("," if len(regs) == 1 else "")


def generate(program, direct=None):
  """fn(state leaves, user leaves) -> output registers, as Python.

  With `direct` = (slow, recover), for a stateless program of array
  arguments with one output: fn(*user) -> that output - the run itself
  (executor.plan_program's, a frame and the argument lists less a call,
  measured by benchmarks/partition.py). Arguments that are not all jax.Arrays
  of the concrete type, and runs under jax.disable_jit(), go to `slow(*user)`
  (the generic run, before any op); what the ops raise goes to
  `recover(exc, user)`, as the generic run recovers it."""
  namespace = {"config": jax.config, "OpByOp": OpByOp, "X64": bool(jax.config.jax_enable_x64),
               "enable_x64": jax.enable_x64}
  fixed = set()
  for r, value in enumerate(program.template):
    if value is not None:
      namespace[f"r{r}"] = value  # constants and literals: globals of the function
      fixed.add(r)
  state = list(range(program.num_state))
  user = list(range(program.num_state, program.num_state + program.num_user))
  if direct is None:
    lines = ["def plan(state, user):",
             "  if config.jax_disable_jit:  # before any op runs: nothing runs twice",
             "    raise OpByOp()",
             "  if config.jax_enable_x64 is not X64:  # run as built",
             "    with enable_x64(X64):",
             "      return plan(state, user)"]
    if state:
      lines.append(f"  {_names(state)} = state")
    if user:
      lines.append(f"  {_names(user)} = user")
    lines += _ops(program, namespace, fixed, "  ")
    lines.append(f"  return [{', '.join(f'r{r}' for r in program.outputs)}]")
  else:
    assert not state and len(program.outputs) == 1, "direct: stateless, one output"
    namespace["slow"], namespace["recover"] = direct
    namespace["RECOVERABLE"], namespace["ARRAY"] = RECOVERABLE, ARRAY
    arrays = " and ".join(f"type(r{r}) is ARRAY" for r in user) or "True"
    lines = ["def plan(*user):",
             f"  if len(user) == {len(user)}:"]
    if user:
      lines.append(f"    {_names(user)} = user")
    lines += [f"    if {arrays} and not config.jax_disable_jit and "
              "config.jax_enable_x64 is X64:",
              "      try:"]
    lines += _ops(program, namespace, fixed, "        ")
    lines += ["      except RECOVERABLE as exc:",
              "        return recover(exc, user)",
              f"      return r{program.outputs[0]}",
              "  return slow(*user)"]
  source = "\n".join(lines) + "\n"
  exec(compile(source, "<jaxsession plan>", "exec"), namespace)  # pylint: disable=exec-used
  plan = namespace["plan"]
  plan.source = source
  return plan


def _ops(program, namespace, fixed, indent):
  """The plan's statements, one op after another at `indent`: each op's call
  (a host op's error named), its early host copies, its dead registers."""
  lines, keep = [], set(program.outputs)
  for k, op in enumerate(program.ops):
    namespace[f"f{k}"] = op.fn
    call = f"{_names(op.outs) if op.outs else '_'} = f{k}({', '.join(f'r{r}' for r in op.ins)})"
    if op.error is not None:  # a host op: whatever it raises names the node
      namespace[f"e{k}"], namespace["rewrap"] = op.error, interrupts.rewrap
      lines += [f"{indent}try:", f"{indent}  {call}", f"{indent}except Exception as exc:",
                f"{indent}  raise e{k}(exc) from exc",
                # a SIGINT handler the callback installed defers too, for the
                # rest of the run (one Ctrl-C there deleted the donated state,
                # 151 of 500: a break-it find)
                f"{indent}rewrap()"]
    elif op.host_ins:  # host results in: a transfer guard's refusal moves them
      namespace[f"g{k}"] = moved_on_refusal(op.fn, op.host_ins, op.in_shardings)
      retry = call.replace(f"f{k}(", f"g{k}(exc, ", 1)
      lines += [f"{indent}try:", f"{indent}  {call}", f"{indent}except RuntimeError as exc:",
                f"{indent}  {retry}"]
    else:
      lines.append(f"{indent}{call}")
    lines.extend(f"{indent}r{r}.copy_to_host_async()" for r in op.prefetch)
    dead = [r for r in op.frees if r not in keep and r not in fixed]
    if dead:
      lines.append(f"{indent}del {', '.join(f'r{r}' for r in dead)}")
  return lines
