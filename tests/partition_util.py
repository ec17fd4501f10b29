"""Shared helpers of the partition tests (issue 7): random host/device
programs, the brute-force partition count, transfer expectations and the
bit-exact checks against jax.jit."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js

from tests.exact import assert_same_bits, with_specials

SHAPE = (32,)  # room for every special value of exact.with_specials
F32 = jnp.float32
F32 = jnp.float32


# -- helpers ---------------------------------------------------------------------------
# Subnormals stay out: jax.jit runs a callback on an XLA thread that flushes
# them to zero, a host partition runs it with the CPU's IEEE default (README:
# "Host partitions and XLA"; fuzz_test.py checks that difference).
SPECIALS = ("neg_zero", "nan", "inf", "-inf", "big")


def _x(rng, *shape, dtype=F32, specials=True):
  """Fresh random values (never all zeros or ones), with -0.0, NaN, +-inf
  and a value past 2**24 in them unless `specials` is off."""
  x = np.asarray(rng.standard_normal(shape or SHAPE) * 3 + 0.25, dtype)
  if specials:
    flat = np.asarray(with_specials(x.reshape(-1), SPECIALS))  # at 0, 7, 14, ...
    x = flat[rng.permutation(flat.size)].reshape(x.shape)     # anywhere
  return jnp.asarray(x)


def host(numpy_fn, *xs, calls=None):
  """pure_callback of numpy_fn(*xs) with the first input's shape and dtype;
  `calls` (a list) records every call."""
  dtype = np.dtype(xs[0].dtype)

  def callback(*arrays):
    if calls is not None:
      calls.append(1)
    with np.errstate(all="ignore"):
      return np.asarray(numpy_fn(*[np.asarray(a) for a in arrays])).astype(dtype)
  return jax.pure_callback(callback, jax.ShapeDtypeStruct(xs[0].shape, dtype), *xs)


def is_transfer(node):
  return node.op.startswith("transfer_")


def real_value(value):
  """The value a transfer node carries, followed back to where it was made."""
  while value.producer is not None and is_transfer(value.producer):
    value = value.producer.inputs[0]
  return value


def real_inputs(node):
  return [real_value(v) for v in node.inputs if not isinstance(v, js.Literal)]


def value_home(value):
  """Where an (untransferred) value lives: its producer's place; graph inputs
  and state on the device; constants nowhere in particular (None)."""
  if value.producer is not None:
    return value.producer.place
  return None if value.kind == "const" else "device"


def work_nodes(graph):
  return [n for n in graph.nodes if not is_transfer(n)]


def fewest_partitions(nodes):
  """Brute force: the fewest runs of same-place nodes over all topological
  orders of `nodes` (memoised over the set of nodes run so far and the place
  of the last one)."""
  index = {id(n): i for i, n in enumerate(nodes)}
  need = []
  for node in nodes:
    mask = 0
    for value in real_inputs(node):
      if value.producer is not None:
        mask |= 1 << index[id(value.producer)]
    need.append(mask)
  full = (1 << len(nodes)) - 1

  @functools.lru_cache(maxsize=None)
  def rest(done, last):
    if done == full:
      return 0
    best = len(nodes) + 1
    for i, node in enumerate(nodes):
      if not done >> i & 1 and need[i] & done == need[i]:
        best = min(best, (node.place != last) + rest(done | 1 << i, node.place))
    return best
  return rest(0, None)


def place_changes(nodes):
  return sum(1 for i, n in enumerate(nodes) if i == 0 or n.place != nodes[i - 1].place)


def check_stateless(sess, fn, make_args, steps=3, where=""):
  """Compiles fn, then runs it on `steps` fresh argument tuples; each result
  must equal jax.jit's bit for bit. Returns the graph id."""
  gid = sess.compile(fn, *make_args())
  jitted = jax.jit(fn)
  for step in range(steps):
    args = make_args()
    assert_same_bits(sess.run(gid, *args), jitted(*args), f"{where} step {step}")
  return gid


def check_stateful(sess, fn, state, make_args, steps=4, where=""):
  """fn(*state, *args) -> (*new state, *outputs) compiled with the leading
  len(state) positions as state; over `steps` runs the outputs and the state
  must equal jax.jit's bit for bit. Returns the graph id."""
  k = len(state)
  gid = sess.compile(fn, *state, *make_args(), state_argnums=tuple(range(k)))
  jitted = jax.jit(fn)
  state = tuple(state)
  for step in range(steps):
    args = make_args()
    got = sess.run(gid, *args)
    outs = jitted(*state, *args)
    state, rest = tuple(outs[:k]), tuple(outs[k:])
    want = rest[0] if len(rest) == 1 else (rest or None)
    assert_same_bits(got, want, f"{where} outputs of step {step}")
    assert_same_bits(sess.get_state(gid), state, f"{where} state after step {step}")
  return gid


def places(sess, gid):
  return [p.place for p in sess.report(gid).partitions]


def partition_of(graph, value):
  """Index of the partition whose node makes `value`."""
  return next(p.index for p in graph.partitions for n in p.nodes if value in n.outputs)


# -- random programs -------------------------------------------------------------------
DEVICE_UNARY = [("sin", jnp.sin), ("cos", jnp.cos), ("tanh", jnp.tanh),
                ("neg", jnp.negative), ("half", lambda a: a * 0.5), ("abs", jnp.abs)]
# No product of two variables on the device: jax.jit's XLA contracts a*b + c
# into one FMA when it sees both, and a host partition between them (which
# the session has, and jax.jit has not) keeps them apart - two roundings, not
# a bug (README: "Host partitions and XLA"). Scaling by 0.5 is exact.
DEVICE_BINARY = [("add", jnp.add), ("sub", jnp.subtract), ("max", jnp.maximum),
                 ("min", jnp.minimum)]
