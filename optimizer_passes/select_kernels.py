"""select_kernels (SelectKernel): writes `node.kernel` on every node.

XLA or, on GPU, Pallas kernels, by backend, platform, dtype and shape (the
kernel registry's priorities). Host kernels are chosen by placement, which
knows where a node runs - except for a node no device kernel takes: it gets
its host kernel here (place_nodes then puts it on the host). A node no kernel
takes at all may run narrowed from int64 to int32 where that is exact
(reduce_precision.py); else KernelSelectError lists every candidate.

Needs Optimize before it: the fusions make the fused ops the kernels are
chosen for. place_nodes uses the same rule (`choose_kernels`) for the nodes a
HardwareOptimize rewrite makes.
"""
from jaxsession.errors import KernelSelectError
from jaxsession.kernels import registry
from jaxsession.optimizer_passes import reduce_precision as precision
from jaxsession.optimizer_passes.base import Pass, PassResult

DEVICE_BACKENDS = ("xla", "pallas")


def choose_kernels(graph, nodes, ctx):
  """Writes the kernel of each of `nodes` (of `graph`), then of the casts the
  int32 rule put around them; whether anything changed."""
  changed = False
  for node in nodes:
    try:
      kernel = registry.select_kernel(node, ctx.platform, backends=DEVICE_BACKENDS)
    except KernelSelectError as error:
      kernel = _host_only(node) or _narrow_to_int32(graph, node, ctx, error)
      changed |= kernel.backend != "host"
    changed |= node.kernel is not kernel
    node.kernel = kernel
  casts = [n for n in graph.nodes if n.kernel is None] if changed else []
  if casts:  # the int32 rule's, around a narrowed node
    choose_kernels(graph, casts, ctx)
  return changed


def _host_only(node):
  """A host kernel for a node no device kernel takes (place_nodes then puts
  it on the host), or None."""
  try:
    kernel = registry.select_kernel(node, "host", backends=("host",))
  except KernelSelectError:
    return None
  node.notes.append(f"kernel {kernel.name}: no device kernel takes this node")
  return kernel


def _narrow_to_int32(graph, node, ctx, error):
  """Reduce precision: int64 -> int32 casts around `node`, if exact; else the
  original error, with the reason the rule did not apply."""
  refusal = precision.narrowing_refusal(node, graph.const_values)
  if refusal is None:
    try:
      kernel = registry.select_kernel(precision.narrowed_view(node), ctx.platform,
                                      backends=DEVICE_BACKENDS)
    except KernelSelectError as narrowed_error:
      refusal = f"no kernel takes the int32 form either:\n{narrowed_error}"
  if refusal is not None:
    raise KernelSelectError(f"{error}\nreduce precision (int64 -> int32) not applied: "
                            f"{refusal}") from None
  precision.insert_casts(graph, node)
  return kernel


class SelectKernels(Pass):
  name = "select_kernels"
  required = True  # every node needs a kernel
  annotates = True

  def run(self, graph, ctx):
    return PassResult(choose_kernels(graph, list(graph.nodes), ctx))
