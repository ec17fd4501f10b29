"""Shardings under a mesh: what every run argument and state leaf holds on
each device, decided once at compile from `in_specs` and `state_specs`.

The session does not partition anything itself: it gives each executable's
arguments and new state a `NamedSharding`, and XLA's SPMD partitioner
(GSPMD) splits the program and inserts the collectives. Defaults:
  * run arguments: data parallel - the leading axis split over the mesh's
    first axis (a leaf whose leading axis does not divide is an InputError
    naming it, never silently replicated; a scalar, a learning rate say, is
    replicated);
  * state: replicated; "zero" shards each state leaf along its largest axis
    that divides by the number of devices, over every mesh axis (ZeRO stage 1,
    MindSpore's parallel optimizer: each device holds 1/N of the leaf), and
    replicates the leaves with no such axis.
Specs may be one PartitionSpec for every leaf, or a pytree prefix of the
argument (one spec per non-state argument, or per subtree). None as a whole
argument's entry means that argument's default (data parallel, or
replicated for state); None inside a prefix means replicated.

Many processes (`jax.distributed`): a run argument is each process's local
piece of the global batch, and `global_array` assembles the global array
(`jax.make_array_from_process_local_data`); state is global.
"""
import contextlib

import jax
import numpy as np
from jax import tree_util
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxsession.jax_api import real_jit
from jaxsession.runtime import debug_flags
from jaxsession.errors import InputError
from jaxsession.graph.ir import aval_str

ZERO = "zero"


def auto_axes(mesh):
  """`mesh` with every axis Auto: the session lays values out by specs and
  lets GSPMD place the collectives (as jax.jit under an Auto mesh), which
  a mesh of Explicit axes (jax.make_mesh's default) refuses for the traced
  program's dot_generals (their sharding is in their types there). Same
  devices and names; arrays laid out on the given mesh are moved onto it
  as run arguments."""
  if mesh is None or all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types):
    return mesh
  return jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                           axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))


def auto_context():
  """The context the session traces and compiles its own programs in: a
  context mesh of Explicit axes (`with jax.set_mesh(...)` around a compile
  or a run) as its Auto copy, as auto_axes makes the session's mesh;
  otherwise the caller's context as it is."""
  current = jax.sharding.get_abstract_mesh()
  if current.empty or all(t == jax.sharding.AxisType.Auto for t in current.axis_types):
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(current.update_axis_types(
      {name: jax.sharding.AxisType.Auto for name in current.axis_names}))


@contextlib.contextmanager
def replaced_context(mesh, device):
  """The context mesh `mesh` (None: none), as its Auto copy, under `device`
  where given; inside a trace, where jax.set_mesh refuses to run, the
  caller's mesh stays."""
  with contextlib.ExitStack() as stack:
    try:
      stack.enter_context(jax.set_mesh(mesh))
    except ValueError:  # inside a trace: jax.set_mesh refuses to run there
      pass
    else:
      stack.enter_context(auto_context())
    if device is not None:
      stack.enter_context(jax.default_device(device))
    yield


def _is_spec(x):
  return x is None or isinstance(x, P)


def axis_size(mesh, entry):
  """Devices one PartitionSpec entry splits a dimension over."""
  if entry is None:
    return 1
  names = entry if isinstance(entry, tuple) else (entry,)
  return int(np.prod([mesh.shape[n] for n in names]))


def check_axes(mesh, spec, where):
  """InputError unless every mesh axis `spec` names is the mesh's; the
  NamedSharding otherwise."""
  partial = [f"{kind}={set(axes)}" for kind in ("unreduced", "reduced")
             for axes in [getattr(spec, kind, ())] if axes]
  if partial:  # a partial sum held per device: jax.jit's own layouts, no value's
    raise InputError(f"{where}: PartitionSpec {spec} has {' and '.join(partial)}: a state "
                     "leaf or run argument is a whole value, laid out by partitions alone "
                     "(PartitionSpec(*spec) without them)")
  for entry in spec:
    names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
    for name in names:
      if name not in mesh.shape:
        raise InputError(f"{where}: PartitionSpec {spec} names mesh axis {name!r}; the "
                         f"mesh has {tuple(mesh.axis_names)}")
  try:
    return NamedSharding(mesh, spec)
  except Exception as exc:  # pylint: disable=broad-except  # e.g. DuplicateSpecError
    raise InputError(f"{where}: PartitionSpec {spec}: {exc}") from None


