"""The all-reduce bucket plan: gradient all-reduces fused into buckets.

What: under a mesh (SessionOptions.mesh) with `allreduce_bucket_bytes` set,
the pass `plan_allreduce` (HardwareOptimize, before placement) rewrites every
sum over the sharded batch axis - a `reduce_sum` over the rows, a
`dot_general` contracting the rows of both operands (a weight gradient
dW = x^T dy) - into two steps:
  * `dp_partial`: the same reduction, computed by each device on its own rows
    only, stacked over the devices: output [D, *S] laid out P(axis), so each
    device's partial sum stays on it (no communication yet);
  * `allreduce_bucket`: many partials at once - each flattened to [D, n_i],
    concatenated to [D, N], summed over the devices (XLA's SPMD partitioner,
    GSPMD, makes that exactly one all-reduce), split and reshaped back into
    the reduced values, replicated.
Under a ZeRO layout (`state_specs="zero"`, or a leaf sharded on one axis
over the row axis) a point whose sum has the shape of a sharded state leaf
it feeds is instead reduce-scattered: `dp_reduce_scatter` sums the partials
over the devices and leaves each device only its shard, laid out as the
leaf (one reduce-scatter: 1/D of the all-reduce's bytes per device), not
bucketed. GSPMD alone all-reduces the whole gradient and then slices it.
The points are grouped in graph order - the backward pass's order, so the
last layer's gradients come first - into buckets of at most
`first_bucket_bytes` (the first one) and `allreduce_bucket_bytes` (the
others); a value larger than the limit gets a bucket of its own; a point
that depends on an earlier member of the open bucket (BatchNorm statistics
in the forward pass, then gradients computed from them) or has another
dtype closes it. The plan is `graph.allreduce_plan` (an `AllReducePlan`).

Why: left alone, GSPMD puts one all-reduce after each such reduction (one per
gradient leaf); XLA's combiners merge them later by their own thresholds, or,
on CPU, all into one. Planning the buckets in the graph (MindSpore's
AllReduceFusion, PyTorch DDP's buckets) makes the collective count and sizes a
decision the session states: with the backend's combiner disabled, the
executable has exactly one all-reduce per bucket.

Which values carry the sharded rows is tracked from the run arguments whose
sharding splits axis 0 over the mesh's first axis, through the batch-axis
rules of the padding analysis (runtime/batch_axis.py `step`). The walk is
this module's own: a reduction point's output is replicated (no rows), and a
row-free operand meeting the rows is fine here (each device reads its slice
of a replicated value), where padding must refuse it. An operation the rules
cannot follow makes its outputs unknown; reductions of unknown values, and
ops without a rule (unknown fused ops, control flow that mixes), are left to
GSPMD. Results differ from single-device jax.jit only by summation order
(partial sums per device, then a sum over devices - what GSPMD does anyway).
"""
import dataclasses
import heapq
from typing import List, Optional

from absl import logging
import numpy as np
from jax.core import ShapedArray
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsession.graph import op_properties
from jaxsession.kernels import fused  # PARTIAL_PRIMITIVES: what a dp_partial may compute
from jaxsession.graph.ir import Value, aval_bytes
from jaxsession.runtime.batch_axis import step
from jaxsession.runtime.batch_rules import Eqn, Fact, FREE, Mixing

PARTIAL_OP = "dp_partial"
BUCKET_OP = "allreduce_bucket"
SCATTER_OP = "dp_reduce_scatter"
_UNKNOWN_INPUT = -1  # mixed_by of an input whose rows are not the batch's


@dataclasses.dataclass
class Bucket:
  """One fused all-reduce: its members' partials summed over the devices."""
  index: int
  bytes: int
  dtype: str
  members: List[int]       # dp_partial node ids, in graph order
  replaced: List[int]      # the reduction node ids they replaced
  serves: List[str]        # state leaves whose new value reads a member; outputs
  closed: str = ""         # why no further point joined
  node: Optional[int] = None  # the allreduce_bucket node id

  def describe(self):
    serves = _short(self.serves)
    return (f"bucket {self.index}: {len(self.members)} point(s), {self.bytes} B {self.dtype}, "
            f"node {self.node}, partials {self.members} (replacing nodes {self.replaced})"
            + (f", serves {serves}" if serves else "") + f"; closed: {self.closed}")


