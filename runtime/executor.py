"""The executor: runs the built steps in order and commits state at the end.

Every runner has `call(args) -> user outputs`. It reads the state
leaves from the slots it is bound to and writes the new ones back only after
the whole run succeeded, so a failed run leaves the state as it was.
  * FastRunner: one device partition - a single compiled call whose argument
    checks are done by the executable itself (the fast path);
  * PlanRunner: several partitions - eval_jaxpr's loop over steps.
"""
import jax
import numpy as np
from jax import tree_util

from jaxsession.ir import Literal
from jaxsession.lowering import lower_graph
from jaxsession.runtime.build import callback_failure, compile_fn, dispatch_fn, shape_struct
from jaxsession.runtime.state import owned_copy


class StateLayout:
  """How state leaves travel: which are donated, kept and updated, and the
  (slot, leaf index) each flat state leaf lives in."""

  def __init__(self, graph, plan, leaf_slots):
    states = graph.inputs_of_kind("state")
    donated = plan.donated_ids()
    self.leaf_slots = leaf_slots
    self.num_state = len(states)
    # outputs[:num_outputs] hold new state values (0 for a graph that only reads)
    self.num_outputs = len(graph.state_updates())
    self.donated_idx = [i for i, s in enumerate(states) if s.id in donated]
    self.kept_idx = [i for i, s in enumerate(states) if s.id not in donated]
    self.updated_idx = [i for i, (s, new) in enumerate(graph.state_updates())
                        if new is not s]
    self.state_avals = [s.aval for s in states]
    self._donated_refs = [leaf_slots[i] for i in self.donated_idx]
    self._kept_refs = [leaf_slots[i] for i in self.kept_idx]
    self._updated_refs = [leaf_slots[i] for i in self.updated_idx]
    self.slots = list(dict.fromkeys(slot for slot, _ in leaf_slots))
    # The usual training step: every leaf donated and updated. Then whole slots
    # travel as tuples and are replaced whole, the cheapest way in and out.
    everything = list(range(self.num_state))
    self.slotwise = bool(everything) and self.donated_idx == everything == self.updated_idx

  def gather(self):
    """The current (donated, kept) state leaves, read from the slots."""
    return (tuple(slot.leaves[j] for slot, j in self._donated_refs),
            tuple(slot.leaves[j] for slot, j in self._kept_refs))

  def gather_all(self):
    return [slot.leaves[j] for slot, j in self.leaf_slots]

  def commit(self, updated):
    """Writes the new values of the updated leaves (in updated_idx order)."""
    changed = {}
    for (slot, j), value in zip(self._updated_refs, updated):
      changed.setdefault(slot, list(slot.leaves))[j] = value
    for slot, leaves in changed.items():
      slot.leaves = tuple(leaves)

  def merge(self, donated, kept):
    leaves = [None] * self.num_state
    for i, x in zip(self.donated_idx, donated):
      leaves[i] = x
    for i, x in zip(self.kept_idx, kept):
      leaves[i] = x
    return leaves

  def structs(self):
    return (tuple(shape_struct(self.state_avals[i]) for i in self.donated_idx),
            tuple(shape_struct(self.state_avals[i]) for i in self.kept_idx))


def const_structs(consts):
  return tuple(jax.ShapeDtypeStruct(np.shape(c), c.dtype) for c in consts)


def arg_structs(spec, leading=None):
  """ShapeDtypeStruct pytrees for the run arguments (optionally with a leading
  steps axis)."""
  lead = () if leading is None else (leading,)
  out = []
  for treedef, avals in zip(spec.treedefs, spec.avals):
    leaves = [jax.ShapeDtypeStruct(lead + tuple(a.shape), a.dtype,
                                   weak_type=getattr(a, "weak_type", False)) for a in avals]
    out.append(tree_util.tree_unflatten(treedef, leaves))
  return out


class Runner:
  """Base of the runners: `runner(args)` is `runner.call(args)`."""

  def __call__(self, args):
    return self.call(args)


def _split(items, sizes):
  it = iter(items)
  return tuple(tuple(next(it) for _ in range(n)) for n in sizes)


def graph_body(graph, layout, rest_tree):
  """fn(state_leaves, consts, args) -> (updated state leaves, user outputs)."""
  body = lower_graph(graph)
  k = layout.num_outputs

  def step(state, consts, args):
    outs = body(*state, *tree_util.tree_leaves(args), *consts)
    return ([outs[i] for i in layout.updated_idx],
            tree_util.tree_unflatten(rest_tree, outs[k:]))
  return step


