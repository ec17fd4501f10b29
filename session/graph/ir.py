"""KernelGraph: jaxsession's graph IR.

Nodes are kept in execution order. Every value has an aval, exactly one producer
(a node, or the graph itself for inputs) and a list of user nodes. Each pipeline
stage writes its decision on the node (`kernel`, `place`, `stream`) or on the
graph (`memory`, `partitions`), so `dump()` after any stage shows everything
decided so far.
"""
import functools
import itertools
import math
import operator
import weakref

import numpy as np
import jax

from jaxsession.graph import settings
from jaxsession.graph.divisors import divisor_cone
from jaxsession.graph.op_properties import CALLS, node_props
from jaxsession.graph.text import call_str, param_str, sharded

INPUT_KINDS = ("input", "state", "const")


def aval_str(aval):
  """`f32[3,4]`-style text for an aval, with `~` marking weak types."""
  fn = getattr(aval, "str_short", None)
  text = fn(short_dtypes=True) if fn else str(aval)
  return text + ("~" if getattr(aval, "weak_type", False) else "")


def aval_bytes(aval):
  """Bytes one value of this aval occupies (0 for tokens and other non-arrays)."""
  shape = getattr(aval, "shape", None)
  dtype = getattr(aval, "dtype", None)
  if shape is None or dtype is None:
    return 0
  return math.prod(map(int, shape)) * int(getattr(dtype, "itemsize", 0))


@functools.lru_cache(maxsize=None)
def dtype_specials(dtype):
  """Which of zero, negatives, -0.0, inf and nan `dtype` can hold (the
  small float types lack some: float8_e8m0fnu has no zero and no sign,
  e4m3fn no inf, the fnuz types no -0.0)."""
  dtype = np.dtype(dtype)

  def probe(v):  # v in dtype, read back as a real float64
    return np.real(np.asarray(v).astype(dtype)).astype(np.float64)
  with np.errstate(all="ignore"):
    held = set()
    if probe(0) == 0:
      held.add("zero")
    if probe(-1) < 0:
      held.add("negative")
    if jax.numpy.issubdtype(dtype, jax.numpy.inexact):
      if np.signbit(probe(-0.0)):
        held.add("-0.0")
      if np.isinf(probe(np.inf)):
        held.add("inf")
      if np.isnan(probe(np.nan)):
        held.add("nan")
  return frozenset(held)


class Value:
  """A value of the graph: a graph input or a node output."""
  __slots__ = ("id", "aval", "producer", "users", "kind", "name", "index", "sharding",
               "same_as", "note")

  def __init__(self, vid, aval, producer=None, kind="node", name=None, index=0):
    self.id = vid
    self.aval = aval
    self.producer = producer  # the Node defining it, None for graph inputs
    self.users = []           # Nodes reading it, one entry per reading node
    self.kind = kind          # "node" or one of INPUT_KINDS
    self.name = name          # for inputs: the argument and pytree path
    self.index = index        # position among the producer's outputs
    self.sharding = None      # under a mesh: its jax.sharding.NamedSharding, where
                              # the session fixes it (inputs, state, all-reduce plan)
    self.same_as = None       # Optimize's cse: the first value that computes the same
                              # (one Value per class of duplicates; see same_value)
    self.note = None          # an input's: why its layout is what it is (dump())

  def __repr__(self):
    return f"%{self.id}"


def same_value(a, b):
  """Whether `a` and `b` (Values or Literals) are one value: the same
  object, equal literals, or duplicates cse found (the same op, params and
  inputs, left unmerged for XLA: optimizer_passes/cse.py)."""
  if a is b:
    return True
  if isinstance(a, Literal) or isinstance(b, Literal):
    return isinstance(a, Literal) and isinstance(b, Literal) and a.key() == b.key()
  return a.same_as is not None and a.same_as is b.same_as


class Literal:
  """A constant scalar written inline in an equation (a jaxpr Literal)."""
  __slots__ = ("value", "aval")

  def __init__(self, value, aval):
    self.value = value
    self.aval = aval

  def key(self):
    """Hashable identity of the constant (for CSE): its type (weak or not)
    and its bytes."""
    arr = np.asarray(self.value)
    aval = self.aval
    return ("lit", tuple(aval.shape), aval.dtype, bool(getattr(aval, "weak_type", False)),
            arr.tobytes(), arr.dtype)

  def __repr__(self):
    return f"{np.asarray(self.value).item()!r}:{aval_str(self.aval)}"


