"""The stage invariants KernelGraph.verify checks: what each stage of the
pipeline has decided on the graph (kernels, places and transfers,
partitions, streams, the memory plan), each as a check that returns what is
wrong, or None. A check of a stage holds after it and after every later
pass, unless a later stage's own passes remake that decision."""
from jaxsession.graph.ir import Literal
from jaxsession.graph.op_properties import facts, home as home_of
from jaxsession.graph.text import node_where


def _every_node_has_a_kernel(graph):
  node = next((n for n in graph.nodes if n.kernel is None), None)
  return node and f"{node_where(node)} has no kernel"


def _every_node_has_a_place(graph):
  for node in graph.nodes:
    if node.place not in ("device", "host"):
      return f"{node_where(node)} has no place (place={node.place!r})"
    if node.kernel is not None and (node.kernel.backend == "host") != (node.place == "host"):
      return (f"{node_where(node)} is placed on the {node.place} with kernel "
              f"{node.kernel.name} ({node.kernel.backend})")
  return None


def _transfer(op):
  """A transfer op's direction ("d2h"/"h2d") from the op table, else None."""
  return facts(op).transfer


def _transfers_at_every_edge(graph):
  homes = {}  # value -> home_of(value): each value is read by several nodes
  for node in graph.nodes:
    kind = _transfer(node.op)  # a transfer reads from the side it copies from
    want = node.place if kind is None else "device" if kind == "d2h" else "host"
    for value in node.inputs:
      if isinstance(value, Literal):
        continue
      home = homes.get(value, homes)
      if home is homes:
        home = homes[value] = home_of(value)
      if home is not None and home != want:
        return (f"{node_where(node)} on the {node.place} reads {value}, which lives on the "
                f"{home}, without a transfer")
  for i, (_, new) in enumerate(graph.state_updates()):
    if not isinstance(new, Literal) and home_of(new) == "host":
      return f"the new value {new} of state {i} lives on the host, without a transfer"
  return None


def _partitions_cover_the_nodes(graph):
  if graph.partitions is None:
    return "the graph has no partitions"
  members = [n for p in graph.partitions for n in p.nodes]
  if len(members) != len(graph.nodes) or any(a is not b for a, b in zip(members, graph.nodes)):
    missing = next((n for n in graph.nodes if all(n is not m for m in members)), None)
    return ("the partitions are not the node list in order"
            + (f": {node_where(missing)} is in none" if missing is not None else ""))
  part = next((p for p in graph.partitions if any(n.place != p.place for n in p.nodes)), None)
  return part and f"partition #{part.index} ({part.place}) holds a node of another place"


def _every_node_has_a_stream(graph):
  node = next((n for n in graph.nodes if n.stream is None), None)
  if node is not None:
    return f"{node_where(node)} has no stream"
  for part in graph.partitions or ():
    node = next((n for n in part.nodes if n.stream != part.stream), None)
    if node is not None:
      return (f"{node_where(node)} has stream {node.stream}, its partition "
              f"#{part.index} {part.stream}")
  return None


def _a_memory_plan(graph):
  return None if graph.memory is not None else "the graph has no memory plan"


# what holds after each stage (and after every later pass, unless a later
# stage's own passes remake that decision: place_nodes picks the kernels of
# the nodes a HardwareOptimize rewrite makes)
STAGE_INVARIANTS = {
    "SelectKernel": (_every_node_has_a_kernel,),
    "HardwareOptimize": (_every_node_has_a_kernel, _every_node_has_a_place,
                         _transfers_at_every_edge, _partitions_cover_the_nodes),
    "AssignStream": (_every_node_has_a_stream,),
    "AllocateMemory": (_a_memory_plan,),
}
