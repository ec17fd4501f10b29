"""Host/device partitioning (issue 7), part 2: the executor on
multi-partition plans - host ops in every position, the PyTorch Inductor
partition bug classes (a value freed too early, an output made mid-plan, an
input read by one partition only, a state value read after a partition it
was given to), and argument checks - bit for bit against jax.jit."""
import zlib

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jaxsession import errors
from tests.exact import assert_equal_signed, assert_same_bits
from tests.partition_util import (
    _x, host, work_nodes, fewest_partitions, check_stateless, check_stateful,
    places, partition_of, sin_plus, cos_minus,
    across_five, assert_transfers, SHAPE, F32)


def _flaky_step(fail, error):
  """A stateful step whose host callback raises `error` while `fail` (a
  list) is not empty."""
  def flaky(a):
    if fail:
      raise error("callback failed on purpose")
    return np.cos(a)

  def step(s, x):
    a = jnp.sin(s) + x
    return s - jnp.tanh(host(flaky, a)) * 0.5, a
  return step


class HostOpPositionTest(absltest.TestCase):
  """Programs with 1, 2 and 5 host ops in various positions, bit for bit."""

  def setUp(self):
    super().setUp()
    self.rng = np.random.default_rng(zlib.crc32(self.id().encode()))  # per test, reproducible
    self.sess = js.Session()

  def two_inputs(self):
    return _x(self.rng), _x(self.rng)

  def check(self, fn, want_places=None, steps=3):
    gid = check_stateless(self.sess, fn, self.two_inputs, steps, self.id())
    graph = self.sess.graph(gid)
    callbacks = [n for n in graph.nodes if n.op == "pure_callback"]
    self.assertTrue(callbacks)
    self.assertTrue(all(n.place == "host" for n in callbacks))
    self.assertTrue(all(n.place == "device" for n in work_nodes(graph)
                        if n.op != "pure_callback"))
    self.assertEqual(len(graph.partitions), fewest_partitions(work_nodes(graph)))
    if want_places is not None:
      self.assertEqual(places(self.sess, gid), want_places)
    return gid

  def test_one_host_op_first(self):
    self.check(lambda x, y: jnp.cos(host(np.sin, x)) + y, ["host", "device"])

  def test_one_host_op_last(self):
    self.check(lambda x, y: host(sin_plus, jnp.tanh(x) - y, x), ["device", "host"])

  def test_one_host_op_in_the_middle(self):
    self.check(lambda x, y: jnp.sin(host(np.tanh, jnp.cos(x) + y)) - x,
               ["device", "host", "device"])

  def test_one_host_op_only(self):
    self.check(lambda x, y: host(cos_minus, x, y), ["host"])

  def test_two_consecutive_host_ops(self):
    self.check(lambda x, y: jnp.tanh(host(np.sin, host(cos_minus, jnp.sin(x), y))),
               ["device", "host", "device"])

  def test_two_host_ops_apart(self):
    def fn(x, y):
      a = host(np.cos, jnp.sin(x))
      b = host(sin_plus, jnp.tanh(a) + y, a)
      return jnp.cos(b) - y
    self.check(fn, ["device", "host", "device", "host", "device"])

  def test_two_independent_host_ops_share_a_partition(self):
    def fn(x, y):
      return jnp.sin(host(np.tanh, x)) + jnp.cos(host(np.cos, y))
    self.check(fn, ["host", "device"])

  def test_five_host_ops_first_consecutive_middle_and_last(self):
    def fn(x, y):
      h1 = host(sin_plus, x, y)                # first
      a = jnp.cos(h1) + x
      h2 = host(np.tanh, a)                    # two consecutive
      h3 = host(cos_minus, h2, y)
      b = jnp.sin(h3) - jnp.tanh(a)
      h4 = host(np.sin, b)                     # middle
      c = jnp.maximum(h4, b) * 0.5
      h5 = host(sin_plus, c, h1)               # last, reading the first one too
      return h5
    self.check(fn, ["host", "device", "host", "device", "host", "device", "host"])

  def test_five_host_ops_with_independent_work(self):
    def fn(x, y):
      hs = [host(np.sin, x), host(np.cos, y), host(np.tanh, jnp.sin(x))]
      d = jnp.cos(hs[0]) + jnp.sin(hs[1])
      hs.append(host(sin_plus, d, hs[2]))
      hs.append(host(cos_minus, hs[3], hs[0]))
      return jnp.tanh(hs[4]) - d, hs[1]
    self.check(fn)

  def test_host_ops_on_both_branches_joined_later(self):
    def fn(x, y):
      up = jnp.cos(host(np.sin, x))           # x -> host -> device
      down = host(np.tanh, jnp.sin(x) + y)    # x -> device -> host
      return up - down, down
    self.check(fn)

  def test_host_ops_feed_outputs_directly(self):
    def fn(x, y):
      a = host(np.sin, x)
      b = jnp.cos(a) + y
      return a, host(cos_minus, b, a), b, host(np.tanh, y)
    gid = self.check(fn)
    graph = self.sess.graph(gid)
    made_on_host = [v for v in graph.outputs if v.producer.op == "pure_callback"]
    self.assertLen(made_on_host, 3)

  def test_host_op_reads_state(self):
    def step(s, x):
      h = host(sin_plus, s, x)               # state read on the host
      return jnp.cos(h) - s * 0.5, h
    gid = check_stateful(self.sess, step, (_x(self.rng),), lambda: (_x(self.rng),),
                         where="state read on the host")
    self.assertIn("host", places(self.sess, gid))

  def test_host_op_makes_the_new_state(self):
    def step(s, t, x):
      a = jnp.sin(s) + x
      return host(np.tanh, a), t - a * 0.5, jnp.cos(a)   # new s made on the host
    check_stateful(self.sess, step, (_x(self.rng), _x(self.rng)),
                   lambda: (_x(self.rng),), where="state made on the host")

  def test_state_only_on_the_host(self):
    def step(s, x):
      return host(cos_minus, s, x), host(np.sin, s)
    check_stateful(self.sess, step, (_x(self.rng),), lambda: (_x(self.rng),),
                   where="state read and made on the host")

  def test_state_pytree_read_on_both_sides(self):
    def step(params, x):
      w, b = params["w"], params["b"]
      h = host(sin_plus, w, x)
      new = {"w": w - jnp.tanh(h) * 0.25, "b": host(cos_minus, b, h)}
      return new, jnp.sin(new["w"]) + new["b"]
    state = ({"w": _x(self.rng), "b": _x(self.rng)},)
    check_stateful(self.sess, step, state, lambda: (_x(self.rng),),
                   where="pytree state")


