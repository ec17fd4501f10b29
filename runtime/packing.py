"""Packed small state: AllocateMemory's decision, a slot's storage.

Every state leaf is an argument and an output of the step's executable, and
each costs dispatch work per call whatever its size: a step over 200 tiny
leaves spends most of its time handing buffers over (benchmarks/state.py).
So a slot may keep its small leaves - biases, norm scales, step counters and
their optimizer moments - ravelled one after another in a few flat buffers,
one per (dtype, layout): its `storage`. The executable takes the buffers,
reads each leaf as a slice (fused into its readers) and writes the new
values back as one concatenation, which XLA aliases to the donated buffer.
A buffer of a floating dtype of at most 16 bits is stored as the unsigned
integers of its width (runtime/bitwise.py: XLA:CPU joins those floats
through f32, which changed a NaN's bits).
A leaf read by a contraction stays its own buffer: a matmul's operand is
copied out of a slice before it runs.

`decide` is the policy (a PackDecision per state leaf, with its reason, in
graph.memory and dump()); `Packing` is a slot's storage map and the one
place leaves and storage are converted, traced inside an executable or by
one jitted call outside (get_state, set_state, checkpoints).
"""
import dataclasses
import math
from typing import Optional

import jax
import numpy as np
from jax import lax

from jaxsession.graph import op_properties
from jaxsession.graph.divisors import divisor_cone
from jaxsession.graph.ir import aval_bytes
from jaxsession.jax_api import real_jit
from jaxsession.runtime import bitwise, debug_flags


@dataclasses.dataclass
class PackDecision:
  state: object          # the state input Value
  packed: bool
  unit: Optional[tuple]  # (slot number, buffer number in its packing) when packed
  reason: str


@dataclasses.dataclass(frozen=True)
class SlotLeaf:
  """What the pipeline knows of a state input's slot: its number among the
  graph's slots, the leaf's index in it, and - for a slot shared from
  another graph (state_from) - that slot's Packing (None: not packed),
  which this graph must take as it is."""
  slot: int
  leaf: int
  shared: bool = False
  packing: Optional["Packing"] = None


def _contracted(value):
  """The node that contracts `value` (reads it as a matmul or convolution
  operand, or passes it into a body that contracts), or None."""
  for node in value.users:
    operands = op_properties.facts(node.op).contracts
    if any(v is value for i, v in enumerate(node.inputs) if i in operands):
      return node
    if op_properties.contracts_inside(node.params) and any(v is value for v in node.inputs):
      return node
  return None


def _eligible(state, new, threshold, divisors):
  """Why `state` (whose new value the step returns as `new`, None where it
  only reads it) cannot be packed, or None. `divisors`: the ids of the
  inputs a division's divisor is made of (graph/divisors.py)."""
  aval = state.aval
  if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended):
    return "a PRNG key: its dtype has no flat buffer"
  if bitwise.widened(aval.dtype):
    return ("a 2-bit integer: XLA:CPU cannot concatenate its arrays into a buffer "
            "(moved as 8 bits elsewhere)")
  if getattr(aval, "weak_type", False):
    return "weakly typed (a Python scalar): a slice of a buffer would be strong"
  if new is not None and getattr(new.aval, "weak_type", False):
    # the step's weak value is the state as jax.jit returns it (a break-it
    # find: packed, get_state gave it back strong)
    return ("its new value is weakly typed (a Python scalar): a slice of a buffer "
            "would be strong")
  size = aval_bytes(aval)
  if size == 0:
    return "empty"
  if size >= threshold:
    return f"{size} B >= pack_state_below_bytes ({threshold} B)"
  sharding = state.sharding
  if sharding is not None and not sharding.is_fully_replicated:
    return f"sharded ({sharding.spec}): its shards cannot share a flat buffer"
  if aval.shape == () and state.id in divisors:
    # XLA rewrites x / broadcast(s) as x * (1 / s) where s has one reader: a
    # slice of a buffer has, the leaf jax.jit returns has two (a break-it find)
    return ("a scalar a division reads: XLA would rewrite the division by its slice "
            "into a multiply by the reciprocal")
  node = _contracted(state)
  if node is not None:
    return (f"read by {node.op} (node {node.id}), a contraction: a slice would be "
            "copied before it")
  return None


