"""move_into_readers (HardwareOptimize): device arithmetic that only a later
device partition reads runs in that partition.

`t = a * b` before a host callback and `t + r` after it: jax.jit's one
executable fuses the multiply with the add, and XLA:CPU contracts them into
an FMA (one rounding); two executables round the product first (a break-it
find: a quarter to a half of the elements off, up to thousands of ulp near
zero; `log(exp(a))`, a division by a square root alike). So each device
node of elementwise arithmetic or of data movement XLA fuses through (a
broadcast, reshape, slice, transpose, pad, concatenate, gather; a nested jit
of those) whose readers all run in one later device partition moves into
that run, at the place its id (the user's order) takes among the run's nodes
where its readers allow; the latest nodes go first, so a chain moves whole.
Its inputs come before its old run, so the order stays valid, and it joins
a run of its own place: no partition is added (one it empties goes). XLA
then sees the chain between a partition's boundary values and its reader as
jax.jit's executable has it (tests/host_split_test.py). Each moved node says
so in its notes; the count is in `report.schedule`. A state leaf updated
there is donated to that partition, after the host work that may fail.

A node that stays (a callback, or device work before it, reads it too) is
copied into a later device partition where jax.jit's XLA would see through
it to its readers there (`_seen_through`). XLA's simplifier rewrites an op
through its operand's maker whatever else reads that: a division by a
division, an exp or a power, a division of a division, a power of an exp,
a log of an exp or a power, a product of exps (`(a / b) / c` to
`a / (b * c)`, `log(exp(z))` to `z`: 1-3 ulp off, and a nan where exp
underflows), and gathers array constants (`(x * C) * D`); it meets powers
as jax lowers them (`x ** 2` a product, `x ** -1` a division) and exp2
and sigmoid as an exp and a division (`_as_xla_reads`, `_AS_XLA_MAKES`).
XLA's fusion recomputes data movement and cheap arithmetic reading one
array (a subtraction of a broadcast max, `x * x`, `x * 2`) in each
elementwise reader, with what it fused into that arithmetic's one reader
(`-(x * y)`), where a product then contracts with an add into an FMA, and
a sum after it is another loop. A copy closes: it reads nothing the
partition before it would newly return where that changes its arithmetic
(`closes`: x * y returned beside x * y + 1 lost the FMA there, and the
callback read other bits). The copy reads the node's inputs and computes
what it computes; those readers read the copy (the others the value as
computed before: an exp that a sum reads too is computed once in jax.jit's
executable), so the partition's executable holds the chain as jax.jit's
does. Each copy says so in its notes; the count is in `report.schedule`.
Not copied: a node that divides by a scalar, reads or makes a scalar
divisor, whose rewrite follows how many read the scalar (graph/divisors.py);
a fused op or x ** 3 (XLA computes them once); under a mesh, a fusion's
copy of a value that is not replicated (`_replicated_values`).

Required: exactness is not optional. Needs place_nodes and the final order
(after reorder_for_partitions), before insert_transfers.
"""
import jax.numpy as jnp
import numpy as np

from jaxsession.graph.divisors import divisor_cone
from jaxsession.graph.ir import Literal, Value
from jaxsession.graph.op_properties import facts, moves_or_maps, rewritten_through_one_reader
from jaxsession.optimizer_passes.base import Pass, PassResult
from jaxsession.optimizer_passes.reorder import (ScheduleDecision, count_partitions,
                                                 order_peak, two_queue_order)


def _sinkable(node):
  """Elementwise arithmetic, or data movement XLA fuses through (a product
  broadcast, sliced, transposed or padded into an add still contracts into
  an FMA), or a nested jit of those alone (op_properties.moves_or_maps)."""
  return (node.place == "device" and not node.props.effects and not node.props.may_fail
          and moves_or_maps(node.op, node.params))


