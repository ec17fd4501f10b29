"""The op table (session/graph/op_properties.py): every registered kernel's op has
its facts, the facts reach the passes that read them, DCE drops the dead
outputs of scan and cond (never an effect inside), and the caches do not keep
a released graph's arrays alive."""
import gc

from absl.testing import absltest
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jaxsession.graph import ir, op_properties
from jaxsession.kernels import fused, registry
from jaxsession.runtime import batch_axis
from tests.exact import assert_same_bits

RNG = np.random.default_rng(1414)

MIXING_FUSED_OPS = ("dp_partial", "allreduce_bucket", "dp_reduce_scatter")  # made after the
# batch analysis


def _x(*shape):
  return RNG.standard_normal(shape).astype(np.float32)


def _nodes(sess, gid, op):
  return [n for n in sess.graph(gid).nodes if n.op == op]


class FactsTest(absltest.TestCase):

  def test_every_registered_kernel_has_its_facts(self):
    self.assertEqual(registry.ops_without_facts(), [])
    self.assertGreaterEqual(len(fused.FUSED_OPS), 11)
    for op in fused.FUSED_OPS:  # and each says how rows pass through it
      self.assertTrue(op_properties.known(op), op)
      self.assertEqual(batch_axis.rule_for(op) is None, op in MIXING_FUSED_OPS, op)

  def test_a_kernel_registered_without_facts_is_caught(self):
    registry.register_kernel("TestOpWithoutFacts", name="xla:test_no_facts")(
        lambda node, x: [x])
    try:
      self.assertEqual(registry.ops_without_facts(), ["TestOpWithoutFacts"])
      op_properties.register_op("TestOpWithoutFacts", elementwise=True)
      self.assertEqual(registry.ops_without_facts(), [])
    finally:
      registry.unregister_kernel("xla:test_no_facts")
      op_properties.unregister_op("TestOpWithoutFacts")

  def test_fused_ops_take_the_batch_rule_their_facts_name(self):
    for op in ("GeluTanh", "AddN", "Adam", "BatchNormRelu", "BatchNormAddRelu"):
      self.assertIs(batch_axis.rule_for(op), batch_axis.ELEMENTWISE, op)
    for op in ("Softmax", "LayerNorm", "RMSNorm"):
      self.assertIs(batch_axis.rule_for(op), batch_axis.NAMED_RULES["rows"], op)
    self.assertIs(batch_axis.rule_for("transfer_d2h"), batch_axis.NAMED_RULES["identity"])
    self.assertIsNone(batch_axis.rule_for("NoSuchFusedOp"))  # no facts: it mixes
    with self.assertRaisesRegex(ValueError, "batch rule of Bad must be one of"):
      op_properties.register_op("Bad", batch="sideways")
    self.assertFalse(op_properties.known("Bad"))

  def test_one_numpy_implementation_is_xla_on_host_integers(self):
    # the function folding reads is the host kernel: both must be XLA's result
    for op in op_properties.ops_with(host=True):
      facts = op_properties.facts(op)
      self.assertIsNotNone(facts.numpy, op)
      if not facts.elementwise or op in ("convert_element_type", "select_n"):
        continue
      prim = getattr(lax, f"{op}_p")
      arity = 1 if op in ("neg", "not") else 2
      dtype = np.bool_ if op in ("and", "or", "xor", "not") else np.int32
      args = [RNG.integers(-2**31, 2**31 - 1, 12).astype(dtype) for _ in range(arity)]
      want = jax.jit(lambda *a, p=prim: p.bind(*a))(*args)
      with np.errstate(over="ignore"):
        got = np.asarray(facts.numpy(*args), dtype=want.dtype)
      np.testing.assert_array_equal(got, want, err_msg=op)


