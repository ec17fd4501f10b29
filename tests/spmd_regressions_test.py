"""Regressions under a mesh of 8 CPU devices: each case failed before its
fix (found by reviews), plus per-compile XLA options."""
from absl.testing import absltest
import pytest

from tests.subproc import HELPERS, SnippetTest, run_json

REGRESSIONS = r"""
import json
from functools import partial
import numpy as np, jax, jax.numpy as jnp, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jaxsession as js

mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
rng = np.random.default_rng(5)
out = {}
x = rng.standard_normal((16, 4)).astype(np.float32)

# swapping two leaves of different layouts in a sunk run keeps each slot's layout
def swap(s, x):
  return {"a": s["b"].reshape(8, 4).T.reshape(4, 8) * 1.0, "b": s["a"]}, jnp.sum(x)
s0 = {"a": rng.standard_normal((4, 8)).astype(np.float32),
      "b": rng.standard_normal((4, 8)).astype(np.float32)}
sess = js.Session(js.SessionOptions(mesh=mesh))
gid = sess.compile(swap, s0, x, state_argnums=0, state_specs=({"a": P("data", "model"), "b": P("model")},))
sess.run(gid, np.stack([x, x]), steps=2)
out["sunk_layout"] = [str(l.sharding.spec) for l in jax.tree.leaves(sess.get_state(gid)[0])]
out["run_after_sunk"] = err(lambda: float(sess.run(gid, x)))

# an empty state leaf under a spec that would split it
def grow(s, x):
  return {"w": s["w"] + 1, "e": s["e"] * 2}, jnp.sum(x)
e0 = {"w": np.ones((8,), np.float32), "e": np.zeros((0, 8), np.float32)}
eid = sess.compile(grow, e0, x, state_argnums=0, state_specs="zero")
out["empty_runs"] = [err(lambda: float(sess.run(eid, x))) for _ in range(3)]

# shard_map inside the step (gradients summed by its own psum), vs jax.jit
w = rng.standard_normal((4, 3)).astype(np.float32)
y = rng.standard_normal((16, 3)).astype(np.float32)
mesh1 = Mesh(np.array(jax.devices()), ("data",))
@partial(jax.shard_map, mesh=mesh1, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P()))
def local_grad(w, x, y):
  l, g = jax.value_and_grad(lambda w: jnp.sum((x @ w - y) ** 2))(w)
  return jax.lax.psum(g, "data") / 16, jax.lax.psum(l, "data") / 16
def sm_step(w, x, y):
  g, l = local_grad(w, x, y)
  return w - 0.1 * g, l
s1 = js.Session(js.SessionOptions(mesh=mesh1))
sid = s1.compile(sm_step, w, x, y, state_argnums=0)
got = s1.run(sid, x, y)
ref_w, ref_l = jax.jit(sm_step)(w, x, y)
out["shard_map_bits"] = [np.asarray(got).tobytes() == np.asarray(ref_l).tobytes(),
                         np.asarray(s1.get_state(sid)[0]).tobytes() == np.asarray(ref_w).tobytes()]

# integer-label cross-entropy with all-reduce buckets
def ce_step(p, x, labels):
  def loss(p):
    logits = x @ p["w"] + p["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  l, g = jax.value_and_grad(loss)(p)
  return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), l
p0 = {"w": rng.standard_normal((4, 5)).astype(np.float32), "b": np.zeros((5,), np.float32)}
labels = rng.integers(0, 5, (16,)).astype(np.int32)
s2 = js.Session(js.SessionOptions(mesh=mesh1, allreduce_bucket_bytes=4096))
cid = s2.compile(ce_step, p0, x, labels, state_argnums=0)
l = s2.run(cid, x, labels)
out["ce_rel"] = abs(float(l) - float(jax.jit(ce_step)(p0, x, labels)[1])) / abs(float(l))

# a sunk run whose outputs mix a host value and device values; collectives
# are read from every partition's executable
def mixed(w, x):
  m = jax.pure_callback(lambda a: np.asarray(a).max(), jax.ShapeDtypeStruct((), np.float32), x)
  return w * 1.0, (x * 2.0, m)
xs1 = rng.standard_normal((16, 4)).astype(np.float32)
mid = s1.compile(mixed, w, xs1, state_argnums=0)
ys, ms = s1.run(mid, np.stack([xs1, xs1 + 1, xs1 - 1]), steps=3)
out["sunk_mixed"] = [list(ys.shape), [float(v) for v in ms],
                     [float(xs1.max()), float((xs1 + 1).max()), float((xs1 - 1).max())]]
def host_then_grad(w, x):  # the batch mean before the callback: an all-reduce
  g = jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
  scale = jax.pure_callback(lambda a: np.float32(1 / (1 + np.abs(a).max())),
                            jax.ShapeDtypeStruct((), np.float32), g)
  return w - scale * g, scale
hid = s1.compile(host_then_grad, w, xs1, state_argnums=0)
out["plan_collectives"] = [c.kind for c in s1.report(hid).collectives]

# ZeRO stage 1 proper: params replicated, only the optimizer state sharded
def sgd_momentum(p, m, x):
  g = jax.grad(lambda p: jnp.mean((x @ p) ** 2))(p)
  m = 0.9 * m + g
  return p - 0.1 * m, m, jnp.sum(x)
p8 = rng.standard_normal((4, 8)).astype(np.float32)
m8 = rng.standard_normal((4, 8)).astype(np.float32)
m8[0, :3] = [-0.0, 1e-40, 3e38]  # a signed zero, a subnormal, a large value
zero_bits = {}
for specs in ((None, "zero"), "zero", None):
  s1z = js.Session(js.SessionOptions(mesh=mesh1))
  zid = s1z.compile(sgd_momentum, p8, m8, xs1, state_argnums=(0, 1), state_specs=specs)
  zp, zm = s1z.get_state(zid)
  if specs == (None, "zero"):
    out["zero1_specs"] = [str(zp.sharding.spec), str(zm.sharding.spec)]
  # jax.jit with the identical shardings, in and out, on the same fresh inputs
  xsh = NamedSharding(mesh1, P("data"))
  ref = jax.jit(sgd_momentum, in_shardings=(zp.sharding, zm.sharding, xsh),
                out_shardings=(zp.sharding, zm.sharding, None))
  rp, rm = jax.device_put(p8, zp.sharding), jax.device_put(m8, zm.sharding)
  same = []
  for step in range(4):
    xt = rng.standard_normal((16, 4)).astype(np.float32)
    loss = s1z.run(zid, xt)
    rp, rm, rloss = ref(rp, rm, jax.device_put(xt, xsh))
    sp, sm = s1z.get_state(zid)
    same.append([np.asarray(a).tobytes() == np.asarray(b).tobytes()
                 for a, b in ((sp, rp), (sm, rm), (loss, rloss))])
  zero_bits[str(specs)] = same
out["zero_bits"] = zero_bits

# the memory plan under a mesh is per device
def tanh_step(w, x):
  loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
  return w - 0.1 * g, loss
wm, xm = np.ones((64, 128), np.float32), np.ones((256, 64), np.float32)
mem = {}
for name, options in (("mesh", js.SessionOptions(mesh=mesh1)), ("one", js.SessionOptions())):
  s3 = js.Session(options)
  g3 = s3.compile(tanh_step, wm, xm, state_argnums=0, state_specs="zero" if name == "mesh" else None)
  mem[name] = list(s3.report(g3).memory) + [str(s3.report(g3))]
out["memory"] = mem

# bad specs and deleted arrays are InputErrors naming where
out["dup_axis"] = err(lambda: sess.compile(swap, s0, x, state_argnums=0, in_specs=(P("data", "data"),)))
gone = jnp.array(s0["a"])
gone.delete()
out["deleted_set_state"] = err(lambda: sess.set_state(gid, {"a": gone, "b": s0["b"]}))
# js.jit given arrays sharded over the mesh, or committed to another device,
# runs where jax.jit does; a meshless Session refuses a sharded example clearly
xm = jax.device_put(jnp.asarray(rng.standard_normal((8, 4)), jnp.float32),
                    NamedSharding(mesh, P("data", "model")))
x2 = jax.device_put(jnp.asarray(rng.standard_normal(4), jnp.float32), jax.devices()[2])
sin = lambda v: jnp.sin(v) * 2 + 1
placed = []
for v in (xm, x2):
  a, b = jax.jit(sin)(v), js.jit(sin)(v)
  placed.append([np.asarray(a).tobytes() == np.asarray(b).tobytes(), a.sharding == b.sharding])
out["jit_placed"] = placed
out["meshless_sharded_example"] = err(lambda: js.Session().compile(sin, xm))
# a mesh of Explicit axes (jax.make_mesh's default) runs as its Auto copy:
# the same bits as the session and jax.jit on an Auto mesh, with arguments
# and set_state values laid out on the Explicit mesh, and inside
# `with jax.set_mesh(...)` (a compile, sunk and chunked runs, an eager run)
from jax.sharding import AxisType
emesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
def mom_step(w, m, x):
  l, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
  m = 0.9 * m + g
  return w - 0.1 * m, m, l
we = rng.standard_normal((8, 16)).astype(np.float32)
me = rng.standard_normal((8, 16)).astype(np.float32)
me[0, :2] = [-0.0, np.inf]
xe = [rng.standard_normal((32, 8)).astype(np.float32) for _ in range(3)]
bits = {}
for label, m_ in (("explicit", emesh), ("auto", mesh1)):
  se = js.Session(js.SessionOptions(mesh=m_))
  eid = se.compile(mom_step, we, me, xe[0], state_argnums=(0, 1), state_specs="zero")
  ls = [se.run(eid, xe[0]), se.run(eid, jax.device_put(xe[1], NamedSharding(m_, P("data"))))]
  ls.append(se.run(eid, np.stack([xe[2]]), steps=1))
  bits[label] = [np.asarray(a).tobytes() for a in (*ls, *se.get_state(eid))]
  if label == "explicit":
    se.set_state(eid, jax.device_put(we, NamedSharding(emesh, P())),
                 jax.device_put(me, NamedSharding(emesh, P(None, "data"))))
    bits["after_set_state"] = np.asarray(se.run(eid, xe[0])).tobytes() == bits["explicit"][0]
    sp, sm = se.get_state(eid)
zp, zm = sp.sharding, sm.sharding
ref = jax.jit(mom_step, in_shardings=(zp, zm, NamedSharding(mesh1, P("data"))),
              out_shardings=(zp, zm, None))
rw, rm_ = jax.device_put(we, zp), jax.device_put(me, zm)
jl = []
for xt in xe:
  rw, rm_, l = ref(rw, rm_, xt)
  jl.append(np.asarray(l).tobytes())
bits["jit"] = jl + [np.asarray(rw).tobytes(), np.asarray(rm_).tobytes()]
# inside the context: examples made there (typed by the Explicit mesh), a
# first sunk run, then another steps value (chunks of 2 + 1, whose join was
# compiled after the first chunk had consumed the state: the state was lost)
xs3 = np.stack([xe[0], xe[1], xe[2]])
auto = js.Session(js.SessionOptions(mesh=mesh1))
aid = auto.compile(mom_step, we, me, xe[0], state_argnums=(0, 1), state_specs="zero")
auto.run(aid, xe[0]); auto.run(aid, np.stack(xe[1:]), steps=2)
chunked_want = np.asarray(auto.run(aid, xs3, steps=3)).tobytes()
state_want = [np.asarray(a).tobytes() for a in auto.get_state(aid)]
with jax.set_mesh(emesh):
  se = js.Session(js.SessionOptions(mesh=emesh))
  eid = se.compile(mom_step, jnp.asarray(we), jnp.asarray(me), jnp.asarray(xe[0]),
                   state_argnums=(0, 1), state_specs="zero")
  under = [np.asarray(se.run(eid, xe[0])).tobytes()]
  under.append(np.asarray(se.run(eid, np.stack(xe[1:]), steps=2)).tobytes())
  under.append(np.asarray(se.run(eid, xs3, steps=3)).tobytes() == chunked_want)
  under.append([np.asarray(a).tobytes() for a in se.get_state(eid)] == state_want)
  with jax.disable_jit():
    under.append(err(lambda: float(se.run(eid, xe[0]))))
bits["under_set_mesh"] = [under[0] == bits["explicit"][0],
                          under[1] == bits["explicit"][1] + bits["explicit"][2], *under[2:]]
out["explicit_mesh"] = {k: v if k in ("after_set_state", "under_set_mesh") else
                        [b == bits["auto"][i] for i, b in enumerate(v)]
                        for k, v in bits.items()}

# CSE under a mesh: a model applied twice, AdamW with clipping, a sunk run
# against jax.jit's scan with the same shardings (14 of 19 leaves differed)
def twice_init(key, sizes):
  ps = []
  for a, b in zip(sizes[:-1], sizes[1:]):
    k1, k2, key = jax.random.split(key, 3)
    ps.append({"w": jax.random.normal(k1, (a, b)) / np.sqrt(a),
               "b": jax.random.normal(k2, (b,)) * 0.1})
  return ps
def twice_apply(ps, x):
  for i, l in enumerate(ps):
    x = x @ l["w"] + l["b"]
    x = jax.nn.relu(x) if i < len(ps) - 1 else x
  return x
tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2))
def twice_step(p, o, batch):
  bx, by = batch
  loss, g = jax.value_and_grad(lambda p: jnp.mean(
      (twice_apply(p, bx * 0.5) + twice_apply(p, bx) - by) ** 2))(p)
  u, o = tx.update(g, o, p)
  return optax.apply_updates(p, u), o, loss
tp = twice_init(jax.random.key(0), [12, 40, 24, 3])
to = tx.init(tp)
stk = (rng.standard_normal((4, 32, 12)).astype(np.float32),
       rng.standard_normal((4, 32, 3)).astype(np.float32))
ts = js.Session(js.SessionOptions(mesh=mesh1))
tid = ts.compile(twice_step, tp, to, jax.tree.map(lambda a: a[0], stk), state_argnums=(0, 1))
tsh = jax.tree.map(lambda a: a.sharding, ts.get_state(tid))
bsh = NamedSharding(mesh1, P(None, "data"))
def twice_scan(p, o, bs):
  (p, o), l = jax.lax.scan(lambda c, b: (lambda r: ((r[0], r[1]), r[2]))(
      twice_step(c[0], c[1], b)), (p, o), bs)
  return p, o, l
tref = jax.jit(twice_scan, in_shardings=(tsh[0], tsh[1], (bsh, bsh)),
               out_shardings=(tsh[0], tsh[1], NamedSharding(mesh1, P())))
tl = ts.run(tid, stk, steps=4)
wp, wo, wl = tref(tp, to, stk)
out["cse_sunk_bits"] = [np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(
    jax.tree.leaves((ts.get_state(tid), tl)), jax.tree.leaves(((wp, wo), wl)))]

# the same program compiled outside jax.set_mesh and inside it, in one session
# (the compile cache handed the second the first's executable), both orders
def acc(s, v):
  return s + v, jnp.sum(s * v)
def doubled(v):
  return v * 2.0, jnp.sum(v)
v8 = jnp.arange(8.0)
placed_ok = []
for inside_first in (False, True):
  cs = js.Session()
  gids = []
  for inside in ((True, False) if inside_first else (False, True)):
    if inside:
      with jax.set_mesh(mesh):
        gids.append((cs.compile(doubled, v8), True))
    else:
      gids.append((cs.compile(doubled, v8), False))
  for cg, inside in gids:
    if inside:
      with jax.set_mesh(mesh):
        got, want = cs.run(cg, v8), jax.jit(doubled)(v8)
    else:
      got, want = cs.run(cg, v8), jax.jit(doubled)(v8)
    placed_ok.append([np.asarray(got[0]).tobytes() == np.asarray(want[0]).tobytes(),
                      got[0].sharding == want[0].sharding])
out["set_mesh_cache"] = placed_ok

# a tied-embedding model applied twice under "zero": fuse_matmul_bias kept two
# fused copies of what XLA merges in jax.jit's program (SGD state off jax.jit's)
V, D = 32, 16
tied = {"emb": rng.standard_normal((V, D)).astype(np.float32) * 0.3,
        "w1": rng.standard_normal((D, D)).astype(np.float32) * 0.3,
        "b1": rng.standard_normal((D,)).astype(np.float32) * 0.1}
def tied_model(p, tok):
  h = p["emb"][tok]
  for _ in range(2):
    h = jnp.tanh(h @ p["w1"] + p["b1"])
  return h @ p["emb"].T
def tied_step(p, tok, tgt):
  def loss(p):
    lp = jax.nn.log_softmax(0.5 * (tied_model(p, tok) + tied_model(p, tok)))
    return -jnp.take_along_axis(lp, tgt[..., None], -1).mean()
  l, g = jax.value_and_grad(loss)(p)
  return jax.tree.map(lambda a, b: a - 0.01 * b, p, g), l
toks = rng.integers(0, V, (3, 8, 4)).astype(np.int32)
tgts = rng.integers(0, V, (3, 8, 4)).astype(np.int32)
zs = js.Session(js.SessionOptions(mesh=mesh1))
zid = zs.compile(tied_step, tied, toks[0], tgts[0], state_argnums=0, state_specs="zero")
zsh = jax.tree.map(lambda a: a.sharding, zs.get_state(zid)[0])
zref = jax.jit(tied_step, in_shardings=(zsh, NamedSharding(mesh1, P("data")),
                                        NamedSharding(mesh1, P("data"))),
               out_shardings=(zsh, NamedSharding(mesh1, P())))
zp, zbits = jax.device_put(tied, zsh), []
for t in range(3):
  zl = zs.run(zid, toks[t], tgts[t])
  zp, wl = zref(zp, toks[t], tgts[t])
  zbits.append(np.asarray(zl).tobytes() == np.asarray(wl).tobytes())
zbits += [np.asarray(a).tobytes() == np.asarray(b).tobytes()
          for a, b in zip(jax.tree.leaves(zs.get_state(zid)[0]), jax.tree.leaves(zp))]
out["tied_twice_zero"] = zbits

# state compiled inside jax.set_mesh by a session without a mesh: refused at
# compile (every run was a raw ValueError); js.jit keeps meshes that differ in
# device order apart (outputs landed on the first mesh's devices)
with jax.set_mesh(mesh1):
  out["ambient_state"] = err(lambda: js.Session().compile(acc, v8, v8, state_argnums=0))
flipped = Mesh(np.array(jax.devices())[::-1], ("data",))
spread = js.jit(lambda v: jax.lax.with_sharding_constraint(v * 2, P("data")))
order = []
for m_ in (mesh1, flipped):
  with jax.set_mesh(m_):
    got = spread(v8)
  order.append([d.id for d in got.sharding._device_assignment])
out["jit_device_order"] = order

# jax_debug_nans under a mesh: a state holding a nan can be read, saved and
# restored (the session's own copies raised FloatingPointError); a run raises
import tempfile
nan_state = np.array([np.nan, 1, 2, 3, 4, 5, 6, 7], np.float32)
ns = js.Session(js.SessionOptions(mesh=mesh1))
nid = ns.compile(lambda p, v: (p + v, v), nan_state, np.float32(1), state_argnums=0)
jax.config.update("jax_debug_nans", True)
try:
  with tempfile.TemporaryDirectory() as nan_dir:
    got = ns.get_state(nid)[0]
    saved = err(lambda: (ns.save(nid, nan_dir, 0), ns.wait_until_saved()))
    restored = err(lambda: ns.restore(nid, nan_dir))
    out["debug_nans_mesh"] = [np.asarray(got).tobytes() == nan_state.tobytes(), saved, restored,
                              err(lambda: ns.run(nid, np.float32(1)))[0]]
finally:
  jax.config.update("jax_debug_nans", False)

# js.jit given a mesh session compiles as that session does: its default
# in_specs split each argument's leading axis over the first mesh axis
out["jit_mesh_session"] = [err(lambda: js.jit(jnp.cumsum, session=sess)(jnp.arange(5.0))),
                           float(js.jit(jnp.sum, session=sess)(jnp.arange(8.0))),
                           # a keyword argument comes first in its call: the
                           # message named the position there (a review's find)
                           err(lambda: js.jit(lambda x, w, t: x * w * t, session=sess)(
                               jnp.ones((6, 3)), jnp.ones(3), t=jnp.ones(4)))]
# a top-level callback gets the whole value on one device, as under jax.jit
# (it got the executable's 8-device array, sharded over 'data'), and what it
# keeps of the state stays valid after the update takes the state over
seen = []
def look(v):
  seen.append(v)
  return np.asarray(v.addressable_data(0)).sum(keepdims=True).repeat(16)
def cb_step(w, x):
  y = jax.pure_callback(look, jax.ShapeDtypeStruct((16,), np.float32), x * w)
  k = jax.pure_callback(look, jax.ShapeDtypeStruct((16,), np.float32), w)
  return w + 1.0, y + k
w16 = rng.standard_normal((16, 4)).astype(np.float32)
xw = rng.standard_normal((16, 4)).astype(np.float32)
want = jax.jit(cb_step)(jax.device_put(w16, NamedSharding(mesh1, P())),
                        jax.device_put(xw, NamedSharding(mesh1, P("data"))))[1]
want.block_until_ready()
jit_seen = [(str(v.sharding), list(v.addressable_data(0).shape)) for v in seen]
seen.clear()
cbid = s1.compile(cb_step, w16, xw, state_argnums=0)
got = s1.run(cbid, xw)
s1.run(cbid, xw)
# two run scalars whose weak types change the program only together: refused
# under a mesh too (the guard was built without a mesh only)
together = s1.compile(lambda a, b, x: (a + b) * x, np.float32(0.4), np.float32(0.7),
                      xw.astype(jnp.bfloat16))
out["weak_together_mesh"] = err(lambda: s1.run(together, 0.4, 0.7, xw.astype(jnp.bfloat16)))
# output weak types follow the run's scalars under a mesh too, as jax.jit's
# (they kept the compiled ones: out * bf16 was bf16, a break-it find)
scaled = lambda x, s: (s * 2, x * s)
weak_runs = []
for example, given in ((2.5, np.float32(3.0)), (np.float32(2.5), 3.0)):
  sid = s1.compile(scaled, xw, example)
  weak_runs.append([[v.weak_type for v in s1.run(sid, xw, given)],
                    [v.weak_type for v in jax.jit(scaled)(xw, given)]])
out["weak_outputs_mesh"] = weak_runs
out["callback_whole_value"] = [
    jit_seen, [(str(v.sharding), list(v.addressable_data(0).shape)) for v in seen[:2]],
    bool(np.array_equal(np.asarray(got), np.asarray(want))),
    [bool(np.array_equal(np.asarray(v), e)) for v, e in zip(seen[:3], (xw * w16, w16, xw * (w16 + 1)))]]
print(json.dumps(out))
"""


