"""Liveness: for each value, the step that makes it and the last step that
reads it - the one analysis behind every "free it after its last use".

A step is one item of a sequence that reads and writes value ids: a node of a
node list, or a partition of a graph in launch order. `analyze(steps, keep)`
returns a `Liveness`:

  made[id]  the step that writes it; -1 for an id read but never written
            (an input of the sequence)
  last[id]  the last step that reads it; the step that writes it when nothing
            reads it (it dies at once); `end` (= the number of steps) for an
            id in `keep` (an output of the sequence, held past its end)

Who reads it, at which granularity, computed once where:
  * per node, over one partition's nodes (keep: its outputs): lowering frees a
    traced value after its last reader (Build, once per partition); the memory
    plan's estimate of a partition (AllocateMemory, once per partition: `peak_bytes`);
  * per node, over a whole candidate order (keep: the graph outputs): reorder
    compares the peaks of its candidate orders (HardwareOptimize, once per
    order: `peak_bytes`);
  * per partition (`of_partitions`: graph inputs from -1, graph inputs and
    outputs to `end`): the memory plan's live ranges, computed once in
    AllocateMemory and stored on the plan, where donation, `memory.refine` and
    the profiler's per-partition live bytes read them;
  * per op of a Program (registers): Build's frees, once per program.
"""
import dataclasses
from typing import Dict

from jaxsession.graph.ir import Literal


@dataclasses.dataclass
class Liveness:
  made: Dict[int, int]
  last: Dict[int, int]
  end: int

  def frees(self):
    """Per step, the ids whose last step it is (kept ids are never freed),
    each list in the order the ids were first seen."""
    frees = [[] for _ in range(self.end)]
    for vid, step in self.last.items():
      if step < self.end:
        frees[step].append(vid)
    return frees

  def ranges(self):
    """id -> (made, last)."""
    return {vid: (self.made[vid], last) for vid, last in self.last.items()}

  def live_after(self, step):
    """The ids made at or before `step` and read after it."""
    return [vid for vid, last in self.last.items() if self.made[vid] <= step < last]


def peak_bytes(nodes, last, size_of, skip=frozenset()):
  """The most bytes live at once, walking `nodes` in order: each output from
  its node to its last reader (`last`: value id -> position, a node list's
  Liveness.last), sized by `size_of(value)`; the ids in `skip` not counted.
  Reorder's peak of a candidate order and the memory plan's estimate of a
  partition both add what lives throughout to it."""
  live = peak = 0
  dies = [0] * (len(nodes) + 1)
  for pos, node in enumerate(nodes):
    for out in node.outputs:
      if out.id not in skip:
        size = size_of(out)
        live += size
        dies[last[out.id]] += size
    peak = max(peak, live)
    live -= dies[pos]
  return peak


def analyze(steps, keep=()):
  """The Liveness of `steps`, an iterable of (ids read, ids written); a step
  may read an id it writes (a partition's own intermediates)."""
  made, last = {}, {}
  end = 0
  for k, (reads, writes) in enumerate(steps):
    for vid in writes:  # first: a partition reads values it makes itself
      made.setdefault(vid, k)
      last.setdefault(vid, k)  # made but never read: it dies where it is made
    for vid in reads:
      made.setdefault(vid, -1)
      last[vid] = k
    end = k + 1
  for vid in keep:
    made.setdefault(vid, -1)
    last[vid] = end
  return Liveness(made, last, end)


def node_reads(node):
  return [v.id for v in node.inputs if not isinstance(v, Literal)]


def node_writes(node):
  return [v.id for v in node.outputs]


def of_nodes(nodes, keep_values=()):
  """Liveness of a node list, one step per node; `keep_values` (Values or
  Literals) live past its end."""
  return analyze(((node_reads(n), node_writes(n)) for n in nodes),
                 [v.id for v in keep_values if not isinstance(v, Literal)])


def of_partitions(graph, partitions):
  """Liveness of `graph` at partition granularity, one step per partition in
  launch order. Graph inputs live from -1 to the end (the caller and the
  state slots hold them; a donated state buffer counts as kept, an upper
  bound), graph outputs to the end."""
  def steps():
    for part in partitions:
      yield ([vid for n in part.nodes for vid in node_reads(n)],
             [vid for n in part.nodes for vid in node_writes(n)])
  keep = [v.id for v in graph.inputs] + [v.id for v in graph.outputs
                                        if not isinstance(v, Literal)]
  return analyze(steps(), keep)


def partition_index(partitions):
  """node id -> index of the partition holding it."""
  return {n.id: p.index for p in partitions for n in p.nodes}