class Node:
  """One operation: a JAX primitive, or a fused op made by a pass."""
  __slots__ = ("id", "op", "prim", "params", "inputs", "outputs", "effects",
               "source", "origin", "ctx", "kernel", "place", "stream", "notes", "_props",
               "_checked")

  def __init__(self, nid, op, prim, params, inputs, effects=(), source=None, ctx=None):
    self.id = nid
    self.op = op              # primitive name or fused-op name
    self.prim = prim          # the jax Primitive (None for fused ops)
    self.params = dict(params)
    self.inputs = list(inputs)  # Values and Literals
    self.outputs = []
    self.effects = effects
    self.source = source      # "file:line (function)" of the user code
    self.origin = None        # its equation's jax source_info (the importer's; lowering
                              # binds under it: HLO metadata and jax's errors name the
                              # user's code, not the session's kernels)
    self.ctx = ctx            # jax settings it binds under, where not the caller's (settings.py)
    self.kernel = None        # SelectKernel: a KernelBuildInfo
    self.place = None         # HardwareOptimize: "device" or "host"
    self.stream = None        # AssignStream: the queue number
    self.notes = []           # why a pass did what it did to this node
    self._props = None
    self._checked = None      # verify(): what its shape check last saw (_shape_inputs)

  @property
  def props(self):
    """The node's OpProps (op_properties.py): pure, deterministic, may_fail,
    user_code, effects - looking inside its sub-jaxprs."""
    if self._props is None:
      self._props = node_props(self)
    return self._props

  def invalidate_props(self):
    """Forgets the cached props (after a pass changed the node's params)."""
    self._props = None

  @property
  def label(self):
    """The op as dumps and reasons name it: a kept nested jit by its name
    too (`jit relu`), since its op alone says nothing."""
    name = self.params.get("name") if self.op in CALLS else None
    return f"{self.op} {name}" if name else self.op

  def __repr__(self):
    return f"Node({self.id}, {self.op})"


