"""Batch-axis analysis: may a program's dynamic rows be padded?

Shape buckets pad some inputs' rows up to a bucket size, run that bucket's
executable and slice the outputs back: right only when no real row of any
output, and no state, depends on another row (padded rows included). As JAX's
batching rules do, each value gets a `Fact` - the axis carrying the rows, or
None when it does not depend on them - and one table, `RULES`, keyed by
primitive name (beside the op table's `elementwise` fact and named rules,
op_properties: `rule_for`), maps an op's operand facts and params to its
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
the bucket's trace is the same program. A value made from the batch size as
an array (`jnp.ones(x.shape[0])`) is the same program at every size, so the
analysis itself refuses an op that reads across an axis of the batch's extent
of a row-free value, as its rows rule would refuse it on rows (`_batch_sized`;
padding alone: PaddedBatch). Bit-exact buckets also need kernels
that round a row the same at every batch size; XLA on CPU does not by default
(tests/batch_axis_test.py says which options it takes).
"""

import dataclasses

import numpy as np
from jax.extend import core as jcore

from jaxsession.graph import op_properties
from jaxsession.graph.importer import INLINE_RULES, source_of
from jaxsession.runtime.batch_rules import (  # the facts and the row rules
    Mixing, Fact, FREE, Problem, BatchVerdict, Eqn,
    _shape, constant_along, _one_axis, no_uniform, BatchRule, elementwise,
    not_along, _param, _partial_slices, _partial_sizes, _windowed, broadcast_in_dim,
    reshape, squeeze, squeeze_uniform, reduction, dot_general, dot_uniform, matmul_bias_add,
    normalization, gather, gather_uniform, scatter, conv_general_dilated, refuse,
    PaddedBatch, ALL, stack, stack_uniform)


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
  if any(f.axis == 0 for f in eqn.facts[nc + nk:]):
    return scan_over_rows(eqn)
  if type(eqn.batch) is PaddedBatch and p["length"] == eqn.batch:
    raise Mixing("runs as many steps as the batch has rows (a loop over x.shape[0]): a "
                 "padded batch would run more")
  xs = []
  for f in eqn.facts[nc + nk:]:
    xs.append(Fact(axis=f.axis - 1) if f.axis is not None
              else Fact(uniform=frozenset(d - 1 for d in f.uniform if d > 0)))
  carry, ys = fixed_point(p["jaxpr"], eqn.facts[:nc], eqn.facts[nc:nc + nk], xs,
                          eqn.in_avals[nc:nc + nk], eqn.batch, "in its body")
  return carry + [None if y.axis is None else y.axis + 1 for y in ys]


def scan_over_rows(eqn):
  """A scan whose steps are the rows (lax.map, a vmap written as a loop) is
  row-wise when each step sees its own row alone: every carry passed through
  unchanged (a padded row's extra step changes nothing a real row sees), every
  other sequence the same at every step, and no step output reading a value
  that carries rows (the whole batch closed over). Each output is then its
  step's row."""
  p = eqn.params
  nc, nk = p["num_consts"], p["num_carry"]
  body = p["jaxpr"].jaxpr
  if op_properties.jaxpr_props(body).user_code:  # (a break-it find: it was called on them)
    raise Mixing("scans over the batch axis running the user's code (a callback) each "
                 "step: it would see the padded rows")
  if any(out is not var for var, out in zip(body.invars[nc:nc + nk], body.outvars[:nk])):
    raise Mixing("scans over the batch axis with a carry that changes: the rows become loop "
                 "steps, each carrying into the next (padded steps included)")
  xs = []
  for f, aval in zip(eqn.facts[nc + nk:], eqn.in_avals[nc + nk:]):
    if f.axis == 0:
      xs.append(FREE)  # one row per step: within a step, nothing to mix
    elif f.axis is None and constant_along(f, aval, 0):
      xs.append(Fact(uniform=frozenset(d - 1 for d in f.uniform if d > 0)))
    else:
      raise Mixing("scans over the batch axis a sequence that differs along it without "
                   "being the rows" if f.axis is None else
                   f"scans over the batch axis a sequence carrying rows on its axis {f.axis}")
  outs = analyze_jaxpr(p["jaxpr"], list(eqn.facts[:nc + nk]) + xs, eqn.batch,
                       "in its body (a step per row)")
  if any(y.axis is not None for y in outs[nk:]):
    raise Mixing("scans over the batch axis, and a step's output reads every row of a value "
                 "passed into the scan")
  return list(eqn.facts[nc:nc + nk]) + [0] * (len(outs) - nk)


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
  called = eqn.op + (f" {eqn.params['name']}" if eqn.params.get("name") else "")
  return analyze_jaxpr(body, eqn.facts[len(eqn.facts) - len(jaxpr.invars):], eqn.batch,
                       f"in its body ({called})")


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
  """Constant but along its dimension; along the batch's extent, in a padded
  program, the rows' own indices (Fact.position): padding appends rows, so a
  real row's index is the same at every batch size."""
  shape, dim = eqn.out_shape(), eqn.params["dimension"]
  if type(eqn.batch) is PaddedBatch and shape[dim] == eqn.batch and \
      shape.count(eqn.batch) == 1 and np.dtype(eqn.params["dtype"]).itemsize >= 4:
    return [Fact(axis=dim, position=ALL, sized=True)]  # (a wide index: no bucket wraps it)
  return [Fact(uniform=frozenset(range(len(shape))) - {dim})]


