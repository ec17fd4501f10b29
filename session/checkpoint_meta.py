"""What a checkpoint says about the state it holds (session/checkpoints.py
writes it with each step as orbax's `meta` item and checks it on restore):
per state arg its slot's name, leaf paths and types, each leaf's weak type
(orbax reads arrays back strong), the PRNG implementation of each key leaf
(written as its key data), its empty leaves (orbax writes no empty array)
and its static metadata. A meta that does not describe the graph's slots is
an InputError naming where; one edited into another shape (a key missing, a
list where a dict belongs) is a corrupted checkpoint, not a raw KeyError
(a break-it find)."""
from absl import logging
import jax
from jax import tree_util

from jaxsession import checkpoint_steps as step_dirs, state_typing
from jaxsession.errors import InputError
from jaxsession.graph.ir import aval_str
from jaxsession.runtime.state import structure_statics, with_weak_type


def is_key(aval):
  return jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key)


def paths(slot):
  """The slot's leaf paths, in leaf order (keystr)."""
  return [tree_util.keystr(p) for p, _ in tree_util.tree_flatten_with_path(
      tree_util.tree_unflatten(slot.treedef, list(range(len(slot.avals)))))[0]]


def made(entry, keys):
  """The checkpoint's description of the state; `keys`: per slot, the PRNG
  implementation of each key leaf, read from the snapshot (under the lock)."""
  slots = []
  for slot, impls in zip(entry.slots, keys):
    slots.append({"name": slot.name, "paths": paths(slot),
                  "types": [aval_str(a) for a in slot.avals], "keys": impls,
                  "statics": structure_statics(slot.treedef)})
  return {"format": step_dirs.FORMAT, "graph": entry.name, "slots": slots}


def corrupted(where, name, what):
  """The InputError of a checkpoint that cannot be read as written."""
  return InputError(f"{where}: checkpoint {name} is corrupted: {what}; the state is "
                    "unchanged (restore another step)")


def _list_of(value, kind, n=None):
  return isinstance(value, list) and (n is None or len(value) == n) and all(
      isinstance(x, kind) and not (kind is int and isinstance(x, bool)) for x in value)


def _malformed(saved, n):
  """What is wrong with the shape of one slot's entry of the meta (None:
  nothing); `n`: its graph slot's leaf count."""
  if not isinstance(saved, dict):
    return "a state arg's entry is not a dict"
  if not _list_of(saved.get("paths"), str) or not _list_of(saved.get("types"), str,
                                                           len(saved["paths"])):
    return "its paths or types are not lists of strings of one length"
  keys = saved.get("keys")
  if not isinstance(keys, dict) or not all(
      isinstance(j, str) and j.isdecimal() and int(j) < n and isinstance(impl, str)
      for j, impl in keys.items()):
    return f"its PRNG key entries are {keys!r:.80}"
  for field, kind in (("weak", bool), ("crc32", (int, type(None)))):
    if saved.get(field) is not None and not _list_of(saved[field], kind, n):
      return f"its {field} entries are {saved[field]!r:.80}"
  empty = saved.get("empty")
  if empty is not None and not (_list_of(empty, int) and all(0 <= j < n for j in empty)):
    return f"its empty leaves are {empty!r:.80}"
  statics = saved.get("statics")
  if statics is not None and not (isinstance(statics, list) and all(
      isinstance(s, list) and len(s) == 3 and isinstance(s[0], str) for s in statics)):
    return f"its static metadata is {statics!r:.80}"
  return None


