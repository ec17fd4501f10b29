"""New values for a graph's state slots: checked, then bound.

`set_state`, `replace_state` (and a checkpoint's restore) all go through
`new_leaves`: every value is checked against its slot (structure, each leaf's
shape and dtype, and - where they change the program of a graph reading it -
the weak types: state_typing.py) before any slot changes, then bound as
session-owned buffers, each in its leaf's weak type as the program has it
(StateSlot.weak_types): a copy by default, or with `donate=True` the
caller's own buffer where it is already laid out as the slot's leaf (the
caller's array is then deleted, as `jax.jit` deletes a donated argument).
Binding happens only once every value has passed.
"""
import jax
from jax import tree_util

from jaxsession.errors import InputError
from jaxsession import processes, state_typing
from jaxsession.inputs import check_leaf, is_weak
from jaxsession.jax_api import ARRAY, real_jit, trace_state_clean
from jaxsession.runtime import debug_flags, static_leaves
from jaxsession.runtime.state import (check_structure, holding, owned_copies, relaid,
                                      with_weak_type)

# moves an array's buffer into a new array without a copy: XLA aliases the
# donated parameter to the output, and jax deletes the argument
_take = real_jit(lambda x: x, donate_argnums=0)


def check_values(place, slot, value):
  """The flat leaves of `value` for `slot`, checked (InputError naming
  `place` and the path)."""
  if slot.statics:  # its non-array leaves are part of the structure
    value = static_leaves.hide(value)
  leaves, treedef = tree_util.tree_flatten(value)  # one flatten: leaves and structure
  if treedef != slot.treedef:
    check_structure(slot, value, place)  # raises, naming the field that differs
  for j, (leaf, aval) in enumerate(zip(leaves, slot.avals)):
    if not _exact(leaf, aval):  # the one leaf check, and its message, for the rest
      check_leaf(_leaf_place(place, slot, value, j), leaf, aval)
  for j in slot.sub_byte:  # (a committed int4 array: refused as it is)
    leaves[j] = relaid(leaves[j], slot.device if slot.shardings is None else None)
  return leaves


def _leaf_place(place, slot, value, j):
  if slot.statics:
    value = static_leaves.hide(value)
  path = tree_util.keystr(tree_util.tree_flatten_with_path(value)[0][j][0])
  return f"{place} at path {path or '(root)'}"


def _exact(x, aval):
  """Whether `x` is a live concrete jax.Array of `aval`'s dtype and shape:
  what check_leaf accepts, decided without building its messages (a KV
  cache reset per request)."""
  return ((type(x) is ARRAY or isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer))
          and x.dtype == aval.dtype and x.shape == aval.shape and not x.is_deleted())


def check_typing(items, rows):
  """InputError where the values' weak types, bound in the slots' program
  typing, change the program of a graph that reads them
  (state_typing.refused; only slots with such a graph are looked at)."""
  flips, places = [], []
  for (place, slot, value), row in zip(items, rows):
    if slot.typings:  # (an array's aval read directly: is_weak costs ~0.4 µs a leaf)
      for j, was in slot.numeric_weak:
        x = row[j]
        if (x.aval.weak_type if type(x) is ARRAY else is_weak(x)) != was:
          flips.append((slot, j, not was))
          places.append((place, value))
  if not flips:
    return
  refusal = state_typing.refused(flips)
  if refusal is not None:
    alone, step = refusal
    named = lambda n: _leaf_place(places[n][0], flips[n][0], places[n][1], flips[n][1])
    together = "" if alone is not None else ", ".join(named(n) for n in range(1, len(flips)))
    n = alone or 0
    raise state_typing.refusal_error(named(n), flips[n][2], step, together)


def _fits(x, slot, j):
  """Whether `x` can become slot's leaf j as it is: a live jax.Array of the
  leaf's exact type, on the slot's device (under a mesh: in its sharding)."""
  if not isinstance(x, jax.Array) or x.is_deleted():
    return False
  aval = slot.avals[j]
  if x.dtype != aval.dtype or x.shape != aval.shape:
    return False
  if slot.shardings is not None:
    return x.sharding == slot.shardings[j]
  return x.devices() == {slot.device}


def refuse_under_trace(where):
  """InputError while a jax transformation traces (inside jax.jit, grad,
  vmap...): the session's copies would be the trace's values, and the state
  would hold its tracers (a review's find: every later call raised)."""
  if not trace_state_clean():
    raise InputError(f"{where}: called while a jax transformation traces (inside jax.jit, "
                     "grad, vmap...): the state would hold its tracers; bind the state "
                     "outside the traced function")