def decide(graph, partitions, threshold, slot_leaves):
  """A PackDecision per state input, in order, and the Packing of each fresh
  slot (slot number -> Packing, absent where nothing is packed).
  `slot_leaves`: a SlotLeaf per state input (None: each its own fresh slot
  0, as for a graph compiled outside a Session)."""
  states = graph.inputs_of_kind("state")
  if slot_leaves is None:
    slot_leaves = [SlotLeaf(0, j) for j in range(len(states))]
  one = len(partitions) == 1 and partitions[0].place == "device"
  new_of = {state.id: new for state, new in graph.state_updates()}
  divisors = divisor_cone(graph.nodes)[1] if threshold else set()
  why, groups = {}, {}
  for state, where in zip(states, slot_leaves):
    if where.shared:
      continue
    if threshold == 0:
      why[state.id] = "packing off (pack_state_below_bytes=0)"
    elif not one:
      why[state.id] = (f"the graph runs as {len(partitions)} partitions: a plan takes its "
                       "state leaf by leaf")
    else:
      why[state.id] = _eligible(state, new_of.get(state.id), threshold, divisors)
    if why[state.id] is None:
      key = (where.slot, str(state.aval.dtype), state.sharding)
      groups.setdefault(key, []).append((where.leaf, state))
  packings = {}
  for (slot, dtype, sharding), leaves in groups.items():
    if len(leaves) < 2:
      why[leaves[0][1].id] = f"the only small {dtype} leaf of its slot: nothing to pack it with"
      continue
    packings.setdefault(slot, []).append(([j for j, _ in leaves], sharding))
  packings = {slot: Packing(len([w for w in slot_leaves if w.slot == slot]), groups_, avals={
      w.leaf: s.aval for s, w in zip(states, slot_leaves) if w.slot == slot})
              for slot, groups_ in packings.items()}
  decisions = []
  for state, where in zip(states, slot_leaves):
    packing = where.packing if where.shared else packings.get(where.slot)
    unit = None if packing is None else packing.pack_of(where.leaf)
    if where.shared:
      reason = ("its slot is shared (state_from) and keeps the source graph's layout: "
                + (packing.describe_leaf(where.leaf) if unit is not None else "not packed"))
    elif unit is not None:
      reason = packing.describe_leaf(where.leaf)
    else:
      reason = why[state.id]
    decisions.append(PackDecision(state, unit is not None,
                                  None if unit is None else (where.slot, unit), reason))
  return decisions, packings


