"""What `compile` does differently under a mesh (SessionOptions.mesh).

It decides, before tracing, the NamedSharding of every run-argument leaf and
every state leaf (runtime/sharding.py has the rules), checks each against its
value (InputError naming the argument and path), and, when the mesh spans
several processes, turns each process's example batch into the global array
the program is traced for. After import it writes the shardings on the
graph's inputs (so `dump()` shows them) with the mesh and the per-compile
XLA options; Build compiles every executable for them.
"""
import contextlib
import dataclasses
import re
import zlib
from typing import Any, List, Optional

import jax
import numpy as np
from jax import tree_util

from jaxsession.jax_api import context_meshes, real_jit
from jaxsession import processes
from jaxsession.errors import InputError
from jaxsession.inputs import leaf_aval, paths_of
from jaxsession.graph.ir import aval_str
from jaxsession.runtime import build, collectives, fingerprint, sharding
from jaxsession.runtime.state import sub_byte


@dataclasses.dataclass
class MeshLayout:
  """The shardings of one graph's arguments and state under a mesh."""
  mesh: Any
  args: List[List[Any]]            # NamedSharding per leaf, per run argument
  state: List[List[Any]]           # NamedSharding per leaf, per state argument
  local_pieces: bool               # many processes: run takes process-local batches
  compiler_options: Optional[dict]
  state_notes: Optional[List[List[Any]]] = None  # per state leaf: why "zero" kept it whole

  def describe(self):
    """The mesh, for the report."""
    return (f"mesh {dict(self.mesh.shape)} over {self.mesh.devices.size} devices"
            f"{' in ' + str(jax.process_count()) + ' processes' if self.local_pieces else ''}")


def check_no_specs(options, in_specs, state_specs):
  if options.mesh is None and (in_specs is not None or state_specs is not None):
    raise InputError("compile: in_specs / state_specs need SessionOptions(mesh=...)")


def check_ambient_mesh(where, state_nums):
  """InputError for state compiled inside the caller's `jax.set_mesh(...)` by a
  session without a mesh of its own: the program is traced for that mesh
  (as jax.jit's is) while the state lives on one device, and every run was
  refused by the executable with a raw ValueError (a break-it find)."""
  mesh = jax.sharding.get_mesh()
  if state_nums and not mesh.empty:
    raise InputError(f"{where}: state (state_argnums) compiled inside jax.set_mesh({mesh}) "
                     "by a Session without a mesh: give the session the mesh, "
                     "js.Session(js.SessionOptions(mesh=...)), which lays the state out on "
                     "it, or compile outside the set_mesh block")


def compiler_options(options, platform):
  """The XLA options of every executable: the user's, plus XLA's all-reduce
  combine threshold where the platform takes one (GPU)."""
  opts = dict(options.compiler_options or {})
  if options.mesh is not None and options.allreduce_bucket_bytes and platform in ("gpu", "cuda",
                                                                                 "rocm"):
    opts.setdefault("xla_gpu_all_reduce_combine_threshold_bytes",
                    options.allreduce_bucket_bytes)
  return opts or None


def check_compiler_options(opts, platform):
  """InputError naming an XLA option this platform's compiler does not take
  (checked on an empty program, before any graph is compiled)."""
  if not opts:
    return
  arg = jax.ShapeDtypeStruct((), "float32", sharding=jax.sharding.SingleDeviceSharding(
      jax.local_devices(backend=platform)[0]))
  try:
    real_jit(lambda a: a).lower(arg).compile(compiler_options=dict(opts))
  except Exception as exc:  # pylint: disable=broad-except  # XLA's error, restated
    raise InputError(f"SessionOptions.compiler_options={opts!r} is not taken by the "
                     f"{platform} compiler: {str(exc).splitlines()[0]}") from None


def own_context(options, device=None, tracing=False):
  """The context the session traces, compiles and copies in: the caller's
  as it is, but for a context mesh (`with jax.set_mesh(...)` around the
  call), on which jax.jit lays its programs out. A session mesh's own
  devices there stay, as its Auto copy (sharding.auto_context), for code
  that names its axes; another mesh (other devices, another order of them,
  other axis names or sizes) gives way to the session's. Without a session
  mesh, the context mesh is cleared for what the session makes of a graph already traced
  (a run's later build, the state's copies, a checkpoint): a run(steps=)
  built inside one took a single-device state onto the mesh's devices, and
  every later run failed (a break-it find). A compile (`tracing`) keeps it:
  the user's code may name its axes. `device`: without a session mesh, the
  graph's device, for a run's later build (whatever the caller's default
  device is now)."""
  concrete, abstract = context_meshes()
  mesh = options.mesh
  if mesh is not None:
    if _same_mesh(concrete, mesh) and _same_mesh(abstract, mesh):
      return sharding.auto_context()
    return sharding.replaced_context(mesh, None)
  if tracing or (concrete is None and abstract is None):  # nothing to clear
    return contextlib.nullcontext() if device is None else jax.default_device(device)
  return sharding.replaced_context(None, device)


