"""Horizontal fusion of packed buffers' write-backs (Build, packed state).

A step over packed small state (runtime/packing.py) reads each leaf as a
slice of its flat buffer and writes the buffer back as one concatenation of
the leaves' new values. XLA:CPU fuses each leaf's update with its slice, but
neither fuses the updates of different leaves with each other nor any of
them into the concatenation: 200 packed leaves still run 200 small kernels
and a copy each step. Here the step's jaxpr is rewritten before XLA sees it:
where the leaves' new values are the same elementwise op (one primitive,
the same params) of operands that line up leaf by leaf, the op runs once
over the whole buffer - SLP vectorisation, across leaves instead of lanes.
Walking down from a buffer's concatenation, the operands of a merged op are:
  * consecutive slices of one flat buffer (the leaves' reads): that buffer,
    or one slice of it;
  * one value every leaf reads alike (a shared f32[16]): tiled;
  * scalars (a literal, a learning rate): the scalar once, or each leaf's
    broadcast over its elements where they differ;
  * leaves that differ in op: cut into runs of one op, each merged, joined;
  * anything else: copied in (one concatenation, as the write-back was).
A merged op computes every element with the same primitive from the same
operand values as the leaf's own op did; which multiply-adds XLA:CPU
contracts into FMAs follows the fusions, as packing's already do
(docs/numerics.md). The per-leaf ops stay in the program; XLA drops those
nothing else reads. Each rewritten buffer gets a line in report.memory's
`horizontal` and in dump()'s memory section.
"""
import math

import jax
import numpy as np
from jax import lax, tree_util
from jax.extend import core as jcore

from jaxsession.graph import op_properties

try:  # eval_jaxpr's frames and name stacks for the HLO's metadata; no public API
  from jax._src import source_info_util as _source_info
except ImportError:  # an internal path: the rewritten ops lose their metadata
  _source_info = None


# A run is merged where its leaves average at most this many elements. One
# kernel over the run saves a kernel launch per leaf, but runs on one thread,
# where XLA:CPU runs the leaves' kernels side by side: 50 f32 leaves of 512
# elements each ran in 0.28-0.36x the time merged, of 1024 in 0.70x, of 2048
# in 1.17x, of 4096 in 1.26x (2 cores; benchmarks/state.py's sweep).
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
  elementwise primitive with one output of a numeric dtype."""
  prim = eqn.primitive
  if prim.multiple_results or not op_properties.facts(prim.name).elementwise:
    return None
  if any(jax.dtypes.issubdtype(v.aval.dtype, jax.dtypes.extended)
         for v in (*eqn.outvars, *(a for a in eqn.invars))):
    return None
  return (prim, repr(sorted(eqn.params.items())))


class _Plan:
  """The rewrite of one jaxpr's packed write-backs, planned on the jaxpr
  (nothing traced): a recipe per root, shared sub-recipes memoised by the
  values they pack, so a value every buffer needs is packed once."""

  def __init__(self, jaxpr):
    self.producer = {v: e for e in jaxpr.eqns for v in e.outvars
                     if not isinstance(v, jcore.DropVar)}
    self.memo = {}
    self.merged = self.ops = self.copies = 0

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
      return ("tile", atoms[0], len(atoms))
    spread = [self._broadcast_scalar(a) for a in atoms]
    if all(s is not None for s in spread):
      return ("spread", spread, [_size(a) for a in atoms])
    runs, start = [], 0
    sigs = [self._signature(a) for a in atoms]
    for j in range(1, len(atoms) + 1):
      if j == len(atoms) or sigs[j] is None or sigs[j] != sigs[start]:
        runs.append(atoms[start:j])
        start = j
    parts = [self._run(run) for run in runs]
    if all(p[0] == "copy" for p in parts):
      self.copies += 1
      return ("copy", list(atoms))
    self.copies += sum(p[0] == "copy" for p in parts)
    return parts[0] if len(parts) == 1 else ("join", parts)

  def _signature(self, atom):
    eqn = None if _literal(atom) else self.producer.get(atom)
    return None if eqn is None else _mergeable(eqn)

  def _broadcast_scalar(self, atom):
    """The scalar `atom` broadcasts, where it is a broadcast_in_dim of one."""
    eqn = None if _literal(atom) else self.producer.get(atom)
    if (eqn is None or eqn.primitive.name != "broadcast_in_dim" or eqn.invars[0].aval.shape
        or eqn.params.get("sharding") is not None):
      return None
    return eqn.invars[0]

  def _reads(self, atoms):
    """("var"/"slice", buffer, start, stop) where `atoms` are consecutive
    slices (each maybe reshaped) of one flat buffer, in order; else None."""
    source, start, at = None, None, None
    for atom in atoms:
      eqn = None if _literal(atom) else self.producer.get(atom)
      if (eqn is None or eqn.primitive.name != "slice" or _literal(eqn.invars[0])
          or len(eqn.invars[0].aval.shape) != 1 or eqn.params.get("strides") not in (None, (1,))):
        return None
      (lo,), (hi,) = eqn.params["start_indices"], eqn.params["limit_indices"]
      if source is None:
        source, start, at = eqn.invars[0], lo, lo
      if eqn.invars[0] is not source or lo != at:
        return None
      at = hi
    if start == 0 and at == source.aval.shape[0]:
      return ("var", source)
    return ("slice", source, start, at)

  def _run(self, run):
    """An "op" recipe merging `run` (one signature), or ("copy", run)."""
    eqns = [None if _literal(a) else self.producer.get(a) for a in run]
    if len(run) < 2 or eqns[0] is None or _mergeable(eqns[0]) is None:
      return ("copy", list(run))
    shapes = [e.outvars[0].aval.shape for e in eqns]
    if sum(math.prod(s) for s in shapes) > MERGE_BELOW_ELEMENTS * len(run):
      return ("copy", list(run))  # big leaves: their own kernels run side by side
    operands = []
    for i in range(len(eqns[0].invars)):
      column = [e.invars[i] for e in eqns]
      if len({str(a.aval.dtype) for a in column}) != 1:
        return ("copy", list(run))
      if all(a.aval.shape == s for a, s in zip(column, shapes)):
        operands.append(self.pack(column))  # scalar leaves' scalar operands land here
      elif all(a.aval.shape == () for a in column):
        keys = {_key(a) for a in column}
        operands.append(("scalar", column[0]) if len(keys) == 1 else
                        ("spread", column, [math.prod(s) for s in shapes]))
      else:
        return ("copy", list(run))
    self.merged += len(run) - 1
    self.ops += 1
    return ("op", eqns[0], operands, sum(math.prod(s) for s in shapes))


def _emit(recipe, read, values):
  """The traced value of `recipe`: flat, the pack's elements in order."""
  done = values.get(id(recipe))
  if done is not None:
    return done
  kind = recipe[0]
  if kind == "var":
    out = read(recipe[1])
  elif kind == "slice":
    out = lax.slice(read(recipe[1]), (recipe[2],), (recipe[3],))
  elif kind == "tile":
    x = jax.numpy.asarray(read(recipe[1]), recipe[1].aval.dtype)
    out = lax.broadcast_in_dim(x, (recipe[2], *x.shape), tuple(range(1, x.ndim + 1)))
    out = lax.reshape(out, (recipe[2] * math.prod(x.shape),))
  elif kind == "spread":
    parts = [lax.broadcast_in_dim(jax.numpy.asarray(read(a), a.aval.dtype), (n,), ())
             for a, n in zip(recipe[1], recipe[2])]
    out = parts[0] if len(parts) == 1 else lax.concatenate(parts, 0)
  elif kind == "copy":
    parts = [lax.reshape(jax.numpy.asarray(read(a), a.aval.dtype), (_size(a),))
             for a in recipe[1]]
    out = parts[0] if len(parts) == 1 else lax.concatenate(parts, 0)
  elif kind == "join":
    out = lax.concatenate([_emit(part, read, values) for part in recipe[1]], 0)
  else:  # "op"
    eqn, operands = recipe[1], recipe[2]
    args = [read(o[1]) if o[0] == "scalar" else _emit(o, read, values) for o in operands]
    with _context(eqn):
      out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
  values[id(recipe)] = out
  return out