@dataclasses.dataclass
class Scatter:
  """One sum over the rows reduce-scattered into a sharded state leaf's layout."""
  node: int                # the dp_reduce_scatter node id
  replaced: int            # the reduction node id it replaced
  partial: int             # its dp_partial node id
  leaf: str                # the state leaf whose layout it takes
  dim: int                 # the axis scattered over the devices
  bytes: int               # the whole sum's bytes; each device receives bytes / devices

  def describe(self, devices):
    return (f"reduce-scatter node {self.node}: node {self.replaced} summed over the rows "
            f"(partials node {self.partial}), its axis {self.dim} scattered for {self.leaf}: "
            f"{self.bytes // devices} B per device instead of {self.bytes} B all-reduced")


@dataclasses.dataclass
class AllReducePlan:
  """The buckets and reduce-scatters of one graph, and the reductions left to GSPMD."""
  mesh_axis: Optional[str]  # None: no plan (`left` says why)
  devices: int
  bucket_bytes: int
  first_bucket_bytes: int
  buckets: List[Bucket] = dataclasses.field(default_factory=list)
  left: List[str] = dataclasses.field(default_factory=list)  # not planned, and why
  scatters: List[Scatter] = dataclasses.field(default_factory=list)

  def describe(self):
    """Lines for dumps and reports."""
    if self.mesh_axis is None:
      return ["all-reduce plan: none"] + ["  left to GSPMD: " + why for why in self.left]
    lines = [f"all-reduce plan over mesh axis {self.mesh_axis!r} ({self.devices} devices): "
             f"{len(self.buckets)} bucket(s), limit {self.bucket_bytes} B "
             f"(first {self.first_bucket_bytes} B), {len(self.scatters)} reduce-scatter(s)"]
    lines += ["  " + b.describe() for b in self.buckets]
    lines += ["  " + s.describe(self.devices) for s in self.scatters]
    lines += ["  left to GSPMD: " + why for why in self.left]
    return lines


def _short(names, limit=6):
  if len(names) <= limit:
    return ", ".join(names)
  return ", ".join(names[:limit]) + f" (+{len(names) - limit} more)"


# -- where the rows are ---------------------------------------------------------------
def _row_axis_name(graph):
  """(the mesh axis the batch rows are split over, None) - the one the run
  arguments' leading axes are split on (by default in_specs, the mesh's
  first; it was taken to be that one always, and a plan of rows split over
  another found nothing, silently: a review's find) - or (None, why not)."""
  axes = []
  for value in graph.inputs:
    spec = getattr(value.sharding, "spec", None)
    if value.kind != "input" or not getattr(value.aval, "shape", ()) or not spec \
        or spec[0] is None:
      continue
    names = tuple(spec[0]) if isinstance(spec[0], tuple) else (spec[0],)
    if len(names) != 1:
      return None, (f"fn's {value.name or value} (a run argument) splits its rows over mesh "
                    f"axes {names} at once: the plan sums over one axis")
    if names[0] not in axes:
      axes.append(names[0])
  if not axes:
    return None, "no run argument is split on its leading axis: there are no rows to sum"
  if len(axes) > 1:
    return None, f"the run arguments split their rows over mesh axes {axes}: the plan sums over one"
  return axes[0], None


def _splits_rows(sharding, axis_name):
  spec = getattr(sharding, "spec", None)
  if not spec:
    return False
  return spec[0] == axis_name or spec[0] == (axis_name,)


def _input_facts(graph, axis_name):
  """(batch size, {value id: Fact}) for the graph inputs: a run argument split
  on axis 0 over `axis_name` carries rows on axis 0."""
  facts, batch = {}, None
  for value in graph.inputs:
    facts[value.id] = FREE
    shape = tuple(getattr(value.aval, "shape", ()))
    if value.kind != "input" or not shape or not _splits_rows(value.sharding, axis_name):
      continue
    batch = shape[0] if batch is None else batch
    # another batch size: its rows are not these; unknown, never planned
    facts[value.id] = Fact(axis=0) if shape[0] == batch else Fact(mixed_by=_UNKNOWN_INPUT)
  return batch, facts


