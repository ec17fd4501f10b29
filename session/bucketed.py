"""A graph compiled with shape buckets: one executable per bucket size, a
dispatcher that pads each batch to its bucket and slices the outputs back.

`Session.compile(..., buckets={argnum: [1, 2, 4, ...] | "auto"})` compiles
the first bucket at once, checking with the padding analysis
(runtime/batch_axis.py) that padded rows can never reach a real row of an
output or the state - else an InputError names the node that mixes rows. The
other sizes compile on first use (or all at compile with
`SessionOptions(precompile_buckets=True)`), each sharing the first one's state
slots. Every distinct compiled size counts towards
`SessionOptions(recompile_warn_limit)`: a warning names the argument and the
sizes at the limit and once per new size after it.

Buckets are a client of the Session's public doors: each bucket is
`Session.compile` at its size (`state_from` the first bucket) and runs with
`Session.run`; the padding analysis traces and imports fn itself (the graph
layer's importer); run's arguments are checked here against the bucketed
graph's own ArgSpec, whose messages name the id the user holds.
"""
import re
import threading

import jax
import numpy as np
from absl import logging
from jax import tree_util

from jaxsession import inputs, pipeline, tracing
from jaxsession.errors import InputError, SessionError, UnknownGraphError
from jaxsession.graph import importer, settings
from jaxsession.graph.ir import Literal, aval_str
from jaxsession.runtime import buckets as policy_lib, debug_flags, static_leaves
from jaxsession.runtime.state import session_device, with_weak_type



