"""The row rules of the batch-axis analysis (runtime/batch_axis.py): the
facts it tracks (`Fact`: the axis carrying the rows, the axes a row-free
value is constant along), `Mixing`, and one rule per kind of primitive -
(eqn) -> the facts of its outputs, or `Mixing` with the reason. The table
that maps primitive names to these rules, and the control-flow rules that
walk sub-jaxprs with it, live in batch_axis.py."""
import dataclasses
import math

import numpy as np


class Mixing(Exception):
  """An operation mixes rows, or may: `reason` says how."""

  def __init__(self, reason):
    super().__init__(reason)
    self.reason = reason


@dataclasses.dataclass(frozen=True)
class Fact:
  """What the analysis knows of one value.

  axis: the axis carrying the rows (row r of the value depends on row r of the
    dynamic inputs only), or None when the value does not depend on the rows.
  uniform: for axis None, axes along which the value is provably constant.
  mixed_by: the node whose mixing this value depends on (graph level only).
  position: for a value with rows, where it holds the row's own index (padding
    alone: an arange of the batch size, whose real rows padding leaves as they
    are): ALL (everywhere), or the indices along its last axis that do (the
    columns of an index vector: x[jnp.arange(B), labels]).
  sized: rows made from the batch size alone (an arange of it), not from the
    real rows (padding alone): a refusal says so.
  """
  axis: int = None
  uniform: frozenset = frozenset()
  mixed_by: int = None
  position: object = None
  sized: bool = False


ALL = "all"  # Fact.position: every element is its row's index


FREE = Fact()


class PaddedBatch(int):
  """The batch size of the padding analysis (batch_axis.analyze): an int
  that also says padding is what is asked about. Values made from the batch
  size are refused only then - the all-reduce planner (runtime/allreduce.py)
  follows rows through the same rules at the real batch size, where such a
  value is fine and an axis of the batch's extent may well be another one."""


@dataclasses.dataclass
class Problem:
  node_id: int   # None when no node is to blame (a graph input returned as it is)
  op: str
  source: str
  reason: str

  def describe(self):
    where = f"node {self.node_id} '{self.op}'" if self.node_id is not None else f"'{self.op}'"
    return where + (f" at {self.source}" if self.source else "") + f": {self.reason}"


@dataclasses.dataclass
class BatchVerdict:
  safe: bool          # padding cannot change any real row of any output, nor any state
  problems: list      # [Problem]: every node that mixes rows, every state that sees them
  output_axes: list   # per graph output: the axis carrying the rows, or None

  def describe(self):
    if self.safe:
      return "padding is safe: no node mixes the rows"
    return "\n".join(p.describe() for p in self.problems)


@dataclasses.dataclass
class Eqn:
  """One operation as a rule sees it: a KernelGraph node or a jaxpr equation."""
  op: str
  params: dict
  in_avals: list
  out_avals: list
  facts: list       # per operand
  batch: int        # the extent of the batch axis
  effects: object = ()

  @property
  def axes(self):
    return [f.axis for f in self.facts]

  def shape(self, i):
    return _shape(self.in_avals[i])

  def rank(self, i):
    return len(self.shape(i))

  def out_shape(self, k=0):
    return _shape(self.out_avals[k])


def _shape(aval):
  return tuple(getattr(aval, "shape", ()))


def constant_along(fact, aval, dim):
  """`fact`'s value is the same at every index of `dim` (rows never are)."""
  if fact.axis is not None or fact.mixed_by is not None:
    return False
  return _shape(aval)[dim] == 1 or dim in fact.uniform


# -- helpers the rules share --------------------------------------------------------
def _one_axis(axes, what="combines rows carried on different axes"):
  found = sorted({a for a in axes if a is not None})
  if len(found) > 1:
    raise Mixing(f"{what} ({', '.join(map(str, found))})")
  return found[0] if found else None


def _only_rows_in(eqn, *allowed):
  for i, a in enumerate(eqn.axes):
    if a is not None and i not in allowed:
      raise Mixing(f"its operand {i} carries rows, and {eqn.op} reads that operand whole")