def rebind(where, items_of, given, donate):
  """Binds the values `items_of()` lists ((lock, [(place, slot, value)])),
  `given` by the caller: all checked first - alike on every process, or an
  error on each (session/processes.py; a copy is a collective there) -
  then copied and bound."""
  def checked():
    lock, items = items_of()
    return lock, items, checked_rows(where, items, donate)
  lock, items, rows = processes.agreed(
      where, checked, lambda _: processes.checksum(jax.tree.leaves(given)), "values")
  bind(lock, [slot for _, slot, _ in items], new_leaves(items, rows, donate), where)


def checked_rows(where, items, donate=False):
  """`items`: (place, slot, value) triples. Every value checked against its
  slot (InputError), with no collective and no copy: per item, the row of
  its leaves, for `new_leaves`."""
  if not isinstance(donate, bool):
    raise InputError(f"{where}: donate must be True or False, got {donate!r}")
  rows = [check_values(place, slot, value) for place, slot, value in items]  # fresh lists
  refuse_under_trace(where)  # (after the values' checks: a tracer value is named there)
  if rows:
    check_typing(items, rows)
  return rows


def new_leaves(items, rows, donate=False):
  """Per item (`checked_rows`' rows), the row of leaves `bind` writes:
  copies (one dispatch for all that are on the slots' device), or with
  `donate` the caller's buffers where they fit (an array passed twice is
  taken once), marked to be taken over by `bind`, after every copy."""
  if not rows:
    return rows
  slots = [slot for _, slot, _ in items]
  taken = set()
  copied = [(r, j) for r, (slot, row) in enumerate(zip(slots, rows)) for j, x in enumerate(row)
            if not (donate and _fits(x, slot, j) and _take_once(x, taken, row, j))]
  # one device: a graph's slots share it (state_from across devices is
  # refused), and are all under its mesh or none
  copies = owned_copies([rows[r][j] for r, j in copied],
                        None if slots[0].shardings is None else
                        [slots[r].shardings[j] for r, j in copied], slots[0].device)
  for (r, j), copy in zip(copied, copies):
    rows[r][j] = copy
  return rows


def _take_once(x, taken, row, j):
  """Marks row[j] (`x`, a donated array that fits) to be taken over, unless
  its buffers are taken already (then it is copied)."""
  buffers = _buffers(x)
  if buffers in taken:
    return False
  taken.add(buffers)
  row[j] = _Taken(x)
  return True


def bind(lock, slots, rows, where="this call"):
  """Writes `rows` (new_leaves's, one per slot) into `slots` under `lock`
  (their slots_lock), each leaf in the weak type the program has for it
  (StateSlot.weak_types: a Python scalar bound to a float32 leaf is a strong
  float32, as the executables and every later run's state are). The caller's
  donated arrays are taken over there, inside the critical section, all
  before any slot changes: a Ctrl-C lands after the takes and the write or
  before both, never between (where the caller's arrays would be deleted
  and the slots still hold the old state)."""
  def write():
    leaves = [tuple(with_weak_type(_take_over(x.array) if type(x) is _Taken else x, weak)
                    for x, weak in zip(row, slot.weak_types))
              for slot, row in zip(slots, rows)]
    for slot, row in zip(slots, leaves):
      slot.leaves = row
  holding(lock, write, where)


class _Taken:
  __slots__ = ("array",)

  def __init__(self, array):
    self.array = array


def _buffers(x):
  """What an array's buffers are: two arrays on one buffer (device_put of an
  array to its own sharding) are taken once, the other copied - donating
  both deleted both (jax.jit refuses to donate one buffer twice)."""
  try:
    return tuple(s.data.unsafe_buffer_pointer() for s in x.addressable_shards)
  except Exception:  # pylint: disable=broad-except
    return id(x)


def _take_over(x):
  """x's buffer as a new array, x deleted. Under jax.disable_jit() a jitted
  call does not donate (the caller's array would stay on the state's
  buffer, and a later run's donation deleted it): jit is on for the take."""
  if debug_flags.MAYBE[0] or jax.config.jax_disable_jit:
    # a nan the caller's array holds is not the take's to report
    with debug_flags.checks_off(), jax.disable_jit(False):
      return _take(x)
  return _take(x)
