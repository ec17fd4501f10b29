"""The flat pipeline (session/pipeline.py): one table gives the order of the
passes, a user pass's nodes are decided by the ordinary passes after it, and
each stage's invariants are checked after it (KernelGraph.verify)."""
import sys

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jaxsession import pipeline
from jaxsession.graph.importer import import_jaxpr
from jaxsession.optimizer_passes import FunctionPass, Pass, PassContext, PassResult
from exact import assert_same_bits

RNG = np.random.default_rng(14)


def _x(*shape):
  return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


def _triple(v):
  return np.asarray(v) * np.float32(3)  # numpy on the host, in both programs


def _callback(v):
  return jax.pure_callback(_triple, jax.ShapeDtypeStruct(v.shape, v.dtype), v)


def program(x):
  return jnp.sin(x) * 2 + 1


def program_with_callback(x):  # what the user pass below makes of `program`
  return _callback(jnp.sin(x) * 2) + 1


class AddHostCallback(Pass):
  """A user pass: a host callback (`_triple`) on the output of the first mul."""
  name = "add_host_callback"

  def run(self, graph, ctx):
    position, mul = next((i, n) for i, n in enumerate(graph.nodes) if n.op == "mul")
    out = mul.outputs[0]
    (eqn,) = jax.make_jaxpr(_callback)(jax.ShapeDtypeStruct(out.aval.shape,
                                                             out.aval.dtype)).jaxpr.eqns
    readers = list(out.users)
    node = graph.make_node("pure_callback", eqn.primitive, dict(eqn.params), [out],
                           [out.aval], eqn.effects)
    graph.insert_node(position + 1, node)
    for reader in readers:
      reader.inputs = [node.outputs[0] if v is out else v for v in reader.inputs]
      node.outputs[0].users.append(reader)
    out.users = [node]
    return PassResult(True)


class UnsetStream(Pass):
  """Breaks AssignStream's decision and says it changed nothing."""
  name = "unset_stream"

  def run(self, graph, ctx):
    graph.nodes[0].stream = None
    return PassResult(False)


def _registered(test, pass_, **where):
  js.register_pass(pass_, **where)
  test.addCleanup(js.unregister_pass, pass_.name)


def _flat(stages, disabled=()):
  return [(stage, p.name) for stage, passes in stages.items() for p in passes
          if p.name not in disabled]


def _run_order(records):
  """The (stage, pass) order of a report, Optimize's repeated sweeps taken as one."""
  seen, order = set(), []
  for r in records:
    if (r.stage, r.name) not in seen:
      seen.add((r.stage, r.name))
      order.append((r.stage, r.name))
  return order


class UserPassTest(absltest.TestCase):

  def test_a_callback_a_user_pass_adds_is_decided_by_the_ordinary_passes(self):
    _registered(self, AddHostCallback(), stage="HardwareOptimize")
    sess = js.Session()
    x = _x(16)
    gid = sess.compile(program, x)
    graph, report = sess.graph(gid), sess.report(gid)
    (node,) = [n for n in graph.nodes if n.op == "pure_callback"]
    self.assertEqual((node.kernel.name, node.place, node.stream), ("host:pure_callback",
                                                                   "host", 1))
    self.assertTrue(any(n.startswith("placed on host (callback)") for n in node.notes))
    self.assertEqual([p.place for p in report.partitions], ["device", "host", "device"])
    self.assertEqual([t.direction for t in report.transfers], ["d2h", "h2d"])
    self.assertIsNotNone(graph.memory)
    names = [r.name for r in report.passes]
    self.assertLess(names.index("add_host_callback"), names.index("place_nodes"))
    self.assertTrue(report.passes[names.index("add_host_callback")].changed)
    x = _x(16)
    assert_same_bits(sess.run(gid, x), jax.jit(program_with_callback)(x), "user callback")

  def test_an_anchor_among_the_decisions_runs_before_them(self):
    _registered(self, AddHostCallback(), stage="HardwareOptimize", after="insert_transfers")
    hardware = pipeline.stage_passes()["HardwareOptimize"]
    names = [p.name for p in hardware]
    self.assertEqual(names.index("add_host_callback") + 1, names.index("place_nodes"))
    sess = js.Session()
    gid = sess.compile(program, _x(8))
    self.assertEqual([p.place for p in sess.report(gid).partitions],
                     ["device", "host", "device"])
    x = _x(8)
    assert_same_bits(sess.run(gid, x), jax.jit(program_with_callback)(x), "anchored")


