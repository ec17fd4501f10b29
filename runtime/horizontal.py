"""Horizontal fusion of packed buffers' write-backs (Build, packed state).

A step over packed small state (runtime/packing.py) reads each leaf as a
slice of its flat buffer and writes the buffer back as one concatenation of
the leaves' new values. XLA:CPU fuses each leaf's update with its slice, but
neither fuses the updates of different leaves with each other nor any of
them into the concatenation: 200 packed leaves still run 200 small kernels
and a copy each step. Here the step's jaxpr is rewritten before XLA sees it:
where consecutive leaves' new values are computed alike - the same
elementwise ops, params and scalar operands, down to the leaves' reads (a
`_structure`) - each op runs once over the run of leaves: SLP vectorisation,
across leaves instead of lanes. A merged op reads
  * the leaves' reads: consecutive slices of one flat buffer, that buffer
    (or one slice of it);
  * another merged op;
  * a value every leaf reads alike, computed once and tiled;
  * scalars, the same for the whole run (spread to its length where each
    leaf's op took them spread).
Runs of other structures are written back as they were (their values
concatenated) beside the merged ones. Nothing else is merged, because XLA
rewrites an op by what it reads, and must rewrite the merged op as it
rewrote each leaf's: (x + 0.1) + 0.7 into x + 0.8, pow(x, 2) into x * x,
x / s into x * (1 / s) - which it decides by the scalar's value and even the
kernel's size. So a merged op never reads values concatenated (hiding their
ops), scalars that differ between leaves, scalars alone, constants, a scalar
spread over a one-element leaf, a divisor that is a spread scalar, or a
leaf's value read elsewhere too (XLA counts readers: a / sqrt(b) becomes
a * rsqrt(b) where the sqrt has one); every element is
then computed by the same primitives from the same operand values as
before. Nor is an op XLA:CPU approximates (exp, log, tanh, atan...:
op_properties' `approximated`), whose polynomial rounds by the kernel's
size - jax.jit itself gives other bits for 7 and 56 elements. Which
multiply-adds XLA:CPU contracts into FMAs, in the step and inside those
polynomials, still follows the kernels, as packing's already do
(docs/numerics.md). Leaves of more than
MERGE_BELOW_ELEMENTS elements on average keep their kernels. The per-leaf
ops stay in the program; XLA drops those nothing else reads. Each buffer
gets a line in report.memory's `horizontal` and in dump()'s memory section.
"""
import contextlib
import math

import jax
import numpy as np
from jax import lax, tree_util
from jax.extend import core as jcore

from jaxsession.graph import lowering, op_properties
from jaxsession.runtime import bitwise


# A run is merged where its leaves average at most this many elements. One
# kernel over the run saves a kernel launch per leaf, but runs on one thread,
# where XLA:CPU runs the leaves' kernels side by side: 50 f32 leaves of 512
# elements each ran in 0.28-0.48x the time merged, of 1024 in 0.67-0.74x, of
# 2048 in 0.80-1.17x, of 4096 in 1.12-1.26x (2 cores; benchmarks/RESULTS.md).
MERGE_BELOW_ELEMENTS = 1024


def _size(atom):
  return math.prod(atom.aval.shape)


def _literal(atom):
  return isinstance(atom, jcore.Literal)


def _key(atom):
  """What makes two atoms the same value: a variable itself, a literal its bits."""
  if _literal(atom):
    value = np.asarray(atom.val, atom.aval.dtype)
    return ("literal", str(value.dtype), value.shape, value.tobytes(),
            bool(getattr(atom.aval, "weak_type", False)))
  return atom


