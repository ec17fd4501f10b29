"""Device-resident state: the session's parameter slots.

A slot holds one state argument (a pytree) as device arrays the session owns.
Graphs bind to slots by reference, so two graphs that share a slot see each
other's updates without a copy. Each slot has a lock: a run, `get_state` or
`set_state` holds the locks of every slot it touches (taken in slot creation
order, so two calls never wait on each other in a cycle), which makes each
call see and commit a consistent state; graphs with no slot in common run in
parallel.
"""
import dataclasses
import enum
import itertools
import numbers
import threading
import types

import jax
import numpy as np
from jax import tree_util

from jaxsession.errors import InputError
from jaxsession.jax_api import ARRAY, real_jit
from jaxsession.runtime import debug_flags, interrupts, sharding, static_leaves

_SERIAL = itertools.count()


def session_device():
  """The device a graph compiled now runs on (jax's default device now:
  a thread-local setting, so a graph and its state slots keep the one they
  were compiled under - StateSlot.device, ArgSpec.device)."""
  return jax.config.jax_default_device or jax.local_devices()[0]


def with_weak_type(x, weak, committed=None):
  """`x` typed weakly (`weak`) or strongly, with the same bits: its buffers
  under the other aval, so nothing is compiled (an eager convert compiles
  one per shape); where jax lacks that internal API, a convert. The one way
  the session retypes an array: bound state (a Python scalar's copy, a
  restored checkpoint), sliced bucket outputs, outputs whose weak type
  jax.jit's would have. `committed` (None: as it is): the array committed
  to its device or not, as jax.jit commits its outputs (session/jitted.py)."""
  if type(x) is ARRAY:
    if x.weak_type == weak and (committed is None or x._committed == committed):  # pylint: disable=protected-access
      return x
  elif not isinstance(x, jax.Array) or bool(getattr(x, "weak_type", False)) == weak:
    return x
  try:
    from jax._src.array import ArrayImpl  # pylint: disable=import-outside-toplevel
    return ArrayImpl(x.aval.update(weak_type=weak), x.sharding, list(x._arrays),  # pylint: disable=protected-access
                     committed=x._committed if committed is None else committed)  # pylint: disable=protected-access
  except (ImportError, AttributeError, TypeError):  # an internal API: convert (compiles)
    if weak == x.weak_type:  # only the commitment differs: left as it is
      return x
    from jax._src.lax import lax as lax_internal  # pylint: disable=import-outside-toplevel
    return lax_internal._convert_element_type(x, x.dtype, weak_type=weak)  # pylint: disable=protected-access


def owned_copy(x, layout=None, device=None):
  """A device array the session owns, on `device` (a slot's; default: the
  device a graph compiled now runs on): never the caller's buffer, since the
  session donates its state buffers and must not invalidate the caller's (an
  array on another device is moved, which copies). Under a mesh, `layout` is
  the leaf's NamedSharding: the copy is laid out so, whatever the layout of
  `x` (host, one device, another sharding)."""
  if isinstance(x, (int, float, complex)) and not isinstance(x, (bool, np.generic)):
    # a Python scalar is weakly typed, as jax.jit sees it; np.asarray drops that
    # (np.float64 subclasses float but is strong, as inputs.is_weak says)
    return with_weak_type(owned_copy(np.asarray(x, jax.dtypes.canonicalize_dtype(
        np.result_type(x))), layout, device), True)
  if layout is not None:
    return sharding.put_global(x, layout)
  device = device or session_device()
  if isinstance(x, jax.Array):
    if x.devices() == {device}:
      if debug_flags.MAYBE[0] and debug_flags.on():
        return private_copy(x)  # a jitted copy would raise on the nan it holds
      return _copy_on(device, [x])[0]
    moved = jax.device_put(x, device)
    if device in x.devices():  # laid out over several devices, the slot's among them:
      # device_put gives that shard's own buffer (even with may_alias=False),
      # which a run then donated - the caller's array was deleted (a review's find)
      return private_copy(moved)  # (no computation: x may be typed by an Explicit mesh)
    return moved
  # a copy first: on the CPU device_put may keep an aligned numpy buffer as
  # the array's own, and the caller may refill it (a break-it find)
  return jax.device_put(np.array(x, copy=True), device)


def _copy_all(xs):
  return [x.copy() for x in xs]


_COPY_ALL = real_jit(_copy_all)


