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

# jax's settings it keys its traces by (config.trace_context_names) are the
# ones a trace or a lowering may read; the session sets two itself where it
# builds (its device: spmd.own_context; jit's off switch: the eager runs), and
# the meshes and equation contexts are no `State`s (own_context, `binding`).
_OWN = frozenset(("jax_disable_jit", "jax_default_device"))
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
  return [states[name] for name in names if name in states and name not in _OWN]


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
      stack.enter_context(binding(snap.ctx))
    yield


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