class FastRunner(Runner):
  """A graph that is one device partition: one executable call per run.

  The executable takes (donated state, kept state, consts, *args) with the
  empty groups left out, so a stateless graph's call is the bare executable.
  """

  def __init__(self, graph, plan, spec, rest_tree, consts, partition, layout,
               example_args):
    self.layout = layout
    self.spec = spec
    self.partition = partition
    self.may_fail = bool(partition and partition.may_fail)
    step = graph_body(graph, layout, rest_tree)
    groups = [g for g, present in (("donated", layout.donated_idx),
                                   ("kept", layout.kept_idx),
                                   ("consts", consts)) if len(present)]

    self._updates = bool(layout.updated_idx)

    def whole_step(*xs):
      given = dict(zip(groups, xs))
      state = layout.merge(given.get("donated", ()), given.get("kept", ()))
      new, out = step(state, given.get("consts", ()), xs[len(groups):])
      return (tuple(new), out) if self._updates else out

    donated_s, kept_s = layout.structs()
    structs = {"donated": donated_s, "kept": kept_s, "consts": const_structs(consts)}
    self._groups = groups
    self._consts = consts
    self._bare = not groups  # no state, no consts: args go straight in
    self._slots = layout.slots if layout.slotwise else None
    if self._slots:
      # group 0 is then a tuple of per-slot leaf tuples, and so is the new state
      sizes = [len(slot.leaves) for slot in self._slots]
      flat_step = whole_step

      def whole_step(slot_leaves, *xs):
        new, out = flat_step(tuple(x for leaves in slot_leaves for x in leaves), *xs)
        return _split(new, sizes), out
      structs["donated"] = _split(donated_s, sizes)
    all_structs = [structs[g] for g in groups] + arg_structs(spec)
    donate = (0,) if layout.donated_idx else ()
    if self.may_fail:  # a warm-up would run the user's callbacks: compile ahead
      self.exe = compile_fn(whole_step, all_structs, donate)
    else:
      self.exe = dispatch_fn(whole_step, all_structs, donate,
                             self._warm_args(example_args))
    # the call that `run` makes, chosen once for this graph's shape of state
    self.call = (self._call_slotwise if self._slots else
                 self._call_bare if self._bare else self._call_general)

  def _warm_args(self, example_args):
    """Copies of the state (the warm-up may donate them), consts, examples."""
    donated, kept = self.layout.gather()
    if self._slots:
      donated = tuple(tuple(owned_copy(x) for x in slot.leaves) for slot in self._slots)
    else:
      donated = tuple(owned_copy(x) for x in donated)
    copies = {"donated": donated, "kept": kept, "consts": self._consts}
    return [copies[g] for g in self._groups] + list(example_args)

  def _prefix(self):
    donated, kept = self.layout.gather()
    given = {"donated": donated, "kept": kept, "consts": self._consts}
    return [given[g] for g in self._groups]

  def _call_slotwise(self, args):
    """The usual training step: whole slots in, whole slots out."""
    slots = self._slots
    prefix = [tuple([slot.leaves for slot in slots])]
    if len(self._groups) > 1:
      prefix.append(self._consts)
    try:
      new, out = self.exe(*prefix, *args)
    except TypeError:
      new, out = self._retry(prefix, args)
    except jax.errors.JaxRuntimeError as exc:
      raise self._explain(exc)
    for slot, leaves in zip(slots, new):
      slot.leaves = leaves
    return out

  def _call_bare(self, args):
    """No state, no consts: the arguments go straight to the executable."""
    try:
      return self.exe(*args)
    except TypeError:
      return self._retry((), args)
    except jax.errors.JaxRuntimeError as exc:
      raise self._explain(exc)

  def _call_general(self, args):
    prefix = self._prefix()
    try:
      result = self.exe(*prefix, *args)
    except TypeError:
      result = self._retry(prefix, args)
    except jax.errors.JaxRuntimeError as exc:
      raise self._explain(exc)
    if not self._updates:
      return result
    self.layout.commit(result[0])
    return result[1]

  def _retry(self, prefix, args):
    """The executable checks argument types before it consumes anything, so
    nothing was donated: find what is wrong (InputError) or convert Python
    scalars, and try once more."""
    return self.exe(*prefix, *self.spec.conform(args))

  def _explain(self, exc):
    return callback_failure(self.partition, exc) if self.may_fail else exc


class PlanRunner(Runner):
  """Several partitions: device executables with host steps between them."""

  def __init__(self, graph, steps, spec, rest_tree, consts, layout):
    self.steps = steps
    self.spec = spec
    self.rest_tree = rest_tree
    self.consts = consts
    self.layout = layout
    self.state_ids = [v.id for v in graph.inputs_of_kind("state")]
    self.input_ids = [v.id for v in graph.inputs_of_kind("input")]
    self.const_ids = [v.id for v in graph.inputs_of_kind("const")]
    self.outputs = list(graph.outputs)

  def run_flat(self, state_leaves, user_leaves):
    env = dict(zip(self.state_ids, state_leaves))
    env.update(zip(self.input_ids, user_leaves))
    env.update(zip(self.const_ids, self.consts))
    for step in self.steps:
      outs = step.fn(*[env[i] for i in step.in_ids])
      env.update(zip(step.out_ids, outs))
      for vid in step.free_after:
        env.pop(vid, None)
    return [jax.numpy.asarray(v.value, v.aval.dtype) if isinstance(v, Literal)
            else env[v.id] for v in self.outputs]

  def step_once(self, state_leaves, args):
    """One run on the given state leaves; returns (new state leaves, outputs)
    without committing anything."""
    outs = self.run_flat(state_leaves, tree_util.tree_leaves(args))
    new_state = list(state_leaves)
    for i in self.layout.updated_idx:
      new_state[i] = outs[i]
    return new_state, tree_util.tree_unflatten(self.rest_tree,
                                               outs[self.layout.num_outputs:])

  def call(self, args):
    args = self.spec.conform(args)
    new_state, out = self.step_once(self.layout.gather_all(), args)
    self.layout.commit([new_state[i] for i in self.layout.updated_idx])
    return out