def _copy_on(device, xs):
  """_COPY_ALL(xs) for arrays on `device`: a jitted call puts the copies of
  uncommitted arrays on jax's default device now (thread-local, maybe
  another one: `jax.default_device(d)` around a set_state), so it runs
  under `device` where that differs."""
  if device == session_device():
    return _COPY_ALL(xs)
  with jax.default_device(device):
    return _COPY_ALL(xs)


def owned_copies(xs, layouts=None, device=None):
  """owned_copy of each of `xs` on `device` (`layouts`: a NamedSharding or None each):
  the arrays already on `device` are copied by one jitted call,
  one dispatch for all of them (4 leaves of a KV cache: 28 us, against 240
  us copied one by one; benchmarks/workflows.py's decode), the others one by
  one. Weak types and PRNG keys are kept."""
  if debug_flags.MAYBE[0] and debug_flags.on():
    return [owned_copy(x, None if layouts is None else layouts[i], device)
            for i, x in enumerate(xs)]
  device = device or session_device()
  here = {device}
  together = [i for i, x in enumerate(xs) if (layouts is None or layouts[i] is None)
              and (type(x) is ARRAY or isinstance(x, jax.Array)) and x.devices() == here]
  if len(together) == len(xs):  # the usual case: one dispatch, nothing else
    return _copy_on(device, list(xs))
  out = list(xs)
  if together:
    for i, copy in zip(together, _copy_on(device, [xs[i] for i in together])):
      out[i] = copy
  skip = set(together)
  for i, x in enumerate(xs):
    if i not in skip:
      out[i] = owned_copy(x, None if layouts is None else layouts[i], device)
  return out


_SUB_BYTE = {}  # dtype -> narrower than a byte


def sub_byte(dtype):
  """Whether `dtype` is narrower than a byte (int4, int2, float4; a PRNG key
  is not)."""
  narrow = _SUB_BYTE.get(dtype)
  if narrow is None:  # (1.4 us to decide: a conformed leaf a run, once a dtype)
    narrow = _SUB_BYTE[dtype] = (not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
                                 and dtype != jax.dtypes.float0  # (no bits: jax raises)
                                 and jax.dtypes.itemsize_bits(dtype) < 8)
  return narrow


def relaid(x, device=None):
  """`x` as executables take it, where its dtype is narrower than a byte
  (int4, int2, float4) and it is committed to its one device (orbax reads
  arrays back so): jax's AOT executables refuse every such array ("compiled
  for input layouts that disagree", a jax quirk; jax.jit takes it), and no
  device copy helps; an uncommitted copy made through numpy, on the same
  device (`device`, where given: the graph's), is taken, exactly. Any other
  array is returned as it is."""
  dtype = getattr(x, "dtype", None)
  if dtype is None or not sub_byte(dtype):
    return x
  if isinstance(x, jax.Array) and x.committed and len(x.sharding.device_set) == 1:
    with jax.default_device(device or next(iter(x.devices()))):
      return jax.device_put(np.asarray(x))
  if isinstance(x, np.ndarray):  # put with a device it would be committed: refused
    with jax.default_device(device or session_device()):
      return jax.device_put(np.array(x, copy=True))  # (a copy: the caller may refill x)
  return x


def private_copy(x):
  """A copy of `x` in its own buffer, its sharding kept, made without a
  computation: jax_debug_nans/infs do not check it (`get_state` of a state
  holding a nan works under the flag, as reading an array does)."""
  return jax.device_put(x, x.sharding, may_alias=False)