def _keeps_order(eqn):
  """Whether `eqn` only reshapes its one operand (the same elements in the
  same flat order): a reshape, a squeeze, a broadcast that adds unit axes."""
  if len(eqn.invars) != 1:  # (an iota has none)
    return False
  name, x = eqn.primitive.name, eqn.invars[0]
  if _literal(x) or eqn.params.get("sharding") is not None:
    return False
  if name == "reshape":
    return eqn.params.get("dimensions") is None
  if name in ("squeeze", "broadcast_in_dim"):
    return _size(x) == _size(eqn.outvars[0]) and (
        name == "squeeze" or list(eqn.params["broadcast_dimensions"]) == sorted(
            eqn.params["broadcast_dimensions"]))
  return False


def _mergeable(eqn):
  """The signature of an op a run may merge over (None: never merged): an
  elementwise primitive with one output of a numeric dtype, computed exactly
  (not one XLA:CPU approximates, rounded by the kernel's size)."""
  prim = eqn.primitive
  facts = op_properties.facts(prim.name)
  if prim.multiple_results or not facts.elementwise or facts.approximated:
    return None
  if any(jax.dtypes.issubdtype(v.aval.dtype, jax.dtypes.extended)
         for v in (*eqn.outvars, *(a for a in eqn.invars))):
    return None
  return (prim, repr(sorted(eqn.params.items())))