HOST_UNARY = [("np.sin", np.sin), ("np.cos*2", lambda a: np.cos(a) * 2),
              ("np.tanh", np.tanh)]
HOST_BINARY = [("np.sin(a)+b", lambda a, b: np.sin(a) + b),
               ("a*b-a", lambda a, b: a * b - a), ("np.minimum", np.minimum)]


def random_recipe(rng, num_ops, host_share=0.45, num_inputs=2):
  """[(place, name, input indices)]: value i < num_inputs is input i, value
  num_inputs + k the result of op k; plus the output value indices (every
  value nobody reads, so nothing is dead, and a few from the middle)."""
  ops = []
  for k in range(num_ops):
    place = "host" if rng.random() < host_share else "device"
    available = num_inputs + k
    # lean on recent values so that chains (and place changes) appear
    arity = 1 if rng.random() < 0.4 else 2
    picks = [int(min(available - 1, rng.integers(0, available) + rng.integers(0, 2)))
             for _ in range(arity)]
    table = (HOST_UNARY if arity == 1 else HOST_BINARY) if place == "host" else (
        DEVICE_UNARY if arity == 1 else DEVICE_BINARY)
    name = table[rng.integers(len(table))][0]
    ops.append((place, name, picks))
  read = {i for _, _, picks in ops for i in picks}
  total = num_inputs + num_ops
  outputs = [i for i in range(num_inputs, total) if i not in read]
  middle = [i for i in range(num_inputs, total) if i not in outputs]
  for i in middle:
    if rng.random() < 0.3:
      outputs.append(i)
  host_values = [num_inputs + k for k, op in enumerate(ops) if op[0] == "host"]
  if host_values and not set(host_values) & set(outputs):
    outputs.append(host_values[rng.integers(len(host_values))])
  return ops, sorted(outputs)


def program_of(recipe, num_inputs=2):
  ops, outputs = recipe
  tables = {name: (place, fn) for place, table in (
      ("device", DEVICE_UNARY + DEVICE_BINARY), ("host", HOST_UNARY + HOST_BINARY))
      for name, fn in table}

  def fn(*inputs):
    values = list(inputs[:num_inputs])
    for place, name, picks in ops:
      _, op = tables[name]
      args = [values[i] for i in picks]
      values.append(host(op, *args) if place == "host" else op(*args))
    return tuple(values[i] for i in outputs)
  return fn

def sin_plus(a, b):
  return np.sin(a) + b


def cos_minus(a, b):
  return np.cos(a) - b


def across_five(x, y, z, w):
  """device / host / device / host / device, forced by the data: `a` is made
  in partition 0 and read in 2 and 4; z is read in partition 2 only, w in
  partition 3 only; a and h1 are outputs made mid-plan."""
  a = jnp.sin(x) + y                          # partition 0
  h1 = host(np.cos, a)                        # partition 1
  b = jnp.tanh(h1) - a + z                    # partition 2: a again, z only here
  h2 = host(sin_plus, b, w)                   # partition 3: w only here
  c = jnp.cos(h2) - a                         # partition 4: a again
  return c, a, h1


def expected_crossings(graph):
  """(device values read on the host, host values read on the device, host
  values that become state), from the nodes with the transfers looked through."""
  d2h, h2d = {}, {}
  for node in work_nodes(graph):
    for value in real_inputs(node):
      home = value_home(value)
      if home == "device" and node.place == "host":
        d2h[value.id] = value
      elif home == "host" and node.place == "device":
        h2d[value.id] = value
  state_made_on_host = {}
  for _, new in graph.state_updates():
    new = real_value(new)
    if new.producer is not None and new.producer.place == "host":
      state_made_on_host[new.id] = new
  return d2h, h2d, state_made_on_host


def assert_transfers(test, sess, gid):
  """The report's transfers against the graph: one per crossing value per
  direction, each caused by a reader on the other side (or, for state, the
  host producer). Returns the report's rows."""
  graph, rows = sess.graph(gid), sess.report(gid).transfers
  nodes = {n.id: n for n in graph.nodes}
  transfers = [n for n in graph.nodes if is_transfer(n)]
  test.assertLen(rows, len(transfers))
  d2h, h2d, state_made_on_host = expected_crossings(graph)
  test.assertEqual(sorted(real_value(n.inputs[0]).id for n in transfers
                          if n.op == "transfer_d2h"), sorted(d2h))
  h2d_ids = sorted(real_value(n.inputs[0]).id for n in transfers if n.op == "transfer_h2d")
  test.assertEqual(len(h2d_ids), len(set(h2d_ids)),
                   f"one h2d per value\n{graph.dump()}")
  test.assertEqual(sorted(set(h2d_ids)), sorted(set(h2d) | set(state_made_on_host)))
  for row, node in zip(rows, transfers):
    value = node.inputs[0]
    test.assertEqual(row.direction, node.op[-3:])
    test.assertEqual(row.value, repr(value))
    test.assertEqual(row.bytes, value.aval.size * value.aval.dtype.itemsize)
    cause = nodes[row.caused_by]
    test.assertEqual(row.caused_by, node.params["caused_by"])
    test.assertFalse(is_transfer(cause))
    if row.direction == "h2d" and node.place == "host":   # a host value becoming state
      test.assertIs(cause, value.producer)
      test.assertIn(value.id, state_made_on_host)
      continue
    test.assertEqual(cause.place, "host" if row.direction == "d2h" else "device")
    test.assertEqual(node.place, cause.place)
    test.assertIn(node.outputs[0], cause.inputs)
  return rows