class BucketedGraph:
  """Dispatch for one bucketed graph (the Session keeps one per graph id)."""

  def __init__(self, session, fn, name, example_args, kwargs, state_nums, positions,
               run_positions, policy):
    self.session = session
    self.fn = fn
    self.settings = settings.snapshot()  # a bucket traced or compiled at a later run: under them
    # a run's pads and slices under the compile's x64 (a float64 output came back
    # float32 with x64 off: a break-it find)
    self.padded, self.sliced = settings.as_built(self._padded), settings.as_built(self._sliced)
    self.name = name
    self.example_args = example_args
    self.kwargs = kwargs              # Session.compile's keywords for every bucket
    self.state_nums = state_nums
    self.dyn_nums = run_positions     # fn's positions of run's arguments
    self.updates = bool(kwargs["updates_state"]) and bool(state_nums)
    self.positions = positions        # bucketed positions of fn
    self.run_index = [run_positions.index(p) for p in positions]  # among run's arguments
    self.example_avals = {i: [jax.api_util.shaped_abstractify(x) for x in
                              tree_util.tree_leaves(example_args[p])]
                          for i, p in zip(self.run_index, positions)}
    self.policy = policy
    self.options = session.options
    # the device every bucket runs on: jax's default one at this compile (a
    # bucket compiled later, inside another jax.default_device, still goes there)
    self.device = session_device()
    self.sizes = {}                   # compiled size -> sub-graph id
    self.first = None                 # the first bucket's id: the graph's state
    self.spec = None                  # run's arguments, checked before a bucket runs
    self.weak_dyn = None              # [(argument, leaf, weak)] compile's weak check
    self.output_axes = None           # per run output leaf: the row axis or None
    self.verdict = None
    self.signatures = []              # the probe traces' programs, row count named
    self.template = None              # the last probe's, its row count a placeholder
    self.same_program = {}            # size -> None (fn there is the probes' program) or
    #                                   the first line where it differs
    self.exact_one = False            # fn at 1 row is another program: run 1 row exactly
    self.probe_ranks = None           # the last probe trace's ops and result ranks
    self.released = False
    self.lock = threading.Lock()
    self.where = f"run(graph '{name}')"  # with the public id once it has one (bind)

  # -- compile --------------------------------------------------------------
  def check_graph(self, size):
    """The padding analysis on a trace of fn at `size` rows (the graph layer's
    import of jax.make_jaxpr, nothing compiled): InputError naming every node
    that mixes rows; else the row axis of every run output."""
    graph, dyn_args = self.trace(size)
    self.probe_ranks = _ranks(graph)
    dynamic, first = {}, 0
    leaf_ids = [v.id for v in graph.inputs_of_kind("input")]
    for i, (position, arg) in enumerate(zip(self.dyn_nums, dyn_args)):
      pairs = tree_util.tree_flatten_with_path(arg)[0]
      if i in self.run_index:
        for j, (path, leaf) in enumerate(pairs):
          aval = jax.api_util.shaped_abstractify(leaf)
          if not aval.shape or not _paddable(aval.dtype):  # (named as given: not the probe's)
            raise InputError(f"compile({self.name}): bucketed argument at position "
                             f"{position}, leaf {tree_util.keystr(path) or '(root)'}, "
                             f"is {self.example_avals[i][j].str_short()}: only numeric, bool "
                             "or PRNG key arrays with a batch axis can be padded")
          dynamic[leaf_ids[first]] = 0
          first += 1
      else:
        first += len(pairs)
    from jaxsession.runtime import batch_axis  # pylint: disable=import-outside-toplevel
    verdict = batch_axis.analyze(graph, dynamic)
    if not verdict.safe:
      raise InputError(
          f"compile({self.name}): padding to shape buckets is not safe - padded rows "
          f"would mix with real ones:\n{verdict.describe()}\nCompile without buckets= "
          "to run every batch size exactly.")
    num_state = len(graph.state_updates())
    self.verdict = verdict
    self.output_axes = list(verdict.output_axes[num_state:])
    rows = len_of_rows(graph, dynamic)
    self.signatures.append(program_signature(graph, rows))
    self.template = program_signature(graph, rows, as_=_ROWS)

  def trace(self, size):
    """fn traced and imported as compile imports it, the bucketed arguments at
    `size` rows: (the KernelGraph, the run arguments' examples); under the
    compile's jax settings (a bucket's check at a later run too)."""
    with settings.restored(self.settings):
      try:
        return self._trace(size)
      except SessionError:
        raise
      except Exception as exc:  # pylint: disable=broad-except  (fn's own, at `size` rows)
        raise InputError(
            f"compile({self.name}): fn traced with the bucketed arguments at {size} rows "
            f"(a row count of the padding analysis: its probes, the buckets) fails: "
            f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0].rstrip('.')}; an "
            f"array with the batch's rows that is not bucketed ({self._row_partners()}) "
            "cannot follow the padding: bucket a run argument too, or compile without "
            "buckets=") from exc

  def _row_partners(self):
    """The leaves of the run arguments that are not bucketed whose leading
    axis is the bucketed examples' row count, named (or what else it is)."""
    rows = {np.shape(x)[0] for p in self.positions
            for x in tree_util.tree_leaves(self.example_args[p]) if np.shape(x)}
    named = [f"{'state ' if p in self.state_nums else ''}argument {p}"
             f"{tree_util.keystr(path)}" for p in range(len(self.example_args))
             if p not in self.positions
             for path, x in tree_util.tree_flatten_with_path(self.example_args[p])[0]
             if np.ndim(x) and np.shape(x)[0] in rows]
    return ("here: " + ", ".join(named[:4])) if named else \
        "an array fn closes over, a reshape to fixed sizes?"

  def _trace(self, size):
    examples = self.examples(size)
    # the state's non-array leaves in its treedef, as compile traces it
    state_args = [static_leaves.hide(examples[i]) for i in self.state_nums]
    dyn_args = [examples[i] for i in self.dyn_nums]
    wrapped = tracing.stateful_fn(self.fn, self.name, examples, self.state_nums,
                                  self.dyn_nums, self.updates)
    closed = jax.make_jaxpr(wrapped)(tuple(state_args), *dyn_args)
    if self.weak_dyn is None:  # the other arguments' weak types run checks (bind)
      self.weak_dyn = [(i, j, weak) for i, j, weak in tracing.weak_sensitive(
          wrapped, closed, state_args, dyn_args) if i not in self.run_index]
    kinds, labels = tracing.input_labels(self.state_nums, state_args, self.dyn_nums, dyn_args)
    graph = importer.import_jaxpr(closed, name=self.name, input_kinds=kinds,
                                  input_names=labels,
                                  host_callbacks=self.options.host_callbacks)
    graph.updates_state = self.updates
    pipeline.clean_probe(graph)  # Optimize's identities, as the bucket's program has them
    return graph, dyn_args

  def executable(self, size):
    """The sub-graph id for `size`, compiled on first use."""
    gid = self.sizes.get(size)
    if gid is not None:
      return gid
    with self.lock:
      gid = self.sizes.get(size)
      if gid is None:
        if self.released:
          raise UnknownGraphError(f"graph '{self.name}' was released")
        gid = self.sizes[size] = self.compile_one(size)
        self._warn_recompiles(size)
    return gid

  def release(self):
    """Marks the graph released; returns its sub-graph ids (no new ones after)."""
    with self.lock:
      self.released = True
      return list(self.sizes.values())

  def compile_first(self, size, start, other):
    """The first bucket (Session.compile checks the examples and the
    keywords), then the padding analysis on traces at two probe row counts
    from `start` on: primes that no axis of the examples (`other`: their
    axes but the batch's) nor any number of the first bucket's program
    (axes, params) is, so that a row axis cannot pass for another or for a
    broadcast, nor an axis or param of the model's own (a head's width of
    64, a vocabulary of 11, x[:, 17:]) for the batch's. A refusal releases
    the first bucket. The two traces must be the same program once the row
    count is named: a program that reads the batch size (x / x.shape[0], an
    arange of it, a Python branch on it) is refused, naming the first node
    that differs."""
    gid = self.compile_one(size)
    # every number the program holds: its axes, its params (a slice's 17, a
    # conv's dimension numbers), its nested jaxprs' shapes - the signatures
    # would take one equal to a probe for the row count
    text = "\n".join(program_signature(self.session.graph(gid), None))
    other = set(other) | {int(t) for t in re.findall(r"\d+", text) if len(t) < 7}
    probes = []  # primes: a model's own axes are rarely prime
    while len(probes) < 2:
      if start not in other and _prime(start):
        probes.append(start)
      start += 1
    try:
      for probe in probes:
        self.check_graph(probe)
      first, second = self.signatures
      if first != second:
        where = next((a for a, b in zip(first, second) if a != b), "the number of nodes")
        raise InputError(
            f"compile({self.name}): the program depends on the batch size itself (traced "
            f"at {probes[0]} and {probes[1]} rows it differs at: {where}); padding would "
            "change its result. Compile without buckets= to run every batch size exactly.")
      self.exact_one = 1 not in (self.policy.sizes or ()) and self._one_row_differs()
      for bucket in sorted({size, *(self.policy.sizes or ())}):  # the known buckets
        self.check_bucket(bucket, f"compile({self.name})")
    except BaseException:
      self.session.release(gid)
      raise
    self.sizes[size] = self.first = gid

  def check_bucket(self, size, where):
    """InputError unless fn traced at `size` rows (a bucket requests are
    padded to) is the probes' program with `size` rows: a Python branch on
    the batch size between the probes and a bucket (`if x.shape[0] <= 16:
    x - x.mean(0)`, a parity, `min(B, 16)`) made the bucket mix rows (a
    break-it find). One trace per size, nothing compiled."""
    if size < 2:
      return  # (0 and 1 row are never padded into)
    if size not in self.same_program:  # None where it is the same program
      want = [line.replace(_ROWS, str(size)) for line in self.template]
      got = program_signature(self.trace(size)[0], None)
      self.same_program[size] = None if got == want else next(
          (a for a, b in zip(got, want) if a != b),
          f"{len(got) - 1} nodes and constants there, {len(want) - 1} at the probes")
    if self.same_program[size] is not None:
      raise InputError(
          f"{where}: fn traced at {size} rows (a bucket) is another program than at the "
          f"probe sizes the padding analysis checked (it differs at: "
          f"{self.same_program[size]}): it reads the batch size (a Python branch on "
          "x.shape[0]?), and padding to this bucket would change its result. Compile "
          "without buckets=, or give buckets fn treats alike.")

  def _one_row_differs(self):
    """Whether fn traced at 1 row is another program than at the last probe's
    rows, by its ops and the ranks of their results: `jnp.squeeze()` drops
    the batch axis of one row alone (a review's find: a regression head
    returned (1,) where jax.jit returns ()). Such a graph runs one row exactly."""
    try:
      return _ranks(self.trace(1)[0]) != self.probe_ranks
    except Exception:  # pylint: disable=broad-except  (fails at 1 row: run it so, as jax.jit)
      return True

  def examples(self, size):
    """The example args with the bucketed ones at `size` rows (types only)."""
    examples = list(self.example_args)
    for p in self.positions:
      examples[p] = tree_util.tree_map(
          lambda x: jax.ShapeDtypeStruct((size,) + tuple(jax.numpy.shape(x))[1:],
                                         jax.numpy.result_type(x),
                                         weak_type=getattr(x, "weak_type", False)),
          self.example_args[p])
    return examples

  def compile_one(self, size):
    """One bucket's executables: Session.compile at `size` rows, sharing the
    first bucket's state."""
    kwargs = dict(self.kwargs)
    if self.first is not None and self.state_nums:  # the first bucket's slots, one per
      # state arg, already mapped
      kwargs["state_from"], kwargs["state_map"] = self.first, None
    with jax.default_device(self.device), settings.restored(self.settings):
      return self.session.compile(self.fn, *self.examples(size),
                                  name=f"{self.name}[batch {size}]", **kwargs)

  def bind(self, gid):
    """The public id the Session gave this graph: it names the graph in run's
    messages, and run's arguments are checked against the example's."""
    self.where = f"run(graph {gid} '{self.name}')"
    self.spec = inputs.ArgSpec(self.where, self.dyn_nums,
                               [self.example_args[i] for i in self.dyn_nums],
                               weak_sensitive=self.weak_dyn)
    self.check_weak = self.spec.weak_guard(lambda args: None)

  def precompile(self):
    for k, size in enumerate(self.policy.sizes or ()):
      if size not in self.sizes:
        logging.info("compile(%s): precompiling bucket %d of %d (batch size %d)",
                     self.name, k + 1, len(self.policy.sizes), size)
        self.executable(size)

  def _warn_recompiles(self, size):
    limit = self.options.recompile_warn_limit
    if limit and len(self.sizes) >= limit:
      logging.warning(
          "graph '%s': %d distinct batch sizes compiled for the bucketed argument(s) at "
          "position(s) %s (recompile_warn_limit=%d), the latest %d; sizes %s. %s",
          self.name, len(self.sizes), sorted(self.positions), limit, size,
          sorted(self.sizes), "Raise max_buckets or give bucket_sizes_hint (the traffic "
          "outgrew the learned buckets)." if self.policy.auto else
          "Give buckets covering them, or 'auto'.")

  # -- run ------------------------------------------------------------------
  def batch_size(self, args, axis):
    """The rows of the bucketed arguments, checked against the example's
    dtypes and trailing shapes before any size is chosen or compiled."""
    sizes = {}  # size -> the first leaf of that many rows, named
    for i in self.run_index:  # precheck saw the arity and the structures
      pairs = tree_util.tree_flatten_with_path(args[i])[0]
      for (path, leaf), want in zip(pairs, self.example_avals[i]):
        shape = tuple(jax.numpy.shape(leaf))
        dtype = getattr(leaf, "dtype", None)
        # (a numpy int64 or float64 array is taken as jax.jit takes it: as the
        # default int or float without x64; a break-it find: refused)
        if len(shape) <= axis or shape[axis + 1:] != tuple(want.shape[1:]) or (
            dtype is not None and jax.dtypes.canonicalize_dtype(
                dtype, allow_extended_dtype=True) != want.dtype):
          got = (f"{dtype}{list(shape)}" if dtype is not None else
                 f"a Python {type(leaf).__name__} ({leaf!r})")
          raise InputError(
              f"{self.where}: bucketed argument {i} (position "
              f"{self.positions[self.run_index.index(i)]} of the function) has a leaf "
              f"{got}; expected {want.dtype}[{', '.join(['n', *map(str, want.shape[1:])])}] "
              f"with the batch on axis {axis}")
        sizes.setdefault(shape[axis], f"argument {i} at path "
                                      f"{tree_util.keystr(path) or '(root)'}")
    if len(sizes) > 1:
      raise InputError(f"{self.where}: the bucketed arguments disagree on the batch size "
                       f"(axis {axis}): " + ", ".join(f"{n} rows in {leaf}"
                                                      for n, leaf in sorted(sizes.items())))
    return next(iter(sizes))

  def precheck(self, args, steps):
    """What the bucket's run would refuse, refused first - the arity, each
    argument's structure, the other arguments' leaves - so that a failed
    run neither counts in the traffic nor compiles a bucket."""
    spec = self.spec
    spec.check_arity(args)
    for i, arg in enumerate(args):
      leaves, treedef = tree_util.tree_flatten(arg)
      if treedef != spec.treedefs[i]:
        spec.conform(args)  # raises the InputError naming the argument
      if i not in self.run_index:
        for j, leaf in enumerate(leaves):
          spec.conform_leaf(i, j, leaf, steps)
    self.check_weak(args)

  def run(self, args, steps=None):
    """A bucketed run: the arguments checked here (errors name the graph the
    user compiled), then Session.run of the bucket's sub-graph."""
    axis = 0 if steps is None else 1
    self.precheck(args, steps)
    n = self.batch_size(args, axis)
    if n == 0 or (n == 1 and self.exact_one) or (debug_flags.MAYBE[0] and debug_flags.on()):
      # exact: an empty batch (padded, a maximum over a value made from the
      # batch size saw rows where jax.jit sees none), and every run under
      # jax_debug_nans/infs, which check every row - a pad row copies the
      # last row but not its index: sqrt(4 - i) raised where jax.jit did not
      # (a break-it find). Not counted as traffic.
      size = n
    else:
      size = self.policy.size_for(n)
      if size != n:  # padded: only into a bucket whose program is the probes'
        with self.lock:
          self.check_bucket(size, self.where)  # (refused: nothing counted)
      self.policy.record(n, size, self.sizes)
    gid = self.executable(size)
    if size != n:
      args = self.padded(args, size, axis)
    out = self.session.run(gid, *args, steps=steps)
    return out if size == n else self.sliced(out, n, axis)

  def _padded(self, args, size, axis):
    try:
      return tuple(tree_util.tree_map(lambda x: policy_lib.pad_rows(x, size, axis), a)
                   if i in self.run_index else a for i, a in enumerate(args))
    except MemoryError as exc:  # (numpy's, raw before: a judge's find)
      raise InputError(f"{self.where}: padding the batch to the bucket of {size} rows "
                       f"needs more host memory than there is ({exc}); give smaller "
                       "buckets") from None

  def _sliced(self, out, n, axis):
    leaves, treedef = tree_util.tree_flatten(out)
    leaves = [x if ax is None else policy_lib.slice_rows(x, n, ax + axis)
              for x, ax in zip(leaves, self.output_axes)]
    leaves = [_weak_like(x, y) for x, y in zip(leaves, tree_util.tree_leaves(out))]
    return tree_util.tree_unflatten(treedef, leaves)

  def describe(self):
    compiled = sorted(self.sizes)
    return f"{self.policy.describe()}; {len(compiled)} compiled sizes {compiled}"

  def __repr__(self):  # report.buckets, printed alone
    return f"<shape buckets of graph '{self.name}': {self.describe()}>"