# -- PyTorch Inductor's partition bug classes -------------------------------------------
class InductorBugClassTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.rng = np.random.default_rng(1404)
    self.sess = js.Session()

  def inputs(self):
    return tuple(_x(self.rng) for _ in range(4))

  def compile_across_five(self):
    gid = self.sess.compile(across_five, *self.inputs())
    self.assertEqual(places(self.sess, gid), ["device", "host", "device", "host", "device"])
    return gid, self.sess.graph(gid)

  def test_value_read_by_a_later_partition_is_not_freed_early(self):
    gid, graph = self.compile_across_five()
    a = graph.outputs[1]
    self.assertEqual(partition_of(graph, a), 0)
    readers = [p.index for p in graph.partitions if a in p.inputs]
    self.assertEqual(readers, [1, 2, 4])   # 1 through the d2h node
    # a donated intermediate is donated to its last reader only
    for d in graph.memory.intermediate_donations:
      if d.donated:
        later = [p.index for p in graph.partitions[d.partition + 1:] if d.state in p.inputs]
        self.assertEqual(later, [], f"{d.state} donated to #{d.partition}")
    jitted = jax.jit(across_five)
    for step in range(4):
      args = self.inputs()
      assert_same_bits(self.sess.run(gid, *args), jitted(*args), f"step {step}")
      self.assertFalse(any(x.is_deleted() for x in args))  # the caller's arrays live on

  def test_value_made_in_partition_zero_read_in_two_and_four_not_an_output(self):
    def fn(x, y, z, w):
      return across_five(x, y, z, w)[0]       # a is no output: only the plan holds it
    gid = check_stateless(self.sess, fn, self.inputs, 4, "a is internal")
    self.assertEqual(places(self.sess, gid), ["device", "host", "device", "host", "device"])

  def test_output_produced_mid_plan_is_not_missing(self):
    gid, graph = self.compile_across_five()
    self.assertEqual([partition_of(graph, v) for v in graph.outputs], [4, 0, 1])
    args = self.inputs()
    got = self.sess.run(gid, *args)
    self.assertLen(got, 3)
    assert_same_bits(got, jax.jit(across_five)(*args), "mid-plan outputs")

  def test_same_mid_plan_value_returned_twice_and_an_input_returned(self):
    def fn(x, y, z, w):
      c, a, h1 = across_five(x, y, z, w)
      return a, c, a, h1, x, h1
    gid = check_stateless(self.sess, fn, self.inputs, 3, "repeated outputs")
    args = self.inputs()
    got = self.sess.run(gid, *args)
    self.assertIsNot(got[4], args[0])  # jax.jit returns a fresh array for an input too
    self.assertIsNot(got[0], got[2])

  def test_input_read_by_one_partition_only_is_passed_to_it(self):
    gid, graph = self.compile_across_five()
    _, _, z, w = graph.inputs_of_kind("input")
    self.assertEqual([p.index for p in graph.partitions if z in p.inputs], [2])
    self.assertEqual([p.index for p in graph.partitions if w in p.inputs], [3])
    jitted = jax.jit(across_five)
    for step in range(3):
      args = self.inputs()
      assert_same_bits(self.sess.run(gid, *args), jitted(*args), f"step {step}")

  def test_input_read_only_by_the_last_host_partition(self):
    def fn(x, y):
      h = host(np.sin, jnp.cos(x))
      return host(cos_minus, jnp.tanh(h), y)  # y: read by the last partition only
    gid = check_stateless(self.sess, fn, lambda: (_x(self.rng), _x(self.rng)), 3,
                          "y read last")
    graph = self.sess.graph(gid)
    y = graph.inputs_of_kind("input")[1]
    self.assertEqual([p.index for p in graph.partitions if y in p.inputs],
                     [len(graph.partitions) - 1])

  def test_state_read_after_a_partition_that_was_given_it(self):
    def step(s, x):
      a = jnp.sin(s) + x                      # device partition 0 reads s
      h = host(np.cos, a)                     # host partition 1
      new = s - jnp.tanh(h) * 0.5             # device partition 2 reads s again
      return new, a
    gid = check_stateful(self.sess, step, (_x(self.rng),), lambda: (_x(self.rng),),
                         steps=5, where="state read twice")
    graph = self.sess.graph(gid)
    s = graph.inputs_of_kind("state")[0]
    self.assertEqual([p.index for p in graph.partitions if s in p.inputs], [0, 2])
    for d in graph.memory.donations:
      if d.donated:  # only to the last partition reading it
        self.assertEqual(d.partition, 2)

  def test_state_pytree_read_in_three_partitions_updated_at_the_end(self):
    def step(params, x):
      u = jnp.cos(params["u"]) + x                          # device 0
      h = host(sin_plus, u, params["v"])                    # host 1 reads v
      v = jnp.tanh(h) + params["u"] - params["v"] * 0.5     # device 2 reads u, v
      return {"u": params["u"] - v * 0.25, "v": v}, u
    state = ({"u": _x(self.rng), "v": _x(self.rng)},)
    check_stateful(self.sess, step, state, lambda: (_x(self.rng),), steps=5,
                   where="pytree state")

  def test_failed_host_op_leaves_the_state_as_it_was(self):
    fail = []
    step = _flaky_step(fail, RuntimeError)
    gid = check_stateful(self.sess, step, (_x(self.rng),), lambda: (_x(self.rng),),
                         steps=2, where="before the failure")
    before = self.sess.get_state(gid)
    fail.append(1)
    with self.assertRaises(errors.HostOpError) as caught:
      self.sess.run(gid, _x(self.rng))
    self.assertIsInstance(caught.exception.__cause__, RuntimeError)
    assert_same_bits(self.sess.get_state(gid), before, "state after a failed run")
    fail.clear()
    x = _x(self.rng)
    got = self.sess.run(gid, x)
    new, want = jax.jit(step)(before[0], x)
    assert_same_bits(got, want, "the run after the failure")
    assert_same_bits(self.sess.get_state(gid), (new,), "state after the failure")