def _same_mesh(context, mesh):
  """Whether a context mesh (None: unset) is the session's `mesh` but for its
  axis types: its axes by name and size, and (a concrete one) its devices in
  order - a mesh of the same devices under other names made the step's
  own specs a raw error (a review's find)."""
  if context is None:
    return True
  if tuple(context.axis_names) != tuple(mesh.axis_names) or \
      tuple(context.axis_sizes) != tuple(mesh.axis_sizes):
    return False
  if not isinstance(context, jax.sharding.Mesh):  # an AbstractMesh has no devices
    return True
  return tuple(context.devices.flat) == tuple(mesh.devices.flat)


def traced_types(args):
  """`args` as the trace takes them under a session mesh: a jax.Array laid
  out on a mesh of Explicit axes (an example made inside `jax.set_mesh`, or
  put there) as its type alone, without that mesh - the session's mesh and
  specs lay it out (sharding.auto_axes)."""
  def plain(x):
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
      mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
      if mesh is not None and not mesh.empty and any(
          t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type)
    return x
  return [tree_util.tree_map(plain, a) for a in args]


def compile_checksum(mesh_layout, state_flats, dyn_flats, closed, args, statics):
  """Across processes, what every process must compile alike
  (session/processes.py): the run examples' types (each process's piece),
  the layout's specs, `args` (argnums, state_map...), static arguments (a
  number or a string by its value, others by their type), the traced
  program (objects' addresses aside: a step that read the process index
  traced another one there, a review's find) and its constants, the
  initial state's types and values. 0 in a single process."""
  if jax.process_count() == 1:
    return 0
  specs = None if mesh_layout is None else [
      [[str(getattr(s, "spec", s)) for s in row] for row in rows]
      for rows in (mesh_layout.args, mesh_layout.state)]
  text = repr([[(f.treedef, f.avals) for f in (*dyn_flats, *state_flats)], specs, args,
               [repr(x) if isinstance(x, (int, float, str, bool)) else type(x).__name__
                for x in statics], re.sub(r"0x[0-9a-fA-F]+", "", str(closed.jaxpr))])
  return processes.checksum([*closed.consts, *(x for f in state_flats for x in f.leaves)],
                            zlib.crc32(text.encode()))


def _global_example(where, arg_name, path, x, target):
  """The global example this process's piece `x` makes with the others',
  or InputError naming the argument (an indivisible batch raised jax's own
  error, naming nothing: a review's find)."""
  try:
    return sharding.global_array(x, target)
  except (ValueError, TypeError) as exc:
    raise InputError(f"{where}: {arg_name} path {path or '(root)'}: this process's piece "
                     f"(shape {tuple(np.shape(x))}) does not make a global example laid out "
                     f"as {target.spec} over {jax.process_count()} processes: {exc}") from None


