"""Pass infrastructure: Pass, PassResult, PassContext, PassManager.

A pass is small and pure: it rewrites the graph it is given and reports whether
it changed it. The manager owns everything around the passes: timing, node
counts, verification after every pass that reports a change, and the
instruments (IR dumps) that watch the pipeline from outside.
"""
import abc
import dataclasses
import time
from typing import Any, Callable, List

from jaxsession.errors import PassError, SessionError


@dataclasses.dataclass
class PassResult:
  changed: bool


class PassRecord(tuple):
  """One pass run, as `report.passes` lists it: the 5-tuple (name, changed,
  seconds, nodes before, nodes after) of the API contract, with the fields
  also by name and the stage it ran in as `.stage`."""

  def __new__(cls, name, changed, seconds, nodes_before, nodes_after, stage=""):
    record = super().__new__(cls, (name, changed, seconds, nodes_before, nodes_after))
    record.stage = stage
    return record

  name = property(lambda self: self[0])
  changed = property(lambda self: self[1])
  seconds = property(lambda self: self[2])
  nodes_before = property(lambda self: self[3])
  nodes_after = property(lambda self: self[4])

  def __repr__(self):
    return (f"PassRecord({self.stage}/{self.name}, changed={self.changed}, "
            f"{self.seconds * 1e3:.2f} ms, {self.nodes_before} -> {self.nodes_after})")


@dataclasses.dataclass
class PassContext:
  """What passes may read besides the graph, and where the records go."""
  platform: str = "cpu"
  options: Any = None
  verify: bool = True
  records: List[PassRecord] = dataclasses.field(default_factory=list)
  # instruments: fn(stage, pass_name, graph, record) called after each pass
  instruments: List[Callable] = dataclasses.field(default_factory=list)
  history: List[str] = dataclasses.field(default_factory=list)


class Pass(abc.ABC):
  """A graph pass. Subclasses set `name`, document what they rewrite and what
  must run before them, and implement `run(graph, ctx) -> PassResult`.
  `required` passes make decisions every graph needs and cannot be disabled."""
  name = "pass"
  required = False

  @abc.abstractmethod
  def run(self, graph, ctx) -> PassResult:
    """Rewrites `graph` in place; says whether anything changed."""

  def __repr__(self):
    return f"<pass {self.name}>"


class FunctionPass(Pass):
  """A pass made from a plain function `fn(graph, ctx) -> bool`."""

  def __init__(self, name, fn, doc=None, required=False):
    self.name = name
    self.required = required
    self._fn = fn
    self.__doc__ = doc or fn.__doc__

  def run(self, graph, ctx):
    return PassResult(bool(self._fn(graph, ctx)))


class PassManager:
  """A named, flat, ordered list of passes for one stage.

  With `fixed_point`, the list runs again until a whole sweep changes nothing;
  hitting `max_iterations` raises PassError rather than giving up quietly.
  `settle(graph, ctx)`, when given, runs after every pass that changed the
  graph and completes the decisions earlier stages made for nodes the pass
  created (their kernel, place, partition); if it raises, the PassError
  names the pass.
  """

  def __init__(self, stage, passes, fixed_point=False, max_iterations=10, settle=None):
    self.stage = stage
    self.passes = list(passes)
    self.fixed_point = fixed_point
    self.max_iterations = max_iterations
    self.settle = settle

  def names(self):
    return [p.name for p in self.passes]

  def run(self, graph, ctx, disabled=()):
    if self.fixed_point:
      return run_to_fixed_point(self, graph, ctx, self.max_iterations, disabled)
    return self.sweep(graph, ctx, disabled)

  def sweep(self, graph, ctx, disabled=()):
    """Runs every enabled pass once, in order; whether any changed the graph."""
    changed_any = False
    for pass_ in self.passes:
      if pass_.name in disabled:
        continue
      changed_any |= run_one(pass_, graph, ctx, self.stage, self.settle)
    return changed_any


class GraphOptimizer:
  """Runs the pass managers of the graph stages, one stage at a time."""

  def __init__(self, managers, disabled=()):
    self.managers = {m.stage: m for m in managers}
    self.disabled = frozenset(disabled)

  def run_stage(self, stage, graph, ctx):
    return self.managers[stage].run(graph, ctx, self.disabled)


def run_one(pass_, graph, ctx, stage, settle=None):
  """Runs one pass with timing, verification and instruments around it."""
  before = len(graph.nodes)
  start = time.perf_counter()
  try:
    result = pass_.run(graph, ctx)
  except SessionError:  # KernelSelectError, PartitionError, PassError: already precise
    raise
  except Exception as exc:
    raise _pass_error(f"pass {pass_.name} raised {type(exc).__name__}: {exc}",
                      stage, pass_, ctx) from exc
  seconds = time.perf_counter() - start
  if result.changed and settle is not None:
    try:
      settle(graph, ctx)
    except SessionError as exc:
      raise _pass_error(f"pass {pass_.name} created nodes the earlier stages' decisions "
                        f"cannot be completed for: {exc}", stage, pass_, ctx) from exc
  if result.changed and ctx.verify:
    try:
      graph.verify()
    except ValueError as exc:
      raise _pass_error(f"pass {pass_.name} left an invalid graph: {exc}",
                        stage, pass_, ctx) from exc
  record = PassRecord(pass_.name, bool(result.changed), seconds, before,
                      len(graph.nodes), stage)
  ctx.records.append(record)
  ctx.history.append(f"{stage}/{pass_.name}")
  for instrument in ctx.instruments:
    instrument(stage, pass_.name, graph, record)
  return result.changed


def _pass_error(message, stage, pass_, ctx):
  before = ", ".join(ctx.history) or "none"
  return PassError(f"{message} (stage {stage}; passes before it: {before})")


def run_to_fixed_point(manager, graph, ctx, max_iterations=10, disabled=()):
  """Sweeps `manager` until no pass changes the graph; returns whether the
  first sweep changed it. Raises PassError when the iteration limit is hit
  instead of quietly giving up."""
  changed = False
  for _ in range(max_iterations):
    if not manager.sweep(graph, ctx, disabled):
      return changed
    changed = True
  raise PassError(f"stage {manager.stage} did not reach a fixed point in "
                  f"{max_iterations} iterations (passes: {manager.names()})")