# -- transfers --------------------------------------------------------------------------
class ArgumentTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.rng = np.random.default_rng(31)
    self.sess = js.Session()

  def int32(self, *shape):
    info = np.iinfo(np.int32)
    x = self.rng.integers(info.min, info.max, shape or SHAPE, dtype=np.int64)
    x[:3] = [info.max, info.min, -1]
    return jnp.asarray(self.rng.permutation(x).astype(np.int32))

  def test_int32_large_values_through_a_host_op(self):
    def fn(x, y):
      h = host(lambda a, b: a + b * 3 - (a >> 7), x, y)   # wraps around in int32
      return (h ^ x) + y, host(np.negative, h - 1)
    gid = check_stateless(self.sess, fn, lambda: (self.int32(), self.int32()), 3,
                          "int32")
    self.assertIn("host", places(self.sess, gid))
    self.assertIn("device", places(self.sess, gid))
    # h - 1 reads a host value and is read on the host only: placement.py's
    # small-integer rule keeps it there, with no round trip to the device
    (sub,) = [n for n in self.sess.graph(gid).nodes if n.op == "sub"]
    self.assertEqual(sub.place, "host")
    self.assertTrue(any("small integer" in note for note in sub.notes))
    assert_transfers(self, self.sess, gid)

  def test_python_float_argument_on_a_multi_partition_graph(self):
    def fn(x, s):
      a = jnp.sin(x) * s
      h = host(sin_plus, a, x)
      return jnp.cos(h) + s, h * s
    gid = self.sess.compile(fn, _x(self.rng), 0.75)
    self.assertGreater(len(self.sess.report(gid).partitions), 1)
    for s in (1.3, -0.0, 1e-3, 3.4e38, float("inf"), float("nan")):
      x = _x(self.rng)
      assert_same_bits(self.sess.run(gid, x, s), jax.jit(fn)(x, s), f"s={s}")

  def test_python_float_read_by_the_host(self):
    def fn(x, s):
      return jnp.tanh(host(lambda a, b: np.sin(a) * b, x, s)) + s
    gid = self.sess.compile(fn, _x(self.rng), 2.5)
    for s in (0.1, -7.25, 1e30):
      x = _x(self.rng)
      assert_same_bits(self.sess.run(gid, x, s), jax.jit(fn)(x, s), f"s={s}")

  def test_wrong_input_raises_before_any_callback_runs(self):
    calls = []

    def host_first(x, y):
      return jnp.cos(host(np.sin, x, calls=calls)) + y

    def host_later(x, y):
      return host(sin_plus, jnp.sin(x), y, calls=calls)  # y: read on the host only

    def device_first(x, y):
      a = host(np.tanh, jnp.sin(x) + y, calls=calls)
      return host(np.cos, jnp.cos(a), calls=calls)

    for fn in (host_first, host_later, device_first):
      gid = self.sess.compile(fn, _x(self.rng), _x(self.rng))
      self.assertEqual(calls, [], "compile runs no callback")
      wrong = {"x shape": (_x(self.rng, 5), _x(self.rng)),
               "y shape": (_x(self.rng), _x(self.rng, 4, 8)),
               "y rank": (_x(self.rng), _x(self.rng)[None]),
               "y dtype": (_x(self.rng), self.int32()),
               "arity": (_x(self.rng),)}
      for what, args in wrong.items():
        with self.assertRaises(errors.InputError, msg=f"{fn.__name__}: {what}"):
          self.sess.run(gid, *args)
        self.assertEqual(calls, [], f"{fn.__name__}: {what} ran a callback")
      x, y = _x(self.rng), _x(self.rng)
      assert_same_bits(self.sess.run(gid, x, y), jax.jit(fn)(x, y), fn.__name__)
      self.assertNotEqual(calls, [])
      calls.clear()

  def test_input_error_is_a_value_error_naming_the_argument(self):
    gid = self.sess.compile(lambda x, y: host(sin_plus, jnp.sin(x), y),
                            _x(self.rng), _x(self.rng))
    with self.assertRaisesRegex(ValueError, r"argument 1") as caught:
      self.sess.run(gid, _x(self.rng), _x(self.rng, 7))
    self.assertIsInstance(caught.exception, js.errors.InputError)


