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
"""
import threading

import jax
from absl import logging
from jax import tree_util

from jaxsession.errors import InputError
from jaxsession.runtime import buckets as policy_lib


class BucketedGraph:
  """Dispatch for one bucketed graph (the Session keeps one per graph id)."""

  def __init__(self, session, name, compile_one, positions, run_index, policy, options):
    self.session = session
    self.name = name
    self.compile_one = compile_one    # (size, check_graph) -> sub-graph id
    self.positions = positions        # bucketed positions of fn
    self.run_index = run_index        # those positions among run's arguments
    self.policy = policy
    self.options = options
    self.sizes = {}                   # compiled size -> sub-graph id
    self.output_axes = None           # per run output leaf: the row axis or None
    self.verdict = None
    self.lock = threading.Lock()

  # -- compile --------------------------------------------------------------
  def check_graph(self, graph, spec):
    """The padding analysis on the first imported graph: InputError naming
    every node that mixes rows; else the row axis of every run output."""
    dynamic, first = {}, 0
    leaf_ids = [v.id for v in graph.inputs_of_kind("input")]
    for i, avals in enumerate(spec.avals):
      if i in self.run_index:
        for j, aval in enumerate(avals):
          if not aval.shape:
            raise InputError(f"compile({self.name}): bucketed argument at position "
                             f"{spec.positions[i]} has a scalar leaf "
                             f"{spec.paths[i][j] or '(root)'}: nothing to pad")
          dynamic[leaf_ids[first + j]] = 0
      first += len(avals)
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
    return "traced only"

  def executable(self, size):
    """The sub-graph id for `size`, compiled on first use."""
    gid = self.sizes.get(size)
    if gid is not None:
      return gid
    with self.lock:
      gid = self.sizes.get(size)
      if gid is None:
        gid = self.sizes[size] = self.compile_one(size, None)
        self._warn_recompiles(size)
    return gid

  def compile_first(self, size, probe):
    """The padding analysis on a trace at `probe` rows (at least 2, and a size
    no other axis of the example has, so a row axis cannot pass for another
    or for a broadcast), then the first bucket."""
    self.compile_one(probe, self.check_graph)
    self.sizes[size] = self.compile_one(size, None)

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
          "position(s) %s (recompile_warn_limit=%d), the latest %d; sizes %s. Give "
          "buckets covering them, or 'auto'.", self.name, len(self.sizes),
          sorted(self.positions), limit, size, sorted(self.sizes))

  # -- run ------------------------------------------------------------------
  def batch_size(self, args, axis):
    sizes = set()
    for i in self.run_index:
      if i >= len(args):
        return None  # run reports the arity
      for leaf in tree_util.tree_leaves(args[i]):
        shape = jax.numpy.shape(leaf)
        if len(shape) <= axis:
          raise InputError(f"run(graph '{self.name}'): bucketed argument {i} has a leaf "
                           f"of shape {list(shape)}: no batch axis {axis}")
        sizes.add(shape[axis])
    if len(sizes) > 1:
      raise InputError(f"run(graph '{self.name}'): the bucketed arguments disagree on "
                       f"the batch size: {sorted(sizes)}")
    return sizes.pop() if sizes else None

  def run(self, args, steps=None):
    axis = 0 if steps is None else 1
    n = self.batch_size(args, axis)
    if n is None:  # the arity is wrong: the first executable's run says how
      return self.session.run(next(iter(self.sizes.values())), *args, steps=steps)
    size = self.policy.target(n)
    gid = self.executable(size)
    if size != n:
      args = tuple(tree_util.tree_map(lambda x: policy_lib.pad_rows(x, size, axis), a)
                   if i in self.run_index else a for i, a in enumerate(args))
    out = self.session.run(gid, *args, steps=steps)
    if size == n:
      return out
    leaves, treedef = tree_util.tree_flatten(out)
    leaves = [x if ax is None else policy_lib.slice_rows(x, n, ax + axis)
              for x, ax in zip(leaves, self.output_axes)]
    return tree_util.tree_unflatten(treedef, leaves)

  def call(self, args):
    return self.run(args)

  def describe(self):
    compiled = sorted(self.sizes)
    return f"{self.policy.describe()}; compiled sizes {compiled}"


def compile_bucketed(session, fn, example_args, kwargs, name, buckets, max_buckets, hint,
                     run_positions):
  """Session.compile with buckets: checks the spec, compiles the example's
  bucket (running the padding analysis on its graph), and returns the id of
  a dispatching entry whose state is the sub-graphs' shared state."""
  checked, hint = policy_lib.check_spec(buckets, run_positions, max_buckets, hint)
  name = name or getattr(fn, "__name__", "graph")
  positions = sorted(checked)
  run_index = [run_positions.index(p) for p in positions]
  sizes = {jax.numpy.shape(leaf)[0] if jax.numpy.ndim(leaf) else None
           for p in positions for leaf in tree_util.tree_leaves(example_args[p])}
  if None in sizes or len(sizes) != 1:
    raise InputError(f"compile({name}): the bucketed example args at positions "
                     f"{positions} need one shared leading (batch) axis; their leading "
                     f"sizes are {sorted(s for s in sizes if s is not None)}"
                     + (" and some leaves are scalars" if None in sizes else ""))
  n0 = sizes.pop()
  policy = policy_lib.BucketPolicy.make(checked[positions[0]], max_buckets, hint)
  first_gid = []

  def compile_one(size, check_graph):
    examples = list(example_args)
    for p in positions:
      examples[p] = tree_util.tree_map(
          lambda x: jax.ShapeDtypeStruct((size,) + tuple(jax.numpy.shape(x))[1:],
                                         jax.numpy.result_type(x),
                                         weak_type=getattr(x, "weak_type", False)),
          example_args[p])
    options = dict(kwargs)
    if first_gid:
      options["state_from"] = first_gid[0]
    gid = session._compile(fn, tuple(examples), name=f"{name}[batch {size}]",
                           check_graph=check_graph, **options)
    if gid is not None and not first_gid:
      first_gid.append(gid)
    return gid

  dispatcher = BucketedGraph(session, name, compile_one, positions, run_index, policy,
                             session.options)
  first = n0
  if policy.sizes is not None:
    larger = [b for b in policy.sizes if b >= n0]
    first = larger[0] if larger else n0
  other = {d for i, arg in enumerate(example_args) for leaf in tree_util.tree_leaves(arg)
           for d in tuple(getattr(leaf, "shape", ()))[1 if i in positions else 0:]}
  probe = max([2, n0] + list(policy.sizes or []))
  while probe in other:
    probe += 1
  dispatcher.compile_first(first, probe)
  if session.options.precompile_buckets:
    dispatcher.precompile()
  return session._bucketed_entry(name, first_gid[0], dispatcher)