def move_into_readers(order):
  """`order` with each movable device node (`_sinkable`) whose readers all
  run in one later device partition moved into that run (latest nodes first,
  so a chain moves whole); (the new order, the moved nodes). The run and its
  new nodes go in the user's order (node ids) where their reads allow
  (`_merged`)."""
  phase = _phases(order)
  into = {}  # phase -> the nodes moved into it
  for node in reversed(order):
    readers = [user for out in node.outputs for user in out.users]
    if not readers or not _sinkable(node) or any(r.place != "device" for r in readers):
      continue
    targets = {phase[id(user)] for user in readers}
    if len(targets) == 1 and next(iter(targets)) > phase[id(node)]:
      phase[id(node)] = targets.pop()
      into.setdefault(phase[id(node)], []).append(node)
  if not into:
    return order, []
  moved = {id(n) for nodes in into.values() for n in nodes}
  runs = {}  # phase -> its nodes that stay, in order (every target run keeps some)
  for node in order:
    if id(node) not in moved:
      runs.setdefault(phase[id(node)], []).append(node)
  out = []
  for q, run in runs.items():  # (dicts keep the phases' order)
    out.extend(_merged(run, into[q]) if q in into else run)
  return out, [n for n in order if id(n) in moved]


def _merged(run, moved):
  """`run` and the nodes `moved` into it, in a topological order that takes
  the smallest node id (the user's order) first among the ready ones
  (reorder.py's schedule over one place)."""
  return two_queue_order(sorted(run + moved, key=lambda n: n.id), "device")


def _phases(order):
  """id(node) -> the index of its run of one place along `order`."""
  phase, k = {}, 0
  for i, node in enumerate(order):
    if i and node.place != order[i - 1].place:
      k += 1
    phase[id(node)] = k
  return phase


def _made_by(value, *ops):
  return isinstance(value, Value) and value.producer is not None and value.producer.op in ops


def _cheap(node):
  """Elementwise arithmetic XLA's fusion may compute again in a reader: not
  a fused op (GeluTanh holds a tanh: a review's find), not a transcendental
  XLA:CPU approximates (those it computes once), not x ** 3 (two products
  XLA keeps apart) nor x ** -1 (a division)."""
  fact = facts(node.op)
  if node.prim is None or not fact.elementwise or fact.approximated:
    return False
  return node.op != "integer_pow" or (node.params.get("y") == 2 and jnp.issubdtype(
      node.outputs[0].aval.dtype, jnp.floating))


def _duplicated(node):
  """Whether XLA's fusion copies `node` into each of its readers: data
  movement, or cheap arithmetic (`_cheap`) reading at most one array of its
  own shape that is not a broadcast (literals, lower-rank operands and
  size-1 axes the op broadcasts - x * c for a column c - are broadcasts),
  or no more bytes than it writes (`x * x`)."""
  if node.prim is not None and facts(node.op).fused_through:
    return True
  if not _cheap(node):
    return False
  out = node.outputs[0].aval
  full = {id(v): v for v in node.inputs if isinstance(v, Value) and v.aval.shape == out.shape
          and not _made_by(v, "broadcast_in_dim", "iota")}
  return len(full) <= 1 or sum(v.aval.size for v in full.values()) <= out.size


def _fused_into_its_reader(value, returned):
  """Whether XLA fuses `value`'s cheap maker into its one reader (every
  user is one node or its copies, and the graph does not return `value`:
  the ids `returned`), a fusion then copied whole with that reader:
  -(x * y) or (x * y).reshape(...) read by a callback and added to after it
  contract into an FMA there, where x * y alone (or returned too: a
  review's find) is computed once."""
  readers = {(u.op, tuple(id(v) for v in u.inputs)) for u in value.users}
  return _cheap(value.producer) and len(readers) == 1 and value.id not in returned


# makers as XLA's simplifier meets them: jax lowers exp2 to an exp of a
# product, and XLA's logistic expander writes 1 / (1 + exp(-x))
_AS_XLA_MAKES = {"exp2": "exp", "logistic": "div"}


def _as_xla_makes(node):
  """`node`'s op as XLA's simplifier meets it (`_AS_XLA_MAKES`; jax lowers
  x ** -n to 1 / x ** n)."""
  if node.op == "integer_pow" and node.params.get("y", 0) < 0:
    return "div"
  if node.op == "mul" and all(_made_by(v, "exp", "exp2") for v in node.inputs):
    return "exp"  # exp(a) * exp(b) is exp(a + b)
  return _AS_XLA_MAKES.get(node.op, node.op)


def _reciprocal(node):
  """Whether `node` is 1 / x as XLA meets it (x ** -n, 1 / x)."""
  if node.op == "integer_pow":
    return node.params.get("y", 0) < 0
  return (node.op == "div" and isinstance(node.inputs[0], Literal)
          and np.all(np.asarray(node.inputs[0].value) == 1))