def _laid_out(x, sharding):
  """Traced `x` laid out as `sharding`: a reshard where its mesh types its
  shardings (explicit axes), else a constraint."""
  typed = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(typed, "mesh", None)
  if mesh is not None and not getattr(mesh, "empty", True) and any(
      t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
    return jax.sharding.reshard(x, sharding)
  return lax.with_sharding_constraint(x, sharding)


class Packing:
  """A slot's storage map. Storage unit k is either one leaf, as it is, or a
  flat buffer holding several leaves of one dtype (and layout) ravelled one
  after another; the plain leaves come first, in leaf order, then the
  buffers. `leaves(storage)` and `storage(leaves)` convert, traced (inside
  an executable) or eagerly (`view`, `pack`: one jitted call each)."""

  def __init__(self, num_leaves, groups, avals):
    packed = {j for members, _ in groups for j in members}
    self.plain = [j for j in range(num_leaves) if j not in packed]
    self.groups = [list(members) for members, _ in groups]
    self.shardings = [sharding for _, sharding in groups]
    self.shapes = {j: tuple(avals[j].shape) for j in packed}
    self.dtypes = [avals[members[0]].dtype for members, _ in groups]
    self.where = {}  # leaf -> (unit, offset, size); offset None for a plain leaf
    for k, j in enumerate(self.plain):
      self.where[j] = (k, None, None)
    self.sizes = []
    for g, members in enumerate(self.groups):
      offset = 0
      for j in members:
        size = int(np.prod(self.shapes[j], dtype=np.int64))
        self.where[j] = (len(self.plain) + g, offset, size)
        offset += size
      self.sizes.append(offset)
    self.num_leaves = num_leaves
    self.num_units = len(self.plain) + len(self.groups)
    self._view = real_jit(self._unpack_groups)
    self._pack = real_jit(self._pack_groups)

  def key(self):
    """What of the packing shapes an executable (compile cache keys)."""
    return (tuple(self.plain), tuple(map(tuple, self.groups)),
            tuple(map(str, self.dtypes)), tuple(map(str, self.shardings)))

  def pack_of(self, leaf):
    """The unit number of `leaf`'s buffer, or None for a plain leaf."""
    unit, offset, _ = self.where[leaf]
    return None if offset is None else unit

  def describe_leaf(self, leaf):
    unit, offset, size = self.where[leaf]
    g = unit - len(self.plain)
    held = bitwise.carrier(self.dtypes[g])
    held = "" if held == self.dtypes[g] else f" held as {held.name}"
    return (f"packed into {np.dtype(self.dtypes[g]).name} buffer #{g}{held} (storage unit {unit}, "
            f"{len(self.groups[g])} leaves), elements [{offset}, {offset + size})")

  def unit_leaves(self, unit):
    """The leaves unit `unit` holds."""
    return [self.plain[unit]] if unit < len(self.plain) else self.groups[unit - len(self.plain)]

  def buffer_struct(self, unit):
    """The ShapeDtypeStruct an executable takes packed unit `unit` as."""
    g = unit - len(self.plain)
    return jax.ShapeDtypeStruct((self.sizes[g],), bitwise.carrier(self.dtypes[g]),
                                sharding=self.shardings[g])

  def unit_sharding(self, unit, leaf_sharding):
    return leaf_sharding if unit < len(self.plain) else self.shardings[unit - len(self.plain)]

  # -- traced: inside an executable (or eagerly, array by array) ------------
  def leaves(self, storage):
    """The slot's leaves, in leaf order, from its storage (a unit each)."""
    out = [None] * self.num_leaves
    for k, j in enumerate(self.plain):
      out[j] = storage[k]
    for g, members in enumerate(self.groups):
      buffer = storage[len(self.plain) + g]
      for j in members:  # sliced from its carrier (runtime/bitwise.py), then bitcast
        _, offset, size = self.where[j]
        out[j] = None if buffer is None else bitwise.uncarried(
            lax.slice(buffer, (offset,), (offset + size,)), self.dtypes[g]).reshape(self.shapes[j])
    return out

  def buffer(self, g, leaves):
    """Pack `g`'s flat buffer from the slot's leaves (its members')."""
    members = [leaves[j] for j in self.groups[g]]
    if any(x is None for x in members):
      return None  # unset (a ShapeDtypeStruct example, not bound yet)
    sharding = self.shardings[g]
    if sharding is not None:  # under a mesh the members are laid out as the buffer
      members = [_laid_out(x, sharding) for x in members]
    return lax.concatenate([bitwise.carried(lax.reshape(x, (math.prod(x.shape),)))
                            for x in members], 0)

  def storage(self, leaves):
    """The storage (a unit each) of the slot's leaves, in leaf order."""
    return tuple([leaves[j] for j in self.plain]
                 + [self.buffer(g, leaves) for g in range(len(self.groups))])

  # -- eager: one jitted call ---------------------------------------------
  def _unpack_groups(self, buffers):
    """Per buffer (None: unset), its members' leaves (None each)."""
    return [None if buffer is None else [
        bitwise.uncarried(lax.slice(buffer, (self.where[j][1],), (self.where[j][1] + self.where[
            j][2],)), self.dtypes[g]).reshape(self.shapes[j])
        for j in self.groups[g]] for g, buffer in enumerate(buffers)]

  def _pack_groups(self, members):
    """Per group, its members' leaves (None: unset) -> its buffer (None)."""
    return [None if group is None else lax.concatenate(
        [bitwise.carried(x.reshape(-1)) for x in group], 0) for group in members]

  def view(self, storage):
    """The leaves of `storage`, in leaf order: the plain ones as they are,
    the packed ones sliced out by one jitted call (fresh buffers)."""
    out = [None] * self.num_leaves
    for k, j in enumerate(self.plain):
      out[j] = storage[k]
    for group, sliced in zip(self.groups, _moved(self._view, list(storage[len(self.plain):]))):
      for j, x in zip(group, sliced or [None] * len(group)):
        out[j] = x
    return tuple(out)

  def pack(self, leaves):
    """The storage of `leaves` (in leaf order): the plain ones as they are,
    the packed ones copied into their buffers by one jitted call. A buffer
    with an unset (None) member stays None."""
    members = [None if any(leaves[j] is None for j in group) else [leaves[j] for j in group]
               for group in self.groups]
    return tuple([leaves[j] for j in self.plain] + list(_moved(self._pack, members)))


def _moved(fn, values):
  """fn(values), a jitted move of the state's bits (packed or sliced out):
  unchecked under jax_debug_nans/infs, which a state holding a nan would
  trip - reading, binding and saving such a state moves data, as without
  packing (a break-it find: a bare FloatingPointError from a concatenate)."""
  if debug_flags.MAYBE[0] and debug_flags.on():
    with debug_flags.checks_off():
      return fn(values)
  return fn(values)