class KernelGraph:
  """The graph IR. Build with `add_input` / `add_node`; rewrite with
  `replace_uses` / `remove_node`; check with `verify()`."""

  def __init__(self, name="graph"):
    self.name = name
    self.inputs = []    # Values of kind input/state/const, in parameter order
    self.outputs = []   # Values or Literals
    self.nodes = []     # in execution order
    self.const_values = {}  # Value.id -> the constant array of a const input
    self.memory = None      # AllocateMemory: a runtime.memory.MemoryPlan
    self.partitions = None  # HardwareOptimize: list of runtime.partition.Partition
    # outputs[:len(state inputs)] are the new values of the state inputs, in order
    self.updates_state = False
    self.mesh = None              # a jax.sharding.Mesh: executables are SPMD-partitioned
    self.compiler_options = None  # XLA options every executable is compiled with
    self.allreduce_plan = None    # HardwareOptimize under a mesh: runtime.allreduce plan
    self.schedule = None          # HardwareOptimize: reorder's decision (partition order)
    # the ids of the inputs jax.jit's DCE keeps (importer, for js.jit's commits)
    self.read_before_rewrites = None  # (None: not asked)
    self.lays_out = False  # the traced program lays out values (jax_api.lays_out)
    # a nan (inf) the debug flags find in a run is explained by replaying the
    # graph op by op (executor.special_value); False for js.jit's graphs,
    # where jax.jit's de-optimized call of fn explains it
    self.replays_specials = True
    # (pass name, text) per node a pass removed: how its results are computed now
    # (dump() lists them: a fold, a merge or a rewrite is a decision too), and the
    # pattern rules whose pattern a line there spelled out (once per graph)
    self.removed, self.rules_described = [], set()
    self._ids = itertools.count()

  # -- construction -------------------------------------------------------
  def new_value(self, aval, producer=None, kind="node", name=None, index=0):
    return Value(next(self._ids), aval, producer, kind, name, index)

  def add_input(self, aval, kind="input", name=None, const_value=None):
    assert kind in INPUT_KINDS, kind
    value = self.new_value(aval, kind=kind, name=name)
    self.inputs.append(value)
    if kind == "const":
      if isinstance(const_value, np.ndarray):
        # the value as traced: jax.jit embeds a captured numpy array when it
        # compiles, while a host op here reads the constant at every run
        # (a caller refilling the array changed the results: a break-it find)
        const_value = np.array(const_value, copy=True)
        const_value.flags.writeable = False
      self.const_values[value.id] = const_value
    return value

  def make_node(self, op, prim, params, inputs, out_avals, effects=(), source=None, ctx=None,
                origin=None):
    """Creates a node with fresh output values; the caller places it."""
    node = Node(next(self._ids), op, prim, params, inputs, effects, source, ctx)
    node.origin = origin
    node.outputs = [self.new_value(a, node, index=i) for i, a in enumerate(out_avals)]
    return node

  def add_node(self, op, prim, params, inputs, out_avals, effects=(), source=None, ctx=None,
               origin=None):
    """Appends a node at the end of the execution order."""
    node = self.make_node(op, prim, params, inputs, out_avals, effects, source, ctx, origin)
    self.insert_node(len(self.nodes), node)
    return node

  def insert_node(self, position, node):
    self.nodes.insert(position, node)
    self.link(node)

  @staticmethod
  def link(node):
    """Records `node` as a user of its inputs (for nodes placed by a pass
    that rebuilds the node list itself)."""
    for value in node.inputs:
      if isinstance(value, Value):
        value.users.append(node)

  @staticmethod
  def unlink(node):
    """Forgets `node` as a user of its inputs (it is being dropped)."""
    for value in node.inputs:
      if isinstance(value, Value):
        value.users.remove(node)

  # -- rewriting ----------------------------------------------------------
  def remove_node(self, node):
    """Removes a node whose outputs are no longer used."""
    for out in node.outputs:
      if out.users or any(o is out for o in self.outputs):
        raise ValueError(f"{node} still has users of {out}")
    self.nodes.remove(node)
    self.unlink(node)

  def remove_nodes(self, nodes):
    """Removes many unused nodes in one pass over the node list (O(N), where
    repeated remove_node would be O(N^2) on big graphs)."""
    doomed = set(nodes)
    if not doomed:
      return
    for node in doomed:
      for out in node.outputs:
        if any(u not in doomed for u in out.users) or any(o is out for o in self.outputs):
          raise ValueError(f"{node} still has users of {out}")
    self.nodes = [n for n in self.nodes if n not in doomed]
    touched = {id(v): v for node in doomed for v in node.inputs if isinstance(v, Value)}
    for value in touched.values():  # one rebuild per value, not one remove per reader
      value.users = [u for u in value.users if u not in doomed]

  def record_removed(self, pass_name, node, how):
    """Notes for dump() that `pass_name` removed `node`, and `how` its
    readers are served now."""
    where = f" @ {node.source}" if node.source else ""
    self.removed.append((pass_name, f"node {node.id} {node.op}{where}: {how}"))

  def replace_uses(self, old, new):
    """Makes every reader of `old` (nodes and graph outputs) read `new`."""
    for user in old.users:
      user.inputs = [new if v is old else v for v in user.inputs]
      if isinstance(new, Value):
        new.users.append(user)
    old.users = []
    self.outputs = [new if v is old else v for v in self.outputs]

  # -- queries ------------------------------------------------------------
  def values(self):
    """Every value: inputs, then node outputs in execution order."""
    yield from self.inputs
    for node in self.nodes:
      yield from node.outputs

  def inputs_of_kind(self, kind):
    return [v for v in self.inputs if v.kind == kind]

  def state_updates(self):
    """[(state input, value holding its new value)] when the graph updates state."""
    if not self.updates_state:
      return []
    states = self.inputs_of_kind("state")
    return list(zip(states, self.outputs[:len(states)]))

  def passed_state(self):
    """Indices of the state leaves the graph returns as they came (no
    executable returns them; jax.jit's debug_nans check sees them). Not a
    scalar a division reads (divisors.py): XLA rewrites x / broadcast(s) as
    x * (1 / s) where s has no other reader, and jax.jit's executable
    returns s (a fuzzer's find: 1 ulp); the executable returns it too."""
    divisors = None
    passed = []
    for i, (s, new) in enumerate(self.state_updates()):
      if new is s:
        if s.aval.shape == ():
          divisors = divisor_cone(self.nodes)[1] if divisors is None else divisors
          if s.id in divisors:
            continue
        passed.append(i)
    return passed

  def verify(self, stages=(), skip=None, structure=True, shapes=True):
    """Checks the invariants; raises ValueError naming the first violation.
    The structure (with `structure`): topological order, every value defined
    once, users in sync - values compared by identity, so a value of another
    graph is caught - and (with `shapes`) each primitive node's output avals
    against its shape rule. Then the decisions of every stage in `stages`
    (STAGE_INVARIANTS), except those the passes of stage `skip` make again.
    Reads the graph only."""
    if structure:
      self._verify_structure(shapes)
    from jaxsession.graph.invariants import STAGE_INVARIANTS  # pylint: disable=import-outside-toplevel
    checks = {}  # check -> the first stage that establishes it
    for stage in stages:
      for check in STAGE_INVARIANTS.get(stage, ()):
        checks.setdefault(check, stage)
    for check in STAGE_INVARIANTS.get(skip, ()):
      checks.pop(check, None)
    for check, stage in checks.items():
      problem = check(self)
      if problem:
        raise ValueError(f"{stage}'s invariant does not hold: {problem}")
    return True

  def _verify_structure(self, shapes=True):
    # plain ifs, not _check(cond, lambda): a closure per check per node cost
    # this loop most of its time on 11k-node graphs
    defined = set()
    for value in self.inputs:
      if value.producer is not None:
        raise ValueError(f"input {value} has a producer")
      if value in defined:
        raise ValueError(f"{value} defined twice")
      defined.add(value)
    readers = {}
    for node in self.nodes:
      for value in node.inputs:
        if isinstance(value, Literal):
          continue
        if value not in defined:
          raise ValueError(f"{node} reads {value} before it is defined (not in "
                           "topological order)")
        got = readers.get(value)
        if got is None:
          readers[value] = [node]
        else:
          got.append(node)
      for i, out in enumerate(node.outputs):
        if out in defined:
          raise ValueError(f"{out} defined twice")
        if out.producer is not node or out.index != i:
          raise ValueError(f"{out} does not name {node} output {i} as its producer")
        defined.add(out)
      if shapes:
        seen = _shape_inputs(node)
        if node._checked is None or not _same(node._checked, seen):
          _check_avals(node)
          node._checked = seen
    for value in defined:
      actual = readers.get(value, ())
      if value.users != actual and len(value.users) + len(actual) and \
          sorted(n.id for n in value.users) != sorted(n.id for n in actual):
        # the same readers in another order are in sync too
        raise ValueError(f"users of {value} out of sync: recorded {value.users}, actual "
                         f"{sorted(n.id for n in actual)}")
    for value in self.outputs:
      if not (isinstance(value, Literal) or value in defined):
        raise ValueError(f"graph output {value} is not defined")

  # -- text and Graphviz ----------------------------------------------------
  def dump(self):
    """The graph as text: inputs, one node a line with every decision, outputs."""
    lines = [f"graph {self.name} ({len(self.nodes)} nodes)"]
    if self.mesh is not None:
      lines.append(f"  mesh {dict(self.mesh.shape)} ({self.mesh.devices.size} devices); values "
                   "marked @P(...) carry that sharding, XLA's SPMD partitioner propagates the rest")
    for value in self.inputs:
      comment = "; ".join(t for t in (value.name, value.note) if t)
      lines.append(f"  {value.kind:5s} {value}: {aval_str(value.aval)}{sharded(value)}"
                   + (f"  # {comment}" if comment else ""))
    for node in self.nodes:
      outs = ", ".join(f"{o}: {aval_str(o.aval)}{sharded(o)}" for o in node.outputs)
      params = (call_str(node) if node.op in CALLS else
                " ".join(f"{k}={param_str(v)}" for k, v in node.params.items()
                         if v is not None))
      decided = []
      if node.kernel is not None:
        decided.append(f"kernel={node.kernel.name}")
      if node.place is not None:
        decided.append(f"place={node.place}")
      if node.stream is not None:
        decided.append(f"stream={node.stream}")
      if node.ctx is not None:  # traced under other jax settings than the caller's
        decided.append(f"settings: {settings.describe(node.ctx)}")
      line = f"  node {node.id}: {outs} = {node.op}"  # reasons and errors name node ids
      if params:
        line += f"[{params}]"
      line += " " + ", ".join(map(repr, node.inputs))
      if decided:
        line += "  {" + ", ".join(decided) + "}"
      if node.source:
        line += f"  @ {node.source}"
      lines.append(line)
      lines.extend(f"      # {note}" for note in node.notes)
    lines.append("  return " + ", ".join(map(repr, self.outputs)))
    if self.removed:
      lines.append("removed by the passes:")
      lines.extend(f"  {name}: {text}" for name, text in self.removed)
    if self.schedule is not None:  # reorder_for_partitions' decision
      lines.append(f"schedule: {self.schedule}")
    if self.partitions is not None:
      lines.append("partitions:")
      lines.extend(f"  {p.describe()}" for p in self.partitions)
    if self.allreduce_plan is not None:
      lines.append("all-reduce plan:")
      lines.extend("  " + line for line in self.allreduce_plan.describe())
    if self.memory is not None:
      lines.append("memory:")
      lines.extend("  " + line for line in self.memory.describe())
    return "\n".join(lines) + "\n"

  def to_dot(self):
    """The graph in Graphviz form: a box per node, an edge per value read."""
    colors = {"device": "lightblue", "host": "khaki"}
    # (a quote or a trailing backslash ended the DOT string: review finds)
    quoted = lambda text: str(text).replace("\\", "\\\\").replace('"', '\\"')
    lines = [f'digraph "{quoted(self.name)}" {{', "  rankdir=TB;"]
    for value in self.inputs:
      lines.append(f'  v{value.id} [shape=ellipse,label="{value.kind} {quoted(value)}\\n'
                   f'{aval_str(value.aval)}"];')
    for node in self.nodes:
      label = quoted(node.label) + (f"\\n{node.kernel.name}" if node.kernel else "")
      color = colors.get(node.place, "white")
      lines.append(f'  n{node.id} [shape=box,style=filled,fillcolor={color},'
                   f'label="{label}"];')
      for value in node.inputs:
        if isinstance(value, Value):
          src = f"n{value.producer.id}" if value.producer else f"v{value.id}"
          lines.append(f'  {src} -> n{node.id} [label="{aval_str(value.aval)}"];')
    lines.append('  out [shape=doublecircle,label="return"];')
    for value in self.outputs:
      if isinstance(value, Value):
        src = f"n{value.producer.id}" if value.producer else f"v{value.id}"
        lines.append(f"  {src} -> out;")
    lines.append("}")
    return "\n".join(lines) + "\n"

  def __repr__(self):
    return f"KernelGraph({self.name!r}, {len(self.nodes)} nodes)"


