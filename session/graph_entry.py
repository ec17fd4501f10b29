"""A compiled graph as a Session keeps it: everything `run` needs, the
state-set guard, and the factory of its sunk (`steps=N`) calls."""
import dataclasses
from typing import Any, Dict, List

from jaxsession.errors import InputError
from jaxsession.graph import settings
from jaxsession.inputs import ArgSpec
from jaxsession.report import CompileReport
from jaxsession.runtime import loop_sink
from jaxsession.runtime.state import StateSlot, slots_lock


@dataclasses.dataclass
class Entry:
  """A compiled graph and everything `run` needs."""
  name: str
  graph: Any
  report: CompileReport
  runner: Any               # executor.Runner: run's one path
  spec: ArgSpec
  slots: List[StateSlot]
  make_sunk: Any            # (steps, leading[, chunks]) -> the Runner of run(steps=, in_axes=)
  hooks: Any = None         # the profiler's GraphHooks, when profiling
  make_eager: Any = None    # (steps, leading) -> the Runner of a run under jax.disable_jit()
  weak_outputs: Any = None  # weak_outputs.WeakOutputs: output weak types follow the scalars
  sunk: Dict[Any, Any] = dataclasses.field(default_factory=dict)  # (steps, leading) -> call
  chunks: Dict[Any, Any] = dataclasses.field(default_factory=dict)  # (steps, leading) -> Runner
  first_steps: int = None   # the first steps value run: its own executable per in_axes
  released: bool = False
  bucketed: Any = None      # a BucketedGraph: run dispatches to its sub-graphs
  # the jax settings it was compiled under: what run builds later is built under them
  settings: Any = dataclasses.field(default_factory=settings.snapshot)

  def __post_init__(self):
    self.call = self._wrap(self.runner, None)  # run's hot path: one attribute, one call
    program = self.runner.program
    # run's fast path (benchmarks/dispatch.py's tiny stateless row): where the
    # call is a stateless program's own run with nothing around it, run calls
    # it and recovers a refusal itself - Runner.call's frame less a call
    self.direct = program.run if self.call is self.runner.call and program.bare and \
        self.bucketed is None and not self.spec.local_pieces else None
    if any(slot.unset for slot in self.slots):  # compiled from ShapeDtypeStructs
      self.call = self._until_set(self.call)
    if self.spec.weak_sensitive:  # only where a weak type changes the program
      self.call = self.spec.weak_guard(self.call)
    if self.weak_outputs is not None:  # only where the graph has scalar run args
      self.call = self.weak_outputs.guard(self.call)
    self.call = self._pieces(self.call)
    if self.call is not self.runner.call:  # guarded: no fast path around the guards
      self.direct = None
    self.lock = slots_lock(self.slots)
    executables = self.runner.program.executables
    self.executables = [executables[k] for k in sorted(executables)]

  def check_set(self, what="run"):
    """InputError while a state arg is unset (compiled from ShapeDtypeStructs)."""
    for k, slot in enumerate(self.slots):
      if slot.unset:
        where = self.spec.where.replace("run(", f"{what}(", 1)  # names the graph's id
        raise InputError(f"{where}: state arg {k} ({slot.name}) is unset: "
                         "it was compiled from jax.ShapeDtypeStruct examples; bind it with "
                         "set_state, replace_state or restore first")

  def _until_set(self, call):
    """`call`, refused while the state is unset; once it is set (here or
    through a graph sharing the slots), the call itself again."""
    def guarded(args):
      self.check_set()
      self.call = guarded_call[0]
      return self.call(args)
    guarded_call = [call]
    return guarded

  def _sunk_guards(self, call, leading):
    """A sunk call's guards, as a single run's: the weak-type one on its
    arguments, stacked or not (jax.jit's scan over strongly typed steps
    compiles another program than over weak ones); the output weak types
    following the steps' (stacked as a scan stacks them); _pieces."""
    if self.spec.weak_sensitive:
      call = self.spec.weak_guard(call, leading)
    if self.weak_outputs is not None:
      call = self.weak_outputs.guard(call, always=True)
    return self._pieces(call, leading)

  def _pieces(self, call, leading=None):
    """`call`, where many processes each pass their own rows: the global
    batch assembled first (ArgSpec.conform)."""
    if not self.spec.local_pieces:
      return call
    conform = self.spec.conform
    return lambda args: call(conform(args, leading=leading))

  def _wrap(self, runner, steps):
    return runner.call if self.hooks is None else self.hooks.run_call(runner.call, steps)

  def sunk_call(self, steps, leading):
    """The call of run(steps=steps) (`leading`: loop_sink.check_in_axes's),
    built on first use: the first steps value a graph runs compiles its own
    executable (one per in_axes pattern it runs with); any other runs as
    chunks of power-of-two steps (64 + 32 + 4 for 100), each chunk's
    executable compiled once and shared by every steps value - the short
    last chunk of an epoch compiles at most log2(steps) + 1 small ones, once."""
    kind = "one executable (lax.scan)" if self.runner.layout.one_executable else \
        "the plan, once per step"
    sizes = loop_sink.chunk_sizes(steps)
    if self.first_steps is None:
      self.first_steps = steps
    # the first steps value, under any in_axes, runs as one scan (chunks are
    # loops of other lengths: another in_axes there was 1 ulp off, a break-it find)
    if steps == self.first_steps or len(sizes) == 1:
      runner = self.chunks[steps, leading] = self.make_sunk(steps, leading)
      self.report.loop_sink[steps] = kind
      return self._sunk_guards(self._wrap(runner, steps), leading)
    parts = []
    for size in sizes:
      part = loop_sink.with_steps(leading, size)
      if (size, part) not in self.chunks:
        self.chunks[size, part] = self.make_sunk(size, part)
        self.report.loop_sink.setdefault(size, kind)
      parts.append((size, self.chunks[size, part].program))
    runner = self.make_sunk(steps, leading, parts)
    self.report.loop_sink[steps] = f"chunks of {' + '.join(map(str, sizes))} steps ({kind} each)"
    return self._sunk_guards(self._wrap(runner, steps), leading)