class EscapingHostBuffersTest(absltest.TestCase):
  """A callback may return a buffer it reuses; jax.jit copies the result into
  its own buffer, so state and outputs made on the host must not change when
  the callback's buffer does (found by the review of issue 7)."""

  def setUp(self):
    super().setUp()
    self.buf = np.zeros((64,), np.float32)

  def fill(self, v):
    self.buf[:] = np.asarray(v) + 1
    return self.buf

  def test_new_state_made_on_the_host_is_a_copy(self):
    step = lambda w, x: (jax.pure_callback(self.fill, jax.ShapeDtypeStruct((64,), F32),
                                           w * x), w.sum())
    sess = js.Session()
    w = _x(np.random.default_rng(5), 64, specials=False)
    gid = sess.compile(step, w, jnp.float32(1.5), state_argnums=0)
    sess.run(gid, jnp.float32(1.5))
    want = np.asarray(w) * np.float32(1.5) + 1
    self.buf[:] = -7
    assert_equal_signed(sess.get_state(gid)[0], want)

  def test_output_made_on_the_host_is_a_copy(self):
    fn = lambda x: jax.pure_callback(self.fill, jax.ShapeDtypeStruct((64,), F32), x)
    sess = js.Session()
    x1, x2 = (_x(np.random.default_rng(s), 64, specials=False) for s in (6, 7))
    gid = sess.compile(fn, x1)
    first = sess.run(gid, x1)
    want = np.asarray(jax.jit(fn)(x1))
    sess.run(gid, x2)
    self.buf[:] = 99
    assert_equal_signed(first, want)