def _lenient(fact, aval):
  """A row-free value meeting the rows is each device's slice of a replicated
  value: as good as a constant for where the rows go (padding must refuse it,
  sharding need not)."""
  if fact.axis is not None or fact.mixed_by is not None:
    return fact
  return Fact(uniform=frozenset(range(len(getattr(aval, "shape", ())))))


def _dot_point(node, facts, batch):
  """(lhs axis, rhs axis) when `node` contracts the rows: both operands carry
  them on a paired contracting axis, or one does and the other is row-free."""
  (lc, rc), _ = node.params["dimension_numbers"]
  la, ra = facts[0].axis, facts[1].axis
  if la is None and ra is None:
    return None
  if la is not None and la in tuple(lc):
    pair = (la, tuple(rc)[tuple(lc).index(la)])
  elif ra is not None and ra in tuple(rc):
    pair = (tuple(lc)[tuple(rc).index(ra)], ra)
  else:
    return None
  if (la is not None and la != pair[0]) or (ra is not None and ra != pair[1]):
    return None  # one operand's rows sit elsewhere: rows times rows, not a sum
  for value, axis in zip(node.inputs, pair):
    if not isinstance(value, Value) or value.aval.shape[axis] != batch:
      return None
  return pair


def reduction_point(node, facts, batch, devices):
  """The operand axes split over the devices (one per operand, None for an
  operand read whole) when `node` sums over the sharded rows; else None."""
  if node.prim is None or node.op not in fused.PARTIAL_PRIMITIVES or node.effects or batch % devices:
    return None
  if any(f.mixed_by is not None for f in facts):
    return None
  if node.params.get("out_sharding") is not None:
    return None  # an explicit-sharding op: its layout is the user's
  if node.op == "reduce_sum":
    axis = facts[0].axis
    if axis is None or axis not in tuple(node.params["axes"]):
      return None
    return (axis,)
  return _dot_point(node, facts, batch)


def find_points(graph, axis_name, devices):
  """(points, deps, facts): `points` [(node, split axes, mask)] in graph
  order - the reductions over the sharded rows, each with the bit mask of
  the earlier points it depends on (bit k: points[k]); `deps` {value id:
  mask of the points it depends on}; `facts` {value id: Fact} - where each
  value's rows are (mixed_by set: lost, the value's layout is GSPMD's)."""
  batch, facts = _input_facts(graph, axis_name)
  deps = {v.id: 0 for v in graph.inputs}
  points = []
  read = lambda v: facts.get(v.id, FREE) if isinstance(v, Value) else FREE
  mask = lambda v: deps.get(v.id, 0) if isinstance(v, Value) else 0
  for node in graph.nodes:
    in_facts = [read(v) for v in node.inputs]
    upstream = 0
    for v in node.inputs:
      upstream |= mask(v)
    split = reduction_point(node, in_facts, batch, devices) if batch else None
    if split is not None:
      bit = 1 << len(points)
      points.append((node, split, upstream))
      outs = [FREE] * len(node.outputs)  # summed over every device: replicated
      upstream |= bit
    else:
      eqn = Eqn(node.op, node.params, [v.aval for v in node.inputs],
                [o.aval for o in node.outputs],
                [_lenient(f, v.aval) for f, v in zip(in_facts, node.inputs)], batch or 0,
                node.effects)
      try:
        outs = step(eqn) if batch else [FREE] * len(node.outputs)
      except Mixing:
        outs = [Fact(mixed_by=node.id)] * len(node.outputs)
    for out, fact in zip(node.outputs, outs):
      facts[out.id] = fact
      deps[out.id] = upstream
  return points, deps, facts


def _left_to_gspmd(graph, facts):
  """Reductions the plan does not own: sums over unknown layouts."""
  left = []
  for node in graph.nodes:
    if op_properties.facts(node.op).reduces:
      mixed = [f for v in node.inputs if isinstance(v, Value)
               for f in [facts.get(v.id, FREE)] if f.mixed_by is not None]
      if mixed:
        by = mixed[0].mixed_by
        left.append(f"node {node.id} '{node.op}' reads a value whose rows the batch rules lost "
                    + ("(an input of another batch size)" if by == _UNKNOWN_INPUT
                       else f"at node {by}"))
  return left