def check_spec(mesh, spec, aval, where):
  """InputError unless `spec` fits a value of `aval` on `mesh`."""
  shape = tuple(getattr(aval, "shape", ()))
  if len(spec) > len(shape):
    raise InputError(f"{where}: PartitionSpec {spec} has {len(spec)} entries for a "
                     f"{len(shape)}-d value {aval_str(aval)}")
  check_axes(mesh, spec, where)
  for dim, entry in enumerate(spec):
    size = axis_size(mesh, entry)
    if shape[dim] % size:
      raise InputError(f"{where}: axis {dim} of {aval_str(aval)} has {shape[dim]} "
                       f"entries, which do not divide over the {size} devices of mesh "
                       f"axis {entry!r} (PartitionSpec {spec})")


def data_parallel(mesh, aval):
  """The default spec of a run argument: its leading axis over the first mesh axis."""
  return P(mesh.axis_names[0]) if getattr(aval, "shape", ()) else P()


def zero(mesh, aval):
  """ZeRO stage 1: the largest axis that divides by the device count, split
  over every mesh axis; replicated if none does."""
  shape = tuple(getattr(aval, "shape", ()))
  n = mesh.devices.size
  names = tuple(mesh.axis_names)
  fits = [d for d in range(len(shape)) if shape[d] % n == 0 and shape[d] >= n]
  if not fits or n == 1 or 0 in shape:  # an empty leaf has nothing to split
    return P()
  dim = max(fits, key=lambda d: (shape[d], -d))
  return P(*([None] * dim), names[0] if len(names) == 1 else names)


def zero_kept_whole(mesh, aval):
  """Why `zero` keeps a leaf replicated (dump() says it), or None where it splits it."""
  if zero(mesh, aval) != P():
    return None
  shape, n = tuple(getattr(aval, "shape", ())), mesh.devices.size
  if n == 1:
    return "zero: replicated (a mesh of one device)"
  if 0 in shape:
    return "zero: replicated (an empty leaf)"
  if not shape:
    return "zero: replicated (a scalar)"
  return f"zero: replicated (no axis of {shape} divides by the {n} devices)"


def leaf_specs(what, mesh, specs, args, arg_names, avals, default, why=None):
  """One PartitionSpec per leaf of every argument: `specs` is None (each
  leaf gets `default(mesh, aval)`), "zero" (state only), one PartitionSpec,
  or a sequence with one spec / pytree prefix per argument. `why`, a list:
  per argument, per leaf, why "zero" left it replicated (else None)."""
  if specs is None:
    per_arg = [None] * len(args)
  elif isinstance(specs, P) or (isinstance(specs, str) and specs == ZERO):
    per_arg = [specs] * len(args)
  elif isinstance(specs, (tuple, list)) and len(specs) == len(args):
    per_arg = list(specs)
  else:
    zero_text = ', "zero"' if what == "state_specs" else ""
    raise InputError(f"compile: {what} must be None, a PartitionSpec{zero_text} or a sequence of "
                     f"{len(args)} (one per {'state' if what == 'state_specs' else 'run'} "
                     f"argument), got {specs!r}")
  out = []
  for k, (arg, spec, name, leaf_avals) in enumerate(zip(args, per_arg, arg_names, avals)):
    if spec is None or (isinstance(spec, str) and spec == ZERO):
      rule = zero if spec == ZERO and what == "state_specs" else default
      if isinstance(spec, str) and what != "state_specs":
        raise InputError(f"compile: {what}[{k}] = 'zero' is for state_specs only")
      leaves = [rule(mesh, aval) for aval in leaf_avals]
      if why is not None:
        why.append([zero_kept_whole(mesh, aval) if rule is zero else None
                    for aval in leaf_avals])
    else:
      if why is not None:
        why.append([None] * len(leaf_avals))
      prefix, prefix_def = tree_util.tree_flatten(spec, is_leaf=_is_spec)
      if not all(_is_spec(s) for s in prefix):
        raise InputError(f"compile: {what} for {name} must hold PartitionSpecs, got {spec!r}")
      try:
        subtrees = prefix_def.flatten_up_to(arg)
      except (ValueError, TypeError) as exc:
        raise InputError(f"compile: {what} for {name} is not a pytree prefix of the "
                         f"argument: {exc}") from None
      leaves = []
      for s, sub in zip(prefix, subtrees):
        leaves += [s or P()] * len(tree_util.tree_leaves(sub))
    out.append(leaves)
  return out