_ROWS = "\x00rows\x00"  # the row count's place in a probe's program (check_bucket)


def _ranks(graph):
  return [(n.op, tuple(len(getattr(o.aval, "shape", ())) for o in n.outputs))
          for n in graph.nodes]


def _prime(n):
  return n >= 2 and all(n % k for k in range(2, int(n ** 0.5) + 1))


def compile_bucketed(session, fn, example_args, kwargs, name, buckets, max_buckets, hint,
                     state_nums, run_positions):
  """Session.compile with buckets: checks the spec, runs the padding analysis
  on traces of fn, compiles the example's bucket with Session.compile, and
  returns the BucketedGraph (its `first` id holds the state the sub-graphs
  share); the Session gives it its public id (`bind`)."""
  checked, hint = policy_lib.check_spec(buckets, run_positions, max_buckets, hint)
  name = name or getattr(fn, "__name__", "graph")
  positions = sorted(checked)
  sizes = {jax.numpy.shape(leaf)[0] if jax.numpy.ndim(leaf) else None
           for p in positions for leaf in tree_util.tree_leaves(example_args[p])}
  if None in sizes or len(sizes) != 1:
    raise InputError(f"compile({name}): the bucketed example args at positions "
                     f"{positions} need one shared leading (batch) axis; their leading "
                     f"sizes are {sorted(s for s in sizes if s is not None)}"
                     + (" and some leaves are scalars" if None in sizes else ""))
  n0 = sizes.pop()
  policy = policy_lib.BucketPolicy.make(checked[positions[0]], max_buckets, hint)
  dispatcher = BucketedGraph(session, fn, name, example_args, kwargs, state_nums, positions,
                             run_positions, policy)
  first = policy.first_size(n0)
  other = {d for i, arg in enumerate(example_args) for leaf in tree_util.tree_leaves(arg)
           for d in tuple(getattr(leaf, "shape", ()))[1 if i in positions else 0:]}
  dispatcher.compile_first(first, max([2, n0] + list(policy.sizes or [])), other)
  if session.options.precompile_buckets:
    dispatcher.precompile()
  return dispatcher


