"""runtime/allreduce: the all-reduce bucket plan (dp_partial + allreduce_bucket).

Real tests need 8 CPU devices, which must be configured before JAX
initializes, so each runs its program in a fresh subprocess and hands its
findings back as JSON. They compile with XLA:CPU's all-reduce combiner
disabled (it merges every all-reduce into one whatever the thresholds), so
the executable's all-reduce count is the session's own plan. The bucketing
rules themselves are pinned in-process on hand-made points.
"""
import textwrap
import types

from absl.testing import absltest
import pytest

from tests.subproc import run_json
import numpy as np
from jax.core import ShapedArray

from jaxsession.runtime import allreduce

_PRELUDE = """
import json
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
import jaxsession as js
assert len(jax.devices()) == 8, jax.devices()
mesh = Mesh(jax.devices(), ("data",))
NO_COMBINER = {"xla_disable_hlo_passes": "cpu-all-reduce-combiner"}

def count_allreduces(sess, gid):
  text = sess.executables(gid)[0].as_text()
  return sum((" all-reduce(" in line or "all-reduce-start(" in line)
             for line in text.splitlines())

def plan_of(sess, gid):
  plan = getattr(sess.graph(gid), "allreduce_plan", None)
  if plan is None:
    return None
  return {"buckets": [dict(index=b.index, bytes=b.bytes, members=b.members, closed=b.closed,
                           serves=b.serves) for b in plan.buckets],
          "describe": plan.describe(), "left": plan.left}

def ops(sess, gid):
  return [n.op for n in sess.graph(gid).nodes]

def mlp(sizes=(16, 32, 32, 4), batch=64, seed=0):
  rng = np.random.default_rng(seed)
  params = [(rng.standard_normal((a, b)).astype(np.float32) * 0.3,
             rng.standard_normal(b).astype(np.float32) * 0.1)
            for a, b in zip(sizes[:-1], sizes[1:])]
  xs = [rng.standard_normal((batch, sizes[0])).astype(np.float32) for _ in range(3)]
  ys = [rng.standard_normal((batch, sizes[-1])).astype(np.float32) for _ in range(3)]
  return params, xs, ys

def mlp_loss(p, x, y):
  h = x
  for i, (w, b) in enumerate(p):
    h = h @ w + b
    if i < len(p) - 1:
      h = jnp.tanh(h)
  return jnp.mean((h - y) ** 2)

def sgd_step(p, x, y):
  loss, g = jax.value_and_grad(mlp_loss)(p, x, y)
  return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss

def leaf_err(got, want):
  '''max |got - want| / (|want| + max |want|): an rtol with an absolute
  floor at the leaf's scale, for entries where the sum cancels to near 0.'''
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = np.max(np.abs(want)) if want.size else 0.0
  return float(np.max(np.abs(got - want) / (np.abs(want) + scale + 1e-30))) if want.size else 0.0

def run_session(step, state, xs, ys, sess_options):
  sess = js.Session(sess_options)
  gid = sess.compile(step, state, xs[0], ys[0], state_argnums=0)
  losses = [float(sess.run(gid, x, y)) for x, y in zip(xs, ys)]
  return sess, gid, losses, [np.asarray(a) for a in jax.tree.leaves(sess.get_state(gid)[0])]

def compare(step, state, xs, ys, sess_options, gspmd=False):
  '''3 steps in the session and in single-device jax.jit: their results,
  the plan and the executable's all-reduce count; with `gspmd`, also whether
  the session without the plan (GSPMD's own all-reduces) gives the same bits.'''
  sess, gid, losses, got = run_session(step, state, xs, ys, sess_options)
  ref = jax.jit(step)  # unsharded numpy arguments: one device
  ref_state, ref_losses = state, []
  for x, y in zip(xs, ys):
    ref_state, loss = ref(ref_state, x, y)
    ref_losses.append(float(loss))
  want = [np.asarray(a) for a in jax.tree.leaves(ref_state)]
  out = {"allreduces": count_allreduces(sess, gid), "plan": plan_of(sess, gid),
         "ops": ops(sess, gid), "losses": losses, "ref_losses": ref_losses,
         "state_err": max(leaf_err(g, w) for g, w in zip(got, want)), "leaves": len(want),
         "dump": sess.graph(gid).dump()}
  if gspmd:
    import dataclasses
    plain = dataclasses.replace(sess_options, allreduce_bucket_bytes=None,
                                first_bucket_bytes=None)
    _, _, plain_losses, plain_state = run_session(step, state, xs, ys, plain)
    out["same_as_gspmd"] = plain_losses == losses and all(
        np.array_equal(a, b) for a, b in zip(plain_state, got))
  return out
"""


