"""How state travels between the slots and a program: the state layouts.

A program takes the state in its layout's form (`gather()`), and returns the
new values of what it updates in `returned()`'s form, which `commit()` writes
back to the slots:
  * StateLayout: leaf by leaf (plans of several partitions, the eager path); a
    packed slot is read through its view and written through its pack;
  * StorageLayout: one executable takes each slot's storage as it is - a unit
    per leaf, or a packed slot's flat buffer of small leaves
    (runtime/packing.py), sliced inside the executable and written back as
    one concatenation;
  * WholeSlots: the StorageLayout where one executable donates and updates
    every unit (the training step): the slots' storage tuples go in as they
    are and come back replaced whole.
`state_layout` picks the one a graph needs.
"""
import operator

from jax import tree_util

from jaxsession.runtime.build import shape_struct


class StateLayout:
  """How state leaves travel to a plan (several partitions) or the eager
  path: leaf by leaf. `gather()` is the state a program takes - every
  state leaf, in state order - and `commit(new)` writes back what it
  returned: the new values of the updated leaves, in updated_idx order. A
  packed slot (runtime/packing.py) is read through its view and written
  through its pack, its packed leaves never donated. `state_layout` picks
  StorageLayout for one executable."""
  whole = False

  def __init__(self, graph, plan, leaf_slots, one_executable):
    states = graph.inputs_of_kind("state")
    donated = plan.donated_ids()
    self.leaf_slots = leaf_slots
    self.num_state = len(states)
    # outputs[:num_outputs] hold new state values (0 for a graph that only reads)
    self.num_outputs = len(graph.state_updates())
    # the memory plan's own decisions (a packed leaf is never donated to a
    # plan; a leaf with its own buffer in a packed slot may be): the leaves
    # a failed sunk run or a debug_nans run copies first
    self.donated_idx = [i for i, s in enumerate(states) if s.id in donated]
    # every leaf but those the step returns as they came (a scalar divisor is
    # returned by the executable all the same: KernelGraph.passed_state)
    passed = graph.passed_state()
    self.updated_idx = [i for i in range(self.num_outputs) if i not in passed]
    # (index, name) of the leaves the step returns as they came (call_path's
    # debug_nans/infs check)
    self.passed = [(i, states[i].name or f"state {i}") for i in passed]
    self.state_avals = [s.aval for s in states]
    self.state_shardings = [s.sharding for s in states]  # None without a mesh
    self._updated_refs = [leaf_slots[i] for i in self.updated_idx]
    self.slots = list(dict.fromkeys(slot for slot, _ in leaf_slots))
    self.one_executable = one_executable
    # a slot is packed (or not) by its first graph's Build, before any layout reads it
    self._unpacked = all(slot.packing is None for slot in self.slots)

  def gather(self):
    if self._unpacked:  # the slots' storage is their leaves: no view to read
      return tuple([slot.storage[j] for slot, j in self.leaf_slots])
    return tuple([slot.leaves[j] for slot, j in self.leaf_slots])

  def commit(self, new):
    if not self._updated_refs:
      return
    changed = {}
    for (slot, j), value in zip(self._updated_refs, new):
      changed.setdefault(slot, list(slot.leaves))[j] = value
    for slot, leaves in changed.items():
      slot.leaves = leaves

  def structs(self):
    """The state arguments an executable taking gather()'s form is compiled
    for (a leaf each)."""
    return [shape_struct(self.state_avals[i], self.state_shardings[i])
            for i in range(self.num_state)]

  def donate_argnums(self):
    return tuple(self.donated_idx)

  def leaves_of(self, state):
    """gather()'s form -> the flat state leaves, in state order."""
    return list(state)

  def returned(self, new, state):  # pylint: disable=unused-argument
    """The flat new values of the updated leaves (and the state they were
    made from, in gather()'s form) -> commit()'s form."""
    return tuple(new)

  def merged(self, state, new):
    """gather()'s form after returned() value `new` replaced its part."""
    full = list(state)
    for i, x in zip(self.updated_idx, new):
      full[i] = x
    return tuple(full)

  def returned_shardings(self):
    """Per commit()'s entry: the layout its slot keeps (None without a mesh)."""
    return [self.state_shardings[i] for i in self.updated_idx]

  def updated_names(self, names):
    """What each of commit()'s entries is, from the state leaves' `names`."""
    return [names[i] or f"state {i}" for i in self.updated_idx]

  def input_names(self, names):
    """What each of gather()'s entries (structs(), flat) is, from the state
    leaves' `names`."""
    return [names[i] or f"state {i}" for i in range(self.num_state)]

  def packed_returns(self):
    """(position in returned()'s flat form, name) of each packed buffer it
    returns: none, leaf by leaf."""
    return []

  def key(self):
    """What of the layout shapes an executable (the compile cache's key)."""
    return (self.whole, tuple(self.donated_idx), tuple(self.updated_idx), self.num_outputs)