def _same_for_every_row(eqn, i, dim):
  """A row-free operand that spans the batch axis at `dim` meets the rows: each
  row reads its own slice of it, so it must be one slice for all rows."""
  if dim is None or dim < 0 or eqn.facts[i].axis is not None:
    return
  if not constant_along(eqn.facts[i], eqn.in_avals[i], dim):
    raise Mixing(f"meets the rows with operand {i}, which spans the batch axis (its axis {dim}) "
                 "without coming from the rows and differs along it (state, an iota, random "
                 "bits or a constant made for this batch size)")


def _rows_at(eqn, i, dim):
  """Operand i carries rows at `dim`, or is the same for every row there."""
  if eqn.axes[i] is not None and eqn.axes[i] != dim:
    raise Mixing(f"its operand {i} carries rows on axis {eqn.axes[i]}, not on axis {dim} "
                 "where the other rows are")
  _same_for_every_row(eqn, i, dim)


def no_uniform(eqn):
  return [FREE] * len(eqn.out_avals)


@dataclasses.dataclass(frozen=True)
class BatchRule:
  """An entry of RULES: how rows pass through an op, and, when no rows reach
  it, along which axes its outputs are constant."""
  rows: object                  # (Eqn) -> output facts (or axes); raises Mixing
  uniform: object = no_uniform  # (Eqn) -> output facts


# -- row rules: (eqn) -> [axis or None or Fact per output], or raise Mixing ----------
def elementwise(eqn):
  """numpy broadcasting: operands align at their last axes; rows stay rows."""
  rank = len(eqn.out_shape())
  aligned = []
  for i, a in enumerate(eqn.axes):
    if a is None:
      continue
    at = a + rank - eqn.rank(i)
    if eqn.shape(i)[a] != eqn.out_shape()[at]:
      raise Mixing(f"broadcasts the batch axis {a} of operand {i}")
    aligned.append(at)
  axis = _one_axis(aligned)
  for i in range(len(eqn.facts)):
    _same_for_every_row(eqn, i, axis - (rank - eqn.rank(i)))
  return [axis] * len(eqn.out_avals)


def not_along(axes_of, verb):
  """Row-wise unless it works along the batch axis; `axes_of(eqn)` are the
  axes it works along (sorts, slices, pads, concatenates...)."""
  def rows(eqn):
    axis = _one_axis(eqn.axes)
    if axis in tuple(axes_of(eqn)):
      raise Mixing(f"{verb} along the batch axis {axis}: it moves rows or makes them meet")
    for i in range(len(eqn.facts)):
      if eqn.rank(i) == eqn.rank(0):  # not the scalar operands (indices, padding value)
        _same_for_every_row(eqn, i, axis)
    if eqn.op == "concatenate" and any(f.position for f in eqn.facts):
      return [Fact(axis=axis, position=positions(eqn, axis))]
    return [axis] * len(eqn.out_avals)

  def uniform(eqn):  # constant along an axis it does not work along stays so
    rank = eqn.rank(0)
    if any(len(_shape(a)) != rank for a in eqn.out_avals):
      return no_uniform(eqn)
    moved = set(axes_of(eqn))
    dims = frozenset(d for d in range(rank) if d not in moved and all(
        constant_along(f, eqn.in_avals[i], d) for i, f in enumerate(eqn.facts)
        if eqn.rank(i) == rank))
    return [Fact(uniform=dims)] * len(eqn.out_avals)
  return BatchRule(rows, uniform)


def _param(name):
  return lambda eqn: np.ravel(eqn.params[name]).tolist()


def _partial_slices(eqn):
  p, shape = eqn.params, eqn.shape(0)
  strides = p.get("strides") or (1,) * len(shape)
  return [d for d in range(len(shape))
          if (p["start_indices"][d], p["limit_indices"][d], strides[d]) != (0, shape[d], 1)]


def _partial_sizes(sizes_of):
  return lambda eqn: [d for d, n in enumerate(sizes_of(eqn)) if n != eqn.shape(0)[d]]


def _windowed(eqn):
  p = eqn.params
  return [d for d in range(eqn.rank(0)) if (
      p["window_dimensions"][d], p["window_strides"][d], tuple(p["padding"][d]),
      p["base_dilation"][d], p["window_dilation"][d]) != (1, 1, (0, 0), 1, 1)]