def _paddable(dtype):
  """Numeric or bool, ml_dtypes' included (bfloat16 and the float8s are numpy
  kind 'V'), or typed PRNG keys (a key per row: padded as their data)."""
  try:
    return bool(jax.numpy.issubdtype(dtype, jax.numpy.number)
                or jax.numpy.issubdtype(dtype, jax.numpy.bool_)
                or jax.numpy.issubdtype(dtype, jax.dtypes.prng_key))
  except TypeError:
    return False


def _weak_like(sliced, original):
  """A sliced output keeps the padded output's weak type (jax.jit's would
  have it at the exact shape too), without a compile per batch size
  (tests/buckets_test.py counts XLA compiles)."""
  if sliced is original or not getattr(original, "weak_type", False):
    return sliced
  return with_weak_type(sliced, True)


def len_of_rows(graph, dynamic):
  """The row count of a trace: the batch axis size of a dynamic input."""
  vid = next(iter(dynamic))
  value = next(v for v in graph.inputs if v.id == vid)
  return value.aval.shape[dynamic[vid]]


def _param_text(value, name):
  """A node param as program_signature compares it, the row count named.
  A callback's function (a lambda defined in fn is another object at each
  trace, its repr another address) by its code, closure and defaults,
  unnamed: a closure over the row count still tells the traces apart."""
  fn = getattr(value, "callback_func", value)
  code = getattr(fn, "__code__", None)
  if code is None:
    return "".join(name(str(value)).split())  # (a jaxpr breaks its lines by their width)
  try:
    cells = tuple(c.cell_contents for c in fn.__closure__ or ())
  except ValueError:  # an empty cell
    cells = ("<empty cell>",)
  tree = getattr(value, "in_tree", "")
  return (f"{type(value).__name__}({getattr(fn, '__qualname__', '?')} at {code.co_filename}:"
          f"{code.co_firstlineno} closure={cells!r} defaults={fn.__defaults__!r} {tree})")