class StorageLayout(StateLayout):
  """One executable takes its slots' storage as it is: a unit each - a
  leaf, or a packed slot's flat buffer of small leaves, sliced inside the
  executable and written back as one concatenation. A unit is updated when
  any of its leaves is, and donated when any of its updated leaves is."""

  def __init__(self, graph, plan, leaf_slots, one_executable):
    super().__init__(graph, plan, leaf_slots, one_executable)
    index = {(id(slot), j): i for i, (slot, j) in enumerate(leaf_slots)}
    donated = {i for i, s in enumerate(graph.inputs_of_kind("state"))
               if s.id in plan.donated_ids()}
    updated = set(self.updated_idx)
    self.units = []  # (slot, k, the state indices it holds)
    for slot in self.slots:
      packing = slot.packing
      for k in range(len(slot.storage)):
        members = packing.unit_leaves(k) if packing is not None else [k]
        self.units.append((slot, k, [index[(id(slot), j)] for j in members]))
    self.unit_updated = [u for u, (_, _, m) in enumerate(self.units) if updated & set(m)]
    self.unit_donated = [u for u in self.unit_updated if donated & set(self.units[u][2])]
    self._refs = [(self.units[u][0], self.units[u][1]) for u in self.unit_updated]
    self._index = index
    self.packed = any(slot.packing is not None for slot in self.slots)

  def gather(self):
    return tuple([slot.storage[k] for slot, k, _ in self.units])

  def commit(self, new):
    if not self._refs:
      return
    changed = {}
    for (slot, k), value in zip(self._refs, new):
      changed.setdefault(slot, list(slot.storage))[k] = value
    for slot, storage in changed.items():
      slot.storage = tuple(storage)

  def _unit_struct(self, u):
    slot, k, members = self.units[u]
    if _plain(slot, k):
      return shape_struct(self.state_avals[members[0]], self.state_shardings[members[0]])
    return slot.packing.buffer_struct(k)

  def structs(self):
    return [self._unit_struct(u) for u in range(len(self.units))]

  def donate_argnums(self):
    return tuple(self.unit_donated)

  def _flat_leaves(self, units):
    """The flat state leaves (state order) from the units (gather order)."""
    if not self.packed:
      return list(units)
    out, at = [None] * self.num_state, 0
    for slot in self.slots:
      n = len(slot.storage)
      mine = units[at:at + n]
      at += n
      leaves = mine if slot.packing is None else slot.packing.leaves(mine)
      for j, x in enumerate(leaves):
        out[self._index[(id(slot), j)]] = x
    return out

  def _flat_returned(self, new, units):
    """The updated units (unit_updated order) from the new values of the
    updated leaves and the units they were made from."""
    if not self.packed:
      return tuple(new)
    full = self._flat_leaves(units)
    for i, x in zip(self.updated_idx, new):
      full[i] = x
    out = []
    for u in self.unit_updated:
      slot, k, members = self.units[u]
      packing = slot.packing
      if _plain(slot, k):
        out.append(full[members[0]])
      else:
        out.append(packing.buffer(k - len(packing.plain),
                                  dict(zip(packing.unit_leaves(k), (full[i] for i in members)))))
    return tuple(out)

  def leaves_of(self, state):
    return self._flat_leaves(list(state))

  def returned(self, new, state):
    return self._flat_returned(new, list(state))

  def merged(self, state, new):
    full = list(state)
    for u, x in zip(self.unit_updated, new):
      full[u] = x
    return tuple(full)

  def returned_shardings(self):
    out = []
    for u in self.unit_updated:
      slot, k, members = self.units[u]
      leaf = self.state_shardings[members[0]]
      out.append(leaf if slot.packing is None else slot.packing.unit_sharding(k, leaf))
    return out

  def updated_names(self, names):
    return [self._unit_name(u, names) for u in self.unit_updated]

  def input_names(self, names):
    return [self._unit_name(u, names) for u in range(len(self.units))]

  def _unit_name(self, u, names):
    slot, k, members = self.units[u]
    if _plain(slot, k):
      return names[members[0]] or f"state {members[0]}"
    return _buffer_name(slot, k, members)

  def packed_returns(self):  # what runtime/horizontal.py rewrites
    out = []
    for p, u in enumerate(self.unit_updated):
      slot, k, members = self.units[u]
      if not _plain(slot, k):
        out.append((p, _buffer_name(slot, k, members)))
    return out

  def key(self):
    return (self.whole, tuple(self.unit_donated), tuple(self.unit_updated),
            tuple(self.updated_idx), self.num_outputs,
            tuple(None if s.packing is None else s.packing.key() for s in self.slots))