def run_jax(snippet):
  """Runs `snippet` after the 8-device prelude in a subprocess; the snippet
  sets `result`, which comes back decoded from JSON."""
  return run_json(_PRELUDE + textwrap.dedent(snippet) + "\nprint(json.dumps(result))\n",
                  env={"JAX_PLATFORMS": "cpu"})


# The session's arithmetic differs from single-device jax.jit only by
# summation order: each device sums its own rows, then the bucket sums the 8
# partials - what GSPMD's own all-reduces do too (the tests with gspmd=True
# find the same bits). In float32 that moves results by a few ulps: within
# 1e-6 relative after 3 steps, with an absolute floor at 1e-6 of each leaf's
# scale for entries where a gradient sum cancels to nearly zero (Adam's
# moments of such entries differ by 1e-5 relative while being 1e-8 in size).
RTOL = 1e-6


@pytest.mark.slow
class AllReducePlanTest(absltest.TestCase):

  def assert_matches_jit(self, r):
    np.testing.assert_allclose(r["losses"], r["ref_losses"], rtol=RTOL)
    self.assertLess(r["state_err"], RTOL)

  def test_mlp_sgd_buckets_group_gradients(self):
    r = run_jax("""
      params, xs, ys = mlp()
      result = compare(sgd_step, params, xs, ys, js.SessionOptions(
          mesh=mesh, allreduce_bucket_bytes=600, compiler_options=NO_COMBINER), gspmd=True)
      """)
    buckets = r["plan"]["buckets"]
    self.assertEqual(r["allreduces"], len(buckets))  # one all-reduce per planned bucket
    self.assertTrue(r["same_as_gspmd"])
    self.assertLess(len(buckets), r["leaves"])       # fewer than the gradient leaves
    self.assertEqual(r["ops"].count("allreduce_bucket"), len(buckets))
    # 6 gradients + the loss: every point is planned, each exactly once
    members = [m for b in buckets for m in b["members"]]
    self.assertLen(members, 7)
    self.assertLen(set(members), 7)
    self.assertEqual(r["ops"].count("dp_partial"), 7)
    for b in buckets[:-1]:
      self.assertTrue(b["bytes"] <= 600 or len(b["members"]) == 1, b)
      self.assertIn("full", b["closed"])
    self.assert_matches_jit(r)

  def test_without_plan_one_allreduce_per_reduction(self):
    """The baseline the plan improves on: GSPMD alone, combiner disabled."""
    r = run_jax("""
      params, xs, ys = mlp()
      result = compare(sgd_step, params, xs, ys,
                       js.SessionOptions(mesh=mesh, compiler_options=NO_COMBINER))
      """)
    self.assertIsNone(r["plan"])
    self.assertNotIn("dp_partial", r["ops"])
    self.assertEqual(r["allreduces"], 7)  # 6 gradient leaves + the loss
    self.assert_matches_jit(r)

  def test_pass_can_be_disabled(self):
    r = run_jax("""
      params, xs, ys = mlp()
      result = compare(sgd_step, params, xs, ys, js.SessionOptions(
          mesh=mesh, allreduce_bucket_bytes=600, compiler_options=NO_COMBINER,
          disabled_passes=("plan_allreduce",)))
      """)
    self.assertNotIn("allreduce_bucket", r["ops"])
    self.assertEqual(r["allreduces"], 7)

  def test_loop_sink(self):
    """steps=N runs the planned graph in a loop: the same bits as N runs."""
    r = run_jax("""
      params, xs, ys = mlp()
      o = js.SessionOptions(mesh=mesh, allreduce_bucket_bytes=600, compiler_options=NO_COMBINER)
      s1, g1, l1, st1 = run_session(sgd_step, params, xs, ys, o)
      s2 = js.Session(o)
      g2 = s2.compile(sgd_step, params, xs[0], ys[0], state_argnums=0)
      l2 = np.asarray(s2.run(g2, np.stack(xs), np.stack(ys), steps=3)).tolist()
      st2 = [np.asarray(a) for a in jax.tree.leaves(s2.get_state(g2)[0])]
      result = {"l1": l1, "l2": l2, "same": all(np.array_equal(a, b) for a, b in zip(st1, st2)),
                "buckets": ops(s2, g2).count("allreduce_bucket")}
      """)
    self.assertGreater(r["buckets"], 1)
    self.assertEqual(r["l1"], r["l2"])
    self.assertTrue(r["same"])

  def test_zero_gradients_are_reduce_scattered(self):
    """Under "zero" a gradient whose leaf is sharded is reduce-scattered into
    the leaf's layout, summed in the devices' order as the all-reduce sums
    (RTOL against jax.jit: the plan's summation order); the collective bytes
    are 1/8 of replicated training's; a sunk run gives N runs' bits."""
    r = run_jax("""
      from jaxsession.runtime import collectives
      params, xs, ys = mlp(sizes=(16, 32, 64, 8))
      def bytes_of(sess, gid):
        kinds = {}
        for c in sess.report(gid).collectives:
          kinds[c.kind] = kinds.get(c.kind, 0) + c.bytes
        return kinds
      out = {}
      for specs in (None, "zero"):
        o = js.SessionOptions(mesh=mesh, allreduce_bucket_bytes=1 << 20)
        sess = js.Session(o)
        gid = sess.compile(sgd_step, params, xs[0], ys[0], state_argnums=0, state_specs=specs)
        losses = [float(sess.run(gid, x, y)) for x, y in zip(xs, ys)]
        got = [np.asarray(a) for a in jax.tree.leaves(sess.get_state(gid)[0])]
        sunk = js.Session(o)
        g2 = sunk.compile(sgd_step, params, xs[0], ys[0], state_argnums=0, state_specs=specs)
        l2 = np.asarray(sunk.run(g2, np.stack(xs), np.stack(ys), steps=3)).tolist()
        st2 = [np.asarray(a) for a in jax.tree.leaves(sunk.get_state(g2)[0])]
        ref_state, ref_losses = params, []
        for x, y in zip(xs, ys):
          ref_state, loss = jax.jit(sgd_step)(ref_state, x, y)
          ref_losses.append(float(loss))
        want = [np.asarray(a) for a in jax.tree.leaves(ref_state)]
        plan = sess.graph(gid).allreduce_plan
        out[str(specs)] = {
            "bytes": bytes_of(sess, gid), "losses": losses, "ref": ref_losses,
            "err": max(leaf_err(g, w) for g, w in zip(got, want)),
            "scatters": [s.describe(plan.devices) for s in plan.scatters],
            "sunk_same": l2 == losses and all(np.array_equal(a, b) for a, b in zip(got, st2)),
            "dump": sess.graph(gid).dump()}
      result = out
      """)
    rep, zero = r["None"], r["zero"]
    self.assertEqual(rep["scatters"], [])
    self.assertNotIn("reduce-scatter", rep["bytes"])
    self.assertLen(zero["scatters"], 6)  # every weight and bias gradient
    self.assertIn("reduce-scatter", zero["bytes"])
    self.assertIn("reduce-scatter: node", zero["dump"])
    moved = zero["bytes"].get("all-reduce", 0) + zero["bytes"]["reduce-scatter"]
    self.assertLessEqual(moved, rep["bytes"]["all-reduce"] / 8 + 64)  # + the loss's
    for run in (rep, zero):  # RTOL: the plan's summation order (why: above RTOL)
      np.testing.assert_allclose(run["losses"], run["ref"], rtol=RTOL)
      self.assertLess(run["err"], RTOL)
      self.assertTrue(run["sunk_same"])

  def test_reduction_after_unknown_op_left_to_gspmd(self):
    """Rows sorted along the batch axis: the rules lose the rows, so the sums
    after the sort (and w1's gradient, through its gather) are not planned -
    GSPMD handles them; w2's gradient, away from the sort, still is."""
    r = run_jax("""
      rng = np.random.default_rng(3)
      w = [rng.standard_normal((8, 4)).astype(np.float32) for _ in range(2)]
      xs = [rng.standard_normal((32, 8)).astype(np.float32) for _ in range(3)]
      ys = [rng.standard_normal((32, 4)).astype(np.float32) for _ in range(3)]
      def step(w, x, y):
        def loss_fn(w):
          sorted_ = jnp.sum((jnp.sort(x @ w[0], axis=0) - y) ** 2)
          return (sorted_ + jnp.sum((x @ w[1] - y) ** 2)) / 32
        loss, g = jax.value_and_grad(loss_fn)(w)
        return [a - 0.01 * b for a, b in zip(w, g)], loss
      result = compare(step, w, xs, ys, js.SessionOptions(
          mesh=mesh, allreduce_bucket_bytes=1 << 20, compiler_options=NO_COMBINER))
      """)
    plan = r["plan"]
    self.assertTrue(any("'reduce_sum'" in why for why in plan["left"]), plan)
    (bucket,) = plan["buckets"]
    self.assertIn("state 0 (arg 0)[1]", bucket["serves"])
    self.assertNotIn("state 0 (arg 0)[0]", bucket["serves"])
    self.assert_matches_jit(r)

  def test_rows_on_the_second_axis_of_a_mesh(self):
    """The plan sums over the axis the rows are split on (it took the mesh's
    first always: rows on 'data' of a ('model', 'data') mesh were planned
    over 'model', found no sum and said nothing - a review's find); rows
    over two axes at once or no rows at all say why there is no plan. Bits
    as jax.jit with the same shardings."""
    r = run_jax("""
      from jax.sharding import NamedSharding, PartitionSpec as P
      grid = Mesh(np.array(jax.devices()).reshape(2, 4), ("model", "data"))
      params, xs, ys = mlp(batch=16, seed=5)
      result = {}
      for name, spec in (("data", P("data")), ("model", P("model")),
                         ("both", P(("model", "data"))), ("none", P(None, "data"))):
        sess = js.Session(js.SessionOptions(mesh=grid, allreduce_bucket_bytes=1 << 20))
        gid = sess.compile(sgd_step, params, xs[0], ys[0], state_argnums=0,
                           in_specs=(spec, spec))
        loss = sess.run(gid, xs[0], ys[0])
        put = lambda a, s: jax.device_put(a, NamedSharding(grid, s))
        want_p, want_loss = jax.jit(sgd_step)(put(params, P()), put(xs[0], spec),
                                              put(ys[0], spec))
        same = np.array_equal(np.asarray(loss), np.asarray(want_loss)) and all(
            np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
            zip(jax.tree.leaves(sess.get_state(gid)[0]), jax.tree.leaves(want_p)))
        result[name] = {"plan": plan_of(sess, gid), "same": bool(same)}
      """)
    for name in ("data", "model"):
      self.assertTrue(r[name]["same"], name)
      self.assertIn(f"over mesh axis '{name}' (", r[name]["plan"]["describe"][0])
      self.assertLen(r[name]["plan"]["buckets"], 1)
    self.assertIn("mesh axes ('model', 'data') at once", " ".join(r["both"]["plan"]["left"]))
    self.assertIn("no run argument is split on its leading axis",
                  " ".join(r["none"]["plan"]["left"]))
    for name in ("both", "none"):
      self.assertTrue(r[name]["same"], name)
      self.assertEqual(r[name]["plan"]["buckets"], [])

  def test_tiny_buckets_one_per_point(self):
    r = run_jax("""
      params, xs, ys = mlp()
      result = compare(sgd_step, params, xs, ys, js.SessionOptions(
          mesh=mesh, allreduce_bucket_bytes=1, compiler_options=NO_COMBINER))
      """)
    buckets = r["plan"]["buckets"]
    self.assertLen(buckets, 7)
    self.assertTrue(all(len(b["members"]) == 1 for b in buckets))
    self.assertEqual(r["allreduces"], 7)
    self.assert_matches_jit(r)

  def test_one_big_bucket(self):
    r = run_jax("""
      params, xs, ys = mlp()
      result = compare(sgd_step, params, xs, ys, js.SessionOptions(
          mesh=mesh, allreduce_bucket_bytes=1 << 20, compiler_options=NO_COMBINER))
      """)
    (bucket,) = r["plan"]["buckets"]
    self.assertLen(bucket["members"], 7)
    self.assertEqual(r["allreduces"], 1)
    # the bucket serves every parameter leaf and the loss
    self.assertLen(bucket["serves"], 7)
    self.assertIn("output 0", bucket["serves"])
    self.assert_matches_jit(r)

  def test_first_bucket_bytes(self):
    r = run_jax("""
      params, xs, ys = mlp()
      opts = lambda **kw: js.SessionOptions(mesh=mesh, allreduce_bucket_bytes=1 << 20,
                                            compiler_options=NO_COMBINER, **kw)
      result = {"plain": compare(sgd_step, params, xs, ys, opts()),
                "first": compare(sgd_step, params, xs, ys, opts(first_bucket_bytes=20))}
      """)
    plain, first = r["plain"]["plan"]["buckets"], r["first"]["plan"]["buckets"]
    self.assertLen(plain, 1)
    self.assertLen(first, 2)
    # the loss (4 B) and the last bias gradient (16 B) fill the first 20 B
    self.assertEqual(first[0]["bytes"], 20)
    self.assertLen(first[0]["members"], 2)
    self.assertIn("> 20 B", first[0]["closed"])
    self.assertLen(first[1]["members"], 5)
    self.assertEqual(r["first"]["allreduces"], 2)
    self.assertEqual(r["plain"]["allreduces"], 1)
    self.assert_matches_jit(r["first"])

  def test_adamw(self):
    r = run_jax("""
      import optax
      params, xs, ys = mlp(seed=1)
      opt = optax.adamw(1e-2, weight_decay=1e-3)
      def step(state, x, y):
        p, o = state
        loss, g = jax.value_and_grad(mlp_loss)(p, x, y)
        updates, o = opt.update(g, o, p)
        return (optax.apply_updates(p, updates), o), loss
      result = compare(step, (params, opt.init(params)), xs, ys, js.SessionOptions(
          mesh=mesh, allreduce_bucket_bytes=1024, compiler_options=NO_COMBINER), gspmd=True)
      """)
    self.assertTrue(r["same_as_gspmd"])
    buckets = r["plan"]["buckets"]
    self.assertGreater(len(buckets), 1)
    self.assertLess(len(buckets), 6)
    self.assertEqual(r["allreduces"], len(buckets))
    self.assert_matches_jit(r)

  def test_batchnorm_statistics_split_buckets(self):
    """A mean over the batch in the forward pass feeds the variance and
    every gradient after it: they cannot share its all-reduce."""
    r = run_jax("""
      rng = np.random.default_rng(2)
      params = {"w1": rng.standard_normal((8, 16)).astype(np.float32) * 0.5,
                "g": np.ones(16, np.float32), "b": np.zeros(16, np.float32),
                "w2": rng.standard_normal((16, 2)).astype(np.float32) * 0.5}
      xs = [rng.standard_normal((32, 8)).astype(np.float32) for _ in range(3)]
      ys = [rng.standard_normal((32, 2)).astype(np.float32) for _ in range(3)]
      def loss_fn(p, x, y):
        h = x @ p["w1"]
        mean = h.mean(0)
        var = ((h - mean) ** 2).mean(0)
        h = (h - mean) * jax.lax.rsqrt(var + 1e-5) * p["g"] + p["b"]
        h = jax.nn.relu(h) @ p["w2"]
        return jnp.mean((h - y) ** 2)
      def step(p, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        return jax.tree.map(lambda a, b: a - 0.05 * b, p, g), loss
      result = compare(step, params, xs, ys, js.SessionOptions(
          mesh=mesh, allreduce_bucket_bytes=1 << 20, compiler_options=NO_COMBINER), gspmd=True)
      """)
    self.assertTrue(r["same_as_gspmd"])
    buckets = r["plan"]["buckets"]
    self.assertGreater(len(buckets), 1)  # one size limit would take everything: deps split
    self.assertTrue(any("depends on member node" in b["closed"] for b in buckets), buckets)
    self.assertEqual(r["allreduces"], len(buckets))
    self.assert_matches_jit(r)

  def test_dump_shows_buckets(self):
    r = run_jax("""
      params, xs, ys = mlp()
      result = compare(sgd_step, params, xs, ys, js.SessionOptions(
          mesh=mesh, allreduce_bucket_bytes=600, compiler_options=NO_COMBINER))
      """)
    dump = r["dump"]
    n = len(r["plan"]["buckets"])
    self.assertEqual(dump.count("= allreduce_bucket["), n)
    for b in range(n):
      self.assertIn(f"# all-reduce bucket {b}:", dump)
    self.assertIn("= dp_partial[", dump)
    self.assertIn("@P('data',) = dp_partial", dump)  # each device keeps its partial
    describe = r["plan"]["describe"]
    self.assertIn(f"{n} bucket(s)", describe[0])
    self.assertLen(describe, 1 + n)