class KeptCallbackArgumentsTest(absltest.TestCase):
  """A callback may keep the arrays it is given (a history, a snapshot of
  the parameters); under jax.jit they stay valid. A host-placed callback
  read the state's own buffer, and the update that took it over (donated)
  deleted what it kept (a break-it find)."""

  def setUp(self):
    super().setUp()
    self.kept = []

  def keep(self, v):
    self.kept.append(v)
    return np.asarray(v) * 2

  def kept_values(self):
    return [np.asarray(v) for v in self.kept]

  def test_the_state_a_callback_reads(self):
    def f(s, x):
      y = jax.pure_callback(self.keep, jax.ShapeDtypeStruct(s.shape, s.dtype), s)
      return s + y + x, y.sum()
    rng = np.random.default_rng(41)
    s0 = _x(rng, 8)
    xs = [_x(rng, 8) for _ in range(3)]
    jf, s = jax.jit(f), s0
    for x in xs:
      s, _ = jf(s, x)
    want = self.kept_values()
    self.kept.clear()
    sess = js.Session()
    gid = sess.compile(f, s0, xs[0], state_argnums=0)
    self.assertTrue(any("as copies" in note for n in sess.graph(gid).nodes for note in n.notes))
    for x in xs:
      sess.run(gid, x)
    self.assertLen(self.kept, 3)
    for got, w in zip(self.kept_values(), want):
      assert_equal_signed(got, w)
    assert_equal_signed(sess.get_state(gid)[0], s)

  def test_an_eval_graphs_snapshot_of_the_shared_state(self):
    train = lambda p, x: (p - 0.1 * x, (p * x).sum())
    evaluate = lambda p, x: jax.pure_callback(
        self.keep, jax.ShapeDtypeStruct(p.shape, p.dtype), p).sum() + x.sum()
    rng = np.random.default_rng(42)
    p, x = _x(rng, 4, specials=False), _x(rng, 4, specials=False)
    sess = js.Session()
    tr = sess.compile(train, p, x, state_argnums=0)
    ev = sess.compile(evaluate, p, x, state_argnums=0, state_from=tr, updates_state=False)
    sess.run(ev, x)
    sess.run(tr, x)  # donates the parameters' buffer
    sess.run(ev, x)
    got = self.kept_values()
    assert_equal_signed(got[0], p)
    assert_equal_signed(got[1], jax.jit(train)(p, x)[0])


class DeletedArgumentTest(absltest.TestCase):

  def test_deleted_array_is_an_input_error_whatever_the_plan(self):
    def device_first(w, x):
      h = jax.pure_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct((3,), F32),
                            jnp.sin(x))
      return w + h.sum(), h
    sess = js.Session()
    gid = sess.compile(device_first, jnp.float32(0), jnp.ones(3), state_argnums=0)
    single = sess.compile(jnp.sin, jnp.ones(3))
    before = np.asarray(sess.get_state(gid)[0])
    for graph in (gid, single):
      dead = jnp.ones(3)
      dead.delete()
      with self.assertRaisesRegex(errors.InputError, "deleted"):
        sess.run(graph, dead)
    assert_equal_signed(sess.get_state(gid)[0], before)


