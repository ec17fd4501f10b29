"""What a checkpoint says about the state it holds (session/checkpoints.py
writes it with each step as orbax's `meta` item and checks it on restore):
per state arg its slot's name, leaf paths and types, each leaf's weak type
(orbax reads arrays back strong), the PRNG implementation of each key leaf
(written as its key data), its empty leaves (orbax writes no empty array)
and its static metadata. A meta that does not describe the graph's slots is
an InputError naming where; one edited into another shape (a key missing, a
list where a dict belongs) is a corrupted checkpoint, not a raw KeyError
(a break-it find)."""
import numbers

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


def _malformed(saved):
  """What is wrong with the shape of one state arg's entry of the meta
  (None: nothing), its leaf count read from its own paths."""
  if not isinstance(saved, dict):
    return "a state arg's entry is not a dict"
  if not _list_of(saved.get("paths"), str) or not _list_of(saved.get("types"), str,
                                                           len(saved["paths"])):
    return "its paths or types are not lists of strings of one length"
  n = len(saved["paths"])
  if len(set(saved["paths"])) != n:
    return "its paths repeat"
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


def check_format(where, name, meta):
  """InputError unless `meta` is a jaxsession checkpoint's, of the shape
  this module writes (a corrupted checkpoint where it is not); its state
  args' entries."""
  if not isinstance(meta, dict) or meta.get("format") != step_dirs.FORMAT:
    raise InputError(f"{where}: {name} is not a jaxsession checkpoint")
  saved = meta.get("slots")
  if not isinstance(saved, list):
    raise corrupted(where, name, "its meta lists no state args")
  for m, got in enumerate(saved):
    what = _malformed(got)
    if what is not None:
      raise corrupted(where, name, f"state arg {m} of its meta: {what}")
  return saved


def sources(where, state_map, n):
  """restore's `state_map` checked before anything is read: per state arg
  of the graph (n), (the checkpoint's state arg, the keystr path of the
  subtree in it, "" for all of it); None without a map."""
  if state_map is None:
    return None
  if isinstance(state_map, (str, bytes)) or not isinstance(state_map, (list, tuple)):
    raise InputError(f"{where}: state_map must be a list or tuple with one entry per state "
                     f"arg, got {state_map!r:.80}")
  if len(state_map) != n:
    raise InputError(f"{where}: state_map has {len(state_map)} entries for {n} state args "
                     "(per state arg of the graph: the checkpoint's state arg it binds, or "
                     "(that state arg, a path in it))")
  out = []
  for k, entry in enumerate(state_map):
    m, path = (entry if isinstance(entry, (tuple, list)) and len(entry) == 2
               else (entry, ""))
    if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 0 or \
        not isinstance(path, str):
      raise InputError(f"{where}: state_map entry {k} is {entry!r:.80}: give the "
                       "checkpoint's state arg (an int >= 0) or (that int, a path in it "
                       "as jax.tree_util.keystr writes it, e.g. '.params' or \"['params']\")")
    out.append((int(m), path))
  return out


def _under(paths_saved, prefix):
  """{the path below `prefix`: leaf index} of the saved leaves under it."""
  return {p[len(prefix):]: j for j, p in enumerate(paths_saved) if _below(p, prefix)}


def _below(path, prefix):
  """Whether `path` is `prefix` or below it (keystr paths: a key's text
  starts with '.' or '[')."""
  return not prefix or path.startswith(prefix) and (
      len(path) == len(prefix) or path[len(prefix)] in ".[")


def _few(paths_, n=6):
  if not paths_:
    return "nothing"
  return repr(paths_[:n])[:-1] + (f", ... {len(paths_) - n} more]" if len(paths_) > n else "]")


def _found(saved, mine):
  """(the checkpoint's state arg, the path) of a subtree whose leaf paths
  are `mine`, or None."""
  if not mine or not mine[0]:
    return None
  for m, got in enumerate(saved):
    for p in got["paths"]:
      if p.endswith(mine[0]) and len(p) > len(mine[0]):
        prefix = p[:-len(mine[0])]
        if set(_under(got["paths"], prefix)) == set(mine):
          return m, prefix
  return None


def _statics_under(statics, prefix):
  out = []
  for path, kind, value in statics:
    path = "" if path == "(root)" else path
    if _below(path, prefix):
      out.append([path[len(prefix):] or "(root)", kind, value])
  return out