def _point(nid, shape, dtype=np.float32, upstream=0):
  """A stand-in reduction point: (node, split axes, dependency mask)."""
  out = types.SimpleNamespace(aval=ShapedArray(shape, np.dtype(dtype)))
  return (types.SimpleNamespace(id=nid, outputs=[out]), (0,), upstream)


class PlanBucketsTest(absltest.TestCase):
  """plan_buckets on hand-made points: sizes, first bucket, deps, dtypes."""

  def members(self, buckets):
    return [b["points"] for b in buckets]

  def test_limit_and_first_bucket(self):
    points = [_point(i, (4,)) for i in range(5)]  # 16 B each
    self.assertEqual(self.members(allreduce.plan_buckets(points, 32, 32)),
                     [[0, 1], [2, 3], [4]])
    self.assertEqual(self.members(allreduce.plan_buckets(points, 48, 16)),
                     [[0], [1, 2, 3], [4]])

  def test_big_value_gets_its_own_bucket(self):
    points = [_point(0, (4,)), _point(1, (100,)), _point(2, (4,))]
    buckets = allreduce.plan_buckets(points, 64, 64)
    self.assertEqual(self.members(buckets), [[0], [1], [2]])
    self.assertEqual(buckets[1]["bytes"], 400)

  def test_dependency_closes_bucket(self):
    points = [_point(0, (4,)), _point(1, (4,)), _point(2, (4,), upstream=0b01)]
    buckets = allreduce.plan_buckets(points, 1 << 20, 1 << 20)
    self.assertEqual(self.members(buckets), [[0, 1], [2]])
    self.assertIn("node 2 depends on member node 0", buckets[0]["closed"])

  def test_dtype_closes_bucket(self):
    points = [_point(0, (4,)), _point(1, (4,), np.float16), _point(2, (4,), np.float16)]
    buckets = allreduce.plan_buckets(points, 1 << 20, 1 << 20)
    self.assertEqual(self.members(buckets), [[0], [1, 2]])
    self.assertIn("float16", buckets[0]["closed"])


if __name__ == "__main__":
  absltest.main()