class StageInvariantTest(absltest.TestCase):

  def test_a_node_added_where_nothing_decides_it_names_the_pass_and_stage(self):
    _registered(self, AddHostCallback(), stage="AssignStream")
    with self.assertRaisesRegex(js.PassError, r"pass add_host_callback left an invalid graph: "
                                r"SelectKernel's invariant does not hold: node \d+ "
                                r"'pure_callback' has no kernel \(stage AssignStream; "
                                r"passes before it: Optimize/dce, .*HardwareOptimize/"
                                r"partition_nodes\)"):
      js.Session().compile(program, _x(4))

  def test_a_decision_undone_unreported_is_caught_after_the_stage(self):
    _registered(self, UnsetStream(), stage="AllocateMemory")
    with self.assertRaisesRegex(js.PassError, r"stage AllocateMemory \(passes unset_stream, "
                                r"plan_memory\) left an invalid graph: AssignStream's "
                                r"invariant does not hold: node \d+ 'sin' .*has no stream"):
      js.Session().compile(program, _x(4))

  def test_verify_checks_each_stage_and_changes_nothing(self):
    sess = js.Session()
    gid = sess.compile(program, _x(4))
    graph = sess.graph(gid)
    text = graph.dump()
    self.assertTrue(graph.verify(stages=pipeline.GRAPH_STAGES))
    self.assertEqual(graph.dump(), text)
    imported = import_jaxpr(jax.make_jaxpr(program)(_x(4)))
    self.assertTrue(imported.verify())
    for stage, problem in [("SelectKernel", "has no kernel"),
                           ("HardwareOptimize", "has no kernel"),
                           ("AssignStream", "has no stream"), ("AllocateMemory", "no memory plan")]:
      with self.assertRaisesRegex(ValueError, rf"{stage}'s invariant does not hold: "
                                  rf".*{problem}"):
        imported.verify(stages=(stage,))
    self.assertTrue(imported.verify(stages=("HardwareOptimize",), skip="HardwareOptimize"))

  def test_the_imported_graph_is_checked_before_the_first_pass(self):
    graph = import_jaxpr(jax.make_jaxpr(program)(_x(4)))
    graph.nodes[0].outputs[0].users = []  # users out of sync
    ctx = PassContext(options=js.SessionOptions())
    with self.assertRaisesRegex(js.PassError, "imported graph is invalid, before any "
                                "pass: users of .* out of sync"):
      pipeline.graph_optimizer().run(graph, ctx)
    self.assertEqual(ctx.records, [])


class StageTableTest(absltest.TestCase):

  def test_report_runs_the_table_in_its_order(self):
    sess = js.Session()
    gid = sess.compile(lambda x: (jnp.cos(x), jnp.exp(jnp.sin(x)))[1], _x(3))
    records = sess.report(gid).passes
    self.assertEqual(_run_order(records), _flat(pipeline.PIPELINE))
    optimize = [r for r in records if r.stage == "Optimize"]
    sweep = [p.name for p in pipeline.PIPELINE["Optimize"]]
    self.assertEqual([r.name for r in optimize[:len(sweep)]], sweep)  # the first sweep: all
    # dce changed the graph (the dead cos): a second sweep, in the table's
    # order, of the passes that have not run since the last change (the ones
    # after dce found nothing on the graph as it is now)
    again = [r.name for r in optimize[len(sweep):]]
    self.assertEqual(again, ["dce"])
    self.assertTrue(optimize[0].changed and not any(r.changed for r in optimize[1:]))
    self.assertEqual(tuple(pipeline.PIPELINE), pipeline.GRAPH_STAGES)

  def test_every_built_in_pass_is_a_pass_class_in_its_own_module(self):
    for stage, passes in pipeline.PIPELINE.items():
      for pass_ in passes:
        cls = type(pass_)
        self.assertTrue(cls.__module__.startswith("jaxsession.optimizer_passes."), cls)
        self.assertNotIsInstance(pass_, FunctionPass)
        self.assertEqual(cls.name, pass_.name)  # named by its class, not per instance
        self.assertIn("run", [k for c in cls.__mro__ for k in vars(c)])
        self.assertRegex(sys.modules[cls.__module__].__doc__,  # says what must run first
                         r"[Nn]eeds|[Rr]uns? (after|before|first)|before it")
    required = [p.name for passes in pipeline.PIPELINE.values() for p in passes if p.required]
    self.assertEqual(required, ["select_kernels", "place_nodes", "move_into_readers",
                                "insert_transfers",
                                "partition_nodes", "assign_streams", "plan_memory"])

  def test_disabled_and_user_passes_keep_the_table_order(self):
    _registered(self, AddHostCallback(), stage="HardwareOptimize")
    disabled = ["cse", "fuse_gelu", "reorder_for_partitions"]
    sess = js.Session(js.SessionOptions(disabled_passes=disabled))
    x = _x(6)
    gid = sess.compile(program, x)
    self.assertEqual(_run_order(sess.report(gid).passes),
                     _flat(pipeline.stage_passes(), disabled))
    self.assertIn(("HardwareOptimize", "add_host_callback"), _flat(pipeline.stage_passes()))
    x = _x(6)
    assert_same_bits(sess.run(gid, x), jax.jit(program_with_callback)(x), "disabled")


if __name__ == "__main__":
  absltest.main()