def _as_xla_reads(reader, value):
  """(op, positions of `value`, the other operands) of `reader` as XLA's
  simplifier meets it: jax lowers x ** 2, x ** 3, x ** -2 and square to
  products of x with itself ("self", over 1 where the power is negative),
  and x ** -1 to 1 / x, and XLA rewrites pow(x, 2.0) and pow(x, -1.0) alike; a fused AddN is the user's adds, the one adding
  `value` to another operand."""
  ins = reader.inputs
  at = [i for i, v in enumerate(ins) if v is value]
  y = reader.params.get("y") if reader.op == "integer_pow" else None
  if reader.op == "pow" and at == [0] and isinstance(ins[1], Literal) and np.ndim(
      ins[1].value) == 0 and float(ins[1].value) in (2.0, -1.0):
    y = int(ins[1].value)  # XLA's simplifier: pow(x, 2) is x * x, pow(x, -1) is 1 / x
  if (reader.op == "square" or (y is not None and abs(y) >= 2)
      or (reader.op == "mul" and all(v is value for v in ins))):
    return "self", at, []
  if y == -1:
    return "div", [1], []
  if reader.op == "AddN":
    for i, j in reader.params["steps"]:
      for a, b in ((i, j), (j, i)):
        if a < len(ins) and ins[a] is value:
          return "add", [0], [ins[b]] if b < len(ins) else []
  return reader.op, at, [v for i, v in enumerate(ins) if i not in at]


def _array_const(v):
  return isinstance(v, Value) and v.kind == "const" and v.aval.ndim > 0


def _scaled(value):
  """Whether XLA sees `value` as x * C for an array constant C: a product by
  one, a quotient by one (XLA writes x / C as x * (1 / C)), the negation of
  such (-(x * C) as x * -C)."""
  node = value.producer if isinstance(value, Value) else None
  if node is None:
    return False
  return ((node.op == "mul" and any(_array_const(v) for v in node.inputs))
          or (node.op == "div" and _array_const(node.inputs[1]))
          or (node.op == "neg" and _scaled(node.inputs[0])))


def _shifted(value):
  """Whether `value` is x + C, x - C or C - x for an array constant C."""
  node = value.producer
  return node.op in ("add", "sub") and any(_array_const(v) for v in node.inputs)


def _reassociated(rop, at, others, reader, value):
  """Whether XLA's simplifier gathers `reader`'s array constants with those
  of `value`'s maker: (x * C) * D is x * (C * D), (x * C) * (x * C) is
  (x * x) * (C * C), (x * C) / D alike, (x + C) + D and
  (x + C) - D is x + (C + D), and -(x * C) is x * -C where only negations
  read x * C (its copies among them) (measured: a full array constant; a
  scalar literal's product is the fusion's copy, `_duplicated`)."""
  if _scaled(value):
    return (rop == "self" or (rop == "neg" and all(u.op == "neg" for u in value.users))
            or (rop == "mul" and any(_array_const(o) or _scaled(o) for o in others))
            or (rop == "div" and at == [0] and _array_const(reader.inputs[1])))
  return _shifted(value) and ((rop == "add" and any(_array_const(o) for o in others))
                              or (rop == "sub" and at == [0]
                                  and _array_const(reader.inputs[1])))


def _rewritten(reader, value):
  """Whether jax.jit's XLA simplifier rewrites `reader` through the node that
  makes `value` (algebraic_simplifier's divide/power/log/multiply rules on
  an operand's producer): exp(a) * exp(a) is exp(a + a), sqrt(a) * sqrt(a)
  is a and rsqrt(a) * rsqrt(a) is 1 / a where XLA knows a >= 0 (a copy
  keeps a's maker beside them: `_duplicated`)."""
  op = _as_xla_makes(value.producer)
  rop, at, others = _as_xla_reads(reader, value)
  return (_reassociated(rop, at, others, reader, value)
          or (rop == "self" and op in ("exp", "sqrt", "rsqrt"))
          or (rop == "div" and ((1 in at and op in ("div", "exp", "pow"))
                                or (0 in at and op == "div")
                                or (0 in at and op == "exp"  # a * exp(-b), then exp(a - b)
                                    and _made_by(reader.inputs[1], "exp", "exp2"))))
          or (rop == "rsqrt" and _reciprocal(value.producer))  # rsqrt(1 / a) is sqrt(a)
          or (rop == "pow" and 0 in at and op == "exp")
          or (rop == "log" and op in ("exp", "pow", "sqrt", "rsqrt"))
          or (rop == "mul" and op == "exp"
              and all(_made_by(v, "exp", "exp2") for v in reader.inputs)))


