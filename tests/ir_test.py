"""KernelGraph: import (inlining, control flow, consts, literals, avals),
verify, dump, to_dot, and lowering back to a callable."""
from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

from jaxsession.graph.importer import import_jaxpr
from jaxsession.graph.ir import KernelGraph, Literal
from jaxsession.graph.lowering import lower_graph, lower_nodes

RNG = np.random.default_rng(42)


def _x(*shape):
  return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


def _import(fn, *args):
  return import_jaxpr(jax.make_jaxpr(fn)(*args))


def _ops(graph):
  return [n.op for n in graph.nodes]


class ImportTest(absltest.TestCase):

  def test_inlines_custom_jvp_custom_vjp_and_remat_and_keeps_nested_jit_calls(self):
    @jax.custom_vjp
    def f(x):
      return jnp.sin(x)
    f.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g,))
    inlined_jit = jax.jit(jnp.exp, inline=True)

    def prog(x):
      return (jax.jit(jnp.tanh)(x) + jax.nn.relu(x) + f(x) + jax.checkpoint(jnp.cos)(x)
              + inlined_jit(x))
    graph = _import(prog, _x(3))
    ops = _ops(graph)
    for gone in ("pjit", "custom_jvp_call", "custom_vjp_call", "remat2", "checkpoint"):
      self.assertNotIn(gone, ops)
    for kept in ("sin", "cos", "exp"):  # jax.jit(..., inline=True) is inlined, as jax lowers it
      self.assertIn(kept, ops)
    # a nested jit stays the call jax.jit lowers it as (XLA fuses across a call
    # boundary otherwise than without one): jnp.tanh's and jax.nn.relu's
    calls = sorted(n.params["name"] for n in graph.nodes if n.op == "jit")
    self.assertEqual(calls, ["relu", "tanh"])
    graph.verify()
    text = graph.dump()  # a kept call by its name and what its body does
    self.assertIn("= jit[name=relu body={1 eqns: max}]", text)
    self.assertIn("= jit[name=tanh body={1 eqns: tanh}]", text)
    self.assertIn('label="jit relu', graph.to_dot())
    relu = next(n for n in graph.nodes if n.label == "jit relu")
    self.assertIn("ir_test.py", relu.source)  # jax.nn.relu's custom_jvp call's line

  def test_control_flow_stays_single_nodes(self):
    def prog(x):
      y = jax.lax.scan(lambda c, a: (c + a, c), 0.0, x)[1]
      z = jax.lax.while_loop(lambda c: c < 5.0, lambda c: c + 1.0, x[0])
      return jax.lax.cond(z > 2, lambda: y, lambda: -y)
    graph = _import(prog, _x(4))
    self.assertEqual([op for op in _ops(graph) if op in ("scan", "while", "cond")],
                     ["scan", "while", "cond"])
    scan = next(n for n in graph.nodes if n.op == "scan")
    self.assertIn("jaxpr", scan.params)

  def test_consts_become_const_inputs_and_literals_stay(self):
    table = np.arange(12, dtype=np.float32).reshape(3, 4) * 0.5
    graph = _import(lambda x: x @ table + 2.0, _x(2, 3))
    consts = graph.inputs_of_kind("const")
    self.assertLen(consts, 1)
    np.testing.assert_array_equal(graph.const_values[consts[0].id], table)
    add = next(n for n in graph.nodes if n.op == "add")
    self.assertTrue(any(isinstance(v, Literal) and float(v.value) == 2.0 for v in add.inputs))

  def test_avals_keep_weak_type_and_sharding(self):
    graph = _import(lambda x, s: x * s, _x(3), 2.0)
    self.assertTrue(graph.inputs[1].aval.weak_type)
    self.assertFalse(graph.inputs[0].aval.weak_type)
    self.assertTrue(hasattr(graph.inputs[0].aval, "sharding"))
    self.assertIn("f32[]~", graph.dump())

  def test_source_lines_are_recorded(self):
    graph = _import(lambda x: jnp.sin(x), _x(2))
    self.assertIn("ir_test.py", graph.nodes[0].source)


class VerifyTest(absltest.TestCase):

  def _graph(self):
    return _import(lambda x: jnp.exp(jnp.sin(x) * 2), _x(3))

  def test_valid_graph(self):
    self.assertTrue(self._graph().verify())

  def test_rejects_out_of_order_nodes(self):
    graph = self._graph()
    graph.nodes.reverse()
    with self.assertRaisesRegex(ValueError, "before it is defined"):
      graph.verify()

  def test_rejects_stale_users(self):
    graph = self._graph()
    graph.nodes[0].outputs[0].users.append(graph.nodes[0])
    with self.assertRaisesRegex(ValueError, "users of .* out of sync"):
      graph.verify()

  def test_rejects_double_definition(self):
    graph = self._graph()
    graph.nodes[1].outputs[0] = graph.nodes[0].outputs[0]
    with self.assertRaisesRegex(ValueError, "defined twice"):
      graph.verify()

  def test_rejects_undefined_output(self):
    graph = self._graph()
    graph.outputs = [KernelGraph("other").add_input(graph.inputs[0].aval)]
    with self.assertRaisesRegex(ValueError, "is not defined"):
      graph.verify()


class TextTest(absltest.TestCase):

  def test_dump_has_one_line_per_node_with_decisions(self):
    graph = _import(lambda x: jnp.sin(x) + 1, _x(3))
    graph.nodes[0].place = "device"
    graph.nodes[0].stream = 0
    text = graph.dump()
    lines = [ln for ln in text.splitlines() if " = " in ln]
    self.assertLen(lines, len(graph.nodes))
    self.assertIn("place=device, stream=0", lines[0])
    self.assertIn("return", text)

  def test_to_dot(self):
    graph = _import(lambda x, y: jnp.dot(x, y), _x(2, 3), _x(3, 2))
    dot = graph.to_dot()
    self.assertTrue(dot.startswith("digraph"))
    self.assertEqual(dot.count("->"), 3)  # two operands and the return


class LoweringTest(absltest.TestCase):

  def test_whole_graph_round_trips(self):
    fn = lambda x, y: (jnp.tanh(x) @ y, (x ** 2).sum())
    x, y = _x(3, 4), _x(4, 2)
    graph = _import(fn, x, y)
    got = jax.jit(lower_graph(graph))(x, y)
    want = fn(x, y)
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, w, rtol=1e-6)

  def test_any_node_list_lowers(self):
    graph = _import(lambda x: jnp.cos(jnp.sin(x) * 3), _x(5))
    mid = graph.nodes[1]  # the mul
    part = lower_nodes(graph.nodes[1:], [mid.inputs[0]], graph.outputs)
    s = _x(5)
    np.testing.assert_allclose(jax.jit(part)(s)[0], jnp.cos(s * 3), rtol=1e-6)


if __name__ == "__main__":
  absltest.main()