class DeadOutputsTest(absltest.TestCase):

  def test_dce_drops_dead_scan_ys_and_what_only_they_compute(self):
    def f(c, xs):
      def body(c, x):
        y = jnp.sin(x) * c
        dead = jnp.exp(x) + c
        return c + y.sum(), (y, dead)
      c, (ys, _) = lax.scan(body, c, xs)
      return c, ys
    c, xs = np.float32(RNG.standard_normal()), _x(6, 4)
    sess = js.Session()
    gid = sess.compile(f, c, xs)
    (scan,) = _nodes(sess, gid, "scan")
    self.assertEqual(len(scan.outputs), 2)  # carry and the live ys
    body_ops = [e.primitive.name for e in scan.params["jaxpr"].jaxpr.eqns]
    self.assertNotIn("exp", body_ops)
    assert_same_bits(sess.run(gid, c, xs), jax.jit(f)(c, xs), "dead ys dropped")

  def test_dce_drops_a_dead_cond_output(self):
    def f(p, x):
      live, _ = lax.cond(p > 0, lambda x: (x * 2.0, jnp.exp(x)), lambda x: (x - 1.0, jnp.cos(x)),
                         x)
      return live
    p, x = np.float32(RNG.standard_normal()), _x(5)
    sess = js.Session()
    gid = sess.compile(f, p, x)
    (cond,) = _nodes(sess, gid, "cond")
    self.assertEqual(len(cond.outputs), 1)
    assert_same_bits(sess.run(gid, p, x), jax.jit(f)(p, x), "dead cond output dropped")

  def test_dce_drops_the_carries_of_a_while_no_output_needs(self):
    calls = []

    def f(x, n, with_callback):
      def body(c):
        i, a, b, d = c
        if with_callback:  # reads d: an effect keeps what it reads
          jax.debug.callback(lambda v: calls.append(1), d)
        return i + 1, a * 1.5 + jnp.sin(b), b + 0.25, jnp.exp(d) * 0.5
      return lax.while_loop(lambda c: c[0] < n, body, (0, x, x * 2.0, x))[1]
    x, n = _x(5), np.int32(4)
    for with_callback, carries in ((False, 3), (True, 4)):  # i (cond), a, b (a needs it)
      g = lambda x, n, w=with_callback: f(x, n, w)
      sess = js.Session()
      gid = sess.compile(g, x, n)
      (loop,) = _nodes(sess, gid, "while")
      self.assertEqual(len(loop.outputs), carries)
      body_ops = [e.primitive.name for e in loop.params["body_jaxpr"].jaxpr.eqns]
      self.assertEqual("exp" in body_ops, with_callback)
      got = sess.run(gid, x, n)
      self.assertEqual(len(calls), 4 if with_callback else 0)
      calls.clear()
      assert_same_bits(got, jax.jit(g)(x, n), f"while, callback={with_callback}")

  def test_a_callback_inside_a_scan_is_never_dropped(self):
    calls = []

    def f(c, xs):
      def body(c, x):
        jax.debug.callback(lambda v: calls.append(np.asarray(v)), x)
        return c + x.sum(), jnp.tanh(x)  # the ys are dead
      c, _ = lax.scan(body, c, xs)
      return c
    c, xs = np.float32(RNG.standard_normal()), _x(4, 3)
    sess = js.Session()
    gid = sess.compile(f, c, xs)
    (scan,) = _nodes(sess, gid, "scan")
    self.assertEqual(len(scan.outputs), 1)  # the dead ys went, the effect stays
    got = sess.run(gid, c, xs)
    self.assertEqual(len(calls), 4)
    calls.clear()
    assert_same_bits(got, jax.jit(f)(c, xs), "callback kept")
    self.assertEqual(len(calls), 4)


class WeakCacheTest(absltest.TestCase):

  def test_compile_and_release_keeps_no_array_alive(self):
    sess = js.Session()

    def once():
      big = jnp.asarray(_x(64))
      # a jit inside a branch: the cond's params hold a ClosedJaxpr with `big`
      def f(x, p):
        return lax.cond(p > 0, lambda x: jax.jit(lambda y: y * big)(x), lambda x: x - big, x)
      x, p = _x(64), np.float32(1.0)
      gid = sess.compile(f, x, p)
      assert_same_bits(sess.run(gid, x, p), jax.jit(f)(x, p), "cond over a closed-over array")
      sess.release(gid)

    once()
    gc.collect()
    before = len(jax.live_arrays())
    for _ in range(3):
      once()
    gc.collect()
    self.assertEqual(len(jax.live_arrays()), before)

  def test_a_shape_rule_error_is_not_cached(self):
    graph = ir.KernelGraph("bad")
    a = graph.add_input(jax.core.ShapedArray((3,), jnp.float32))
    b = graph.add_input(jax.core.ShapedArray((4,), jnp.float32))
    graph.add_node("add", lax.add_p, {}, [a, b], [jax.core.ShapedArray((3,), jnp.float32)])
    for _ in range(2):
      with self.assertRaisesRegex(ValueError, "do not fit primitive add"):
        graph.verify()
    self.assertFalse(any(isinstance(v, str) for v in ir._SHAPE_RULE_CACHE.values()))


if __name__ == "__main__":
  absltest.main()