def named(mesh, specs_per_arg, avals_per_arg, names_per_arg):
  """NamedShardings for the leaf specs, each checked against its leaf."""
  out = []
  for specs, avals, names in zip(specs_per_arg, avals_per_arg, names_per_arg):
    row = []
    for spec, aval, where in zip(specs, avals, names):
      check_spec(mesh, spec, aval, where)
      if 0 in tuple(getattr(aval, "shape", ())):  # XLA hands empty arrays back
        spec = P()                                # replicated: keep them so
      row.append(NamedSharding(mesh, spec))
    out.append(row)
  return out


def stacked(sharding):
  """The sharding of a leaf stacked over a leading steps axis (loop sink)."""
  return NamedSharding(sharding.mesh, P(None, *sharding.spec))


def global_array(x, sharding):
  """The global array of a process-local piece `x` (many processes)."""
  if isinstance(x, jax.Array) and x.sharding == sharding:
    return x
  return jax.make_array_from_process_local_data(sharding, np.asarray(x))


def put_global(x, sharding):
  """A session-owned copy of a whole value `x`, laid out as `sharding`
  (resharded if it is a jax.Array laid out otherwise). Every process passes
  the same whole value; each puts its addressable shards."""
  with debug_flags.checks_off():  # moves data: a nan it holds is not its to report
    return _put_global(x, sharding)


def _put_global(x, sharding):
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    if x.sharding != sharding:  # resharded by device_put: a jitted reshard refuses
      # the same devices in another order across processes (a review's find)
      x = jax.device_put(x, sharding)
    return real_jit(lambda a: a.copy(), out_shardings=sharding)(x)
  if isinstance(x, jax.Array) and sharding.is_fully_addressable:
    # device_put may keep the caller's buffer as the shard on its own device
    # (may_alias=False notwithstanding, measured with jax 0.10.2), and the
    # session donates its state: copy first, then lay the copy out.
    return jax.device_put(jax.numpy.array(x, copy=True), sharding)
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    # a typed key on devices of several processes: its data laid out, then
    # wrapped (numpy takes no key: a review's find)
    data = _put_global(jax.random.key_data(x), _key_data_sharding(sharding, x))
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
  host = np.array(x, copy=True)  # a shard may keep its slice's buffer: not the caller's
  return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _key_data_sharding(sharding, key):
  """`sharding` of a key array for its key data (one more, trailing axis)."""
  extra = jax.random.key_data(key).ndim - key.ndim
  return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(
      *sharding.spec, *([None] * (key.ndim - len(sharding.spec) + extra))))


def device_bytes(arrays):
  """The largest bytes any one device holds of `arrays` (summed over
  addressable shards, per device)."""
  per_device = {}
  for x in arrays:
    for shard in x.addressable_shards:
      per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  return max(per_device.values(), default=0)


def describe(sharding):
  """`P('data')`-style text for dumps and reports ('' without a mesh)."""
  if sharding is None:
    return ""
  return str(sharding.spec) if isinstance(sharding, NamedSharding) else str(sharding)