def _check(condition, message):
  """`message`: a function building the text, called only on a violation
  (an f-string built for every check cost verify() most of its time)."""
  if not condition:
    raise ValueError(message())


def _shape_inputs(node):
  """Everything a node's shape check reads, as the objects themselves: its
  primitive, params and the avals of its inputs and outputs. verify() checks
  the node again only when one of them is another object (a pass that
  rewired, retyped or re-parametrised it); the node holds them, so no id is
  reused meanwhile."""
  params = node.params
  return (len(params), len(node.inputs), node.prim, *params, *params.values(),
          *[getattr(v, "aval", None) for v in node.inputs], *[o.aval for o in node.outputs])


def _same(a, b):
  """Whether two _shape_inputs tuples hold the same objects (compared in C)."""
  return len(a) == len(b) and all(map(operator.is_, a, b))


def _check_avals(node):
  """Every value has an aval, and a primitive node's outputs have the avals
  its primitive's shape rule gives for its inputs' avals and params (so a
  pass that rewires a node to values of another shape or dtype is caught)."""
  for value in node.inputs:
    _check(getattr(value, "aval", None) is not None,
           lambda: f"{node} input {value} has no aval")
  for out in node.outputs:
    _check(out.aval is not None, lambda: f"{node} output {out} has no aval")
  if node.prim is None:
    return  # a fused op: its kernel's outputs are checked at build
  expected = _expected_avals(node)
  if expected is None:
    return
  if isinstance(expected, str):
    raise ValueError(f"{node}: its inputs do not fit primitive {node.op}: {expected}")
  _check(len(expected) == len(node.outputs),
         lambda: f"{node} has {len(node.outputs)} outputs, {node.op} gives {len(expected)}")
  for out, want in zip(node.outputs, expected):
    got = (tuple(out.aval.shape), out.aval.dtype, getattr(out.aval, "weak_type", False))
    _check(got == want, lambda: f"{node} output {out} is {aval_str(out.aval)} but {node.op} "
           f"of its inputs gives {want[1]}{list(want[0])}{'~' if want[2] else ''}")


