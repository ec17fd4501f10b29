"""The checks of compile's position arguments and of graph ids: which
example positions `state_argnums` / `static_argnums` name, which slots of
another graph `state_map` binds, which state args `replace_state` names,
and what counts as a graph id; whether state examples fit another graph's
slots (state_from)."""
import numbers

import jax
from jax import tree_util

from jaxsession.errors import InputError, UnknownGraphError
from jaxsession.inputs import check_leaf
from jaxsession.runtime.state import check_structure, session_device


def _argnums(nums, what, nargs):
  """`nums` (an int or a sequence of ints) as a tuple of positions, checked:
  ints in range, no bools, no duplicates."""
  if isinstance(nums, numbers.Integral):
    nums = (nums,)
  else:
    try:
      nums = () if nums is None else tuple(nums)
    except TypeError:
      raise InputError(f"compile: {what} must be an int or a sequence of ints, got "
                       f"{nums!r}") from None
  seen = set()
  for i in nums:
    if isinstance(i, bool) or not isinstance(i, numbers.Integral) or not -nargs <= i < nargs:
      raise InputError(f"compile: {what} entry {i!r} is not a position of the "
                       f"{nargs} example arguments")
    if int(i) % nargs in seen:
      raise InputError(f"compile: {what} names position {int(i) % nargs} twice")
    seen.add(int(i) % nargs)
  return tuple(int(i) % nargs for i in nums)


def _shared_slots(state_map, source, n):
  """The source graph's slots the n state args bind (`state_map`, checked),
  or None without state_from."""
  if source is None:
    if state_map is not None:
      raise InputError("compile: state_map is given without state_from")
    return None
  if not n:  # (accepted silently: a state_argnums forgotten, a break-it find)
    raise InputError("compile: state_from is given without state_argnums: the graph has "
                     "no state args to bind to the slots of graph "
                     f"'{source.name}' (name them in state_argnums)")
  if state_map is None:
    return source.slots[:n]
  try:
    mapping = tuple(state_map)
  except TypeError:
    raise InputError(f"compile: state_map must be a sequence of slot indices, got "
                     f"{state_map!r}") from None
  if len(mapping) != n:
    raise InputError(f"compile: state_map has {len(mapping)} entries for {n} state args "
                     "(one slot index of the state_from graph per state arg)")
  for m in mapping:
    if isinstance(m, bool) or not isinstance(m, numbers.Integral) or \
        not 0 <= m < len(source.slots):
      raise InputError(f"compile: state_map entry {m!r} is not a slot of graph "
                       f"'{source.name}' (it has {len(source.slots)}: 0..{len(source.slots) - 1})")
  if len(set(mapping)) != len(mapping):
    raise InputError(f"compile: state_map {mapping} binds one slot twice")
  return [source.slots[int(m)] for m in mapping]


def _graph_id(graph_id):
  """A graph id is an int (numpy ints too); 0.0, True and '0' are not."""
  if isinstance(graph_id, bool) or not isinstance(graph_id, numbers.Integral):
    raise UnknownGraphError(f"graph id {graph_id!r} ({type(graph_id).__name__}) is not "
                            "an int returned by this session's compile")
  return int(graph_id)

def _replaced(where, index, value, count):
  """replace_state's (indices, values): one state arg, or a tuple of distinct
  positions and a sequence of as many values (InputError naming what is
  wrong, before anything is checked or bound)."""
  def position(k):
    if type(k) is int and 0 <= k < count:  # the usual index: no ABC check
      return k
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 0 <= k < count:
      raise InputError(f"{where}: index {k!r} is not a state arg: the graph has {count} "
                       f"(indices 0..{count - 1}, positions in state_argnums)")
    return int(k)
  if not isinstance(index, (tuple, list)):
    return [position(index)], [value]
  indices = [position(k) for k in index]
  if not indices:
    raise InputError(f"{where}: index is an empty {type(index).__name__}: name at least one "
                     "state arg")
  if len(set(indices)) != len(indices):
    raise InputError(f"{where}: index {tuple(indices)} names a state arg twice")
  if not isinstance(value, (tuple, list)) or len(value) != len(indices):
    got = (f"a {type(value).__name__} of {len(value)}" if isinstance(value, (tuple, list))
           else f"a {type(value).__name__}")
    raise InputError(f"{where}: index {tuple(indices)} names {len(indices)} state args: "
                     f"value must be a tuple or list of {len(indices)} values, one each, "
                     f"got {got}")
  return indices, list(value)


def check_shared(name, state_nums, state_flats, state_from, source, shared, one_device):
  """InputError unless the state examples fit the `shared` slots of
  `state_from`: the same structure and leaf types, weak ones too (and, on
  one device, the same device)."""
  if len(state_flats) > len(source.slots):
    raise InputError(f"compile({name}): {len(state_flats)} state args but graph "
                     f"{state_from} ('{source.name}') has {len(source.slots)} state slots")
  for k, (flat, slot) in enumerate(zip(state_flats, shared)):
    where = (f"compile({name}): state arg {k} (position {state_nums[k]}) shared from "
             f"graph {state_from}")
    check_structure(slot, tree_util.tree_unflatten(flat.treedef, flat.leaves), where)
    if one_device and slot.device != session_device():
      raise InputError(f"{where}: its state slot {slot.name} lives on {slot.device}, and this "
                       f"graph would run on {session_device()} (jax's default device now): "
                       "sharing it would copy the state between devices every run; compile "
                       "both under one jax.default_device, or give the session "
                       "SessionOptions(device=...)")
    for path, x, aval in zip(flat.paths, flat.leaves, slot.avals):
      check_leaf(f"{where} at path {path or '(root)'}", x, aval, weak=aval.weak_type,
                 note=f" (the state slot {slot.name} holds the former)",
                 type_only=isinstance(x, jax.ShapeDtypeStruct))  # shared: a type will do