class _Plan:
  """The rewrite of one jaxpr's packed write-backs, planned on the jaxpr
  (nothing traced): a recipe per root, shared sub-recipes memoised by the
  values they pack, so a value every buffer needs is packed once."""

  def __init__(self, jaxpr, consts):
    self.producer = {v: e for e in jaxpr.eqns for v in e.outvars
                     if not isinstance(v, jcore.DropVar)}
    self.consts = dict(zip(jaxpr.constvars, consts))
    self.constant = set(jaxpr.constvars)  # values of constants alone: XLA folds them
    for eqn in jaxpr.eqns:
      if not eqn.effects and all(_literal(a) or a in self.constant for a in eqn.invars):
        self.constant.update(v for v in eqn.outvars if not isinstance(v, jcore.DropVar))
    self.users = {}  # var -> how many equations (or outputs) read it
    for a in [a for e in jaxpr.eqns for a in e.invars] + list(jaxpr.outvars):
      if not _literal(a):
        self.users[a] = self.users.get(a, 0) + 1
    self.memo = {}
    self.structures = {}  # atom -> _structure's answer

  def flat(self, atom):
    """`atom`, or what it reshapes: a reshape keeps the flat order of the
    elements, which is all a pack reads."""
    while not _literal(atom):
      eqn = self.producer.get(atom)
      if eqn is None or not _keeps_order(eqn):
        break
      atom = eqn.invars[0]
    return atom

  def pack(self, atoms):
    """A recipe for the flat concatenation of `atoms` (one dtype)."""
    atoms = [self.flat(a) for a in atoms]
    key = tuple(_key(a) for a in atoms)
    if key not in self.memo:
      self.memo[key] = self._pack(atoms, key)
    return self.memo[key]

  def _pack(self, atoms, key):
    read = self._reads(atoms)
    if read is not None:
      return read
    if len(set(key)) == 1 and len({a.aval.shape for a in atoms}) == 1:
      return self._same(atoms)
    spread = [self._broadcast_scalar(a) for a in atoms]
    if all(s is not None for s in spread):  # values only: no op reads them as operands
      return ("spread", spread, [_size(a) for a in atoms])
    structures = [self._structure(a) for a in atoms]
    parts = [self._run(atoms[i:j]) for i, j in _runs(structures)]
    if all(p[0] == "copy" for p in parts):
      return ("copy", list(atoms))
    return parts[0] if len(parts) == 1 else ("join", parts)

  def _structure(self, atom):
    """What `atom`'s computation looks like down to the leaf's read: the ops,
    their params and scalar operands, what they read. Leaves of one
    structure merge at every level, so a run never needs cutting below its
    top (where the pieces would be concatenated, hiding their ops from XLA).
    None: nothing merges it."""
    atom = self.flat(atom)
    if _literal(atom):
      return None
    done = self.structures.get(atom, False)
    if done is not False:
      return done
    self.structures[atom] = None  # (a cycle is impossible; a depth guard for the recursion)
    eqn = self.producer.get(atom)
    read = self._read(atom)
    if eqn is None:
      out = None if atom in self.constant else ("input", atom)
    elif read is not None and len(read[0].invars[0].aval.shape) == 1:
      out = ("read", read[0].invars[0])
    elif _mergeable(eqn) is None:
      out = None
    else:
      shape = eqn.outvars[0].aval.shape
      operands = []
      for a in eqn.invars:
        scalar = self._scalar(a, shape)
        operands.append(("scalar", _scalar_key(scalar)) if scalar is not None else
                        self._structure(a))
      out = (_mergeable(eqn), math.prod(shape) == 1, tuple(operands))
    self.structures[atom] = out
    return out

  def _same(self, atoms):
    """A recipe for one value that every leaf reads: the value, computed once
    as each leaf's op read it, tiled over the run; a constant copied in
    (which the merged op refuses: XLA rewrites an op on a constant by its
    value)."""
    atom = atoms[0]
    if _literal(atom) or atom in self.constant:
      return ("copy", list(atoms))
    return ("tile", atom, len(atoms))

  def _broadcast_scalar(self, atom):
    """The scalar `atom` broadcasts, where it is a broadcast_in_dim of one."""
    eqn = None if _literal(atom) else self.producer.get(atom)
    if (eqn is None or eqn.primitive.name != "broadcast_in_dim" or eqn.invars[0].aval.shape
        or eqn.params.get("sharding") is not None):
      return None
    return eqn.invars[0]

  def _scalar(self, atom, out_shape):
    """What an operand `atom` of an op making `out_shape` is, where XLA sees
    it as a scalar spread over the op - a literal, a constant whose elements
    are all one value, a rank-0 value beside a bigger output, a broadcast of
    one: ("scalar", the scalar atom) or ("constant", its numpy value) - else
    None (an array). XLA simplifies around such scalars (drops x + 0, turns
    pow(x, 2) into x * x and x / s into x * (1 / s)), so leaves merge only
    where their scalars are the same."""
    if _literal(atom):
      return ("scalar", atom)
    value = self.consts.get(atom)
    if value is not None:
      flat = np.asarray(value).reshape(-1)
      if flat.size and not jax.dtypes.issubdtype(flat.dtype, jax.dtypes.extended):
        # one value by its bits: -0.0 == 0.0 and nan != nan by value
        elements = np.ascontiguousarray(flat).view(np.uint8).reshape(flat.size, -1)
        if (elements == elements[0]).all():
          return ("constant", flat[0])
      return None
    if atom.aval.shape == ():
      return ("scalar", atom) if out_shape != () else None
    inner = self.flat(atom)  # a (1,)-shaped reshape of a scalar, say
    if inner.aval.shape != ():
      inner = self._broadcast_scalar(inner)
    return None if inner is None else self._scalar(inner, None)

  def _read(self, atom):
    """(its slice equation, None) where `atom` is a slice; (the slice's
    equation, atom's dtype) where it is a slice bitcast from its carrier (a
    packed buffer's read: runtime/bitwise.py); else None."""
    eqn = None if _literal(atom) else self.producer.get(atom)
    cast = None
    if eqn is not None and eqn.primitive.name == "bitcast_convert_type" and not _literal(
        eqn.invars[0]) and bitwise.carrier(atom.aval.dtype) == eqn.invars[0].aval.dtype:
      cast, eqn = atom.aval.dtype, self.producer.get(eqn.invars[0])
    if eqn is None or eqn.primitive.name != "slice":
      return None
    return eqn, cast

  def _reads(self, atoms):
    """("var"/"slice", buffer, start, stop, dtype) where `atoms` are
    consecutive slices (each maybe reshaped, each maybe bitcast to `dtype`
    from the buffer's carrier, else None) of one flat buffer, in order;
    else None."""
    source, start, at, cast = None, None, None, None
    for atom in atoms:
      read = self._read(atom)
      eqn = None if read is None else read[0]
      if (eqn is None or _literal(eqn.invars[0]) or len(eqn.invars[0].aval.shape) != 1
          or eqn.params.get("strides") not in (None, (1,))):
        return None
      (lo,), (hi,) = eqn.params["start_indices"], eqn.params["limit_indices"]
      if source is None:
        source, start, at, cast = eqn.invars[0], lo, lo, read[1]
      if eqn.invars[0] is not source or lo != at or read[1] != cast:
        return None
      at = hi
    if start == 0 and at == source.aval.shape[0]:
      return ("var", source, cast)
    return ("slice", source, start, at, cast)

  def _run(self, run):
    """A recipe for `run` (one structure): its op merged, or ("copy", run)."""
    eqns = [None if _literal(a) else self.producer.get(a) for a in run]
    if len(run) < 2 or eqns[0] is None or _mergeable(eqns[0]) is None:
      return ("copy", list(run))
    shape = eqns[0].outvars[0].aval.shape
    return self._merge(run, eqns, [self._scalar(a, shape) for a in eqns[0].invars])

  def _merge(self, run, eqns, scalars):
    """An "op" recipe: eqns' op once over the run (the same scalar operands
    `scalars`), or ("copy", run)."""
    shapes = [e.outvars[0].aval.shape for e in eqns]
    if len(run) < 2 or sum(math.prod(s) for s in shapes) > MERGE_BELOW_ELEMENTS * len(run):
      return ("copy", list(run))  # big leaves: their own kernels run side by side
    divides = eqns[0].primitive.name in op_properties.DIVIDES
    operands = []
    for i, scalar in enumerate(scalars):
      column = [e.invars[i] for e in eqns]
      if len({str(a.aval.dtype) for a in column}) != 1:
        return ("copy", list(run))
      if scalar is not None:
        if divides and i == 1:  # XLA:CPU divides by a spread scalar exactly or through
          return ("copy", list(run))  # its reciprocal, by the size of the fusion
        # spread over the run where each leaf's op took it spread (a select's
        # case, a clamp's operand must have the op's shape)
        operands.append((*scalar, sum(math.prod(s) for s in shapes)
                         if column[0].aval.shape != () else None))
        continue
      if not all(a.aval.shape == s and a not in self.constant for a, s in zip(column, shapes)):
        return ("copy", list(run))  # (a constant: XLA rewrites an op on it by its value)
      recipe = self.pack(column)
      # what the op reads must be what each leaf's op read: the leaves' reads, a
      # merged op (XLA sees through it as through each leaf's), a shared value
      # tiled - never values concatenated, behind which XLA would not see their ops
      if recipe[0] not in ("var", "slice", "op", "tile") or (divides and i == 1 and
                                                             recipe[0] == "tile"):
        return ("copy", list(run))
      if recipe[0] == "op" and not all(self._one_user(a) for a in column):
        # XLA rewrites some ops by how many read them (a / sqrt(b) into
        # a * rsqrt(b) where the sqrt has one reader): a leaf's value read
        # elsewhere too would have one reader merged
        return ("copy", list(run))
      operands.append(recipe)
    if not any(o[0] in ("var", "slice", "op", "tile") for o in operands):
      return ("copy", list(run))  # scalars alone: a scalar, not the run's elements
    if any(math.prod(s) == 1 for s in shapes) and any(
        o[0] in ("scalar", "constant", "tile") for o in operands):
      # a one-element leaf's op takes its scalars as they are; over the buffer
      # they would be spread, and XLA simplifies a spread operand otherwise
      return ("copy", list(run))
    return ("op", eqns[0], operands, len(run))

  def _one_user(self, atom):
    """Whether `atom`, and each reshape between it and what it reshapes, is
    read once in the step."""
    while not _literal(atom):
      if self.users.get(atom, 0) != 1:
        return False
      eqn = self.producer.get(atom)
      if eqn is None or not _keeps_order(eqn):
        return True
      atom = eqn.invars[0]
    return True


