"""Pass infrastructure: Pass, PassResult, PassContext, PassManager.

A pass is small and pure: it rewrites the graph it is given and reports whether
it changed it. The manager owns everything around the passes: timing, node
counts, verification after every pass that reports a change, the invariant
checks after every stage, and the instruments (IR dumps) that watch the
pipeline from outside. Which passes run, in which order, is the table in
session/pipeline.py.
"""
import abc
import dataclasses
import time
from typing import Callable, List, Optional

from jaxsession.errors import PassError, SessionError
from jaxsession.options import SessionOptions


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
  options: SessionOptions = dataclasses.field(default_factory=SessionOptions)  # their defaults
  verify: bool = True
  records: List[PassRecord] = dataclasses.field(default_factory=list)
  # instruments: fn(stage, pass_name, graph, record) called after each pass
  instruments: List[Callable] = dataclasses.field(default_factory=list)
  # per state input, its slot (runtime.packing.SlotLeaf): which leaves share a slot
  # and the layout a shared slot keeps; None: each state input its own fresh slot
  slot_leaves: Optional[list] = None


class Pass(abc.ABC):
  """A graph pass. Subclasses set `name`, say in their module's docstring
  what they rewrite and what must run before them, and implement
  `run(graph, ctx) -> PassResult`. `required` passes are the decisions of
  their stage (kernels, places, transfers, partitions, streams, memory):
  every graph needs them, they cannot be disabled, and a user pass runs
  before them."""
  name = "pass"
  required = False
  # True: the pass writes decisions on the nodes (kernel, place, stream) and
  # edits the structure only as a side case (a cast inserted, the nodes put in
  # launch order). After it, the structure is verified again only when the
  # node list or a node's inputs or outputs changed (`_edges`): the stage
  # invariants check its decisions.
  annotates = False
  # False: the pass writes a decision on the graph alone (AllocateMemory's
  # plan), no node: its change is recorded and dumped, and nothing is
  # verified after it but at its stage's end (its own invariant)
  touches_nodes = True

  @abc.abstractmethod
  def run(self, graph, ctx) -> PassResult:
    """Rewrites `graph` in place; says whether anything changed."""

  def __repr__(self):
    return f"<pass {self.name}>"


class FunctionPass(Pass):
  """A user pass made from a plain function `fn(graph, ctx) -> bool`."""

  def __init__(self, name, fn, doc=None):
    self.name = name
    self._fn = fn
    self.__doc__ = doc or fn.__doc__

  def run(self, graph, ctx):
    return PassResult(bool(self._fn(graph, ctx)))


class PassManager:
  """One stage: a named, flat, ordered list of passes.

  With `fixed_point`, the list runs again until a whole sweep changes nothing;
  hitting `max_iterations` raises PassError rather than giving up quietly.
  `holds` names the earlier stages whose invariants every pass of this one
  keeps (`KernelGraph.verify(stages=holds, skip=stage)`: the decisions this
  stage's own passes remake are left to its end); they are checked, with the
  graph's structure, after every pass that reports a change when
  `ctx.verify` is on.
  """

  def __init__(self, stage, passes, fixed_point=False, max_iterations=10, holds=()):
    self.stage = stage
    self.passes = list(passes)
    self.fixed_point = fixed_point
    self.max_iterations = max_iterations
    self.holds = tuple(holds)

  def names(self):
    return [p.name for p in self.passes]

  def run(self, graph, ctx, disabled=()):
    if self.fixed_point:
      return run_to_fixed_point(self, graph, ctx, self.max_iterations, disabled)
    return self.sweep(graph, ctx, disabled)

  def sweep(self, graph, ctx, disabled=(), settled=None):
    """Runs every enabled pass once, in order; whether any changed the graph.
    `settled` (the fixed point's): pass name -> the graph's version when the
    pass last ran and changed nothing; a pass is skipped while the graph is
    still at that version (a pass is a function of the graph: it would find
    nothing again)."""
    changed_any = False
    for pass_ in self.passes:
      if pass_.name in disabled:
        continue
      if settled is not None and settled.get(pass_.name) == settled[None]:
        continue
      changed = run_one(pass_, graph, ctx, self.stage, self.holds)
      changed_any |= changed
      if settled is not None:
        if changed:
          settled[None] += 1
        else:
          settled[pass_.name] = settled[None]
    return changed_any