def broadcast_in_dim(eqn):
  _only_rows_in(eqn, 0)
  a = eqn.axes[0]
  out = eqn.params["broadcast_dimensions"][a]
  if eqn.out_shape()[out] != eqn.shape(0)[a]:
    raise Mixing(f"broadcasts the batch axis {a}")
  return [Fact(axis=out, position=ALL if eqn.facts[0].position == ALL else None)]


def stack(eqn):
  """Operands of one shape stacked on a new axis: rows stay rows (moved one
  axis on where the new axis comes before them), never meeting."""
  axis = _one_axis(eqn.axes)
  for i in range(len(eqn.facts)):
    _rows_at(eqn, i, axis)
  return [axis + (eqn.params["axis"] <= axis)]


def stack_uniform(eqn):
  """Constant along an axis of every operand: so along it in the stack."""
  k = eqn.params["axis"]
  return [Fact(uniform=frozenset(d + (k <= d) for d in range(eqn.rank(0)) if all(
      constant_along(f, eqn.in_avals[i], d) for i, f in enumerate(eqn.facts))))]


def positions(eqn, axis):
  """The output's Fact.position where operands are joined along the last
  axis (concatenate): each operand's position columns, shifted."""
  last = len(eqn.out_shape()) - 1
  if eqn.params.get("dimension") != last or axis == last:
    return None
  cols, start = set(), 0
  for i, f in enumerate(eqn.facts):
    width = eqn.shape(i)[last]
    mine = range(width) if f.position == ALL else (f.position or ())
    cols.update(start + c for c in mine)
    start += width
  return frozenset(cols) or None


def reshape(eqn):
  """Row-wise only when the rows stay an axis of their own with the same
  elements before it: (B, x, y) -> (B, x*y), (L, B, x) -> (L, B, x)."""
  _only_rows_in(eqn, 0)
  a, src, dst = eqn.axes[0], eqn.shape(0), eqn.out_shape()
  if eqn.params.get("dimensions") is None:
    lead = math.prod(src[:a])
    for b in range(len(dst)):
      if math.prod(dst[:b]) == lead and dst[b] == src[a]:
        return [b]
  raise Mixing(f"reshape {src} -> {dst} merges or splits the batch axis {a}")


def squeeze(eqn):
  a, dims = eqn.axes[0], tuple(eqn.params["dimensions"])
  if a in dims:
    raise Mixing(f"squeezes away the batch axis {a}")
  return [a - sum(d < a for d in dims)]


def squeeze_uniform(eqn):
  """The kept axes keep their constancy, renumbered (a gather's size-1 slice
  axis squeezed away: searchsorted's lookups)."""
  dims = tuple(d % eqn.rank(0) for d in eqn.params["dimensions"])
  kept = [d for d in range(eqn.rank(0)) if d not in dims]
  return [Fact(uniform=frozenset(k for k, d in enumerate(kept) if d in eqn.facts[0].uniform))]


def reduction(verb, param="axes"):
  """Over other axes row-wise (the row axis renumbered); over rows mixing."""
  def rows(eqn):
    n = len(eqn.out_avals)  # `reduce` takes n operands, then n init values
    _only_rows_in(eqn, *range(n))
    axis, axes = _one_axis(eqn.axes[:n]), tuple(eqn.params[param])
    if axis in axes:
      raise Mixing(f"{verb} over the batch axis {axis}")
    for i in range(n):
      _same_for_every_row(eqn, i, axis)
    return [axis - sum(d < axis for d in axes)] * n

  def uniform(eqn):
    n, axes = len(eqn.out_avals), tuple(eqn.params[param])
    kept = [d for d in range(eqn.rank(0)) if d not in axes]
    return [Fact(uniform=frozenset(k for k, d in enumerate(kept) if all(
        constant_along(eqn.facts[i], eqn.in_avals[i], d) for i in range(n))))] * n
  return BatchRule(rows, uniform)


