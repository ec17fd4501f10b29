"""A caller's `with jax.set_mesh(...)` around session calls (a break-it
round's finds): a session without a mesh keeps its state and programs on
its device, and a session whose mesh has other devices keeps them on its
mesh - set_state, a first run(steps=), a run, get_state, save, restore and compile
inside such a block work and leave the graph usable after it, with results
equal to jax.jit's bit for bit. Under a mesh a host callback's result comes
back replicated on the mesh, as jax.jit returns it; a PartitionSpec with
unreduced/reduced axes is an InputError. In a subprocess with 8 CPU devices."""
from absl.testing import absltest
import pytest

from subproc import SnippetTest

pytestmark = pytest.mark.slow  # a subprocess with 8 CPU devices

SNIPPET = r"""
import contextlib, json, tempfile
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jaxsession as js

devs = jax.devices()
A = Mesh(np.array(devs[:4]), ("data",))
OTHER = Mesh(np.array(devs[4:]), ("data",))
REVERSED = Mesh(np.array(devs[:4][::-1]), ("data",))
rng = np.random.default_rng(38)
W = rng.standard_normal((8, 12)).astype(np.float32)
W[0, :3] = [-0.0, np.inf, 3e38]
X = rng.standard_normal((4, 8)).astype(np.float32)
XS = rng.standard_normal((3, 4, 8)).astype(np.float32)
ids = lambda a: sorted(d.id for d in a.devices())
same = lambda a, b: bool(np.asarray(a).tobytes() == np.asarray(b).tobytes())
out = {}

def step(w, x):
  return w * 0.5 - 0.1 * (x.T @ jnp.tanh(x @ w)), jnp.sum(x @ w)
scan = jax.jit(lambda w, xs: jax.lax.scan(step, w, xs))
one = jax.jit(step)

# a session without a mesh, its graph compiled outside any block
sess = js.Session()
gid = sess.compile(step, W, X, state_argnums=0)
d = tempfile.mkdtemp()
res = {}
with jax.set_mesh(A):  # device 0 is the mesh's: nothing fails, the state stays put
  sess.set_state(gid, W)
  res["sunk"] = sess.run(gid, XS, steps=3)
  res["state_devices"] = ids(sess.get_state(gid)[0])
  sess.save(gid, d, 1)
  sess.wait_until_saved()
  res["restored"] = sess.restore(gid, d)
w_ref, l_ref = scan(jnp.asarray(W), XS)
res["after_steps_2"] = sess.run(gid, XS[:2], steps=2)
res["after_run"] = sess.run(gid, X)
w2, l2 = jax.lax.scan(step, w_ref, XS[:2])
w3, l3 = one(w2, X)
out["no_mesh"] = {
    "sunk_equal": same(res["sunk"], l_ref), "state_devices": res["state_devices"],
    "restored": res["restored"], "steps_2_equal": same(res["after_steps_2"], l2),
    "run_equal": same(res["after_run"], l3), "final_equal": same(sess.get_state(gid)[0], w3),
    "final_devices": ids(sess.get_state(gid)[0])}
with jax.set_mesh(OTHER):
  out["no_mesh"]["get_state_in_other"] = ids(sess.get_state(gid)[0])

# a session on mesh A, called inside blocks of other meshes
for name, ctx in (("other_devices", OTHER), ("reversed", REVERSED)):
  sess = js.Session(js.SessionOptions(mesh=A))
  gid = sess.compile(step, W, X, state_argnums=0, state_specs="zero")
  d = tempfile.mkdtemp()
  sess.save(gid, d, 1)
  sess.wait_until_saved()
  got = {}
  with jax.set_mesh(ctx):
    got["get_state"] = ids(sess.get_state(gid)[0])
    got["restore"] = sess.restore(gid, d)
    got["sunk"] = same(sess.run(gid, XS, steps=3), l_ref)
    # one step, its argument a jax.Array on device 0 (moved to the session
    # mesh in the session's context: under REVERSED this was jax's raw error)
    got["single"] = same(sess.run(gid, jnp.asarray(X)), one(w_ref, X)[1])
    gid2 = sess.compile(lambda w, x: (w * 2, (x @ w).sum()), W, X, state_argnums=0)
    got["compiled"] = same(sess.run(gid2, X), jnp.sum(X @ W))
  got["after"] = same(sess.run(gid, X), one(one(w_ref, X)[0], X)[1])
  got["state"] = str(sess.get_state(gid)[0].sharding.spec)
  out[name] = got

# a host callback's result under a mesh: replicated on it, as jax.jit returns it
def cb_step(w, x):
  y = jax.pure_callback(lambda v: (np.asarray(v) * 2).astype(np.float32),
                        jax.ShapeDtypeStruct(x.shape, x.dtype), x)
  return w * 0.5, (y, (x @ w).sum(), 2.0)
sess = js.Session(js.SessionOptions(mesh=OTHER))
gid = sess.compile(cb_step, W, X, state_argnums=0)
y, l, lit = sess.run(gid, X)
jy, jl, jlit = jax.jit(cb_step, in_shardings=(NamedSharding(OTHER, P()),
                                              NamedSharding(OTHER, P("data"))))(W, X)[1]
out["callback"] = {"y": ids(y), "literal": ids(lit), "jit_y": ids(jy), "jit_literal": ids(jlit),
                   "y_equal": same(y, jy), "sum": same(y.sum() + l, jy.sum() + jl),
                   "literal_weak": [lit.weak_type, jlit.weak_type]}

sess = js.Session(js.SessionOptions(mesh=Mesh(np.array(devs[:4]).reshape(2, 2), ("data", "model"))))
out["unreduced"] = err(lambda: sess.compile(lambda w, x: (w * 2, (x @ w).sum()), W, X,
                                            state_argnums=0,
                                            state_specs=P(None, "model", unreduced={"data"})))
out["reduced"] = err(lambda: sess.compile(lambda w, x: (w * 2, (x @ w).sum()), W, X,
                                          state_argnums=0, in_specs=P("data", reduced={"model"})))
# an array laid out over several devices, the session's among them, given to
# set_state/replace_state: copied, so a run's donation leaves the caller's array
rep = NamedSharding(Mesh(np.array(devs), ("d",)), P())
kept = []
for how in ("set_state", "replace_state"):
  sess = js.Session()
  gid = sess.compile(lambda w, x: (w + 1.0, x * w[0]), np.ones(4, np.float32),
                     np.ones(4, np.float32), state_argnums=0)
  v = jax.device_put(jnp.arange(4.0), rep)
  sess.set_state(gid, v) if how == "set_state" else sess.replace_state(gid, 0, v)
  sess.run(gid, np.ones(4, np.float32))
  kept.append([v.is_deleted(), same(v, np.arange(4.0, dtype=np.float32)),
               same(sess.get_state(gid)[0], np.arange(4.0, dtype=np.float32) + 1)])
out["replicated_given"] = kept

# the session mesh's devices under other axis names, around a compile whose
# step names the session's axis
sess = js.Session(js.SessionOptions(mesh=A))
named = lambda w, x: (w * 2, jax.lax.with_sharding_constraint(x * 2, P("data")).sum())
with jax.set_mesh(A):  # the step's P("data") names the session mesh's axis
  outside = sess.run(sess.compile(named, W, X, state_argnums=0), X)
with jax.set_mesh(Mesh(np.array(devs[:4]), ("zz",))):
  gid = sess.compile(named, W, X, state_argnums=0)
  out["other_names"] = same(sess.run(gid, X), outside)  # the same program's bits

# js.jit's outputs committed as jax.jit's: over several devices (a context
# mesh, a mesh session, a program laying out its values) they are committed,
# and the next op on them works (uncommitted, it raised NotImplementedError)
rows = X.T.copy()  # (8, 4): 8 rows over the 4 devices
programs = {
    "set_mesh": (lambda a: jnp.sin(a) * 2, "set"),
    "constraint": (lambda a: jax.lax.with_sharding_constraint(a * 2, NamedSharding(A, P("data"))),
                   None),
    "shard_map": (lambda a: jax.shard_map(lambda b: b * -0.0, mesh=A, in_specs=P("data"),
                                          out_specs=P("data"))(a), None),
    "pinned_host": (lambda a: jax.device_put(a * 2, jax.sharding.SingleDeviceSharding(
        devs[0], memory_kind="pinned_host")), None),
    "plain": (lambda a: a * 2, None)}
got = {}
for name, (fn, ctx) in programs.items():
  with jax.set_mesh(A) if ctx else contextlib.nullcontext():
    want, first, again = jax.jit(fn)(rows), js.jit(fn)(rows), js.jit(fn)(rows)
    nxt = js.jit(lambda a: a + 1.0)(first)
  got[name] = [want.committed, first.committed, again.committed, same(first, want),
               same(first + 1.0, want + 1.0), same(nxt, want + 1.0)]
# a dead constraint commits nothing (jax.jit reads layouts after its DCE);
# a program's own layout commits even where a committed call came first
dead = lambda a: (jax.lax.with_sharding_constraint(a, NamedSharding(A, P("data"))), a * 2)[1]
got["dead_constraint"] = [jax.jit(dead)(rows).committed, js.jit(dead)(rows).committed,
                          js.jit(dead)(rows).committed, same(js.jit(dead)(rows), rows * 2),
                          True, True]
pinned = programs["pinned_host"][0]
js.jit(pinned)(jax.device_put(rows, devs[0]))  # first: the committed call
late = js.jit(pinned)(rows)
got["committed_call_first"] = [True, late.committed, late.committed, same(late, rows * 2),
                               True, True]
mesh_sess = js.Session(js.SessionOptions(mesh=A))
y = js.jit(lambda a: jnp.sin(a) * 2, session=mesh_sess)(rows)
got["mesh_session"] = [True, y.committed, y.committed, same(y, jnp.sin(rows) * 2),
                       same(y + 1.0, jnp.sin(rows) * 2 + 1.0), True]
out["jit_commits"] = got
# report.collectives name where a collective's operands come from as dump() does
# (jax's names of the session's step parameters, xs[0][1], were shown)
zero = js.Session(js.SessionOptions(mesh=A))
zg = zero.compile(lambda p, x: ((p[0] * 0.5, p[1] + 1.0), jnp.sum(x @ p[0]) + jnp.sum(p[1])),
                  (W, W[0]), X, state_argnums=0, state_specs="zero")
sources = " ".join(n for c in zero.report(zg).collectives for n in c.op_names)
host = lambda v: jax.pure_callback(lambda u: np.asarray(u) * 2, jax.ShapeDtypeStruct(
    v.shape, v.dtype), v)
zh = zero.compile(lambda p, x: ((p[0] * 0.5, host(p[1]) + 1.0), jnp.sum(x @ p[0])),
                  (W, W[0]), X, state_argnums=0, state_specs="zero")  # several partitions
split = " ".join(n for c in zero.report(zh).collectives for n in c.op_names)
named = "state 0 (arg 0)" in sources + split or "arg 1" in sources
out["collective_sources"] = ["xs[" in sources + split, named,
                             len(zero.report(zh).partitions) > 1]
# a raising callback inside the executable of a graph without state, over
# the mesh: the call returns as jax.jit's does (not waited for: a graph with
# state is, soundness_test.py) and fails at the call or where the output is read
def boom(v):
  raise RuntimeError("boom")
raising = lambda a: (jax.debug.callback(boom, a.sum()), a * 2)[1]
def failure(call):
  try:
    out = call()
  except Exception as exc:  # pylint: disable=broad-except
    return ["call", type(exc).__name__, type(exc.__cause__).__name__]
  try:
    jax.block_until_ready(out)
  except Exception as exc:  # pylint: disable=broad-except
    return ["read", type(exc).__name__]
  return None
with jax.set_mesh(A):
  out["callback_kinds"] = [failure(lambda: js.jit(raising)(rows)),
                           same(js.jit(lambda a: a * 2)(rows), rows * 2)]
# an argument committed to the session's device, read by a program laid out
# over a mesh of other devices too: jax.jit's error, naming the argument and
# the constraint (js.jit gave jax's executable's input check); uncommitted,
# the same program runs
calls = []
def counted(v):
  calls.append(1)
  return np.asarray(v) + 1
def constrained(inp, y):  # (the callback ran, on the host, before the refusal)
  z = jax.pure_callback(counted, jax.ShapeDtypeStruct(y.shape, y.dtype), y)
  return jax.lax.with_sharding_constraint(inp * 2 + z, NamedSharding(A, P("data")))
def error_of(call):
  try:
    call()
  except Exception as exc:  # pylint: disable=broad-except
    return [type(exc).__name__, str(exc), len(calls)]
  return None
on_0, one = jax.device_put(rows, devs[0]), jnp.float32(1.5)
own = js.Session()
wrapped = js.jit(constrained, session=own)
def known_graphs():
  found = set()
  for gid in range(4):
    try:
      own.graph(gid)
      found.add(gid)
    except js.errors.UnknownGraphError:
      pass
  return found
out["committed_elsewhere"] = [error_of(lambda: jax.jit(constrained)(on_0, one)),
                              error_of(lambda: wrapped(on_0, one)),
                              error_of(lambda: wrapped(on_0, one)),
                              same(wrapped(rows, one), jax.jit(constrained)(rows, one)),
                              known_graphs() == set(wrapped.graph_ids)]  # none left behind
print(json.dumps(out))
"""


