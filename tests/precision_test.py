"""The reduce-precision rule: int64 -> int32 around a node no kernel takes,
only where the values provably fit; otherwise KernelSelectError says why."""
from absl.testing import absltest
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jaxsession.graph import op_properties
from jaxsession.optimizer_passes.select_kernels import SelectKernels
from jaxsession.graph.ir import KernelGraph
from jaxsession.kernels import registry
from jaxsession.optimizer_passes import reduce_precision as precision
from jaxsession.graph.lowering import lower_graph
from jaxsession.optimizer_passes import PassContext

OP = "TestPairMax"  # a fused op whose only kernel takes int32


def _pair_max(node, a, b):
  return [jnp.maximum(a, b)]


class ReducePrecisionTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    registry.register_kernel(OP, dtypes=["int32"], name="xla:test_pair_max_i32")(_pair_max)
    op_properties.register_op(OP, range_preserving=True)
    self.enter_context(jax.enable_x64(True))

  def tearDown(self):
    registry.unregister_kernel("xla:test_pair_max_i32")
    op_properties.unregister_op(OP)
    super().tearDown()

  def _graph(self, widen_inputs=True, op=OP):
    graph = KernelGraph("narrow")
    i32 = jax.core.ShapedArray((5,), jnp.int32)
    i64 = jax.core.ShapedArray((5,), jnp.int64)
    if widen_inputs:  # int64 made from int32: provably fits
      ins = [graph.add_input(i32), graph.add_input(i32)]
      wide = [graph.add_node("convert_element_type", lax.convert_element_type_p,
                             {"new_dtype": np.dtype(np.int64), "weak_type": False,
                              "sharding": None}, [x], [i64]).outputs[0] for x in ins]
    else:
      wide = [graph.add_input(i64), graph.add_input(i64)]
    node = graph.add_node(op, None, {}, wide, [i64])
    graph.outputs = [node.outputs[0]]
    return graph, node

  def _select(self, graph):
    return SelectKernels().run(graph, PassContext(platform="cpu"))

  def test_narrows_when_inputs_provably_fit(self):
    graph, node = self._graph()
    self._select(graph)
    graph.verify()
    self.assertEqual(node.kernel.name, "xla:test_pair_max_i32")
    self.assertEqual([n.op for n in graph.nodes],
                     ["convert_element_type"] * 4 + [OP, "convert_element_type"])
    self.assertEqual(node.outputs[0].aval.dtype, np.int32)
    self.assertEqual(graph.outputs[0].aval.dtype, np.int64)
    self.assertIn("reduce precision", graph.dump())
    rng = np.random.default_rng(5)
    a, b = (jnp.asarray(rng.integers(-1000, 1000, 5), jnp.int32) for _ in range(2))
    (out,) = jax.jit(lower_graph(graph))(a, b)
    self.assertEqual(out.dtype, jnp.int64)
    np.testing.assert_array_equal(out, np.maximum(np.asarray(a), np.asarray(b)))

  def test_refuses_int64_of_unknown_range(self):
    graph, _ = self._graph(widen_inputs=False)
    with self.assertRaisesRegex(js.KernelSelectError,
                                r"(?s)dtype int64 not in \['int32'\].*reduce precision "
                                r"\(int64 -> int32\) not applied: input 0 is int64 of unknown"):
      self._select(graph)

  def test_refuses_ops_that_leave_the_range(self):
    registry.register_kernel("TestPairSum", dtypes=["int32"], name="xla:test_sum_i32")(
        lambda node, a, b: [a + b])
    try:
      graph, _ = self._graph(op="TestPairSum")
      with self.assertRaisesRegex(js.KernelSelectError, r"not range-preserving"):
        self._select(graph)
    finally:
      registry.unregister_kernel("xla:test_sum_i32")


if __name__ == "__main__":
  absltest.main()