@pytest.mark.slow
class SpmdRegressionTest(SnippetTest):
  """What a review found: each case failed before its fix."""

  SNIPPET = REGRESSIONS

  def test_weak_scalars_changing_the_program_together_are_refused(self):
    kind, message = self.out["weak_together_mesh"]
    self.assertEqual(kind, "InputError")
    self.assertIn("together they change the program", message)

  def test_output_weak_types_follow_the_run_scalars(self):
    for got, want in self.out["weak_outputs_mesh"]:
      self.assertEqual(got, want)
    self.assertEqual([want[0] for _, want in self.out["weak_outputs_mesh"]], [False, True])

  def test_a_callback_gets_the_whole_value_on_one_device(self):
    jit_seen, seen, equal, kept = self.out["callback_whole_value"]
    self.assertEqual(seen, jit_seen)
    self.assertIn("SingleDeviceSharding", seen[0][0])
    self.assertTrue(equal)
    self.assertEqual(kept, [True, True, True])

  def test_sunk_runs_keep_each_slot_layout(self):
    a, b = self.out["sunk_layout"]
    self.assertIn("'data', 'model'", a)
    self.assertNotIn("'data'", b)
    self.assertIsNone(self.out["run_after_sunk"])

  def test_empty_leaves_run_again(self):
    self.assertEqual(self.out["empty_runs"], [None, None, None])

  def test_shard_map_inside_the_step_equals_jit(self):
    self.assertEqual(self.out["shard_map_bits"], [True, True])

  def test_integer_labels_with_buckets(self):
    self.assertLess(self.out["ce_rel"], 1e-6)  # summation order only

  def test_sunk_outputs_mixing_host_and_device_values(self):
    shape, got, want = self.out["sunk_mixed"]
    self.assertEqual(shape, [3, 16, 4])
    self.assertEqual(got, want)

  def test_collectives_of_a_plan_with_host_partitions(self):
    self.assertIn("all-reduce", self.out["plan_collectives"])

  def test_a_model_applied_twice_in_a_sunk_run_equals_jits_scan(self):
    # CSE merged the two applications' shared values: XLA partitioned and
    # fused them otherwise inside the loop (CSE stays off under a mesh)
    self.assertEqual(self.out["cse_sunk_bits"], [True] * len(self.out["cse_sunk_bits"]))

  def test_the_cache_tells_a_set_mesh_context_apart(self):
    self.assertEqual(self.out["set_mesh_cache"], [[True, True]] * 4)

  def test_a_model_applied_twice_under_zero(self):
    self.assertEqual(self.out["tied_twice_zero"], [True] * len(self.out["tied_twice_zero"]))

  def test_state_inside_set_mesh_without_a_session_mesh(self):
    kind, message = self.out["ambient_state"]
    self.assertEqual(kind, "InputError")
    self.assertIn("SessionOptions(mesh=...)", message)

  def test_jit_keeps_meshes_of_other_device_orders_apart(self):
    self.assertEqual(self.out["jit_device_order"], [list(range(8)), list(range(7, -1, -1))])

  def test_a_nan_in_the_state_under_debug_nans(self):
    self.assertEqual(self.out["debug_nans_mesh"], [True, None, None, "FloatingPointError"])

  def test_jit_given_a_mesh_session(self):
    kind, message = self.out["jit_mesh_session"][0]
    self.assertEqual(kind, "InputError")
    self.assertIn("do not divide over the 4 devices of mesh axis 'data'", message)
    self.assertEqual(self.out["jit_mesh_session"][1], 28.0)
    kind, message = self.out["jit_mesh_session"][2]
    self.assertEqual(kind, "InputError")
    self.assertIn("run argument 'x' at position 1", message)

  def test_zero_on_the_optimizer_state_only(self):
    params_spec, moment_spec = self.out["zero1_specs"]
    self.assertNotIn("data", params_spec)
    self.assertIn("'data'", moment_spec)

  def test_jit_runs_where_its_arguments_are(self):
    self.assertEqual(self.out["jit_placed"], [[True, True], [True, True]])
    kind, message = self.out["meshless_sharded_example"]
    self.assertEqual(kind, "InputError")
    self.assertIn("sharded over 8 devices", message)
    self.assertIn("SessionOptions(mesh=...)", message)

  def test_zero_equals_jit_with_the_same_shardings_bit_for_bit(self):
    # XLA partitions a with_sharding_constraint on the new state otherwise
    # than jit's out_shardings: ZeRO-1 SGD+momentum differed after 2 steps
    for specs, steps in self.out["zero_bits"].items():
      self.assertEqual(steps, [[True, True, True]] * 4, specs)

  def test_an_explicit_mesh_runs_as_its_auto_copy(self):
    # jax.make_mesh's Explicit axes refused every data-parallel matmul step
    # at compile (KernelSelectError: the dot_generals' sharding is typed)
    got = self.out["explicit_mesh"]
    self.assertEqual(got["explicit"], [True] * 5)
    self.assertEqual(got["jit"], [True] * 5)
    self.assertTrue(got["after_set_state"])
    self.assertEqual(got["under_set_mesh"], [True, True, True, True, None])

  def test_the_memory_plan_is_per_device(self):
    peak, donated, bound, text = self.out["memory"]["mesh"]
    one_peak, one_donated, one_bound, _ = self.out["memory"]["one"]
    self.assertEqual(donated * 8, one_donated)  # the "zero" state: one shard each
    self.assertEqual(bound, (64 * 128 + 256 * 64) * 4 // 8)  # inputs, one shard each
    self.assertLess(peak, one_peak)
    self.assertGreaterEqual(peak, bound)
    self.assertIn("per device", text)

  def test_errors(self):
    self.assertEqual(self.out["dup_axis"][0], "InputError")
    self.assertIn("position 1", self.out["dup_axis"][1])
    self.assertEqual(self.out["deleted_set_state"][0], "InputError")
    self.assertIn("['a']", self.out["deleted_set_state"][1])
    self.assertIn("deleted", self.out["deleted_set_state"][1])


class CompilerOptionsTest(absltest.TestCase):

  def test_an_option_xla_does_not_take_is_an_input_error(self):
    import jaxsession as js  # pylint: disable=g-import-not-at-top
    with self.assertRaisesRegex(js.errors.InputError, "xla_no_such_flag"):
      js.Session(js.SessionOptions(compiler_options={"xla_no_such_flag": 1}))
    with self.assertRaisesRegex(js.errors.InputError, "without a mesh"):
      js.SessionOptions(allreduce_bucket_bytes=1024)
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    twice = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("a", "a"))
    with self.assertRaisesRegex(js.errors.InputError, "names an axis twice"):
      js.SessionOptions(mesh=twice)
    # one device twice: compile failed in jax with a bare AssertionError (a review's find)
    same = jax.sharding.Mesh(np.array(jax.devices()[:1] * 2), ("a",))
    with self.assertRaisesRegex(js.errors.InputError, "holds a device twice"):
      js.SessionOptions(mesh=same)

  def test_the_gpu_combine_threshold_is_set_per_compile(self):
    # what Build passes to XLA on GPU (no GPU here: the options, not XLA's use)
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    import jaxsession as js  # pylint: disable=g-import-not-at-top
    from jaxsession import spmd  # pylint: disable=g-import-not-at-top
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    options = js.SessionOptions(mesh=mesh, allreduce_bucket_bytes=1 << 20,
                                compiler_options={"xla_cpu_enable_fast_math": False})
    self.assertEqual(spmd.compiler_options(options, "gpu"),
                     {"xla_cpu_enable_fast_math": False,
                      "xla_gpu_all_reduce_combine_threshold_bytes": 1 << 20})
    self.assertEqual(spmd.compiler_options(options, "cpu"),
                     {"xla_cpu_enable_fast_math": False})