# (primitive, input avals, params) -> the avals its shape rule gives. The key
# holds its params' objects (jaxprs, callbacks) by weak reference, so that a
# released graph's jaxprs and the arrays they close over are not kept alive;
# an entry whose referents died matches nothing. Errors are not cached.
_SHAPE_RULE_CACHE = {}


def _expected_avals(node):
  """[(shape, dtype)] from the primitive's abstract evaluation, cached by
  (primitive, input avals, params); None when it cannot be asked; a string
  saying why when the inputs do not fit the primitive."""
  meshes = {m for m in (mesh_of(v.aval) for v in node.inputs) if m is not None}
  if len(meshes) > 1:  # inputs on different meshes (constants on none): no one context
    return None
  mesh = meshes.pop() if meshes else jax.sharding.get_abstract_mesh()
  try:  # everything the answer depends on: the avals with their shardings, the mesh
    key = (node.prim, tuple((tuple(v.aval.shape), v.aval.dtype, getattr(v.aval, "weak_type",
                                                                       False),
                             getattr(v.aval, "sharding", None))
                            for v in node.inputs),
           param_key(node.params), mesh)
    hash(key)
  except (TypeError, AttributeError):
    key = None
  if key is not None and key in _SHAPE_RULE_CACHE:
    return _SHAPE_RULE_CACHE[key]
  try:  # under the inputs' mesh, as the trace that made them ran
    with jax.sharding.use_abstract_mesh(mesh):
      result = node.prim.abstract_eval(*[v.aval for v in node.inputs], **node.params)
  except (TypeError, ValueError) as exc:
    return f"{type(exc).__name__}: {exc}"
  except Exception:  # a primitive without a usable shape rule: nothing to check
    return None
  outs = result[0] if isinstance(result, tuple) else result
  outs = outs if node.prim.multiple_results else [outs]
  try:
    expected = [(tuple(a.shape), a.dtype, a.weak_type) for a in outs]
  except AttributeError:  # tokens and other non-array results
    return None
  if key is not None:
    if len(_SHAPE_RULE_CACHE) > 4096:  # bounded: a long-lived process compiles many graphs
      _SHAPE_RULE_CACHE.clear()
    _SHAPE_RULE_CACHE[key] = expected
  return expected


def mesh_of(aval):
  """The abstract mesh an aval is laid out on (explicit sharding), or None."""
  mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
  return None if mesh is None or getattr(mesh, "empty", True) else mesh


def param_key(params):
  """The one hashable key of a node's params (CSE, the fold memo, the
  shape-rule cache); raises TypeError when a param cannot be hashed."""
  key = tuple(sorted((k, _freeze(v)) for k, v in params.items()))
  hash(key)
  return key


def _freeze(value):
  """A hashable stand-in for a param: containers frozen item by item, arrays
  by their bytes, any other object that takes a weak reference by one (a
  live weakref hashes and compares as its referent does)."""
  if isinstance(value, (list, tuple)):
    return tuple(_freeze(v) for v in value)
  if isinstance(value, dict):
    return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
  if isinstance(value, np.ndarray):
    return (value.dtype.str, value.shape, value.tobytes())
  if isinstance(value, (float, complex, np.inexact)):
    # by bits: == says -0.0 is 0.0, so two fused Adams whose b1 differed only
    # in its sign were merged by CSE (a break-it find)
    return (type(value).__name__, np.asarray(value).tobytes())
  try:
    return weakref.ref(value)
  except TypeError:  # ints, strings, tuples of them...: held as they are
    return value
