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
each partition. The profiled variant (runtime/profiler.py) runs each
partition under a `jax.profiler.TraceAnnotation`, waits for a device
partition's outputs, and reports its start and end (and those of each
transfer that runs as a step of its own):

        _t0 = now()
        if _traced:                         # JAX's profiler is tracing (read per run)
            with TraceAnnotation(n0):       # "jaxsession graph 3 partition 0"
                r2, = f0(r1)
                r2.block_until_ready()      # the device work belongs to partition 0
                del r1
        else:                               # the same statements, not annotated
            ...
        rec((G, 0, _t0, now(), 4096, 0))    # the record; live bytes from the plan

(`done(0, _t0, now())` instead where the allocator is asked for live bytes.)
"""
import time

import jax

from jaxsession.runtime.build import ARG_MISMATCH


def _names(regs):
  return ", ".join(f"r{r}" for r in regs) + ("," if len(regs) == 1 else "")


def _call_lines(k, op, program):
  """The statements that run op k, with its error handling."""
  call = f"{_names(op.outs) if op.outs else '_'} = f{k}({', '.join(f'r{r}' for r in op.ins)})"
  if op.error is not None:  # a host op: whatever it raises names the node
    return ["try:", f"  {call}", "except Exception as exc:", f"  raise e{k}(exc) from exc"]
  if k == 0 and program.first_checked:
    return (["try:", f"  {call}", "except ARG_MISMATCH:"]
            + [f"  r{r} = conform({i}, {j}, r{r})" for r, i, j in program.first_checked]
            + [f"  {call}",
               "except RUNTIME_FAILURE:",  # a failure while running: as it is
               "  raise",
               "except RuntimeError:"]  # refused before running: a deleted array
            + [f"  conform({i}, {j}, r{r})"  # InputError naming it
               for r, i, j in program.first_checked]
            + ["  raise"])
  return [call]


def generate(program, conform_leaf, observed=False, profile=None):
  """fn(state leaves, user leaves, observe) -> output registers, as Python.

  `profile` (a profiler.GraphHooks), when given, makes the profiled variant:
  it reads `profile.annotation(partition)`, `profile.partition_done(
  partition, start_ns, end_ns)`, `profile.transfer_done(transfer, start_ns,
  end_ns)` and `profile.timed_ops(program)` ({op index: transfer index}, the
  transfers that run as ops of their own)."""
  namespace = {"ARG_MISMATCH": ARG_MISMATCH, "conform": conform_leaf,
               "RUNTIME_FAILURE": jax.errors.JaxRuntimeError}
  timed = {}
  if profile is not None:
    namespace.update(now=time.perf_counter_ns, TraceAnnotation=jax.profiler.TraceAnnotation,
                     done=profile.partition_done, moved=profile.transfer_done,
                     block=jax.block_until_ready, traced=profile.trace_active,
                     rec=profile.record, G=profile.graph_id)
    timed = profile.timed_ops(program)
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
  if profile is not None:
    lines.append("  _traced = traced()")  # JAX's profiler tracing: annotate
  keep = set(program.outputs)
  ops = program.ops
  group = []  # the statements of the current partition
  for k, op in enumerate(ops):
    namespace[f"f{k}"] = op.fn
    if op.error is not None:
      namespace[f"e{k}"] = op.error
    call = _call_lines(k, op, program)
    if k in timed:  # a transfer step: timed on its own, its copy waited for
      call = (["_t1 = now()"] + call
              + [f"block([{', '.join(f'r{r}' for r in op.outs)}])",
                 f"moved({timed[k]}, _t1, now())"])
    group.extend(call)
    group.extend(f"r{r}.copy_to_host_async()" for r in op.prefetch)
    if profile is not None and op.error is None and op.outs:  # a device op: wait for
      group.append(f"r{op.outs[0]}.block_until_ready()")  # its work (one execution
                                                         # makes every output ready)
    dead = [r for r in op.frees if r not in keep and r not in fixed]
    if dead:
      group.append(f"del {', '.join(f'r{r}' for r in dead)}")
    if k + 1 < len(ops) and ops[k + 1].partition == op.partition:
      continue
    if profile is not None:
      k = op.partition
      namespace[f"n{k}"] = profile.annotation(k)
      live = None if profile.live is None else profile.live(k)
      group = (["_t0 = now()", "if _traced:", f"  with TraceAnnotation(n{k}):"]
               + [f"    {line}" for line in group] + ["else:"]
               + [f"  {line}" for line in group]
               + [f"done({k}, _t0, now())" if profile.live is None
                  else f"rec((G, {k}, _t0, now(), {live!r}, 0))"])
    if observed:
      group.append(f"observe({op.partition})")
    lines.extend(f"  {line}" for line in group)
    group = []
  lines.append(f"  return [{', '.join(f'r{r}' for r in program.outputs)}]")
  source = "\n".join(lines) + "\n"
  variant = " profiled" if profile is not None else " observed" if observed else ""
  exec(compile(source, f"<jaxsession plan{variant}>", "exec"), namespace)
  plan = namespace["plan"]
  plan.source = source
  return plan
