"""XLA kernels: jax-traceable functions that run inside a compiled executable."""
from jaxsession.kernels.registry import ANY_PRIMITIVE, register_kernel


@register_kernel(ANY_PRIMITIVE, backend="xla", priority=-100, name="xla:bind")
def bind_primitive(node, *args):
  """The default kernel of every primitive: bind it with the node's params;
  XLA lowers it as `jax.jit` would."""
  # get_bind_params: what eval_jaxpr does - some primitives (shard_map) bind
  # with other params than their equations carry.
  out = node.prim.bind(*args, **node.prim.get_bind_params(node.params))
  return list(out) if node.prim.multiple_results else [out]
