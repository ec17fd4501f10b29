"""insert_transfers (HardwareOptimize): an explicit node wherever a value
crosses places.

One transfer per value per direction, whatever the number of readers, placed
just before the first reader on the other side, so it joins that reader's
partition and adds none:
  * transfer_d2h (host-placed): a device value read by host nodes - graph
    inputs and state live on the device, constants everywhere;
  * transfer_h2d (device-placed): a host value read by device nodes; inside
    the executable it is the argument itself, so the call copies it in;
  * transfer_h2d (host-placed): a host value that becomes state, which lives on
    the device, with no device reader to carry it (an explicit device_put);
    with one, the state slot takes the device reader's copy.
A graph output stays where it was produced: no copy for an output made on the
host. Each transfer records the node that made it necessary
(`params["caused_by"]`) and says why in its note.

Needs place_nodes and the final node order before it.
"""
from jaxsession.graph import op_properties
from jaxsession.graph.ir import Literal
from jaxsession.kernels import registry
from jaxsession.optimizer_passes.base import Pass, PassResult

def _transfer(graph, op, value, place, caused_by, note, platform):
  node = graph.make_node(op, None, {"caused_by": caused_by.id}, [value], [value.aval])
  node.place = place
  node.kernel = registry.select_kernel(
      node, "host" if place == "host" else platform,
      backends=("host",) if place == "host" else ("xla",))
  node.notes.append(note)
  return node


class InsertTransfers(Pass):
  name = "insert_transfers"
  required = True

  def run(self, graph, ctx):
    position = {id(n): i for i, n in enumerate(graph.nodes)}
    inserts = []  # (position to insert before, node)
    for value in list(graph.values()):
      if isinstance(value, Literal):
        continue
      home = op_properties.home(value)
      if home is None or (value.producer is not None and op_properties.is_transfer(value.producer.op)):
        continue  # a transfer's result is on the side its readers are
      other = "host" if home == "device" else "device"
      readers = [u for u in dict.fromkeys(value.users)
                 if u.place == other and not op_properties.is_transfer(u.op)]
      if readers:
        readers.sort(key=lambda n: position[id(n)])
        first = readers[0]
        op = op_properties.transfer_op("d2h" if home == "device" else "h2d")
        note = (f"{op[9:]} of {value}: read on the {other} by node(s) "
                + ", ".join(f"{n.id} '{n.label}'" for n in readers))
        node = _transfer(graph, op, value, other, first, note, ctx.platform)
        moved = node.outputs[0]
        for reader in readers:
          reader.inputs = [moved if v is value else v for v in reader.inputs]
          moved.users.extend(reader for v in reader.inputs if v is moved)
        value.users = [u for u in value.users if u not in readers]
        inserts.append((position[id(first)], node))
        if op_properties.is_transfer(op, "h2d"):
          carried = node.outputs[0]  # the executable also returns it for the state slot
      if home == "host":
        inserts.extend(self._state_transfers(graph, value, position, ctx.platform,
                                             carried if readers else None))
    if not inserts:
      return PassResult(False)
    for pos, node in sorted(inserts, key=lambda item: -item[0]):  # back to front
      graph.insert_node(pos, node)
    return PassResult(True)

  @staticmethod
  def _state_transfers(graph, value, position, platform, carried):
    """A host value that is a new state value lives on the device: the state
    slot reads the copy a device reader already has made (`carried`), or a
    host-placed h2d right after its producer when there is none."""
    slots = [i for i, (_, new) in enumerate(graph.state_updates()) if new is value]
    if not slots:
      return []
    inserts = []
    if carried is None:
      producer = value.producer
      node = _transfer(graph, op_properties.transfer_op("h2d"), value, "host", producer,
                       f"h2d of {value}: new value of state {slots}, which lives on the "
                       "device", platform)
      carried = node.outputs[0]
      inserts.append((position[id(producer)] + 1, node))
    else:
      carried.producer.notes.append(f"also the new value of state {slots}")
    outputs = list(graph.outputs)
    for i in slots:
      outputs[i] = carried
    graph.outputs = outputs
    return inserts