def _seen_through(reader, value, returned):
  """Whether jax.jit's XLA rewrites (`_rewritten`) or fuses `reader` through
  the node that makes `value` (the fusion's copies of cheap arithmetic into
  an elementwise reader, `_duplicated`, or with the one reader it is fused
  into, `_fused_into_its_reader`; `returned`: the ids of the graph's
  outputs)."""
  if not jnp.issubdtype(value.aval.dtype, jnp.inexact):  # (a PRNG key's is no numpy dtype)
    return False
  rop, at, _ = _as_xla_reads(reader, value)
  if rop == "div" and 1 in at and value.producer.op in ("sqrt", "rsqrt"):
    return False  # a / sqrt(b) becomes a * rsqrt(b) only where sqrt(b) has one reader
  return _rewritten(reader, value) or (moves_or_maps(reader.op, reader.params) and (
      _duplicated(value.producer) or _fused_into_its_reader(value, returned)))


def _divisor_values(graph):
  """The ids of the values a divisor is made of (graph/divisors.py)."""
  nodes, outside = divisor_cone(graph.nodes)
  return outside | {out.id for node in graph.nodes if node.id in nodes for out in node.outputs}


def _copyable(node, readers, divisors):
  """Not a node reading a scalar (a lower-rank value XLA broadcasts) that
  is a divisor or that it divides by, nor one making such a scalar divisor:
  XLA rewrites x / broadcast(s) by how many read s (graph/divisors.py), and
  a copy adds readers on both sides, or leaves the copy one (a review's
  find: exp(sum(x)) divided by and logged)."""
  out = node.outputs[0]
  rank = out.aval.ndim
  if out.id in divisors and any(r.outputs and r.outputs[0].aval.ndim > rank for r in readers):
    return False
  return not any(isinstance(v, Value) and v.aval.ndim < rank
                 and (node.op == "div" or v.id in divisors) for v in node.inputs)


def _replicated_values(graph):
  """Under a mesh, the ids of the values whole on every device: replicated
  inputs and constants, and elementwise arithmetic and data movement of
  such values. jax.jit's SPMD program recomputes such a value in its readers
  as a single device's does; a sharded one it computes once, gathered for
  the callback (a review's find: x * 3 of a sharded x copied into a later
  add was 1 ulp off, of a replicated x not copied too)."""
  known = {v.id for v in graph.inputs if (v.sharding.is_fully_replicated if v.sharding
                                          is not None else v.kind == "const")}
  for node in graph.nodes:
    whole = moves_or_maps(node.op, node.params) and all(
        isinstance(v, Literal) or v.id in known for v in node.inputs)
    for out in node.outputs:
      if out.sharding.is_fully_replicated if out.sharding is not None else whole:
        known.add(out.id)
  return known


def _same_when_returned(value, phase):
  """Whether the partition that computes `value` computes alike when it
  returns `value` too: no reader there rewritten through its maker (nor a
  division by a square root, a rewrite XLA makes only where that has one
  reader), and no add there that contracts with its product into an FMA
  (x * y + 1 where x * y is returned too: a review's find, the callback
  read other bits), and no transpose of a dot there: XLA computes the
  transpose of a dot that one node reads as the dot of the swapped
  operands, and a reduction of it sums in that layout's order (a judge's
  find: a gradient's norm read by a callback, 1 ulp off, where copies of
  the gradients' transposes made the partition return their dots)."""
  maker = value.producer
  product = maker.op in ("mul", "square", "integer_pow")
  for r in value.users:
    if phase[id(r)] != phase[id(maker)]:
      continue
    rop, at, _ = _as_xla_reads(r, value)
    if (_rewritten(r, value) or (product and r.op in ("add", "sub", "add_any", "AddN"))
        or (rop == "div" and 1 in at and maker.op in ("sqrt", "rsqrt"))
        or rewritten_through_one_reader(maker.op, r.op)):
      return False
  return True