# -- buckets --------------------------------------------------------------------------------
def plan_buckets(points, bucket_bytes, first_bytes, only=None):
  """[(bucket index, [point index], bytes, dtype, why closed)] over the
  points whose indices are in `only` (default: all), in order."""
  buckets = []
  current = None

  def close(reason):
    current["closed"] = reason
    buckets.append(current)

  for k, (node, _, upstream) in enumerate(points):
    if only is not None and k not in only:
      continue
    out = node.outputs[0]
    size, dtype = aval_bytes(out.aval), str(out.aval.dtype)
    reason = None
    if current is not None:
      limit = first_bytes if not buckets else bucket_bytes
      clash = upstream & current["mask"]
      if clash:
        first = next(points[j][0].id for j in current["points"] if clash >> j & 1)
        reason = f"node {node.id} depends on member node {first}"
      elif dtype != current["dtype"]:
        reason = f"node {node.id} is {dtype}, the bucket {current['dtype']}"
      elif current["bytes"] + size > limit:
        reason = (f"full: node {node.id} ({size} B) would make {current['bytes'] + size} B "
                  f"> {limit} B")
      if reason:
        close(reason)
        current = None
    if current is None:
      current = {"points": [], "bytes": 0, "dtype": dtype, "mask": 0}
    current["points"].append(k)
    current["bytes"] += size
    current["mask"] |= 1 << k
  if current is not None:
    close("the last reduction over the rows")
  return buckets


def _readers(graph, deps, nbits):
  """Per point index: [(label, state input or None)] - the state leaves
  whose new value reads it, then the other outputs (by position) that do."""
  found = [[] for _ in range(nbits)]
  updates = graph.state_updates()
  for k, value in enumerate(graph.outputs):
    mask = deps.get(value.id, 0) if isinstance(value, Value) else 0
    if k < len(updates):
      label, state = updates[k][0].name or f"state {k}", updates[k][0]
    else:
      label, state = f"output {k - len(updates)}", None
    while mask:
      low = mask & -mask
      found[low.bit_length() - 1].append((label, state))
      mask ^= low
  return found


def _scatter_dim(sharding, axis_name):
  """The one axis `sharding` splits, over the row axis alone; else None."""
  spec = getattr(sharding, "spec", None)
  if spec is None:
    return None
  split = [d for d, s in enumerate(spec) if s is not None]
  if len(split) != 1 or spec[split[0]] not in (axis_name, (axis_name,)):
    return None
  return split[0]


def _forms(value):
  """(shape, axis map) of `value` as it is and as each transpose of it reads
  it: axis map[d] is the value's axis that lands on axis d (a weight's
  gradient is often summed transposed: dW^T = dy^T x)."""
  shape = tuple(value.aval.shape)
  forms = [(shape, tuple(range(len(shape))))]
  transposed = [tuple(u.params["permutation"]) for u in value.users if u.op == "transpose"]
  if transposed and len(transposed) == len(value.users):
    forms = []  # read transposed only: a square gradient must not match as it is
  forms += [(tuple(shape[p] for p in perm), perm) for perm in transposed]
  return forms


def scatter_targets(points, readers, axis_name, devices):
  """{point index: (state input, axis)}: the points whose sum has the shape
  of a state leaf they feed (as it is or transposed) that is split on one
  axis over the row axis (a ZeRO layout): reduce-scattered on the axis
  that becomes the leaf's split one."""
  targets = {}
  for k, (node, _, _) in enumerate(points):
    forms = _forms(node.outputs[0])
    for _, state in readers[k]:
      dim = None if state is None else _scatter_dim(state.sharding, axis_name)
      if dim is None:
        continue
      match = next((axes[dim] for shape, axes in forms
                    if shape == tuple(state.aval.shape)), None)
      if match is not None and tuple(node.outputs[0].aval.shape)[match] % devices == 0:
        targets[k] = (state, match)
        break
  return targets


# -- the rewrite ------------------------------------------------------------------------------
def _partial_node(graph, node, split, devices, axis_name, sharding):
  out = node.outputs[0].aval
  aval = ShapedArray((devices,) + tuple(out.shape), out.dtype,
                     weak_type=getattr(out, "weak_type", False))
  params = {"reduces": node.op, "params": tuple(sorted(node.params.items())),
            "split": tuple(split), "devices": devices, "mesh_axis": axis_name}
  partial = graph.make_node(PARTIAL_OP, None, params, node.inputs, [aval], source=node.source,
                            ctx=node.ctx, origin=node.origin)
  partial.outputs[0].sharding = sharding
  return partial