class TransferGuardTest(absltest.TestCase):
  """Under jax.transfer_guard, a host partition's results reach the next
  executable as jax.jit's callback results reach the rest of its program:
  the placement's own transfer passes the guard; the user's arguments do not."""

  def setUp(self):
    super().setUp()
    self.rng = np.random.default_rng(zlib.crc32(self.id().encode()))
    self.sess = js.Session()

  def test_host_results_pass_every_guard_bit_for_bit(self):
    def f(x, y):
      return jnp.sin(host(cos_minus, jnp.tanh(x) * 2.0, y)) - x
    x, y = _x(self.rng), _x(self.rng)
    gid = self.sess.compile(f, x, y)
    self.assertEqual(places(self.sess, gid), ["device", "host", "device"])
    for guard in ("disallow", "log", "allow"):
      x, y = _x(self.rng), _x(self.rng)
      with jax.transfer_guard(guard):
        got, want = self.sess.run(gid, x, y), jax.jit(f)(x, y)
      assert_same_bits(got, want, f"under transfer_guard({guard!r})")

  def test_stateful_plan_under_the_guard_and_a_failing_callback(self):
    fail = []
    step = _flaky_step(fail, ValueError)
    s0 = _x(self.rng)
    gid = self.sess.compile(step, s0, _x(self.rng), state_argnums=0)
    state = s0
    xs = [_x(self.rng) for _ in range(4)]  # made outside the guard, as a user's inputs
    for x in xs[:3]:
      with jax.transfer_guard("disallow"):
        got = self.sess.run(gid, x)
        state, want = jax.jit(step)(state, x)
      assert_same_bits(got, want, "output under the guard")
    assert_same_bits(self.sess.get_state(gid), (state,), "state under the guard")
    fail.append(1)
    with jax.transfer_guard("disallow"), self.assertRaises(errors.HostOpError):
      self.sess.run(gid, xs[3])
    assert_same_bits(self.sess.get_state(gid), (state,), "state after the failed run")

  def test_host_arguments_are_refused_as_jax_jit_refuses_them(self):
    # before any op runs: a callback that reads them never runs (jax.jit
    # transfers every argument before its executable runs)
    calls = []
    programs = {"read by a callback alone": lambda x, y: jnp.sin(host(cos_minus, x, y, calls=calls)),
                "by a callback and the device": lambda x, y: host(np.sin, x, calls=calls) + y,
                "by the device first": lambda x, y: jnp.sin(host(cos_minus, x * y, y, calls=calls))}
    x, y = _x(self.rng), _x(self.rng)
    for what, f in programs.items():
      gid = self.sess.compile(f, x, y)
      for bad in (np.asarray(y), np.float32(2.5)):
        if bad.shape != y.shape:
          gid_scalar = self.sess.compile(f, x, 2.5)
        with jax.transfer_guard("disallow"):
          with self.assertRaisesRegex(Exception, "Disallowed host-to-device transfer"):
            jax.jit(f)(x, bad)
          calls.clear()
          with self.assertRaisesRegex(Exception, "Disallowed host-to-device transfer"):
            self.sess.run(gid if bad.shape == y.shape else gid_scalar, x, bad)
        self.assertEqual(calls, [], what)

  def test_host_outputs_and_host_made_state_under_the_guard(self):
    calls = []

    def step(s, x):
      new = host(sin_plus, s, x, calls=calls)  # new state made on the host
      return new, host(cos_minus, new, x)        # and an output made there
    s0, xs = _x(self.rng), [_x(self.rng) for _ in range(3)]
    gid = self.sess.compile(step, s0, xs[0], state_argnums=0)
    state = s0
    for x in xs:
      with jax.transfer_guard("disallow"):
        got = self.sess.run(gid, x)
        state, want = jax.jit(step)(state, x)
      assert_same_bits(got, want, "host output under the guard")
    assert_same_bits(self.sess.get_state(gid), (state,), "host-made state")
    self.assertLen(calls, 6)  # once a run each, the session's and jax.jit's


if __name__ == "__main__":
  absltest.main()
