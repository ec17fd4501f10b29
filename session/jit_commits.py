"""Which outputs of a jaxsession.jit call jax.jit commits to their device,
and the outputs recommitted so: where an argument the program uses (as
jax.jit's DCE tells) is committed, where the program lays values out itself
or runs on a mesh; never otherwise."""
import jax
from jax import tree_util

from jaxsession.jax_api import ARRAY, context_meshes
from jaxsession.runtime.state import with_weak_type


def _commits(graph, committed):
  """Whether jax.jit commits the outputs of this call: where the program
  lays out values itself or runs on a mesh (the session's, or a context
  mesh: jax.jit's outputs over several devices, committed - uncommitted
  they failed the next op, a break-it find), or where an argument the
  program uses is committed (it drops the unused ones first; a review's
  find). `committed`: per input leaf of the graph, in its input order,
  whether it is a committed array."""
  if graph.lays_out or graph.mesh is not None or _in_context_mesh():
    return True
  inputs = graph.inputs_of_kind("input")
  if len(inputs) != len(committed):  # not one input per leaf: any committed one
    return any(committed)
  read = graph.read_before_rewrites  # as jax.jit's DCE leaves them: x * 0 reads x
  if read is not None:  # (a review's find: int x * 0 was simplified away, x unused)
    return any(c and v.id in read for c, v in zip(committed, inputs))
  returned = {id(v) for v in graph.outputs}  # (no jax DCE to ask: the final graph's)
  return any(c and (v.users or id(v) in returned) for c, v in zip(committed, inputs))


def to_fix(graph, committed):
  """How a js.jit call commits the outputs of a signature (`committed`: per
  input leaf of the graph, whether it is a committed array): None where the
  session returns them as jax.jit does already - uncommitted, as its
  executables return them - and no pass over them is needed (~0.1 µs a
  leaf, benchmarks/dispatch.py's js.jit rows); else whether jax.jit commits
  them (a host op's output is committed: an uncommitted call recommits it)."""
  committed = _commits(graph, committed)
  if committed or any(node.place == "host" for node in graph.nodes):
    return committed
  return None


def _in_context_mesh():
  """Whether jax.jit takes a context mesh now (jax.set_mesh's, or an
  abstract one with an explicit axis) and so commits its outputs."""
  concrete, abstract = context_meshes()
  return (concrete is not None and not concrete.empty) or (
      abstract is not None and not abstract.empty and
      any(t == jax.sharding.AxisType.Explicit for t in abstract.axis_types))


def as_jit(out, committed):
  """`out` with each array committed as jax.jit commits its outputs: where
  an argument was committed (a device_put one), else not (a later op may
  move it). The session's own outputs are on its device either way, a host
  op's result committed, an executable's not; a PRNG key array as its
  data is (it stayed uncommitted: a break-it find)."""
  leaves = tree_util.tree_leaves(out)
  if all(not isinstance(x, jax.Array) or x.committed == committed for x in leaves):
    return out
  return tree_util.tree_map(lambda x: _recommitted(x, committed), out)


def _recommitted(x, committed):
  if type(x) is ARRAY:
    return with_weak_type(x, x.weak_type, committed)
  if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) \
      and x.committed != committed:
    data = jax.random.key_data(x)
    return jax.random.wrap_key_data(with_weak_type(data, data.weak_type, committed),
                                    impl=jax.random.key_impl(x))
  return x
