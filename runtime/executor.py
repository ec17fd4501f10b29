"""The executor: runs the built steps in order and commits state at the end.

Two runners share one contract, `runner(state_leaves, args) -> (new state
leaves or None per state leaf, user outputs)`, and neither touches session
state: the Session commits what they return only after the whole run
succeeded, so a failed run leaves the state as it was.
  * FastRunner: one device partition - a single compiled call, pytree checks
    done by the executable itself (the fast path);
  * PlanRunner: several partitions - eval_jaxpr's loop over steps.
"""
import jax
import numpy as np
from jax import tree_util

from jaxsession.errors import HostOpError
from jaxsession.ir import Literal
from jaxsession.lowering import lower_graph
from jaxsession.runtime.build import compile_fn, shape_struct


class StateLayout:
  """How state leaves travel: which are donated, kept, updated."""

  def __init__(self, graph, plan):
    updates = graph.state_updates()
    donated = plan.donated_ids()
    self.num_state = len(updates)
    self.donated_idx = [i for i, (s, _) in enumerate(updates) if s.id in donated]
    self.kept_idx = [i for i, (s, _) in enumerate(updates) if s.id not in donated]
    self.updated_idx = [i for i, (s, new) in enumerate(updates) if new is not s]
    self.state_avals = [s.aval for s, _ in updates]

  def split(self, leaves):
    return (tuple(leaves[i] for i in self.donated_idx),
            tuple(leaves[i] for i in self.kept_idx))

  def merge(self, donated, kept):
    leaves = [None] * self.num_state
    for i, x in zip(self.donated_idx, donated):
      leaves[i] = x
    for i, x in zip(self.kept_idx, kept):
      leaves[i] = x
    return leaves

  def structs(self, consts):
    return (tuple(shape_struct(self.state_avals[i]) for i in self.donated_idx),
            tuple(shape_struct(self.state_avals[i]) for i in self.kept_idx),
            tuple(jax.ShapeDtypeStruct(np.shape(c), c.dtype) for c in consts))


class FastRunner:
  """A graph that is one device partition: one executable call per run."""

  def __init__(self, graph, plan, spec, rest_tree, consts, partition):
    self.layout = layout = StateLayout(graph, plan)
    self.consts = consts
    self.spec = spec
    self.partition = partition
    body = lower_graph(graph)
    k = layout.num_state

    def whole_step(donated, kept, consts, *args):
      outs = body(*layout.merge(donated, kept), *tree_util.tree_leaves(args), *consts)
      new_state = tuple(outs[i] for i in layout.updated_idx)
      return new_state, tree_util.tree_unflatten(rest_tree, outs[k:])

    structs = [shape_struct(a) for a in spec.flat_avals()]
    arg_structs = [tree_util.tree_unflatten(t, structs[o:o + len(a)])
                   for t, a, o in _offsets(spec)]
    self.exe = compile_fn(whole_step, (*layout.structs(consts), *arg_structs),
                          donate_argnums=(0,) if layout.donated_idx else ())

  def __call__(self, state_leaves, args):
    layout = self.layout
    donated, kept = layout.split(state_leaves)
    try:
      new, out = self.exe(donated, kept, self.consts, *args)
    except TypeError:
      # The executable checks argument types before it consumes anything, so
      # nothing was donated; find what is wrong (InputError) or convert
      # Python scalars and try once more.
      new, out = self.exe(donated, kept, self.consts, *self.spec.conform(args))
    except jax.errors.JaxRuntimeError as exc:
      if not self.partition.may_fail:
        raise
      raise HostOpError(f"a callback in the graph raised: "
                        f"{str(exc).splitlines()[0]}") from exc
    updated = [None] * layout.num_state
    for i, x in zip(layout.updated_idx, new):
      updated[i] = x
    return updated, out


def _offsets(spec):
  offset = 0
  for treedef, avals in zip(spec.treedefs, spec.avals):
    yield treedef, avals, offset
    offset += len(avals)


class PlanRunner:
  """Several partitions: device executables with host steps between them."""

  def __init__(self, graph, steps, spec, rest_tree, consts):
    self.steps = steps
    self.spec = spec
    self.rest_tree = rest_tree
    self.consts = consts
    self.num_state = len(graph.inputs_of_kind("state"))
    self.state_ids = [v.id for v in graph.inputs_of_kind("state")]
    self.input_ids = [v.id for v in graph.inputs_of_kind("input")]
    self.const_ids = [v.id for v in graph.inputs_of_kind("const")]
    self.outputs = list(graph.outputs)
    updates = graph.state_updates()
    self.updated = [i for i, (s, new) in enumerate(updates) if new is not s]

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

  def __call__(self, state_leaves, args):
    args = self.spec.conform(args)
    outs = self.run_flat(state_leaves, tree_util.tree_leaves(args))
    k = self.num_state
    updated = [None] * k
    for i in self.updated:
      updated[i] = outs[i]
    return updated, tree_util.tree_unflatten(self.rest_tree, outs[k:])