class StateSlot:
  """One state argument: its pytree structure, leaf avals and current leaves."""

  def __init__(self, name, treedef, avals, leaves):
    self.name = name
    self.treedef = treedef
    self.avals = list(avals)
    # the weak type each leaf has in the program: a bound value takes it
    self.weak_types = tuple(bool(getattr(a, "weak_type", False)) for a in self.avals)
    self.packing = None          # a runtime.packing.Packing once small leaves are packed
    self.storage = tuple(leaves)  # a unit each (the leaves, unpacked); replaced whole
                                  # on every update, never mutated
    self._view = self._view_of = None
    self.lock = threading.Lock()
    self.serial = next(_SERIAL)
    self.owners = 0              # graphs bound to this slot (release frees at 0)
    self.shardings = None        # under a mesh: a NamedSharding per leaf
    # without one, the device its leaves live on: its graph's, the default
    # device when it was compiled (bound values go there whatever the
    # default device is when they are bound)
    self.device = session_device()
    # the graphs whose programs a value's weak types may change, gid ->
    # (session/state_typing.py's GraphTyping, this slot's state arg there),
    # and the leaves whose weak types a bound value is checked for
    self.typings = {}
    self.numeric = tuple(j for j, a in enumerate(self.avals)
                         if jax.numpy.issubdtype(a.dtype, jax.numpy.number))
    # the leaves whose weak type a bound value is checked for (state_typing.py):
    # the numeric scalars and the weakly typed ones; a strong array is not
    # (a weak array for it comes from jnp.full(shape, 0.5) at most; checking
    # every leaf cost a KV cache reset ~1 us, benchmarks/decode.py)
    self.numeric_weak = tuple((j, self.weak_types[j]) for j in self.numeric
                              if self.avals[j].shape == () or self.weak_types[j])
    # the leaves of a dtype narrower than a byte: a bound value is relaid
    self.sub_byte = tuple(j for j, a in enumerate(self.avals) if sub_byte(a.dtype))
    # the non-array leaves kept static, in the treedef (runtime/static_leaves.py)
    self.statics = static_leaves.static_paths(
        tree_util.tree_unflatten(treedef, [None] * treedef.num_leaves))

  @property
  def leaves(self):
    """The leaves, in leaf order: the storage itself, or for a packed slot
    its view (the packed leaves sliced out once per storage, cached; those
    buffers are the view's, never donated)."""
    if self.packing is None:
      return self.storage
    storage = self.storage
    if self._view_of is not storage:
      self._view, self._view_of = self._here(self.packing.view, storage), storage
    return self._view

  @leaves.setter
  def leaves(self, leaves):
    """Binds session-owned `leaves` (in leaf order), packed where the slot
    packs (the packed ones are copied into its buffers)."""
    self.storage = tuple(leaves) if self.packing is None else \
        self._here(self.packing.pack, leaves)

  def pack(self, packing):
    """Keeps the slot's leaves as `packing` stores them (its first graph's
    Build: AllocateMemory decided); the unpacked copies are let go."""
    if packing is not None and self.packing is None:
      self.storage, self.packing = self._here(packing.pack, self.storage), packing

  def _here(self, move, values):
    """move(values), a packing's jitted move of uncommitted arrays, on the
    slot's device: jax runs it on the default device, which the caller may
    have set to another (a break-it find: the buffers went there)."""
    if self.shardings is not None or self.device == session_device():
      return move(values)
    with jax.default_device(self.device):
      return move(values)

  def free(self):
    """Deletes the slot's buffers (release, once no graph shares it)."""
    for x in self.storage:
      if x is not None:
        x.delete()
    self.storage, self.packing, self._view, self._view_of = (), None, None, None

  @property
  def unset(self):
    """Compiled from jax.ShapeDtypeStruct examples and not set since: a leaf
    is None until set_state, replace_state or restore binds it."""
    return any(x is None for x in self.storage)  # read without the lock: never the view


class _Locks:
  """Several slot locks held together, acquired in slot-creation order."""
  __slots__ = ("locks",)

  def __init__(self, locks):
    self.locks = locks

  def acquire(self, blocking=True):
    for k, lock in enumerate(self.locks):
      if not lock.acquire(blocking):
        for held in reversed(self.locks[:k]):
          held.release()
        return False
    return True

  def release(self):
    for lock in reversed(self.locks):
      lock.release()

  def __enter__(self):
    self.acquire()

  def __exit__(self, *exc):
    self.release()


class _NoLock:
  __slots__ = ()

  def acquire(self, blocking=True):
    return True

  def release(self):
    pass

  def __enter__(self):
    pass

  def __exit__(self, *exc):
    pass


def slots_lock(slots):
  """One context manager holding the locks of `slots` (the bare lock for one
  slot, nothing for none: the uncontended cost stays a lock acquire)."""
  ordered = sorted(dict.fromkeys(slots), key=lambda s: s.serial)
  if not ordered:
    return _NoLock()
  if len(ordered) == 1:
    return ordered[0].lock
  return _Locks([s.lock for s in ordered])


# The slot locks each thread's runs hold while they may run the user's code
# (callbacks): a callback calling back into a graph whose state its run holds
# (run, get_state, set_state, replace_state, save, release) would wait for
# that run forever; it is refused instead (refuse_reentry).
class _Running(threading.local):
  locks = frozenset()  # (a class default: getattr with a default on a missing
  # thread-local attribute raises and catches inside, ~1 us a call)