class ContextMeshTest(SnippetTest):
  SNIPPET = SNIPPET

  def test_a_session_without_a_mesh_keeps_its_device_inside_set_mesh(self):
    got = self.out["no_mesh"]
    self.assertEqual(got["state_devices"], [0])
    self.assertEqual(got["final_devices"], [0])
    self.assertEqual(got["get_state_in_other"], [0])
    self.assertEqual(got["restored"], 1)
    for key in ("sunk_equal", "steps_2_equal", "run_equal", "final_equal"):
      self.assertTrue(got[key], key)

  def test_a_mesh_session_keeps_its_mesh_inside_another_meshs_block(self):
    for name in ("other_devices", "reversed"):
      got = self.out[name]
      self.assertEqual(got["get_state"], [0, 1, 2, 3], name)
      self.assertEqual(got["restore"], 1, name)
      for key in ("sunk", "single", "compiled", "after"):
        self.assertTrue(got[key], f"{name}: {key}")
      self.assertEqual(got["state"], "P(None, 'data')", name)

  def test_a_callback_result_comes_back_replicated_on_the_mesh(self):
    got = self.out["callback"]
    self.assertEqual(got["y"], got["jit_y"])
    self.assertEqual(got["y"], [4, 5, 6, 7])
    self.assertEqual(got["literal"], got["jit_literal"])
    self.assertTrue(got["y_equal"])
    self.assertTrue(got["sum"])
    self.assertEqual(got["literal_weak"][0], got["literal_weak"][1])

  def test_an_array_over_several_devices_is_copied_into_the_state(self):
    for deleted, value_kept, state_ok in self.out["replicated_given"]:
      self.assertFalse(deleted)
      self.assertTrue(value_kept)
      self.assertTrue(state_ok)

  def test_a_context_mesh_of_the_sessions_devices_under_other_names(self):
    self.assertTrue(self.out["other_names"])

  def test_js_jit_commits_its_outputs_as_jax_jit_does(self):
    for name, (want, first, again, equal, next_op, chained) in self.out["jit_commits"].items():
      self.assertEqual([first, again], [want, want], name)
      self.assertEqual(want, name not in ("plain", "dead_constraint"), name)
      self.assertTrue(equal and next_op and chained, name)

  def test_a_raising_callback_inside_an_executable(self):
    stateless, works_after = self.out["callback_kinds"]
    self.assertIn(stateless, (["call", "HostOpError", "RuntimeError"],
                              ["read", "JaxRuntimeError"]))
    self.assertTrue(works_after)

  def test_an_argument_committed_off_the_programs_mesh_is_jax_jits_error(self):
    want, first, again, runs_uncommitted, graphs = self.out["committed_elsewhere"]
    self.assertEqual(want[0], "ValueError")
    self.assertIn("Received incompatible devices", want[1])
    self.assertEqual(want[2], 0)  # nothing ran, the callback neither
    self.assertEqual([first, again], [want, want])
    self.assertTrue(runs_uncommitted)
    self.assertTrue(graphs)  # (the committed call's graph was left behind, compiled again)

  def test_collectives_name_their_sources_as_the_dump_does(self):
    self.assertEqual(self.out["collective_sources"], [False, True, True])

  def test_unreduced_and_reduced_specs_are_input_errors(self):
    for key, words in (("unreduced", "unreduced={'data'}"), ("reduced", "reduced={'model'}")):
      kind, text = self.out[key]
      self.assertEqual(kind, "InputError", text)
      self.assertIn(words, text)


if __name__ == "__main__":
  absltest.main()
