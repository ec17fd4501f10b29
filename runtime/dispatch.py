"""How the session calls a compiled executable at run time: jax's C++ call
of it (minus a Python frame), one at a time on XLA:CPU meshes, PRNG key
arguments laid out as it takes them. Every executable the session runs -
single graphs, sunk loops, plan partitions, run_op, js.jit's - is called
through `fast_call`."""
import threading

import jax


# On XLA:CPU the executables over several devices run one at a time in the
# process: each is dispatched and waited for under a lock. Two threads each
# running a mesh graph of its own, dispatching steps without reading a
# result, aborted the process in XLA's collective rendezvous after 40 s
# ("Termination timeout for all reduce"), as the same two loops under
# jax.jit do - with a lock around each dispatch alone too: XLA:CPU's threads
# took one program's part on one device and the other's on another, each
# waiting for its partner; one thread dispatching 8-device steps back to
# back hung so (tests/cpu_mesh_dispatch_test.py). Waiting for the one before
# at the next dispatch instead, holding one of its outputs, was let down by
# a user deleting that output, and kept it alive after its Session was gone
# (a break-it find); waiting at once costs ~5% of a small 8-device step
# whose result is not read. An executable with a host callback inside is
# not ordered: the callback may run a mesh graph of its own, which would
# wait for the lock its dispatcher holds. Other platforms run collectives
# on their devices' streams, in dispatch order: nothing is taken there.
_CPU_MESH = threading.Lock()


def fast_call(exe):
  """The executable's C++ call (what `Compiled.__call__` forwards to, minus
  one Python frame: ~0.6 µs a call, measured here); the executable itself
  where this jax has none. Where `ordered(exe)`, run under _CPU_MESH and
  waited for."""
  try:
    call = exe._executable.create_cpp_call(exe._params)  # pylint: disable=protected-access
  except Exception:  # an internal API: fall back to the public call
    call = None
  call = _keys_laid_out(call or exe, exe)
  if not ordered(exe):
    return call

  def one_at_a_time(*args):
    with _CPU_MESH:
      outs = call(*args)
      jax.block_until_ready(_first_array(outs))  # (all are ready at once)
    return outs
  return one_at_a_time


def _keys_laid_out(call, exe):
  """`call` that first lays each committed PRNG key argument out as `exe`
  takes it, where `exe` spans several devices and takes keys: jax's call of
  an executable re-lays other arrays committed in another layout on the same
  devices (a replicated array for a split input) at every call, and a key
  array at the first call only - from the second, it handed the executable
  the unsplit buffer: wrong keys, or a crash where the sizes differ (judges'
  finds, keys in a pytree argument too; jax's own Compiled call does the
  same). Other executables: `call` itself."""
  try:
    avals = jax.tree.leaves(exe.in_avals)
    # (None: an argument the executable does not read - kept in line)
    shardings = jax.tree.leaves(exe.input_shardings, is_leaf=lambda s: s is None)
    several = len({d for s in shardings if s is not None for d in s.device_set}) > 1
  except Exception:  # pylint: disable=broad-except  (no such attributes: nothing known)
    return call
  keys = [(i, s) for i, (a, s) in enumerate(zip(avals, shardings)) if s is not None
          and jax.dtypes.issubdtype(getattr(a, "dtype", None), jax.dtypes.prng_key)]
  if not (several and keys and len(avals) == len(shardings)):
    return call

  def relaid(*args):
    leaves, tree = jax.tree.flatten(args)
    if len(leaves) != len(avals):  # not the executable's arguments: its own error
      return call(*args)
    moved = False
    for i, want in keys:
      x = leaves[i]
      if isinstance(x, jax.Array) and x.committed and x.sharding != want and \
          not x.sharding.is_equivalent_to(want, x.ndim):
        leaves[i], moved = jax.device_put(x, want), True
    return call(*jax.tree.unflatten(tree, leaves)) if moved else call(*args)
  return relaid


def _first_array(outs):
  """The first array among an executable's (nested) outputs, or None."""
  if isinstance(outs, (tuple, list)):
    for x in outs:
      found = _first_array(x)
      if found is not None:
        return found
    return None
  return outs


def ordered(exe):
  """Whether `exe` runs one at a time (_CPU_MESH): on several CPU devices
  of this process, with no host callback inside. Where jax hides its devices,
  its input layouts say; where it hides its callbacks, it has none."""
  # pylint: disable=protected-access
  try:
    devices = exe._executable.xla_executable.local_devices()
  except Exception:  # pylint: disable=broad-except  (an internal API)
    devices = {d for s in jax.tree.leaves(exe.input_shardings) for d in s.device_set}
  if len(devices) < 2 or any(d.platform != "cpu" for d in devices):
    return False
  return not getattr(getattr(exe._executable, "unsafe_call", None), "has_host_callbacks", False)