_RUNNING = _Running()


def _underlying(lock):
  return lock.locks if type(lock) is _Locks else () if type(lock) is _NoLock else (lock,)


def running_user_code(*locks):
  """Marks `locks` (slots_locks, held) as held by a run whose user code runs
  on this thread (its own, or the thread XLA runs a callback on); returns
  what `done_running` takes to unmark them."""
  before = _RUNNING.locks
  _RUNNING.locks = before.union(*(_underlying(lock) for lock in locks))
  return before


def done_running(before):
  _RUNNING.locks = before


def refuse_reentry(lock, where):
  """InputError where this thread's own run holds `lock` (a callback calling
  back into the state its run holds): the call would wait forever."""
  held = _RUNNING.locks
  if held and any(one in held for one in _underlying(lock)):
    raise InputError(f"{where}: called from inside a run (a callback) that holds this "
                     "graph's state, or state it shares; it would wait for that run "
                     "forever. Call it after the run returns.")


@interrupts.critical
def holding(lock, fn, where="this call"):
  """fn() with `lock` (a slots_lock) held; a Ctrl-C meanwhile waits until the
  lock is released (runtime/interrupts.py), so no lock stays held; refused
  from a callback of a run holding it (refuse_reentry, naming `where`).
  Runner.call writes the same out inline (the hot path)."""
  lending = interrupts.lend()
  try:
    refuse_reentry(lock, where)
    with lock:
      return fn()
  finally:
    left_critical = True
    interrupts.leave(lending)


def _children(tree):
  """One level of a pytree: (its treedef one level deep, [(key, child)])."""
  pairs, treedef = tree_util.tree_flatten_with_path(tree, is_leaf=lambda n: n is not tree)
  return treedef, [(path[0] if path else None, child) for path, child in pairs]


def tree_difference(expected, got, path=""):
  """Where pytree `got` first differs in structure from `expected` (both
  values), as 'at <path>: <what differs>'; None when the structures match."""
  if tree_util.tree_structure(expected) == tree_util.tree_structure(got):
    return None
  exp_def, exp_children = _children(expected)
  got_def, got_children = _children(got)
  where = path or "(root)"
  if isinstance(expected, static_leaves.Static) and isinstance(got, static_leaves.Static):
    return f"at {where}: {static_leaves.difference(expected, got)}"
  if type(expected) is not type(got):
    return f"at {where}: expected {_kind(expected)}, got {_kind(got)}"
  exp_keys = [tree_util.keystr((k,)) for k, _ in exp_children]
  got_keys = [tree_util.keystr((k,)) for k, _ in got_children]
  if exp_keys != got_keys:
    missing = [k for k in exp_keys if k not in got_keys]
    extra = [k for k in got_keys if k not in exp_keys]
    return (f"at {where}: {type(got).__name__} children differ"
            + (f"; missing {', '.join(missing)}" if missing else "")
            + (f"; unexpected {', '.join(extra)}" if extra else "")
            + ("" if missing or extra else
               f"; expected {', '.join(exp_keys)}, got {', '.join(got_keys)}"))
  if exp_def != got_def:
    return f"at {where}: {_metadata_difference(expected, got)}"
  for (key, a), (_, b) in zip(exp_children, got_children):
    found = tree_difference(a, b, path + tree_util.keystr((key,)))
    if found:
      return found
  return f"at {where}: structures differ"