def check(where, name, meta, entry):
  """InputError unless the checkpoint's slots are the graph's: count, leaf
  paths and types, and the meta of the shape this module writes."""
  if not isinstance(meta, dict) or meta.get("format") != step_dirs.FORMAT:
    raise InputError(f"{where}: {name} is not a jaxsession checkpoint")
  saved = meta.get("slots")
  if not isinstance(saved, list):
    raise corrupted(where, name, "its meta lists no state args")
  if len(saved) != len(entry.slots):
    raise InputError(f"{where}: {name} holds {len(saved)} state arg(s), graph "
                     f"'{entry.name}' has {len(entry.slots)}")
  for k, (slot, got) in enumerate(zip(entry.slots, saved)):
    what = _malformed(got, len(slot.avals))
    if what is not None:
      raise corrupted(where, name, f"state arg {k} of its meta: {what}")
  flips, places = [], []  # leaves saved in the other weak type
  for k, (slot, got) in enumerate(zip(entry.slots, saved)):
    mine = paths(slot)
    if got["paths"] != mine:
      missing = [p for p in mine if p not in got["paths"]]
      extra = [p for p in got["paths"] if p not in mine]
      raise InputError(f"{where}: state arg {k} of {name} has another structure than "
                       f"slot {slot.name}: missing {missing or 'nothing'}, extra "
                       f"{extra or 'nothing'}")
    for j, (path, saved_type, aval) in enumerate(zip(mine, got["types"], slot.avals)):
      want = aval_str(aval)
      if saved_type.rstrip("~") != want.rstrip("~"):
        raise InputError(f"{where}: state arg {k} of {name} at path {path or '(root)'}: "
                         f"the checkpoint holds {saved_type}, the slot {want}")
      if is_key(aval) != (str(j) in got["keys"]):
        raise corrupted(where, name, f"state arg {k} at path {path or '(root)'} is "
                         f"{want}, and its meta {'lacks' if is_key(aval) else 'gives'} a "
                         "PRNG implementation for it")
      if saved_type != want and j in slot.numeric:  # bound in the slot's weak type,
        # as set_state binds it, unless that changes a program (state_typing.py)
        flips.append((slot, j, saved_type.endswith("~")))
        places.append((k, path, saved_type, want))
  refusal = state_typing.refused(flips) if flips else None
  if refusal is not None:
    alone, step = refusal
    k, path, saved_type, want = places[alone or 0]
    raise InputError(f"{where}: state arg {k} of {name} at path {path or '(root)'}: "
                     f"the checkpoint holds {saved_type}, the slot {want}: "
                     f"{state_typing.why(step)}")


def values(where, name, meta, entry, read):
  """The restored value of each state arg: the leaves `read` (per slot) with
  their weak types, key data wrapped as keys of the implementation saved -
  which must be the slot's."""
  out = []
  for k, (slot, row) in enumerate(zip(entry.slots, read)):
    saved = meta["slots"][k]
    keys, weak = saved["keys"], saved.get("weak") or slot.weak_types
    leaves = []
    for j, (x, aval, path) in enumerate(zip(row, slot.avals, paths(slot))):
      if str(j) in keys:
        try:
          x = jax.random.wrap_key_data(x, impl=keys[str(j)])
        except (TypeError, ValueError, KeyError) as exc:
          raise corrupted(where, name, f"state arg {k} at path {path or '(root)'}: its "
                           f"key data is not a {keys[str(j)]!r} key ({exc})") from None
        if x.dtype != aval.dtype:
          raise corrupted(where, name, f"state arg {k} at path {path or '(root)'} was "
                           f"saved as a {x.dtype} key, the slot holds {aval.dtype}")
      else:
        x = with_weak_type(x, weak[j])
      leaves.append(x)
    out.append(tree_util.tree_unflatten(slot.treedef, leaves))
  return out


def warn_static_differences(where, name, meta, entry):
  """The checkpoint's static metadata (a dataclass's static fields, a mode
  flag kept static) is the saving graph's program, not state: restore keeps
  the graph's own - an eval graph compiled in inference mode restores a
  training checkpoint, as it did before the checkpoint recorded them - and
  logs where they differ (a model compiled with another activation than
  the one its weights were trained with: a break-it find, restored unsaid).
  Checkpoints written before 2026-12-06 record none."""
  for k, slot in enumerate(entry.slots):
    saved = meta["slots"][k].get("statics")
    if saved is None:
      continue
    mine = structure_statics(slot.treedef)
    mine_at = {path: (kind, now) for path, kind, now in mine}
    differ = [f"{path}: {kind} {value} in the checkpoint, {mine_at[path][1]} in the graph"
              for path, kind, value in saved
              if path in mine_at and mine_at[path] != (kind, value)]
    differ += [f"{path}: only in the checkpoint" for path, _, _ in saved
               if path not in mine_at]
    seen = {path for path, _, _ in saved}
    differ += [f"{path}: only in the graph" for path, _, _ in mine if path not in seen]
    if differ:
      logging.warning("%s: state arg %d of %s was saved by a program with other static "
                      "metadata; the graph keeps its own (%s%s)", where, k, name,
                      "; ".join(differ[:4]),
                      f"; {len(differ) - 4} more" if len(differ) > 4 else "")