def copy_into_readers(graph):
  """Copies each staying device node (`_sinkable`) into every later device
  run where one of its readers sees through it (`_seen_through`) and the
  copy closes (`closes`), before that run's first reader, and points those
  readers at the copy; the latest nodes first, so a copy's own inputs are
  seen with it as a reader. Returns the copies."""
  copies, work = [], list(graph.nodes)
  phase, known, closed = _phases(graph.nodes), {}, {}
  returned = {v.id for v in graph.outputs if isinstance(v, Value)}

  def divisors():
    if "divisors" not in known:
      known["divisors"] = _divisor_values(graph)
    return known["divisors"]

  def wanted(node, readers):
    """Those of `readers` (of one later run) that read `node`'s copy."""
    value = node.outputs[0]
    readers = [r for r in readers if _seen_through(r, value, returned)]
    if not readers or not _copyable(node, readers, divisors()):
      return []
    if graph.mesh is not None and not all(_rewritten(r, value) for r in readers):
      if "replicated" not in known:
        known["replicated"] = _replicated_values(graph)
      if value.id not in known["replicated"]:  # a fusion's copy: as a single device's only
        return []
    return readers

  def closes(node, q):
    """Whether `node`'s copy in run q reads only what q can read already (an
    input, a constant, a value of q's or one another run reads), what an
    earlier partition computes alike when it returns it too
    (`_same_when_returned`), or what is copied with it."""
    if (node.id, q) not in closed:
      closed[(node.id, q)] = all(
          not isinstance(v, Value) or v.producer is None or phase[id(v.producer)] == q
          or any(phase[id(u)] != phase[id(v.producer)] for u in v.users)
          or _same_when_returned(v, phase)
          or (_sinkable(v.producer) and len(v.producer.outputs) == 1
              and wanted(v.producer, [node]) and closes(v.producer, q))
          for v in node.inputs)
    return closed[(node.id, q)]

  while work:
    node = work.pop()
    if not _sinkable(node) or len(node.outputs) != 1:
      continue
    value = node.outputs[0]
    later, own = {}, []
    for user in value.users:
      if user.place == "device" and phase[id(user)] > phase[id(node)]:
        later.setdefault(phase[id(user)], []).append(user)
    for q, readers in later.items():
      readers = wanted(node, readers)
      if not readers or not closes(node, q):
        continue
      copy = graph.make_node(node.op, node.prim, node.params, node.inputs,
                             [value.aval], node.effects, node.source, node.ctx, node.origin)
      copy.kernel, copy.place, copy.stream = node.kernel, node.place, node.stream
      copy.notes.append(f"a copy of node {node.id} '{node.op}' (read before the host work "
                        "too) in its readers' device partition: XLA rewrites or fuses them "
                        "through it as in jax.jit's one executable")
      first = min(graph.nodes.index(r) for r in readers)
      graph.insert_node(first, copy)
      phase[id(copy)] = q
      for reader in readers:
        reader.inputs = [copy.outputs[0] if v is value else v for v in reader.inputs]
        copy.outputs[0].users.append(reader)
      value.users = [u for u in value.users if u not in readers]
      copies.append(copy)  # (its inputs' makers come later in `work`: seen with it)
      own.append(str(copy.id))
    if not value.users and not any(o is value for o in graph.outputs):
      graph.remove_node(node)  # read by later runs alone, each now by its copy
      graph.record_removed(MoveIntoReaders.name, node, "read by later device partitions "
                           "alone, each now reading its own copy (nodes "
                           f"{', '.join(own)})")
  return copies


class MoveIntoReaders(Pass):
  name = "move_into_readers"
  required = True  # jax.jit's bits across a host split

  def run(self, graph, ctx):
    order, moved = move_into_readers(graph.nodes)
    for node in moved:
      node.notes.append("moved into its readers' device partition, after the host work "
                        "before it: XLA fuses it with them as in jax.jit's one executable "
                        "(a multiply and an add contract into an FMA there)")
    if graph.schedule is None:  # reorder_for_partitions disabled: its decision, as kept
      count, peak = count_partitions(graph.nodes), order_peak(graph, graph.nodes)
      graph.schedule = ScheduleDecision("original", count, count, peak, peak,
                                        "reorder_for_partitions is disabled")
    graph.schedule.moved_into_readers = len(moved)
    if moved:
      graph.nodes = order
    copies = copy_into_readers(graph)
    graph.schedule.copied_into_readers = len(copies)
    return PassResult(bool(moved or copies))