def _stable(value):
  """`value` described alike in every process, and alike where == (set_state's
  test) holds as far as a description can tell: numbers by value (1, 1.0 and
  True alike; np.float32(0.1) as the float it holds), strings by repr,
  enum members, classes and functions by their qualified names, tuples,
  lists and dicts by their items; any other object by its type alone (its
  repr may hold its address)."""
  if isinstance(value, enum.Enum):  # (a member's value may be an object)
    return f"{type(value).__module__}.{type(value).__qualname__}.{value.name}"
  if isinstance(value, (str, bytes, type(None))):
    return repr(value)
  if isinstance(value, np.bool_):  # (no numbers.Number: as the bool it holds)
    value = bool(value)
  if isinstance(value, numbers.Number):
    try:
      if isinstance(value, numbers.Integral):
        return repr(int(value))
      if not isinstance(value, numbers.Real):
        return repr(complex(value))
      real = float(value)
      return repr(int(real)) if real.is_integer() else repr(real)
    except (TypeError, ValueError, OverflowError):
      pass
  if isinstance(value, (tuple, list)):  # ((1, 2) != [1, 2])
    name = "" if type(value) in (tuple, list) else type(value).__qualname__
    left, right = "[]" if isinstance(value, list) else "()"
    return f"{name}{left}{', '.join(map(_stable, value))}{right}"
  if isinstance(value, dict):  # (== ignores the order of the keys)
    return "{" + ", ".join(sorted(f"{_stable(k)}: {_stable(v)}" for k, v in value.items())) + "}"
  if isinstance(value, types.MethodType):  # (flax's TrainState.apply_fn: a Module's)
    value = value.__func__
  own = getattr(value, "__dict__", {})  # a class's or a function's own names
  if isinstance(value, type) or ("__qualname__" in own and "__module__" in own) or \
      isinstance(value, types.FunctionType):
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
  return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _described(kind, metadata):
  """A node's metadata described (_stable), a dataclass's static fields by
  name where they can be told (so a refusal names the field)."""
  metadata = static_leaves.carried(metadata)
  if dataclasses.is_dataclass(kind) and isinstance(metadata, tuple):
    names = [f.name for f in dataclasses.fields(kind)
             if f.metadata.get("pytree_node", True) is False or f.metadata.get("static")]
    if len(names) == len(metadata):
      return "[" + ", ".join(f"{n}={_stable(v)}" for n, v in zip(names, metadata)) + "]"
  return _stable(metadata)


def structure_statics(treedef):
  """[[path, node type, its static metadata described]] of a structure's
  nodes that carry metadata (a dataclass's static fields, a non-array leaf
  kept static, a container's keys), described alike in every process
  (_stable): what a checkpoint records of the structure beside its leaf
  paths, to compare at restore."""
  out = []

  def walk(value, path):
    node, children = _children(value)
    data = node.node_data()
    if data is None:  # a leaf
      return
    kind, metadata = data
    if metadata is not None:
      out.append([path or "(root)", f"{kind.__module__}.{kind.__qualname__}",
                  _described(kind, metadata)])
    for key, child in children:
      walk(child, path + tree_util.keystr((key,)))
  leaf = jax.ShapeDtypeStruct((), np.float32)  # (an unflatten may read its leaves' types)
  walk(tree_util.tree_unflatten(treedef, [leaf] * treedef.num_leaves), "")
  return out


def _kind(x):
  if isinstance(x, static_leaves.Static):
    return f"the non-array {type(x.value).__name__} {_short(x.value)} (kept static)"
  if isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)):
    return f"an array leaf {x.dtype}{list(np.shape(x))}"
  name = type(x).__name__
  return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _metadata_difference(expected, got):
  """Same children, different static metadata (a dataclass's non-pytree
  fields, such as a flax TrainState's apply_fn or tx): name the field."""
  if dataclasses.is_dataclass(expected):
    for field in dataclasses.fields(expected):
      a, b = getattr(expected, field.name, None), getattr(got, field.name, None)
      if field.metadata.get("pytree_node", True) is False and a is not b and a != b:
        return (f"static field {field.name!r} of {type(got).__name__} differs "
                f"(a pytree's static fields are part of its structure): expected "
                f"{_short(a)}, got {_short(b)}")
  return f"{type(got).__name__} node metadata differs"


def _short(value):
  text = repr(value)
  return text if len(text) <= 80 else text[:77] + "..."


def check_structure(slot, value, where):
  """Raises InputError unless pytree `value` has the slot's structure,
  naming the first field that differs (its leaves are checked by the one
  leaf check, jaxsession.inputs.check_leaf)."""
  if tree_util.tree_structure(value) != slot.treedef:
    # the slot's types, not its values: read without its lock (a packed slot's
    # view slices buffers a run may be donating: a break-it find), and named as
    # arrays while the slot is unset
    expected = tree_util.tree_unflatten(slot.treedef, [
        jax.ShapeDtypeStruct(a.shape, a.dtype) for a in slot.avals])
    detail = tree_difference(expected, value)
    raise InputError(f"{where}: pytree structure does not match state slot {slot.name}: "
                     + (detail or f"expected {slot.treedef}, got "
                        f"{tree_util.tree_structure(value)}"))