class GraphOptimizer:
  """Runs the stages of a pipeline (PassManagers, in order), each followed by
  the check of every invariant established so far: `KernelGraph.verify`
  over the stages run up to it (e.g. after SelectKernel every node has a
  kernel). Invariant checks never change the graph; a violation is a
  PassError naming the stage, its passes and the passes before it. The
  imported graph's structure is checked before the first pass when
  `ctx.verify` is on (its avals are jax's own: no shape rules asked again)."""

  def __init__(self, managers, disabled=()):
    self.managers = {m.stage: m for m in managers}
    self.disabled = frozenset(disabled)

  def run(self, graph, ctx):
    if ctx.verify:
      try:
        graph.verify(shapes=False)
      except ValueError as exc:
        raise PassError(f"the imported graph is invalid, before any pass: {exc}") from exc
    for stage in self.managers:
      self.run_stage(stage, graph, ctx)

  def run_stage(self, stage, graph, ctx):
    manager = self.managers[stage]
    changed = manager.run(graph, ctx, self.disabled)
    try:  # the structure was checked after every change already
      graph.verify(stages=manager.holds + (stage,), structure=False)
    except ValueError as exc:
      ran = [name for name in manager.names() if name not in self.disabled]
      raise _pass_error(f"stage {stage} (passes {', '.join(ran) or 'none'}) left an invalid "
                        f"graph: {exc}", stage, ctx) from exc
    return changed


def run_one(pass_, graph, ctx, stage, holds=()):
  """Runs one pass with timing, verification and instruments around it."""
  before = len(graph.nodes)
  edges = _edges(graph) if pass_.annotates and ctx.verify else None
  start = time.perf_counter()
  try:
    result = pass_.run(graph, ctx)
  except SessionError:  # KernelSelectError, PartitionError, PassError: already precise
    raise
  except Exception as exc:
    raise _pass_error(f"pass {pass_.name} raised {type(exc).__name__}: {exc}",
                      stage, ctx) from exc
  seconds = time.perf_counter() - start
  if result.changed and ctx.verify and pass_.touches_nodes:
    try:
      graph.verify(stages=holds, skip=stage,
                   structure=edges is None or _edges(graph) != edges)
    except ValueError as exc:
      raise _pass_error(f"pass {pass_.name} left an invalid graph: {exc}",
                        stage, ctx) from exc
  record = PassRecord(pass_.name, bool(result.changed), seconds, before,
                      len(graph.nodes), stage)
  ctx.records.append(record)
  for instrument in ctx.instruments:
    instrument(stage, pass_.name, graph, record)
  return result.changed


def _edges(graph):
  """The graph's structure as object identities: every node in order with its
  input and output values (a cast inserted, an input rewired or the nodes
  reordered make another list; nodes and values compare by identity)."""
  return [(node, *node.inputs, None, *node.outputs) for node in graph.nodes]


def _pass_error(message, stage, ctx):
  before = ", ".join(f"{r.stage}/{r.name}" for r in ctx.records) or "none"
  return PassError(f"{message} (stage {stage}; passes before it: {before})")


def run_to_fixed_point(manager, graph, ctx, max_iterations=10, disabled=()):
  """Sweeps `manager` until no pass changes the graph; returns whether the
  first sweep changed it. Raises PassError when the iteration limit is hit
  instead of quietly giving up."""
  changed = False
  settled = {None: 0}  # None: the graph's version (a change bumps it)
  for _ in range(max_iterations):
    if not manager.sweep(graph, ctx, disabled, settled):
      return changed
    changed = True
  raise PassError(f"stage {manager.stage} did not reach a fixed point in "
                  f"{max_iterations} iterations (passes: {manager.names()})")
