"""The jax settings an equation was traced under, kept for binding it again.

A jaxpr equation records in `eqn.ctx` the settings that change how it
lowers: `jax.threefry_partitionable` (which bits jax.random draws),
compute_on's compute type and xla_metadata (and the abstract mesh, which
lowering.node_mesh reads off the values instead). A function may switch one
inside itself (`with jax.threefry_partitionable(False): jax.random.bits(k)`),
and jax.jit lowers that equation under its own settings, as eval_jaxpr binds
it. The session binds every node again when it builds an executable, so the
importer keeps an equation's settings on its node (`Node.ctx`) where they
differ from the caller's, and every kernel call binds under them
(lowering.kernel_fn). CSE never merges, and no pattern fuses, nodes of
different settings. (Bound under the caller's, jax.random.bits and split
drew other bits than jax.jit's, and an xla_metadata block inside the
function tagged no op.)

The caller's own settings at compile are a graph's too: a Session keeps a
`snapshot` of every setting jax keys a trace by, and what it builds or
traces of the graph at a later call runs `restored` to them (and converts
`as_built`, under the compile's x64), so the graph computes as compiled
whatever the caller's settings are at that call.
"""
import contextlib
import dataclasses

import jax
from jax._src import config as jax_config  # the settings eqn.ctx holds have no public setter
from jax._src import xla_metadata_lib

try:
  from jax._src.core import current_jaxpr_eqn_context as _current
except ImportError:  # a jax without equation contexts: every node binds as the caller's
  _current = None

FIELDS = ("threefry_partitionable", "compute_type", "xla_metadata")

# jax's settings it keys its traces by (config.trace_context_names) are the
# ones a trace or a lowering may read; the session sets two itself where it
# builds (its device: spmd.own_context; jit's off switch: the eager runs), the
# debug checks follow the caller of the run, as jax_debug_nans does (pinned to
# the compile's, a key reuse jax.jit refuses ran: a review's find), and the
# meshes and equation contexts are no `State`s (own_context, `_replaced`).
_OWN = frozenset(("jax_disable_jit", "jax_default_device", "jax_check_static_indices",
                  "jax_pallas_enable_debug_checks"))
_OWN_PREFIXES = ("jax_debug_", "jax_error_checking_")
_KNOWN = ("jax_enable_x64", "jax_default_matmul_precision", "jax_threefry_partitionable",
          "jax_numpy_rank_promotion", "jax_numpy_dtype_promotion", "jax_default_prng_impl")


try:  # the tuple jax.jit keys its own caches by (~0.2 µs a call here)
  from jax._src.config import trace_context as trace_key
except ImportError:  # an internal API: the values of the settings above
  def trace_key():
    return traced_values()


def _traced_states():
  try:
    names = jax_config.trace_context_names()
  except Exception:  # pylint: disable=broad-except  (a jaxlib without the list)
    names = _KNOWN
  states = jax_config.config_states
  return [states[name] for name in names if name in states and name not in _OWN
          and not name.startswith(_OWN_PREFIXES)]


def traced_values():
  """(jax option name, value) of every setting jax keys a trace by, as the
  caller has them now (a `with` block's included)."""
  return tuple((state.name, state.value) for state in _traced_states())


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """The settings a Session compiled a graph under (`snapshot`)."""
  values: tuple  # (jax State, its value) per setting jax keys a trace by
  ctx: object    # the caller's equation context (compute type, xla_metadata), or None


def snapshot():
  """The caller's settings now, for `restored`."""
  return Snapshot(tuple((state, state.value) for state in _traced_states()), caller())


@contextlib.contextmanager
def restored(snap):
  """Traces and builds under `snap`, a compile's settings: what a Session
  builds or traces of a graph later - a run(steps=)'s executable, a shape
  bucket and its checks, the state's other weak types, the outputs' weak
  types, an eager run, a restore's reads - computes as its compile does,
  whatever the caller's settings are at that run (under the run's own, a
  sunk run drew other random bits than the same steps run one by one, and a
  bucket compiled under default_matmul_precision was refused: break-it
  finds). Each differing setting is entered with jax's own context manager."""
  with contextlib.ExitStack() as stack:
    for state, value in snap.values:
      if state.value is not value and state.value != value:
        stack.enter_context(state(value))
    if snap.ctx is not None:
      stack.enter_context(_replaced(snap.ctx))
    yield


def as_built(fn):
  """`fn` run under the x64 setting it is wrapped under, a build's: what it
  converts (a host result placed on the device, a padded or sliced batch)
  keeps the compile's 64-bit types under a caller with x64 off. (A plan's
  own body checks it inline: codegen.py.)"""
  config, x64 = jax.config, bool(jax.config.jax_enable_x64)

  def run(*args):
    if config.jax_enable_x64 is x64:
      return fn(*args)
    with jax.enable_x64(x64):
      return fn(*args)
  return run


@contextlib.contextmanager
def _replaced(ctx):
  """The caller's compute type and xla_metadata replaced by `ctx`'s, a
  compile's - not merged into them, as `binding` merges an equation's
  (merged, a run's own metadata tagged the sunk executable built at that
  run: a review's find)."""
  manager = jax_config.xla_metadata_context_manager
  metadata = manager.swap_local(
      xla_metadata_lib.XlaMetadata(dict(ctx.xla_metadata)) if ctx.xla_metadata else None)
  compute = jax_config.compute_on_context_manager.swap_local(ctx.compute_type)
  try:
    yield
  finally:
    jax_config.compute_on_context_manager.set_local(compute)
    manager.set_local(metadata)


def caller():
  """The settings equations traced now would carry (None without contexts)."""
  return _current() if _current is not None else None


def of_equation(eqn, current):
  """`eqn`'s context where it differs from `current` (the caller's) in a
  setting the session binds under, else None."""
  ctx = getattr(eqn, "ctx", None)
  if ctx is None or current is None or ctx is current:
    return None
  return ctx if any(getattr(ctx, f) != getattr(current, f) for f in FIELDS) else None


def describe(ctx):
  """`threefry_partitionable=False, ...`: the settings dump() shows on a node."""
  return ", ".join(f"{f}={getattr(ctx, f)!r}" for f in FIELDS)


@contextlib.contextmanager
def binding(ctx):
  """Binds under `ctx`'s settings, as jax's JaxprEqnContextManager enters an
  equation's (its xla_metadata merged into the caller's), the abstract mesh
  left to lowering.node_mesh. (horizontal.py binds jax's own equations with
  jax's manager itself, their name stacks too.)"""
  manager = jax_config.xla_metadata_context_manager
  metadata = manager.get_local()
  if ctx.xla_metadata:
    manager.set_local(xla_metadata_lib.update_metadata(metadata, ctx.xla_metadata))
  threefry = jax_config.threefry_partitionable.swap_local(ctx.threefry_partitionable)
  compute = jax_config.compute_on_context_manager.swap_local(ctx.compute_type)
  try:
    yield
  finally:
    jax_config.compute_on_context_manager.set_local(compute)
    jax_config.threefry_partitionable.set_local(threefry)
    manager.set_local(metadata)