def views(where, name, saved, entry, mapped):
  """Per state arg of the graph, the part of the checkpoint it binds
  (`mapped`: sources(), None: the checkpoint's state args in order) as an
  entry of the meta in the slot's leaf order, its leaves found by path -
  with "source": (the checkpoint's state arg, its leaf index per slot
  leaf). InputError unless each part is the slot's: leaf paths and types,
  no leaf bound twice."""
  if mapped is None:
    if len(saved) != len(entry.slots):
      raise InputError(f"{where}: {name} holds {len(saved)} state arg(s), graph "
                       f"'{entry.name}' has {len(entry.slots)} (restore(..., state_map=) "
                       "binds a part of a checkpoint)")
    mapped = [(k, "") for k in range(len(saved))]
  out, bound = [], {}
  flips, places = [], []  # leaves saved in the other weak type
  for k, (slot, (m, prefix)) in enumerate(zip(entry.slots, mapped)):
    if m >= len(saved):
      raise InputError(f"{where}: state_map entry {k} names state arg {m} of {name}, "
                       f"which holds {len(saved)}")
    got, at = saved[m], f"state arg {m}" + (f" at {prefix}" if prefix else "")
    under, mine = _under(got["paths"], prefix), paths(slot)
    if not under and mine:  # (a slot of no leaves - {}, optax's EmptyState - binds none)
      raise InputError(f"{where}: {name} has no path {prefix} in state arg {m} (its "
                       f"leaves: {', '.join(got['paths'][:4]) or 'none'}"
                       f"{', ...' if len(got['paths']) > 4 else ''})")
    if set(under) != set(mine):
      missing = [p for p in mine if p not in under]
      extra = [p for p in under if p not in mine]
      found = _found(saved, mine)
      raise InputError(f"{where}: {at} of {name} has another structure than slot "
                       f"{slot.name}: missing {_few(missing)}, extra {_few(extra)}" + (
                           "" if found is None else f"; the slot's leaves are {name}'s state "
                           f"arg {found[0]} at path {found[1]}: restore(..., state_map=) "
                           f"entry {k} {found!r} binds them"))
    index = [under[p] for p in mine]
    for path, j in zip(mine, index):
      if (m, j) in bound:
        raise InputError(f"{where}: state_map binds {name}'s state arg {m} at path "
                         f"{prefix + path or '(root)'} to state args {bound[m, j]} and {k} "
                         "(each checkpoint leaf binds one state arg)")
      bound[m, j] = k
    keys = {str(i): got["keys"][str(j)] for i, j in enumerate(index) if str(j) in got["keys"]}
    for i, (path, aval) in enumerate(zip(mine, slot.avals)):
      saved_type, want = got["types"][index[i]], aval_str(aval)
      where_leaf = f"{where}: state arg {m} of {name} at path {prefix + path or '(root)'}"
      if saved_type.rstrip("~") != want.rstrip("~"):
        raise InputError(f"{where_leaf}: the checkpoint holds {saved_type}, the slot {want}")
      if is_key(aval) != (str(i) in keys):
        raise corrupted(where, name, f"state arg {m} at path {prefix + path or '(root)'} "
                        f"is {want}, and its meta {'lacks' if is_key(aval) else 'gives'} a "
                        "PRNG implementation for it")
      if saved_type != want and i in slot.numeric:  # bound in the slot's weak type,
        # as set_state binds it, unless that changes a program (state_typing.py)
        flips.append((slot, i, saved_type.endswith("~")))
        places.append((where_leaf, saved_type, want))
    empty = set(got.get("empty") or ())
    out.append({
        "paths": mine, "keys": keys, "source": (m, index),
        "weak": None if got.get("weak") is None else [got["weak"][j] for j in index],
        "crc32": None if got.get("crc32") is None else [got["crc32"][j] for j in index],
        "empty": [i for i, j in enumerate(index) if j in empty],
        "statics": None if got.get("statics") is None else
                   _statics_under(got["statics"], prefix)})
  refusal = state_typing.refused(flips) if flips else None
  if refusal is not None:
    alone, step = refusal
    where_leaf, saved_type, want = places[alone or 0]
    raise InputError(f"{where_leaf}: the checkpoint holds {saved_type}, the slot {want}: "
                     f"{state_typing.why(step)}")
  return out


def values(where, name, views_, entry, read):
  """The restored value of each state arg: the leaves `read` (per slot, in
  its leaf order) with their weak types, key data wrapped as keys of the
  implementation saved - which must be the slot's."""
  out = []
  for k, (slot, row, view) in enumerate(zip(entry.slots, read, views_)):
    keys, weak = view["keys"], view["weak"] or slot.weak_types
    leaves = []
    for j, (x, aval, path) in enumerate(zip(row, slot.avals, view["paths"])):
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


def _as_list(text):
  """A described key sequence, a tuple's as a list's."""
  return text.replace("(", "[").replace(")", "]").replace(",]", "]")


def warn_static_differences(where, name, views_, entry):
  """The checkpoint's static metadata (a dataclass's static fields, a mode
  flag kept static) is the saving graph's program, not state: restore keeps
  the graph's own - an eval graph compiled in inference mode restores a
  training checkpoint, as it did before the checkpoint recorded them - and
  logs where they differ (a model compiled with another activation than
  the one its weights were trained with: a break-it find, restored unsaid).
  Checkpoints written before 2026-12-06 record none."""
  for k, slot in enumerate(entry.slots):
    saved = views_[k]["statics"]
    if saved is None:
      continue
    mine = structure_statics(slot.treedef)
    mine_at = {path: (kind, now) for path, kind, now in mine}
    differ = []
    for path, kind, value in saved:
      if path not in mine_at or mine_at[path] == (kind, value):
        continue
      other, now = mine_at[path]
      if other != kind and _as_list(now) == _as_list(value):
        continue  # a container of the same keys of another class (an nnx.State's
        # dict, a judge's find): its leaf paths, checked, are all it says
      differ.append(f"{path}: {kind} {value} in the checkpoint, "
                    f"{'' if other == kind else other + ' '}{now} in the graph")
    differ += [f"{path}: only in the checkpoint" for path, _, _ in saved
               if path not in mine_at]
    seen = {path for path, _, _ in saved}
    differ += [f"{path}: only in the graph" for path, _, _ in mine if path not in seen]
    if differ:
      logging.warning("%s: state arg %d of %s was saved by a program with other static "
                      "metadata; the graph keeps its own (%s%s)", where, k, name,
                      "; ".join(differ[:4]),
                      f"; {len(differ) - 4} more" if len(differ) > 4 else "")