def _scalar_key(scalar):
  kind, value = scalar[:2]
  if kind == "scalar":
    return _key(value)
  value = np.asarray(value)
  return ("literal", str(value.dtype), (), value.tobytes(), False)


def _runs(signatures):
  """(start, stop) of the runs of equal signatures (None: a run of its own)."""
  out, start = [], 0
  for j in range(1, len(signatures) + 1):
    if j == len(signatures) or signatures[j] is None or signatures[j] != signatures[start]:
      out.append((start, j))
      start = j
  return out


def _census(recipe, seen=None):
  """(merged ops, the per-leaf ops they stand for, packs copied in) of a recipe."""
  seen = set() if seen is None else seen
  if id(recipe) in seen or not isinstance(recipe, tuple):
    return 0, 0, 0
  seen.add(id(recipe))
  kind = recipe[0]
  if kind == "carried":
    return _census(recipe[1], seen)
  if kind == "copy":
    return 0, 0, 1
  if kind == "join":
    parts = [_census(p, seen) for p in recipe[1]]
  elif kind == "op":
    parts = [(1, recipe[3], 0)] + [_census(o, seen) for o in recipe[2]]
  else:
    return 0, 0, 0
  return tuple(map(sum, zip(*parts)))


def _emit(recipe, read, values):
  """The traced value of `recipe`: flat, the pack's elements in order."""
  done = values.get(id(recipe))
  if done is not None:
    return done
  kind = recipe[0]
  if kind == "var":
    out = read(recipe[1])
    if recipe[2] is not None:
      out = bitwise.uncarried(out, recipe[2])
  elif kind == "slice":
    out = lax.slice(read(recipe[1]), (recipe[2],), (recipe[3],))
    if recipe[4] is not None:
      out = bitwise.uncarried(out, recipe[4])
  elif kind == "tile":
    x = jax.numpy.asarray(read(recipe[1]), recipe[1].aval.dtype)
    out = lax.broadcast_in_dim(x, (recipe[2], *x.shape), tuple(range(1, x.ndim + 1)))
    out = lax.reshape(out, (recipe[2] * math.prod(x.shape),))
  elif kind in ("spread", "copy", "join"):
    parts = _pieces(recipe, read, values)
    out = parts[0] if len(parts) == 1 else lax.concatenate(parts, 0)
  elif kind == "carried":  # a buffer held as its carrier (runtime/bitwise.py): joined in it
    parts = [bitwise.carried(p) for p in _pieces(recipe[1], read, values)]
    out = parts[0] if len(parts) == 1 else lax.concatenate(parts, 0)
  else:  # "op"
    eqn, operands = recipe[1], recipe[2]
    args = [_scalar_operand(o, read) if o[0] in ("scalar", "constant") else
            _emit(o, read, values) for o in operands]
    with _context(eqn):
      out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
  values[id(recipe)] = out
  return out


