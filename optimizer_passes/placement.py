"""place_nodes (HardwareOptimize): decides where each node runs.

Every node runs on the device except those a placement rule sends to the host.
A `pure_callback` runs its Python function anyway, so calling it on numpy arrays
between two executables costs less than a callback from inside one (DESIGN.md:
10 µs vs 64 µs on CPU). Nodes with effects stay on the device: moving them
could reorder what the user observes. Needs SelectKernel before it (a node goes
to the host only if a host kernel exists for it).
"""
from jaxsession.kernels import registry
from jaxsession.optimizer_passes.base import Pass, PassResult


def _host_callback(node, ctx):
  """pure_callback without effects, with a host kernel, host placement allowed."""
  if node.props.effects or not getattr(ctx.options, "host_callbacks", True):
    return None
  try:
    return registry.select_kernel(node, "host", backends=("host",))
  except Exception:
    return None


# op -> rule(node, ctx) returning the host kernel to use, or None to stay on device
HOST_RULES = {
    "pure_callback": _host_callback,
}


class PlaceNodes(Pass):
  name = "place_nodes"

  def run(self, graph, ctx):
    changed = False
    for node in graph.nodes:
      rule = HOST_RULES.get(node.op)
      kernel = rule(node, ctx) if rule else None
      place = "host" if kernel is not None else "device"
      if kernel is not None:
        node.kernel = kernel
        node.notes.append("placed on host: the callback runs between executables, "
                          "not as a callback from inside one")
      changed |= node.place != place
      node.place = place
    return PassResult(changed)