def layout(options, platform, name, dyn_nums, dyn_args, dyn_flats, in_specs, state_nums,
           state_flats, state_specs, source_slots, params=()):
  """(MeshLayout, dyn_args) for a compile under `options.mesh`; (None,
  dyn_args) without one (`params`: fn's positional parameter names, or None
  each, for messages). `dyn_flats` and `state_flats` are the checked
  examples (inputs.flatten_example). With `source_slots` (state_from) the
  state keeps the source's layout. Many processes: `dyn_args` come back as
  the global arrays of each process's example piece."""
  where = f"compile({name})"
  mesh = sharding.auto_axes(options.mesh)
  if mesh is None:
    return None, dyn_args
  # named by fn's parameter where it has one: js.jit's keyword arguments come
  # first in its call, and a position alone named another argument
  arg_names = [f"run argument {params[i]!r} at position {i}" if i < len(params) and params[i]
               else f"run argument at position {i}" for i in dyn_nums]
  arg_avals = [list(f.avals) for f in dyn_flats]
  arg_specs = sharding.leaf_specs("in_specs", mesh, in_specs, dyn_args, arg_names, arg_avals,
                                  sharding.data_parallel)
  targets = [[sharding.check_axes(mesh, s, f"{where}: {arg_name}") for s in row]
             for row, arg_name in zip(arg_specs, arg_names)]
  narrow = [f"{kind} at position {i} path {path or '(root)'} is {aval_str(aval)}"
            for kind, flats, nums in (("run argument", dyn_flats, dyn_nums),
                                      ("state argument", state_flats, state_nums))
            for i, f in zip(nums, flats)
            for path, aval in zip(f.paths, f.avals) if sub_byte(aval.dtype)]
  if narrow:  # every one named: widening the first alone met the next refusal
    raise InputError(
        f"{where}: {'; '.join(narrow)}: a dtype narrower than a byte is not supported under a "
        "mesh (jax's ahead-of-time executables refuse such arrays laid out over "
        "devices, where jax.jit takes them); widen it (int8) for the session")
  state, state_notes = _state_layout(where, mesh, state_flats, state_nums, state_specs,
                                     source_slots)
  local = jax.process_count() > 1 and any(not t.is_fully_addressable for row in targets
                                          for t in row)
  if local:  # each process's example is its piece of the global batch
    dyn_args = [tree_util.tree_unflatten(f.treedef, [
        _global_example(where, arg_name, path, x, t)
        for x, t, path in zip(f.leaves, row, f.paths)])
        for f, row, arg_name in zip(dyn_flats, targets, arg_names)]
    arg_avals = [[leaf_aval(x, type_only=True) for x in tree_util.tree_leaves(arg)]
                 for arg in dyn_args]
  leaf_names = [[f"{where}: {name_} path {p or '(root)'}" for p in f.paths]
                for name_, f in zip(arg_names, dyn_flats)]
  args = sharding.named(mesh, arg_specs, arg_avals, leaf_names)
  return MeshLayout(mesh, args, state, local, compiler_options(options, platform),
                    state_notes), dyn_args


def _state_layout(where, mesh, state_flats, state_nums, state_specs, source_slots):
  """Each state leaf's sharding - the source's (state_from), or its spec's -
  and why "zero" kept a leaf replicated (None for the others)."""
  if source_slots is not None:
    if state_specs is not None:
      raise InputError(f"{where}: state_specs is given with state_from; shared state keeps "
                       "the layout of the graph it comes from")
    return [list(slot.shardings) for slot in source_slots], None
  state_args = [tree_util.tree_unflatten(f.treedef, f.leaves) for f in state_flats]
  state_avals = [list(f.avals) for f in state_flats]
  state_names = [f"state argument at position {i}" for i in state_nums]
  why = []
  specs = sharding.leaf_specs("state_specs", mesh, state_specs, state_args, state_names,
                              state_avals, lambda mesh, aval: jax.sharding.PartitionSpec(), why)
  state_leaf_names = [[f"{where}: {n} path {p or '(root)'}" for p in f.paths]
                      for n, f in zip(state_names, state_flats)]
  return sharding.named(mesh, specs, state_avals, state_leaf_names), why


def mark_graph(graph, mesh_layout, options, platform):
  """Writes the layout on the imported graph: each input's sharding, the
  mesh, the XLA options (also set without a mesh, from the options)."""
  graph.compiler_options = compiler_options(options, platform)
  if mesh_layout is None:
    return
  graph.mesh = mesh_layout.mesh
  leaves = [s for row in mesh_layout.state for s in row] + [
      s for row in mesh_layout.args for s in row]
  inputs = [v for v in graph.inputs if v.kind != "const"]
  assert len(inputs) == len(leaves), (len(inputs), len(leaves))
  for value, s in zip(inputs, leaves):
    value.sharding = s
  notes = [n for row in mesh_layout.state_notes or () for n in row]
  for value, note in zip(inputs, notes):  # (the state's leaves come first)
    value.note = note


def key_text(mesh_layout):
  """What the executables' cache key needs of the layout; without a session
  mesh, the mesh of the caller's `jax.set_mesh` context, which the program
  is traced and lowered under (an executable compiled outside one was handed
  to a compile inside one: a raw jax ValueError at run, a break-it find)."""
  if mesh_layout is None:
    mesh = jax.sharding.get_mesh()
    if mesh.empty:
      return ()
    return ("ambient", repr(jax.sharding.get_abstract_mesh()),
            tuple(int(d.id) for d in mesh.devices.flat))
  return fingerprint.canonical([mesh_layout.args, mesh_layout.state])