def _bucket_node(graph, index, members, originals, devices, axis_name, sharding):
  params = {"bucket": index, "devices": devices, "mesh_axis": axis_name,
            "sizes": tuple(int(np.prod(o.outputs[0].aval.shape, dtype=np.int64))
                           for o in originals)}
  node = graph.make_node(BUCKET_OP, None, params, [m.outputs[0] for m in members],
                         [o.outputs[0].aval for o in originals],
                         source=originals[-1].source)
  for out in node.outputs:
    out.sharding = sharding
  return node


def _stable_topo(nodes, key):
  """`nodes` in a topological order, each as early as `key` (its wanted
  position) allows; ties and free choices follow `key`."""
  index = {id(n): n for n in nodes}
  waiting = {}
  readers = {}
  for n in nodes:
    producers = {id(v.producer) for v in n.inputs
                 if isinstance(v, Value) and v.producer is not None and id(v.producer) in index}
    waiting[id(n)] = len(producers)
    for p in producers:
      readers.setdefault(p, []).append(n)
  ready = [(key[id(n)], n.id, n) for n in nodes if not waiting[id(n)]]
  heapq.heapify(ready)
  order = []
  while ready:
    _, _, n = heapq.heappop(ready)
    order.append(n)
    for r in readers.get(id(n), ()):
      waiting[id(r)] -= 1
      if not waiting[id(r)]:
        heapq.heappush(ready, (key[id(r)], r.id, r))
  if len(order) != len(nodes):
    raise ValueError("the all-reduce rewrite made a cycle")  # not reached: see plan_buckets
  return order


def _scatter_node(graph, partial, original, dim, devices, axis_name):
  params = {"devices": devices, "mesh_axis": axis_name, "dim": dim}
  out = original.outputs[0].aval
  node = graph.make_node(SCATTER_OP, None, params, [partial.outputs[0]], [out],
                         source=original.source, ctx=original.ctx, origin=original.origin)
  spec = [None] * len(out.shape)
  spec[dim] = axis_name
  node.outputs[0].sharding = NamedSharding(graph.mesh, P(*spec))
  return node


