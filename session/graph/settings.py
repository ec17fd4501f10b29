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
"""
import contextlib
import dataclasses

from jax._src import config as jax_config  # the settings eqn.ctx holds have no public setter
from jax._src import xla_metadata_lib

try:
  from jax._src.core import current_jaxpr_eqn_context as _current
except ImportError:  # a jax without equation contexts: every node binds as the caller's
  _current = None

FIELDS = ("threefry_partitionable", "compute_type", "xla_metadata")

# The jax settings a trace or a lowering reads, which jax.jit keys its cache by.
TRACED = ("enable_x64", "default_matmul_precision", "threefry_partitionable",
          "numpy_rank_promotion", "numpy_dtype_promotion", "default_prng_impl")


def traced_values():
  """(jax option name, value) of every TRACED setting, as the caller has them."""
  return tuple((getattr(jax_config, name).name, getattr(jax_config, name).value)
               for name in TRACED)


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """The settings a Session compiled a graph under (`snapshot`)."""
  values: tuple  # per TRACED name, its value
  ctx: object    # the caller's equation context (compute type, xla_metadata), or None


def snapshot():
  """The caller's settings now, for `restored`."""
  return Snapshot(tuple(getattr(jax_config, name).value for name in TRACED), caller())


@contextlib.contextmanager
def restored(snap):
  """Traces and builds under `snap`, a compile's settings: what a Session
  builds of a graph later - a run(steps=)'s executable, a shape bucket, the
  state's other weak types - computes as its compile does, whatever the
  caller's settings are at that run (under the run's own, a sunk run drew
  other random bits than the same steps run one by one: a break-it find)."""
  states = [getattr(jax_config, name) for name in TRACED]
  before = [state.swap_local(value) for state, value in zip(states, snap.values)]
  try:
    with binding(snap.ctx) if snap.ctx is not None else contextlib.nullcontext():
      yield
  finally:
    for state, value in zip(states, before):
      state.set_local(value)


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
  """Binds under `ctx`'s settings (as jax's JaxprEqnContextManager, the
  abstract mesh left as it is)."""
  threefry = jax_config.threefry_partitionable.swap_local(ctx.threefry_partitionable)
  compute = jax_config.compute_on_context_manager.swap_local(ctx.compute_type)
  metadata = jax_config.xla_metadata_context_manager.swap_local(
      xla_metadata_lib.XlaMetadata(ctx.xla_metadata) if ctx.xla_metadata else None)
  try:
    yield
  finally:
    jax_config.xla_metadata_context_manager.set_local(metadata)
    jax_config.compute_on_context_manager.set_local(compute)
    jax_config.threefry_partitionable.set_local(threefry)