def _dot_dims(eqn):
  """(lhs contracting, rhs contracting, lhs batch, rhs batch, lhs free, rhs free)."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lc, rc, lb, rb = map(tuple, (lc, rc, lb, rb))
  return (lc, rc, lb, rb, [d for d in range(eqn.rank(0)) if d not in lc + lb],
          [d for d in range(eqn.rank(1)) if d not in rc + rb])


def dot_general(eqn):
  """Output layout: batch dims, then lhs free dims, then rhs free dims."""
  lc, rc, lb, rb, lfree, rfree = _dot_dims(eqn)
  la, ra = eqn.axes[0], eqn.axes[1]
  _only_rows_in(eqn, 0, 1)
  if la in lc or ra in rc:
    side = (0, la) if la in lc else (1, ra)
    raise Mixing("contracts over the batch axis (axis %d of operand %d)" % side[::-1])
  if la in lb or ra in rb:
    i = lb.index(la) if la in lb else rb.index(ra)
    _rows_at(eqn, 0, lb[i])
    _rows_at(eqn, 1, rb[i])
    return [i]
  if la is not None and ra is not None:
    raise Mixing("multiplies every row of one operand with every row of the other")
  if la is not None:
    return [len(lb) + lfree.index(la)]
  return [len(lb) + len(lfree) + rfree.index(ra)]


def dot_uniform(eqn):
  lc, rc, lb, rb, lfree, rfree = _dot_dims(eqn)
  sources = ([((0, l), (1, r)) for l, r in zip(lb, rb)] + [((0, d),) for d in lfree]
             + [((1, d),) for d in rfree])  # the operand axes behind each output axis
  return [Fact(uniform=frozenset(k for k, group in enumerate(sources) if all(
      constant_along(eqn.facts[i], eqn.in_avals[i], d) for i, d in group)))]


def matmul_bias_add(eqn):
  """MatMulBiasAdd(a, w, bias): dot_general(a, w) + bias along the last axis."""
  product = FREE
  if eqn.axes[0] is not None or eqn.axes[1] is not None:
    product = Fact(axis=dot_general(dataclasses.replace(eqn, params=dict(eqn.params["dot"])))[0])
  return elementwise(dataclasses.replace(eqn, facts=[product, eqn.facts[2]],
                                         in_avals=[eqn.out_avals[0], eqn.in_avals[2]]))


def normalization(eqn):
  """Softmax / LayerNorm / RMSNorm over `axes`, then per-feature scale and bias."""
  axes = tuple(eqn.params["axes"])
  if eqn.axes[0] in axes:
    raise Mixing(f"normalises over the batch axis {eqn.axes[0]} ({eqn.op} over axes {axes})")
  return elementwise(eqn)


def gather(eqn):
  """Row-wise when the indices carry the rows (an embedding lookup), when the
  operand's rows ride along a full window, or along matching batching dims."""
  dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
  oa, ia = eqn.axes[0], eqn.axes[1]
  obd, ibd = tuple(dn.operand_batching_dims), tuple(dn.start_indices_batching_dims)
  out_rank = len(eqn.out_shape())
  batch_pos = [d for d in range(out_rank) if d not in tuple(dn.offset_dims)]
  if ia is not None and ia == eqn.rank(1) - 1:
    raise Mixing("its index vectors run along the batch axis")
  if oa in obd or ia in ibd:
    j = obd.index(oa) if oa in obd else ibd.index(ia)
    _rows_at(eqn, 0, obd[j])
    _rows_at(eqn, 1, ibd[j])
    return [batch_pos[ibd[j]]]
  own = own_row(eqn, oa, ia, tuple(dn.start_index_map), tuple(dn.collapsed_slice_dims))
  if own is not None:  # x[jnp.arange(B), labels]: row r reads row r alone
    _rows_at(eqn, 0, own)
    return [batch_pos[ia]]
  sized_table = Mixing("gathers by the rows from a value sized by the batch (made from the "
                       "batch size): an index out of range is clipped or filled against its "
                       "length, which padding changes")
  if oa is None:
    if type(eqn.batch) is PaddedBatch and any(eqn.shape(0)[d] == eqn.batch
                                              for d in dn.start_index_map):
      raise sized_table
    return [batch_pos[ia]]
  if eqn.facts[0].sized and ia is not None and oa in tuple(dn.start_index_map):
    raise sized_table  # (an arange of the batch size: Fact.sized)
  window = [d for d in range(eqn.rank(0)) if d not in tuple(dn.collapsed_slice_dims) + obd]
  if oa in tuple(dn.start_index_map) or oa not in window or sizes[oa] != eqn.shape(0)[oa]:
    raise Mixing(f"gathers along the batch axis {oa}: which rows it reads depends on its indices")
  if ia is not None:
    raise Mixing("gathers rows at indices that carry rows themselves")
  return [dn.offset_dims[window.index(oa)]]