def convert(eqn):
  """Elementwise; a row's own index stays one in an integer of 32 bits or more."""
  out = elementwise(eqn)
  if eqn.facts[0].position == ALL:
    dtype = np.dtype(eqn.params["new_dtype"])
    if dtype.kind in "iu" and dtype.itemsize >= 4:
      return [Fact(axis=out[0], position=ALL)]
  return out


def transpose_uniform(eqn):
  perm = tuple(eqn.params["permutation"])
  return [Fact(uniform=frozenset(d for d, src in enumerate(perm)
                                 if constant_along(eqn.facts[0], eqn.in_avals[0], src)))]


# -- the table ---------------------------------------------------------------------------
ELEMENTWISE = BatchRule(elementwise, elementwise_uniform)
IDENTITY = BatchRule(lambda eqn: eqn.facts[:len(eqn.out_avals)])  # each output its operand

# Primitives' own rules. An op the op table calls elementwise takes ELEMENTWISE,
# and an op that names a rule there (transfers, fused ops) takes that rule
# (`rule_for`); any other op mixes.
RULES = {
    **{op: IDENTITY for op in ("optimization_barrier", "device_put", "sharding_constraint",
                               "random_clone", "name")},  # name: checkpoint_name's
    # the total-order comparisons of jnp.digitize and searchsorted
    **{op: ELEMENTWISE for op in ("lt_to", "le_to")},
    "fft": not_along(lambda e: range(e.rank(0) - len(e.params["fft_lengths"]), e.rank(0)),
                     "transforms"),
    "approx_top_k": not_along(lambda e: (e.params["reduction_dimension"] % e.rank(0),),
                              "takes the top k"),
    # the last axis packs into wider elements when the width grows
    "bitcast_convert_type": not_along(
        lambda e: (e.rank(0) - 1,) if len(e.out_shape()) < e.rank(0) else (), "packs"),
    "broadcast_in_dim": BatchRule(broadcast_in_dim, broadcast_uniform),
    "convert_element_type": BatchRule(convert, elementwise_uniform),
    "iota": BatchRule(refuse("iota takes no operands"), iota_uniform),
    "reshape": BatchRule(reshape),
    "transpose": BatchRule(lambda e: [tuple(e.params["permutation"]).index(e.axes[0])],
                           transpose_uniform),
    "squeeze": BatchRule(squeeze, squeeze_uniform),
    "slice": not_along(_partial_slices, "slices"),
    "dynamic_slice": not_along(_partial_sizes(_param("slice_sizes")), "slices"),
    # a full-size update starts at 0 (the start is clamped), so it moves no row
    "dynamic_update_slice": not_along(_partial_sizes(lambda e: e.shape(1)),
                                      "writes part of the rows"),
    "pad": not_along(lambda e: [d for d, c in enumerate(e.params["padding_config"])
                                if tuple(map(int, c)) != (0, 0, 0)], "pads"),
    "rev": not_along(_param("dimensions"), "reverses"),
    "concatenate": not_along(_param("dimension"), "concatenates"),
    "stack": BatchRule(stack, stack_uniform),
    "split": not_along(_param("axis"), "splits"),
    "tile": not_along(lambda e: [d for d, r in enumerate(e.params["reps"]) if r != 1], "tiles"),
    "dot_general": BatchRule(dot_general, dot_uniform),
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
    "gather": BatchRule(gather, gather_uniform),
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
    # control flow and calls: their bodies analysed with or without rows (a
    # body may make a value of the batch's extent and reduce it: Mixing)
    "cond": BatchRule(cond, cond),
    "scan": BatchRule(scan, scan),
    "while": BatchRule(while_, while_),
    **{op: BatchRule(call, call) for op in INLINE_RULES},
}


NAMED_RULES = {  # op_properties.BATCH_RULE_NAMES
    "identity": IDENTITY,
    "rows": BatchRule(normalization),  # normalises along its last axes, each row on its own
    "matmul_bias_add": BatchRule(matmul_bias_add),
}