def _pieces(recipe, read, values):
  """The values a recipe's elements are joined from, in order: a spread's
  scalars spread, a copy's values, each part of a join's; else its value."""
  kind = recipe[0]
  if kind == "spread":
    return [lax.broadcast_in_dim(jax.numpy.asarray(read(a), a.aval.dtype), (n,), ())
            for a, n in zip(recipe[1], recipe[2])]
  if kind == "copy":
    return [lax.reshape(jax.numpy.asarray(read(a), a.aval.dtype), (_size(a),))
            for a in recipe[1]]
  if kind == "join":
    return [piece for part in recipe[1] for piece in _pieces(part, read, values)]
  return [_emit(recipe, read, values)]


def _scalar_operand(operand, read):
  """A merged op's scalar operand: as it is, or spread over `length` elements."""
  kind, value, length = operand
  x = read(value) if kind == "scalar" else value
  if length is None:
    return x
  dtype = value.aval.dtype if kind == "scalar" else np.asarray(value).dtype
  return lax.broadcast_in_dim(jax.numpy.asarray(x, dtype), (length,), ())


def _context(eqn):
  """eval_jaxpr's context of binding `eqn`: its frame and name stack (the
  HLO's metadata: lowering.as_traced), its equation context (compute type,
  jax settings)."""
  if lowering.as_traced is None:
    return eqn.ctx.manager
  stack = contextlib.ExitStack()
  stack.enter_context(lowering.as_traced(eqn.source_info))
  stack.enter_context(eqn.ctx.manager)
  return stack