def program_signature(graph, rows, as_="B"):
  """The program a trace computes with its row count named (`as_`): op,
  params, literals and types of every node in order (no ids, no source
  lines), so two traces at different row counts compare equal unless the
  program reads the row count itself. `rows` None: nothing named."""
  # the row count as a dimension or a tuple item only - "[32," "(32)" ", 32]" -
  # never inside a dtype's name (f32, i8) or a scalar param (bit_width=32);
  # and a scan's step count, where its steps are the rows (lax.map, at any
  # depth: the analysis refuses any other scan of that many steps)
  pattern = re.compile(rf"(?<=[\[(,\s]){rows}(?=[,\])])|(?<=\blength=){rows}\b")
  name = (lambda text: text) if rows is None else (  # noqa: E731
      lambda text: pattern.sub(as_, text))
  lines = [name(" ".join(aval_str(v.aval) for v in graph.inputs))]
  for node in graph.nodes:
    # (a callback's closure stays unnamed: _param_text; a scan's length is named)
    params = ", ".join(name(f"{k}={v}") if k == "length" else f"{k}={_param_text(v, name)}"
                       for k, v in sorted(node.params.items()))
    # literal values stay as they are: a literal equal to the row count is the
    # program reading it (n + x.shape[0])
    ins = ", ".join(repr(v) if isinstance(v, Literal) else name(aval_str(v.aval))
                    for v in node.inputs)
    outs = name(", ".join(aval_str(o.aval) for o in node.outputs))
    lines.append(f"{node.op}[{params}]({ins}) -> {outs}")
  # an output that is a literal: the row count returned or made the new state
  # (`return loss, x.shape[0]`) is in no node (a break-it find: the bucket's)
  lines.append("outputs " + ", ".join(repr(v) if isinstance(v, Literal) else
                                      name(aval_str(v.aval)) for v in graph.outputs))
  for v in graph.inputs_of_kind("const"):  # an array built from the row count differs too
    c = graph.const_values[v.id]
    if jax.dtypes.issubdtype(getattr(c, "dtype", np.float32), jax.dtypes.extended):
      c = jax.random.key_data(c)  # a typed PRNG key closed over (a break-it find)
    lines.append(f"const {np.asarray(c).dtype}{np.shape(c)} {hash(np.asarray(c).tobytes())}")
  return lines