def rewrite(graph, points, buckets, plan, serves, axis_name, devices, scatters=None):
  """Replaces each planned point by its dp_partial, each bucket by one
  allreduce_bucket node and each of `scatters` ({point index: (state input,
  axis)}) by one dp_reduce_scatter node; keeps a topological order close to
  the old one. Points in neither are left as they are."""
  mesh = graph.mesh
  scatters = scatters or {}
  split_sharding = NamedSharding(mesh, P(axis_name))
  replicated = NamedSharding(mesh, P())
  position = {id(n): float(i) for i, n in enumerate(graph.nodes)}
  planned = {k for spec in buckets for k in spec["points"]} | set(scatters)
  partial_of = {}
  for k, (node, split, _) in enumerate(points):
    if k not in planned:
      continue
    partial = _partial_node(graph, node, split, devices, axis_name, split_sharding)
    graph.link(partial)
    position[id(partial)] = position[id(node)]
    partial_of[id(node)] = partial
  new_nodes = []
  for k, (state, dim) in sorted(scatters.items()):
    original = points[k][0]
    partial = partial_of[id(original)]
    node = _scatter_node(graph, partial, original, dim, devices, axis_name)
    graph.link(node)
    position[id(node)] = position[id(original)] + 0.5
    new_nodes.append(node)
    leaf = state.name or "a state leaf"
    size = aval_bytes(original.outputs[0].aval)
    plan.scatters.append(Scatter(node.id, original.id, partial.id, leaf, dim, size))
    node.notes.append(f"reduce-scatter: node {original.id} '{original.op}' summed over the "
                      f"{devices} devices of mesh axis {axis_name!r}, its axis {dim} left "
                      f"split for {leaf} ({size // devices} B per device, where an "
                      f"all-reduce of it moves {size} B; XLA's own partitioning may move "
                      "neither: report.collectives)")
    partial.notes.append(f"node {original.id} '{original.op}' summed over each device's own "
                         f"rows, for reduce-scatter node {node.id}")
    graph.replace_uses(original.outputs[0], node.outputs[0])
  for b, spec in enumerate(buckets):
    originals = [points[k][0] for k in spec["points"]]
    members = [partial_of[id(o)] for o in originals]
    node = _bucket_node(graph, b, members, originals, devices, axis_name, replicated)
    graph.link(node)
    position[id(node)] = position[id(originals[-1])] + 0.5
    new_nodes.append(node)
    names = list(dict.fromkeys(n for k in spec["points"] for n in serves[k]))
    bucket = Bucket(index=b, bytes=spec["bytes"], dtype=spec["dtype"],
                    members=[m.id for m in members], replaced=[o.id for o in originals],
                    serves=names, closed=spec["closed"], node=node.id)
    plan.buckets.append(bucket)
    node.notes.append(f"all-reduce bucket {b}: {len(members)} partial(s), {spec['bytes']} B "
                      f"{spec['dtype']} summed over the {devices} devices of mesh axis "
                      f"{axis_name!r} as one all-reduce (XLA's all-reduce combiner may "
                      f"merge buckets in the executable: report.collectives has what it "
                      f"holds); closed: {spec['closed']}")
    if names:
      node.notes.append(f"bucket {b} serves {_short(names)}")
    for j, (orig, partial) in enumerate(zip(originals, members)):
      partial.notes.append(
          f"all-reduce bucket {b} (member {j + 1} of {len(members)}): node {orig.id} "
          f"'{orig.op}' summed over the rows, each device its own rows (operand axes "
          f"{partial.params['split']}); {aval_bytes(orig.outputs[0].aval)} B to all-reduce")
      graph.replace_uses(orig.outputs[0], node.outputs[j])
  doomed = {id(points[k][0]) for k in planned}
  for k in planned:
    graph.unlink(points[k][0])
    graph.record_removed("plan_allreduce", points[k][0], f"summed by node "
                         f"{partial_of[id(points[k][0])].id} over each device's own rows, "
                         "then by a collective (its notes)")
  kept = [partial_of.get(id(n), n) for n in graph.nodes]
  graph.nodes = _stable_topo(kept + new_nodes, position)
  assert not any(id(n) in doomed for n in graph.nodes)


def plan_allreduce(graph, options):
  """The all-reduce plan (module docstring), as `graph.allreduce_plan`, and
  the rewrite; whether the graph changed. Plans only under a mesh with
  `allreduce_bucket_bytes` set (optimizer_passes/plan_allreduce.py runs it)."""
  limit = getattr(options, "allreduce_bucket_bytes", None)
  if graph.mesh is None or getattr(options, "mesh", None) is None or not limit:
    return False
  if any(n.op in (PARTIAL_OP, BUCKET_OP, SCATTER_OP) for n in graph.nodes):
    return False  # planned already
  first = getattr(options, "first_bucket_bytes", None) or limit
  axis_name, why_not = _row_axis_name(graph)
  devices = int(graph.mesh.shape[axis_name]) if axis_name is not None else 0
  plan = AllReducePlan(axis_name, devices, int(limit), int(first))
  graph.allreduce_plan = plan
  if axis_name is None:
    plan.left.append(why_not)
    return False
  if devices == 1:
    plan.left.append(f"mesh axis {axis_name!r} has one device: nothing to all-reduce")
    return False
  points, deps, facts = find_points(graph, axis_name, devices)
  plan.left.extend(_left_to_gspmd(graph, facts))
  if not points:
    logging.info("all-reduce plan of %s: no sum over the sharded rows", graph.name)
    plan.left.append(f"no sum over the rows split over mesh axis {axis_name!r}")
    return False
  readers = _readers(graph, deps, len(points))
  scatters = scatter_targets(points, readers, axis_name, devices)
  rest = {k for k in range(len(points)) if k not in scatters}
  buckets = plan_buckets(points, int(limit), int(first), only=rest)
  serves = [list(dict.fromkeys(label for label, _ in found)) for found in readers]
  rewrite(graph, points, buckets, plan, serves, axis_name, devices, scatters)
  logging.info("all-reduce plan of %s: %d reduction(s): %d bucket(s), %d reduce-scatter(s)",
               graph.name, len(points), len(buckets), len(scatters))
  return True