class Rewrite:
  """The write-backs of a packed step's buffers fused horizontally. Called
  with the step as jax.jit traced it (its closed jaxpr and output tree), it
  returns the function to trace in its place - the jaxpr evaluated with the
  merged ops - or None where nothing merges: the traced step is then lowered
  as it is, with no second trace (build.compile_fn). `roots`: the flat
  output positions of the step that are packed buffers, with their names.
  `notes`: one line per buffer, filled when called."""

  def __init__(self, roots):
    self.roots = dict(roots)
    self.notes = []

  def __call__(self, closed, out_tree):
    jaxpr = closed.jaxpr
    plan, recipes, notes = _Plan(jaxpr, closed.consts), {}, []
    for position, name in self.roots.items():
      var = jaxpr.outvars[position]
      eqn = None if _literal(var) else plan.producer.get(var)
      written = None if eqn is None else bitwise.written_parts(eqn, plan.producer)
      if written is None or len(var.aval.shape) != 1:
        continue
      parts, carrier = written
      try:
        recipe = plan.pack(parts)
      except RecursionError:  # a chain of ops deeper than Python recurses: as it was
        notes.append(f"{name}: written back leaf by leaf (its leaves' chains of ops are too "
                     "deep to plan)")
        continue
      ops, per_leaf, copies = _census(recipe)
      if not ops:
        notes.append(f"{name}: written back leaf by leaf (no run of its leaves of at most "
                     f"{MERGE_BELOW_ELEMENTS} elements on average is computed alike by "
                     "exactly rounded elementwise ops from their reads, the step's inputs and "
                     "the same scalars alone; a gradient, say, comes from ops that are not "
                     "merged)")
        continue
      recipes[id(eqn)] = recipe if carrier is None else ("carried", recipe, carrier)
      notes.append(f"{name}: {ops} elementwise ops over the whole buffer in place of "
                   f"{per_leaf} per-leaf ones"
                   + (f", {copies} packs of leaf values copied in" if copies else ""))
    self.notes = notes
    if not recipes:
      return None

    def rewritten(*args):
      outs = _evaluate(jaxpr, closed.consts, tree_util.tree_leaves(args), recipes)
      return tree_util.tree_unflatten(out_tree, outs)
    return rewritten


def _evaluate(jaxpr, consts, args, recipes):
  """eval_jaxpr's loop, where an equation with a recipe is its recipe."""
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda a: a.val if _literal(a) else env[a]  # noqa: E731
  values = {}
  for eqn in jaxpr.eqns:
    recipe = recipes.get(id(eqn))
    if recipe is not None:
      out = _emit(recipe, read, values)
      aval = eqn.outvars[0].aval
      if out.shape != aval.shape:  # a plan's fault: never written as the state
        raise AssertionError(f"horizontal: {eqn.outvars[0]} planned as {out.shape}, "
                             f"not {aval.shape}")
      if out.dtype != aval.dtype or getattr(jax.typeof(out), "weak_type", False) != \
          getattr(aval, "weak_type", False):
        out = lax.convert_element_type(out, aval.dtype)
      outs = [out]
    else:
      with _context(eqn):
        ans = eqn.primitive.bind(*map(read, eqn.invars),
                                 **eqn.primitive.get_bind_params(eqn.params))
      outs = ans if eqn.primitive.multiple_results else [ans]
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, jcore.DropVar):
        env[v] = x
  return [read(v) for v in jaxpr.outvars]