class WholeSlots(StorageLayout):
  """The one specialisation: one executable donates and updates every
  storage unit (the training step). The slots' storage tuples go in as
  they are, one donated argument, and come back replaced whole: no unit is
  picked out or put back one by one."""
  whole = True

  def gather(self):
    return (tuple(map(_STORAGE, self.slots)),)

  def commit(self, new):
    for slot, storage in zip(self.slots, new):
      slot.storage = storage

  def structs(self):
    it = iter(super().structs())
    return [tuple(tuple(next(it) for _ in slot.storage) for slot in self.slots)]

  def donate_argnums(self):
    return (0,)

  def leaves_of(self, state):
    return self._flat_leaves([x for units in state[0] for x in units])

  def returned(self, new, state):
    it = iter(self._flat_returned(new, [x for units in state[0] for x in units]))
    return tuple(tuple(next(it) for _ in slot.storage) for slot in self.slots)

  def merged(self, state, new):  # pylint: disable=unused-argument
    return (new,)

  def returned_shardings(self):
    it = iter(super().returned_shardings())
    return tuple(tuple(next(it) for _ in slot.storage) for slot in self.slots)


_STORAGE = operator.attrgetter("storage")


def _buffer_name(slot, unit, members):
  return f"{slot.name} packed buffer (storage unit {unit}, {len(members)} leaves)"


def _plain(slot, unit):
  """Whether storage unit `unit` of `slot` is one leaf as it is (not a packed buffer)."""
  return slot.packing is None or unit < len(slot.packing.plain)


def state_layout(graph, plan, leaf_slots, one_executable):
  """The StateLayout of a graph: for one executable a StorageLayout - WholeSlots
  where it donates and updates every storage unit - else leaf by leaf."""
  if not one_executable:
    return StateLayout(graph, plan, leaf_slots, one_executable)
  layout = StorageLayout(graph, plan, leaf_slots, one_executable)
  everything = list(range(len(layout.units)))
  if everything and layout.unit_donated == everything == layout.unit_updated:
    return WholeSlots(graph, plan, leaf_slots, one_executable)
  return layout


def kept_layouts(layout):
  """The out_shardings of an executable returning (layout.returned(...),
  outputs): under a mesh the new state keeps its slot's layout, so it is
  donated in place; XLA chooses the outputs'. None without a mesh."""
  keep = layout.returned_shardings()
  if all(s is None for s in tree_util.tree_leaves(keep, is_leaf=lambda x: x is None)):
    return None
  return (keep if isinstance(keep, tuple) else tuple(keep), None)