def own_row(eqn, oa, ia, index_map, one_wide):
  """The operand axis along which indices (operand 1) carrying the rows on
  axis `ia` put each row's element at that row's own index (Fact.position),
  one element wide there (`one_wide`: the operand axes a gather collapses or
  a scatter inserts) - each row then reads, or writes, its own row of the
  operand alone, in range at every batch size - or None. `oa`: the
  operand's row axis; `index_map`: the operand axis of each index column."""
  position = eqn.facts[1].position
  if ia is None or position is None:
    return None
  columns = range(len(index_map)) if position == ALL else position
  found = [index_map[c] for c in columns if c < len(index_map) and index_map[c] in one_wide
           and eqn.shape(0)[index_map[c]] == eqn.batch]
  own = oa if oa in found else None if oa is not None else found[0] if len(found) == 1 else None
  # another indexed axis of the batch's extent (a (B, B) table): its index is
  # clipped or filled against a length padding changes (a review's find)
  if own is None or any(eqn.shape(0)[a] == eqn.batch for a in index_map if a != own):
    return None
  return own


def gather_uniform(eqn):
  """No rows: an output axis that indexes along an axis of the indices on
  which they are the same (position ids broadcast over the batch) is the
  same along it."""
  dn = eqn.params["dimension_numbers"]
  if tuple(dn.operand_batching_dims):
    return no_uniform(eqn)
  batch_pos = [d for d in range(len(eqn.out_shape())) if d not in tuple(dn.offset_dims)]
  return [Fact(uniform=frozenset(batch_pos[k] for k in range(eqn.rank(1) - 1)
                                 if k in eqn.facts[1].uniform))]


def scatter(eqn):
  """Row-wise when the rows ride along a full update window that no index
  moves, or along matching batching dims of operand, indices and updates."""
  dn = eqn.params["dimension_numbers"]
  oa, ia, ua = eqn.axes[:3]
  obd, ibd = tuple(dn.operand_batching_dims), tuple(dn.scatter_indices_batching_dims)
  uwd = tuple(dn.update_window_dims)
  window = [d for d in range(eqn.rank(0)) if d not in tuple(dn.inserted_window_dims) + obd]
  upd_scatter = [d for d in range(eqn.rank(2)) if d not in uwd]
  own = own_row(eqn, oa, ia, tuple(dn.scatter_dims_to_operand_dims),
                tuple(dn.inserted_window_dims)) if ia is not None and ia < eqn.rank(1) - 1 \
      else None
  if own is not None:  # x.at[jnp.arange(B), i].set(v): row r writes row r alone
    _rows_at(eqn, 0, own)
    _rows_at(eqn, 2, upd_scatter[ia])
    return [own]
  target = oa
  if target is None and ua is not None:
    if ua in uwd:
      target = window[uwd.index(ua)]
    elif upd_scatter.index(ua) in ibd:
      target = obd[ibd.index(upd_scatter.index(ua))]
  if target is None and ia in ibd:
    target = obd[ibd.index(ia)]
  if target in obd:
    j = obd.index(target)
    _rows_at(eqn, 0, target)
    _rows_at(eqn, 1, ibd[j])
    _rows_at(eqn, 2, upd_scatter[ibd[j]])
    return [target]
  if target is None or target not in window or target in tuple(dn.scatter_dims_to_operand_dims):
    raise Mixing("scatters along the batch axis: where each row lands depends on indices")
  u = uwd[window.index(target)]
  if ia is not None or eqn.shape(2)[u] != eqn.shape(0)[target]:
    raise Mixing(f"scatters part of the batch axis {target}")
  _rows_at(eqn, 0, target)
  _rows_at(eqn, 2, u)
  return [target]


def conv_general_dilated(eqn):
  dn = eqn.params["dimension_numbers"]
  _only_rows_in(eqn, 0)
  if eqn.axes[0] != dn.lhs_spec[0]:
    raise Mixing(f"convolves along the batch axis {eqn.axes[0]}")
  if eqn.params.get("batch_group_count", 1) != 1:
    raise Mixing("groups the batch axis (batch_group_count > 1)")
  return [dn.out_spec[0]]


def refuse(reason):
  def rule(eqn):
    raise Mixing(reason)
  return rule