def _context(eqn):
  """eval_jaxpr's context of binding `eqn`: its frame and name stack (the
  HLO's metadata), its equation context (compute type, jax settings)."""
  manager = eqn.ctx.manager

  class _Both:
    def __enter__(self):
      self.stack = []
      if _source_info is not None:
        name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
        user = _source_info.user_context(eqn.source_info.traceback, name_stack=name_stack)
        user.__enter__()
        self.stack.append(user)
      manager.__enter__()
      self.stack.append(manager)

    def __exit__(self, *exc):
      for ctx in reversed(self.stack):
        ctx.__exit__(*exc)
  return _Both()


class Rewritten:
  """`fn` (a packed step's whole function) with the write-backs of its
  packed buffers fused horizontally, for jax.jit to trace. `roots`: the
  flat output positions of fn that are packed buffers, with their names.
  `notes`: one line per buffer, filled when traced."""

  def __init__(self, fn, roots):
    self.fn = fn
    self.roots = dict(roots)
    self.notes = []

  def __call__(self, *args):
    closed, shape = jax.make_jaxpr(self.fn, return_shape=True)(*args)
    jaxpr = closed.jaxpr
    plan, recipes, notes = _Plan(jaxpr), {}, []
    for position, name in self.roots.items():
      var = jaxpr.outvars[position]
      eqn = None if _literal(var) else plan.producer.get(var)
      if eqn is None or eqn.primitive.name != "concatenate" or len(var.aval.shape) != 1:
        continue
      merged, ops, copies = plan.merged, plan.ops, plan.copies
      recipe = plan.pack(list(eqn.invars))
      if recipe[0] == "copy" or plan.merged == merged:
        notes.append(f"{name}: written back leaf by leaf (no elementwise op common to "
                     f"a run of its leaves of at most {MERGE_BELOW_ELEMENTS} elements each "
                     "on average)")
        continue
      recipes[id(eqn)] = recipe
      notes.append(f"{name}: {plan.ops - ops} elementwise ops over the whole buffer in "
                   f"place of {plan.ops - ops + plan.merged - merged} per-leaf ones"
                   + (f", {plan.copies - copies} packs of leaf values copied in"
                      if plan.copies > copies else ""))
    self.notes = notes
    outs = _evaluate(jaxpr, closed.consts, tree_util.tree_leaves(args), recipes)
    return tree_util.tree_unflatten(tree_util.tree_structure(shape), outs)


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