X64 = r"""
import json
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
import jaxsession as js

mesh = Mesh(np.array(jax.devices()), ("data",))
rng = np.random.default_rng(2)
def step(s, x, k):
  # elementwise per shard: the same arithmetic as jax.jit, so bit for bit
  return {"f": s["f"] * x + 1e-300, "i": s["i"] + k}, jnp.where(x > 0, x, -x) * 2.5
s0 = {"f": rng.standard_normal(16), "i": rng.integers(-2**62, 2**62, 16)}
x = np.array([-0.0, 0.0, np.nan, np.inf, -np.inf, 1e308, 5e-324, 3.0] * 2)
k = np.int64(2**40 + 3)
sess = js.Session(js.SessionOptions(mesh=mesh))
gid = sess.compile(step, s0, x, k, state_argnums=0, state_specs="zero")
got = [sess.run(gid, x, k) for _ in range(2)]
ref, want = s0, []
for _ in range(2):
  ref, y = jax.jit(step)(ref, x, k)
  want.append(y)
state = sess.get_state(gid)[0]
out = dict(
    outputs=[np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(got, want)],
    state=[np.asarray(state[n]).tobytes() == np.asarray(ref[n]).tobytes() for n in ("f", "i")],
    dtypes=[str(state["f"].dtype), str(state["i"].dtype)],
    spec=str(state["f"].sharding.spec),
    weak=err(lambda: sess.run(gid, x, 7)))
print(json.dumps(out))
"""


@pytest.mark.slow
class X64MeshTest(absltest.TestCase):

  def test_float64_int64_and_specials_bit_for_bit(self):
    out = run_json(HELPERS + X64, x64=True)
    self.assertEqual(out["outputs"], [True, True])
    self.assertEqual(out["state"], [True, True])
    self.assertEqual(out["dtypes"], ["float64", "int64"])
    self.assertIn("'data'", out["spec"])
    # a Python int where an int64 array was compiled: converted, it fits
    self.assertIsNone(out["weak"])


if __name__ == "__main__":
  absltest.main()