def rule_for(op):
  """The BatchRule of primitive or fused-op name `op`, or None (it mixes)."""
  rule = RULES.get(op)
  if rule is not None:
    return rule
  facts = op_properties.facts(op)
  if facts.elementwise:
    return ELEMENTWISE
  return NAMED_RULES.get(facts.batch)


def step(eqn):
  """The output facts of one operation: through its rule when rows reach it.
  A rule that cannot read its operation mixes (when unsure, mix)."""
  mixed = next((f.mixed_by for f in eqn.facts if f.mixed_by is not None), None)
  if mixed is not None:
    return [Fact(mixed_by=mixed)] * len(eqn.out_avals)
  rule = rule_for(eqn.op)
  padding = type(eqn.batch) is PaddedBatch
  if all(f.axis is None for f in eqn.facts):
    for sized in _batch_sized(eqn) if padding else ():  # made from the batch size
      try:
        if rule is None:
          raise Mixing(f"no batch rule for {eqn.op}")
        rule.rows(sized)
      except Mixing as exc:
        raise _sized(exc) from None
      except (KeyError, IndexError, ValueError, TypeError, AttributeError):
        pass  # a rule that cannot read it: the uniform rule below knows less
    try:
      outs = (rule.uniform if rule is not None else no_uniform)(eqn)
    except Mixing:  # a body that reads across a value of the batch's extent
      raise
    except Exception:  # noqa: BLE001 - knowing less is always allowed
      return no_uniform(eqn)
    return [o if isinstance(o, Fact) else Fact(axis=o) for o in outs]
  if eqn.effects:
    raise Mixing("has effects: they would see the padded rows")
  if rule is None:
    raise Mixing(f"no batch rule for {eqn.op}")
  # rows made from the batch size alone (Fact.sized): an arange of it
  sized = padding and all(f.sized for f in eqn.facts if f.axis is not None)
  try:
    outs = [o if isinstance(o, Fact) else Fact(axis=o) for o in rule.rows(eqn)]
  except (KeyError, IndexError, ValueError, TypeError, AttributeError) as exc:
    raise Mixing(f"its batch rule cannot read it ({type(exc).__name__}: {exc})") from None
  except Mixing as exc:
    raise _sized(exc) if sized else exc from None
  if sized:
    outs = [dataclasses.replace(o, sized=True) if o.axis is not None else o for o in outs]
  for k, fact in enumerate(outs):  # a safety net under every rule
    shape = _shape(eqn.out_avals[k])
    if fact.axis is not None and (fact.axis >= len(shape) or shape[fact.axis] != eqn.batch):
      raise Mixing(f"changes the extent of the batch axis (output {k} axis {fact.axis})")
    second = [d for d, n in enumerate(shape) if n == eqn.batch and d != fact.axis]
    if padding and fact.axis is not None and second:  # (no number of the program's)
      raise Mixing(f"output {k} has a second axis of the batch's extent (axis {second[0]}) "
                   "beside the rows: made from the batch size (jnp.ones((1, x.shape[0])), "
                   "an arange of it) or from the rows themselves, padded rows would count "
                   "across it")
  return outs


def _sized(exc):
  return Mixing(f"{exc.reason}, on a value sized by the batch that does not come from the "
                "rows (made from the batch size: jnp.ones(x.shape[0]), an arange of it); "
                "padded rows would count")


# reductions whose result over a value the same along an axis does not depend
# on how long that axis is (any(ones_like(ids) == 0), as Hugging Face's models ask)
SAME_ON_REPEATS = frozenset(("reduce_max", "reduce_min", "reduce_and", "reduce_or",
                             "argmax", "argmin"))


def _batch_sized(eqn):
  """The operation as its rows rule would see it were the axes of the batch's
  extent (a probe size, which no number of the program is) rows: one Eqn per such axis of
  an operand with several. A value made from the batch size (`jnp.ones(
  x.shape[0])`) holds no row, yet a sum or an argmax across it counts the
  padded rows: the rows rule then says it mixes."""
  keeps = eqn.op in SAME_ON_REPEATS  # a maximum over copies of one value is that value
  sized = [[d for d, n in enumerate(eqn.shape(i))
            if n == eqn.batch and not (keeps and d in f.uniform)]
           for i, f in enumerate(eqn.facts)]
  for k in range(max(map(len, sized), default=0)):
    facts = [Fact(axis=axes[min(k, len(axes) - 1)]) if axes else f
             for axes, f in zip(sized, eqn.facts)]
    yield dataclasses.replace(eqn, facts=facts)


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
  return (PaddedBatch(sizes.pop()) if sizes else None), facts


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
