"""Batch-axis analysis: may a program's dynamic rows be padded?

Shape buckets pad some inputs' rows up to a bucket size, run that bucket's
executable and slice the outputs back: right only when no real row of any
output, and no state, depends on another row (padded rows included). As JAX's
batching rules do, each value gets a `Fact` - the axis carrying the rows, or
None when it does not depend on them - and one table, `RULES`, keyed by
primitive or fused-op name, maps an op's operand facts and params to its
output facts or raises `Mixing` with the reason. Control flow is analysed
through its sub-jaxprs with the same table; an op without a rule mixes; a rule
that is unsure mixes. The analysis may refuse a harmless program, never accept
a mixing one. A value free of the rows may still span the batch axis (zeros
like x, an iota, a dropout mask): where it meets the rows it must be the same
for every row, so `Fact.uniform` tracks the axes along which it is constant.

What one trace cannot see (the caller's part): Python that reads the batch
size into the program (`x / x.shape[0]`, `x.reshape(4, -1)`) looks like any
literal or shape; a batch size equal to another axis's makes a merge look like
a kept axis. Analyse a trace at a batch size unlike the other sizes, and check
the bucket's trace is the same program. Bit-exact buckets also need kernels
that round a row the same at every batch size; XLA on CPU does not by default
(tests/batch_axis_test.py says which options it takes).
"""
import dataclasses
import math

import numpy as np
from jax.extend import core as jcore

