"""Straight-line Python for a built Program (torch.fx's GraphModule idea).

A generic loop over registers costs ~1 µs per op in list comprehensions and
zips; the same plan written out as Python statements on local variables
costs a fraction of that. So Build writes the plan out once:

    def plan(state, user, observe):
        r0, = state
        r1, = user
        try:
            r2, = f0(r1)                    # partition 0 (device)
        except ARG_MISMATCH:                # checked before it ran or consumed
            r1 = conform(0, 0, r1)
            r2, = f0(r1)
        del r1
        try:
            r3, = f1(r2)                    # partition 1 (host)
        except Exception as exc:
            raise e1(exc) from exc          # HostOpError naming the node
        del r2
        ...
        return [r5, r0]

Each register is deleted after its last reader (graph outputs excepted),
prefetched values start their copy to the host right after the executable
that makes them, and the observed variant calls `observe(partition)` after
each partition.
"""
import jax

from jaxsession.runtime.build import ARG_MISMATCH


def _names(regs):
  return ", ".join(f"r{r}" for r in regs) + ("," if len(regs) == 1 else "")


def generate(program, conform_leaf, observed=False):
  """fn(state leaves, user leaves, observe) -> output registers, as Python."""
  namespace = {"ARG_MISMATCH": ARG_MISMATCH, "conform": conform_leaf,
               "RUNTIME_FAILURE": jax.errors.JaxRuntimeError}
  fixed = set()
  for r, value in enumerate(program.template):
    if value is not None:
      namespace[f"r{r}"] = value  # constants and literals: globals of the function
      fixed.add(r)
  lines = ["def plan(state, user, observe):"]
  state = list(range(program.num_state))
  user = list(range(program.num_state, program.num_state + program.num_user))
  if state:
    lines.append(f"  {_names(state)} = state")
  if user:
    lines.append(f"  {_names(user)} = user")
  keep = set(program.outputs)
  ops = program.ops
  for k, op in enumerate(ops):
    namespace[f"f{k}"] = op.fn
    args = ", ".join(f"r{r}" for r in op.ins)
    call = f"{_names(op.outs) if op.outs else '_'} = f{k}({args})"
    if op.error is not None:  # a host op: whatever it raises names the node
      namespace[f"e{k}"] = op.error
      lines.append("  try:")
      lines.append(f"    {call}")
      lines.append("  except Exception as exc:")
      lines.append(f"    raise e{k}(exc) from exc")
    elif k == 0 and program.first_checked:
      lines.append("  try:")
      lines.append(f"    {call}")
      lines.append("  except ARG_MISMATCH:")
      for r, i, j in program.first_checked:
        lines.append(f"    r{r} = conform({i}, {j}, r{r})")
      lines.append(f"    {call}")
      lines.append("  except RUNTIME_FAILURE:")  # a failure while running: as it is
      lines.append("    raise")
      lines.append("  except RuntimeError:")  # refused before running: a deleted array
      for r, i, j in program.first_checked:
        lines.append(f"    conform({i}, {j}, r{r})")  # InputError naming it
      lines.append("    raise")
    else:
      lines.append(f"  {call}")
    for r in op.prefetch:
      lines.append(f"  r{r}.copy_to_host_async()")
    dead = [r for r in op.frees if r not in keep and r not in fixed]
    if dead:
      lines.append(f"  del {', '.join(f'r{r}' for r in dead)}")
    if observed and (k + 1 == len(ops) or ops[k + 1].partition != op.partition):
      lines.append(f"  observe({op.partition})")
  lines.append(f"  return [{', '.join(f'r{r}' for r in program.outputs)}]")
  source = "\n".join(lines) + "\n"
  exec(compile(source, f"<jaxsession plan{' observed' if observed else ''}>", "exec"),
       namespace)
  plan = namespace["plan"]
  plan.source = source
  return plan
