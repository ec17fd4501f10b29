"""Build, the last stage (session/pipeline.py's STAGES): the final graph
turned into what runs it. A graph of one device partition is one executable
(executor.single_program); any other is a plan of executables and host ops
(runtime/build.py's build_program, run by executor.plan_program). Each is
compiled ahead of time - no warm-up: nothing of the user's runs here - with
the graph's consts embedded as jax.jit embeds a closure's, and the memory
plan refined with each executable's own figures (memory.refine: the
save_graphs dump `NNN_Build.ir` shows them)."""
import functools

from jaxsession.runtime import build as build_lib, executor, interrupts, loop_sink, memory
from jaxsession.runtime.state_layout import state_layout


def build(graph, spec, rest_tree, leaf_slots, platform, cache=None, key=None, hooks=None):
  """(the graph's Runner, make_sunk(steps, leading, parts=None): the Runner
  of `run(..., steps=N)`, eager(steps, leading): the op-by-op Runner of a
  run under jax.disable_jit). `hooks`: the profiler's, which each op's
  function is wrapped in, once, here."""
  interrupts.install()  # (the unraisable hook: again per compile, where it was replaced)
  parts = graph.partitions
  one = len(parts) <= 1 and all(p.place == "device" for p in parts)
  layout = state_layout(graph, graph.memory, leaf_slots, one)
  if one:
    program = executor.single_program(graph, spec, rest_tree, layout, cache, key, hooks)
    sunk = lambda steps, leading: loop_sink.sunk_program(  # noqa: E731
        graph, spec, rest_tree, layout, steps, hooks, leading)
  else:
    program = executor.plan_program(graph, build_lib.build_program(
        graph, parts, graph.memory, spec, platform, cache, key, hooks), spec,
        rest_tree, layout)
    sunk = lambda steps, leading: loop_sink.stepped_program(  # noqa: E731
        program, layout, spec, rest_tree, steps, leading, graph)
  memory.refine(graph.memory, graph, parts, program.analyses, platform)
  user_code = any(p.may_fail for p in parts)  # callbacks (or host kernels) run in it
  runner = functools.partial(executor.Runner, layout=layout, where=spec.where,
                             user_code=user_code)
  eager = lambda steps, leading=None: runner(  # noqa: E731
      executor.eager_program(graph, spec, rest_tree, layout, steps, leading))

  def make_sunk(steps, leading, parts=None):  # parts: chunked_program's
    if parts is None:
      return runner(sunk(steps, leading))
    return runner(loop_sink.chunked_program(parts, layout, spec, rest_tree, steps,
                                            leading, graph))
  return runner(program), make_sunk, eager