from jaxsession.importer import INLINE_RULES, source_of


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
  """
  axis: int = None
  uniform: frozenset = frozenset()
  mixed_by: int = None


FREE = Fact()


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
  return [out]


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
  if oa is None:
    return [batch_pos[ia]]
  window = [d for d in range(eqn.rank(0)) if d not in tuple(dn.collapsed_slice_dims) + obd]
  if oa in tuple(dn.start_index_map) or oa not in window or sizes[oa] != eqn.shape(0)[oa]:
    raise Mixing(f"gathers along the batch axis {oa}: which rows it reads depends on its indices")
  if ia is not None:
    raise Mixing("gathers rows at indices that carry rows themselves")
  return [dn.offset_dims[window.index(oa)]]


def scatter(eqn):
  """Row-wise when the rows ride along a full update window that no index
  moves, or along matching batching dims of operand, indices and updates."""
  dn = eqn.params["dimension_numbers"]
  oa, ia, ua = eqn.axes[:3]
  obd, ibd = tuple(dn.operand_batching_dims), tuple(dn.scatter_indices_batching_dims)
  uwd = tuple(dn.update_window_dims)
  window = [d for d in range(eqn.rank(0)) if d not in tuple(dn.inserted_window_dims) + obd]
  upd_scatter = [d for d in range(eqn.rank(2)) if d not in uwd]
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


# -- control flow: the same table through the sub-jaxprs ------------------------------
def join(a, b, aval, what):
  """One fact for a value that is `a` on one path and `b` on another."""
  if a.axis is None and b.axis is None:
    return Fact(uniform=a.uniform & b.uniform)
  axis = _one_axis([a.axis, b.axis], f"{what} carries rows on different axes")
  for f in (a, b):
    if f.axis is None and not constant_along(f, aval, axis):
      raise Mixing(f"{what} carries rows on axis {axis} on one path and a value that differs "
                   "along that axis (without coming from the rows) on another")
  return Fact(axis=axis)


def cond(eqn):
  if eqn.axes[0] is not None:
    raise Mixing("chooses its branch from the rows")
  outs = None
  for k, branch in enumerate(eqn.params["branches"]):
    got = analyze_jaxpr(branch, eqn.facts[1:], eqn.batch, f"in branch {k}")
    outs = got if outs is None else [join(a, b, aval, f"output {i}") for i, (a, b, aval)
                                     in enumerate(zip(outs, got, eqn.out_avals))]
  return outs


def fixed_point(body, consts, carry, rest, avals, batch, where):
  """Carries after any number of iterations of `body`: each carry keeps one
  row axis (or none); the loop stops when no carry changes."""
  for _ in range(4 + sum(len(_shape(a)) + 2 for a in avals)):  # each fact changes finitely
    outs = analyze_jaxpr(body, consts + carry + rest, batch, where)
    new = [join(c, o, aval, f"carry {i}") for i, (c, o, aval)
           in enumerate(zip(carry, outs[:len(carry)], avals))]
    if new == carry:
      return carry, outs[len(carry):]
    carry = new
  raise Mixing("its carries did not settle on a row axis")  # not reached: facts only rise


def scan(eqn):
  p = eqn.params
  nc, nk = p["num_consts"], p["num_carry"]
  xs = []
  for f in eqn.facts[nc + nk:]:
    if f.axis == 0:
      raise Mixing("scans over the batch axis: the rows become loop steps")
    xs.append(Fact(axis=f.axis - 1) if f.axis is not None
              else Fact(uniform=frozenset(d - 1 for d in f.uniform if d > 0)))
  carry, ys = fixed_point(p["jaxpr"], eqn.facts[:nc], eqn.facts[nc:nc + nk], xs,
                          eqn.in_avals[nc:nc + nk], eqn.batch, "in its body")
  return carry + [None if y.axis is None else y.axis + 1 for y in ys]


def while_(eqn):
  p = eqn.params
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  carry, _ = fixed_point(p["body_jaxpr"], eqn.facts[cn:cn + bn], eqn.facts[cn + bn:], [],
                         eqn.in_avals[cn + bn:], eqn.batch, "in its body")
  (pred,) = analyze_jaxpr(p["cond_jaxpr"], eqn.facts[:cn] + carry, eqn.batch, "in its condition")
  if pred.axis is not None:
    raise Mixing("its loop condition depends on the rows")
  return carry


def call(eqn):
  """pjit, closed_call, custom_jvp/vjp, remat: analyse the body (as the
  importer inlines it: a shorter body skips the leading operands)."""
  body = INLINE_RULES[eqn.op](eqn.params)
  jaxpr = body.jaxpr if isinstance(body, jcore.ClosedJaxpr) else body
  return analyze_jaxpr(body, eqn.facts[len(eqn.facts) - len(jaxpr.invars):], eqn.batch,
                       f"in its body ({eqn.op})")


# -- uniform rules: axes along which a row-free output is constant ----------------------
def elementwise_uniform(eqn):
  rank = len(eqn.out_shape())
  dims = frozenset(d for d in range(rank) if all(
      d - (rank - eqn.rank(i)) < 0 or constant_along(f, eqn.in_avals[i], d - (rank - eqn.rank(i)))
      for i, f in enumerate(eqn.facts)))
  return [Fact(uniform=dims)] * len(eqn.out_avals)


def broadcast_uniform(eqn):
  dims = tuple(eqn.params["broadcast_dimensions"])
  return [Fact(uniform=frozenset(
      d for d in range(len(eqn.out_shape()))
      if d not in dims or constant_along(eqn.facts[0], eqn.in_avals[0], dims.index(d))))]


def iota_uniform(eqn):
  return [Fact(uniform=frozenset(range(len(eqn.out_shape()))) - {eqn.params["dimension"]})]


def transpose_uniform(eqn):
  perm = tuple(eqn.params["permutation"])
  return [Fact(uniform=frozenset(d for d, src in enumerate(perm)
                                 if constant_along(eqn.facts[0], eqn.in_avals[0], src)))]


# -- the table ---------------------------------------------------------------------------
ELEMENTWISE = BatchRule(elementwise, elementwise_uniform)
IDENTITY = BatchRule(lambda eqn: eqn.facts[:len(eqn.out_avals)])  # each output its operand
ELEMENTWISE_OPS = (
    "abs acos acosh add add_any and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt "
    "ceil clamp clz complex conj convert_element_type copy copy_p cos cosh digamma div eq "
    "erf erf_inv erfc exp exp2 expm1 floor ge gt igamma igamma_grad_a igammac imag "
    "integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not "
    "or polygamma population_count pow random_gamma_grad real reduce_precision "
    "regularized_incomplete_beta rem round rsqrt select_n shift_left shift_right_arithmetic "
    "shift_right_logical sign sin sinh sqrt square stop_gradient sub tan tanh xor zeta "
    "threefry2x32 random_seed random_fold_in "
    # fused ops that compute element by element (operands at x's rank or scalars)
    "GeluTanh AddN Adam BatchNormRelu BatchNormAddRelu").split()

RULES = {
    **{op: ELEMENTWISE for op in ELEMENTWISE_OPS},
    **{op: IDENTITY for op in ("optimization_barrier", "device_put", "sharding_constraint",
                               "transfer_d2h", "transfer_h2d", "random_clone")},
    # the last axis packs into wider elements when the width grows
    "bitcast_convert_type": not_along(
        lambda e: (e.rank(0) - 1,) if len(e.out_shape()) < e.rank(0) else (), "packs"),
    "broadcast_in_dim": BatchRule(broadcast_in_dim, broadcast_uniform),
    "iota": BatchRule(refuse("iota takes no operands"), iota_uniform),
    "reshape": BatchRule(reshape),
    "transpose": BatchRule(lambda e: [tuple(e.params["permutation"]).index(e.axes[0])],
                           transpose_uniform),
    "squeeze": BatchRule(squeeze),
    "slice": not_along(_partial_slices, "slices"),
    "dynamic_slice": not_along(_partial_sizes(_param("slice_sizes")), "slices"),
    # a full-size update starts at 0 (the start is clamped), so it moves no row
    "dynamic_update_slice": not_along(_partial_sizes(lambda e: e.shape(1)),
                                      "writes part of the rows"),
    "pad": not_along(lambda e: [d for d, c in enumerate(e.params["padding_config"])
                                if tuple(map(int, c)) != (0, 0, 0)], "pads"),
    "rev": not_along(_param("dimensions"), "reverses"),
    "concatenate": not_along(_param("dimension"), "concatenates"),
    "split": not_along(_param("axis"), "splits"),
    "dot_general": BatchRule(dot_general, dot_uniform),
    "MatMulBiasAdd": BatchRule(matmul_bias_add),
    **{op: reduction(verb) for op, verb in (
        ("reduce_sum", "sums"), ("reduce_max", "takes the maximum"),
        ("reduce_min", "takes the minimum"), ("reduce_prod", "multiplies"),
        ("reduce_and", "takes a logical and"), ("reduce_or", "takes a logical or"),
        ("reduce_xor", "takes a xor"), ("argmax", "takes the argmax"),
        ("argmin", "takes the argmin"))},
    "reduce": reduction("reduces", "dimensions"),
    **{op: not_along(_windowed, "slides a window")
       for op in ("reduce_window_sum", "reduce_window_max", "reduce_window_min")},
    **{op: not_along(_param("axis"), f"accumulates ({op})")
       for op in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")},
    "sort": not_along(_param("dimension"), "sorts"),
    "top_k": not_along(lambda e: (e.params.get("axis", e.rank(0) - 1),), "takes the top k"),
    "Softmax": BatchRule(normalization),
    "LayerNorm": BatchRule(normalization),
    "RMSNorm": BatchRule(normalization),
    "gather": BatchRule(gather),
    **{op: BatchRule(scatter) for op in ("scatter", "scatter-add", "scatter_add", "scatter-mul",
                                         "scatter_mul", "scatter-min", "scatter_min",
                                         "scatter-max", "scatter_max")},
    "conv_general_dilated": BatchRule(conv_general_dilated),
    # linear algebra on the last two axes, each leading index on its own
    **{op: not_along(lambda e: (e.rank(0) - 2, e.rank(0) - 1), "works on matrices")
       for op in ("cholesky", "triangular_solve", "lu", "eigh", "svd", "qr", "geqrf",
                  "householder_product")},
    "random_wrap": not_along(lambda e: (e.rank(0) - 1,), "packs into keys"),
    # per-key bits or keys: out = keys.shape + shape, each key on its own
    "random_bits": not_along(lambda e: (), ""),
    "random_split": not_along(lambda e: (), ""),
    "random_unwrap": not_along(lambda e: (), ""),
    **{op: BatchRule(refuse("the host callback sees every row, padded rows included"))
       for op in ("pure_callback", "io_callback", "debug_callback", "debug_print")},
    "cond": BatchRule(cond),
    "scan": BatchRule(scan),
    "while": BatchRule(while_),
    **{op: BatchRule(call) for op in INLINE_RULES},
}


def step(eqn):
  """The output facts of one operation: through its rule when rows reach it.
  A rule that cannot read its operation mixes (when unsure, mix)."""
  mixed = next((f.mixed_by for f in eqn.facts if f.mixed_by is not None), None)
  if mixed is not None:
    return [Fact(mixed_by=mixed)] * len(eqn.out_avals)
  rule = RULES.get(eqn.op)
  if all(f.axis is None for f in eqn.facts):
    try:
      return (rule.uniform if rule is not None else no_uniform)(eqn)
    except Exception:  # noqa: BLE001 - knowing less is always allowed
      return no_uniform(eqn)
  if eqn.effects:
    raise Mixing("has effects: they would see the padded rows")
  if rule is None:
    raise Mixing(f"no batch rule for {eqn.op}")
  try:
    outs = [o if isinstance(o, Fact) else Fact(axis=o) for o in rule.rows(eqn)]
  except (KeyError, IndexError, ValueError, TypeError, AttributeError) as exc:
    raise Mixing(f"its batch rule cannot read it ({type(exc).__name__}: {exc})") from None
  for k, fact in enumerate(outs):  # a safety net under every rule
    shape = _shape(eqn.out_avals[k])
    if fact.axis is not None and (fact.axis >= len(shape) or shape[fact.axis] != eqn.batch):
      raise Mixing(f"changes the extent of the batch axis (output {k} axis {fact.axis})")
  return outs


def _const_uniform(value):
  """Axes along which a constant array is the same, bit for bit."""
  try:
    arr = np.asarray(value)
  except Exception:  # key arrays and other opaque constants: nothing is known
    return frozenset()
  if arr.dtype == object or arr.ndim == 0 or arr.size > 1 << 22:
    return frozenset()
  if arr.dtype.itemsize in (1, 2, 4, 8):
    arr = arr.view(np.dtype(f"u{arr.dtype.itemsize}"))
  return frozenset(d for d in range(arr.ndim)
                   if np.array_equal(arr, np.broadcast_to(np.take(arr, [0], axis=d), arr.shape)))


def analyze_jaxpr(jaxpr, facts, batch, where="in a sub-jaxpr"):
  """Output facts of a jaxpr (Jaxpr or ClosedJaxpr) for its invars' `facts`;
  raises Mixing naming the first mixing equation."""
  consts = jaxpr.consts if isinstance(jaxpr, jcore.ClosedJaxpr) else ()
  jaxpr = jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr
  env = {var: Fact(uniform=_const_uniform(c)) for var, c in zip(jaxpr.constvars, consts)}
  env.update(zip(jaxpr.invars, facts))
  read = lambda v: FREE if isinstance(v, jcore.Literal) else env.get(v, FREE)
  for e in jaxpr.eqns:
    eqn = Eqn(e.primitive.name, e.params, [v.aval for v in e.invars],
              [v.aval for v in e.outvars], [read(v) for v in e.invars], batch, e.effects)
    try:
      outs = step(eqn)
    except Mixing as exc:
      at = source_of(e)
      raise Mixing(f"{where}: '{eqn.op}'{f' at {at}' if at else ''} {exc.reason}") from None
    env.update(zip(e.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


# -- the graph ------------------------------------------------------------------------------
def _input_facts(graph, dynamic):
  """(batch size, {input id: Fact}); only inputs of kind 'input' carry rows."""
  facts, sizes = {}, set()
  for value in graph.inputs:
    facts[value.id] = (Fact(uniform=_const_uniform(graph.const_values.get(value.id)))
                       if value.kind == "const" else FREE)
  for vid, axis in dynamic.items():
    value = next((v for v in graph.inputs if v.id == vid and v.kind == "input"), None)
    if value is None:
      raise ValueError(f"%{vid} is not a padded input of {graph.name} (only inputs of kind "
                       "'input' carry rows; state and constants never do)")
    shape = _shape(value.aval)
    if not -len(shape) <= axis < len(shape):
      raise ValueError(f"{value} has no axis {axis} (shape {shape})")
    facts[vid] = Fact(axis=axis % len(shape))
    sizes.add(shape[axis])
  if len(sizes) > 1:
    raise ValueError(f"the dynamic inputs disagree on the batch size: {sorted(sizes)}")
  return (sizes.pop() if sizes else None), facts


def _blame(value, reason):
  node = getattr(value, "producer", None)
  if node is None:
    return Problem(None, "input", None, reason)
  return Problem(node.id, node.op, node.source, reason)


def analyze(graph, dynamic):
  """The batch-axis verdict of `graph` when the inputs in `dynamic`
  ({input value id: axis}) are padded along their axis."""
  batch, facts = _input_facts(graph, dynamic)
  read = lambda v: facts[v.id] if hasattr(v, "id") else FREE  # Literals are free
  problems = []
  if batch == 1:  # a broadcast axis and a batch of one look alike: nothing to tell them apart
    problems.append(Problem(None, "input", None, "the graph was traced with 1 row, where a "
                            "value made for the batch size looks like a broadcast; analyse a "
                            "trace with more rows"))
  for node in graph.nodes:
    eqn = Eqn(node.op, node.params, [v.aval for v in node.inputs],
              [o.aval for o in node.outputs], [read(v) for v in node.inputs], batch,
              node.effects)
    try:
      outs = step(eqn)
    except Mixing as exc:
      problems.append(Problem(node.id, node.op, node.source, exc.reason))
      outs = [Fact(mixed_by=node.id)] * len(node.outputs)
    facts.update((o.id, f) for o, f in zip(node.outputs, outs))
  states = [state for state, _ in graph.state_updates()]
  n_state = len(states)
  output_axes = []
  for k, value in enumerate(graph.outputs):
    fact = read(value)
    output_axes.append(fact.axis if k >= n_state else None)
    if k < n_state and (fact.axis is not None or fact.mixed_by is not None):
      through = f" (through node {fact.mixed_by})" if fact.mixed_by is not None else ""
      name = states[k].name or f"state {k}"  # the session's name: slot, argument and path
      problems.append(_blame(value, f"the new value of {name} depends on the padded rows"
                                    f"{through}"))
    elif (fact.axis is None and fact.mixed_by is None and batch in _shape(value.aval)
          and getattr(value, "kind", "node") in ("node", "const")):
      problems.append(_blame(value, f"output {k} has an axis of the batch size {batch} "
                                    f"(shape {_shape(value.aval)}) that does not come from the "
                                    "rows: padding may change its shape"))
  return BatchVerdict(safe=not problems, problems=problems, output_axes=output_axes)