@dataclasses.dataclass
class ShardingReport:
  """What each device holds and which collectives run (report.sharding)."""
  mesh: str
  leaves: List[Any]                # (state leaf name, spec text, bytes per device)
  state_bytes_per_device: int      # the most any one device holds of the state
  state_bytes_replicated: int      # what each device would hold, replicated
  plan: Any = None                 # runtime.allreduce plan (allreduce_bucket_bytes)

  def describe(self):
    ratio = (self.state_bytes_per_device / self.state_bytes_replicated
             if self.state_bytes_replicated else 0.0)
    lines = [f"{self.mesh}: state {self.state_bytes_per_device} B per device "
             f"({ratio:.3f} of replicated, {self.state_bytes_replicated} B)"]
    lines += [f"  {name}: {spec} ({nbytes} B per device)" for name, spec, nbytes in self.leaves]
    if self.plan is not None:
      lines += ["  " + line for line in self.plan.describe()]
    return lines


def sharding_report(graph, slots, mesh_layout):
  """The per-device state bytes of a graph compiled under a mesh."""
  if mesh_layout is None:
    return None
  leaves, rows = [], []
  for slot in slots:
    for (path, x, s) in zip(paths_of(tree_util.tree_unflatten(slot.treedef, slot.leaves)),
                            slot.leaves, slot.shardings):
      leaves.append(x)
      rows.append((f"{slot.name}{path}", sharding.describe(s), sharding.device_bytes([x])))
  return ShardingReport(
      mesh_layout.describe(), rows, sharding.device_bytes(leaves),
      sum(int(x.size) * x.dtype.itemsize for x in leaves),
      graph.allreduce_plan)


def output_names(graph, layout):
  """Names of an executable's flat outputs: the updated state leaves, then
  the user outputs (for the collectives' `serves`)."""
  names = layout.updated_names([s.name for s in graph.inputs_of_kind("state")])
  names += [f"output {k}" for k in range(len(graph.outputs) - layout.num_outputs)]
  return names


def collectives_of(graph, runner):
  """The collectives XLA put in a mesh graph's executables (read from their
  HLO): the one executable's, or every device partition's, in order."""
  if graph.mesh is None:
    return []
  axes = list(graph.mesh.shape.items())
  exe = getattr(runner, "exe", None)
  if exe is not None:
    names = runner.layout.input_names([s.name for s in graph.inputs_of_kind("state")])
    names += [v.name or f"input {k}" for k, v in enumerate(graph.inputs_of_kind("input"))]
    return [_named_sources(c, exe, names)
            for c in collectives.collectives(exe, output_names(graph, runner.layout), axes)]
  program = getattr(runner, "program", None)
  found = []
  for part in graph.partitions:
    exe = None if program is None else program.executables.get(part.index)
    if exe is not None:
      names = [f"partition #{part.index} -> {_value_name(graph, v)}"
               for v in part.outputs + part.witnesses]  # (witnesses: returned too)
      sources = [v.name or repr(v) for v in build.device_inputs(part)]
      found += [_named_sources(c, exe, sources)
                for c in collectives.collectives(exe, names, axes)]
  return found


def _named_sources(found, exe, names):
  """`found` (a Collective) with the op names it comes from in the dump's
  `names` of the executable's flat parameters: jax names them by the
  session's step function, `xs[1]`, `xs[0][0][1]` (named nowhere else: a
  review's find)."""
  try:
    paths = [path for path, _ in tree_util.tree_flatten_with_path(
        tree_util.tree_unflatten(exe.in_tree, range(exe.in_tree.num_leaves)))[0]]
  except (AttributeError, TypeError, ValueError):  # no in_tree: the names as jax gives them
    return found
  if len(names) != len(paths):
    return found
  by_path = {"xs" + tree_util.keystr(path[1:]): name for path, name in zip(paths, names)}
  rename = lambda m: by_path.get(m.group(0), m.group(0))
  op_names = tuple(re.sub(r"xs(\[\d+\])+", rename, n) for n in found.op_names)
  return dataclasses.replace(found, op_names=op_names)


def _value_name(graph, value):
  """A state leaf's name, 'output k', or the value's id."""
  states = graph.inputs_of_kind("state")
  for k, out in enumerate(graph.outputs):
    if out is value:
      n = len(graph.state_updates())
      return (states[k].name or f"state {k}") if k < n else f"output {k - n}"
  return repr(value)
