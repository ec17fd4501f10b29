"""SessionOptions(device=...): a single-device session on another device than
jax's default. Its executables, state and outputs live on that device
(single, sunk, host-partitioned, run_op, js.jit), results equal jax.jit's bit
for bit, arguments on other devices are moved, and other sessions and
threads keep theirs. In a subprocess with 2 CPU devices."""
from absl.testing import absltest
import pytest

from subproc import HELPERS, run_json

pytestmark = pytest.mark.slow  # a subprocess with 2 CPU devices

SNIPPET = HELPERS + r"""
import json, tempfile, threading
import numpy as np, jax, jax.numpy as jnp, optax
import jaxsession as js

d0, d1 = jax.devices()
out = {}
rng = np.random.default_rng(21)
tx = optax.adam(1e-2)
def train(p, o, x):
  g = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(p)
  u, o = tx.update(g, o, p)
  return optax.apply_updates(p, u), o, jnp.sum(g["w"])
p = {"w": rng.standard_normal((4, 3)).astype(np.float32),
     "b": rng.standard_normal(3).astype(np.float32)}
p["w"][0, :2] = [-0.0, 3e38]
o = tx.init(p)
xs = rng.standard_normal((6, 5, 4)).astype(np.float32)
devs = lambda tree: sorted({str(d) for a in jax.tree.leaves(tree) for d in a.devices()})
bits = lambda a: (np.asarray(a).dtype, np.asarray(a).tobytes())  # nan == nan here

sess = js.Session(js.SessionOptions(device=d1))
out["device"], out["d0"], out["d1"] = str(sess.device), str(d0), str(d1)
gid = sess.compile(train, p, o, xs[0], state_argnums=(0, 1))
ref = jax.jit(train)
rp, ro = p, o
losses = []
for i in range(3):
  rp, ro, want = ref(rp, ro, xs[i])
  x = jax.device_put(xs[i], d0) if i == 1 else xs[i]  # committed to the other device
  got = sess.run(gid, x)
  losses.append(bool(np.array_equal(got, want)))
  out.setdefault("loss_devices", []).append(devs(got))
sunk = sess.run(gid, xs[3:6], steps=3)
wants = []
for i in range(3, 6):
  rp, ro, want = ref(rp, ro, xs[i])
  wants.append(want)
out["losses_equal"] = losses + [bool(np.array_equal(sunk, np.stack(wants)))]
out["sunk_devices"] = devs(sunk)
state = sess.get_state(gid)
out["state_devices"] = devs(state)
out["state_equal"] = all(np.array_equal(a, b) for a, b in
                         zip(jax.tree.leaves(state), jax.tree.leaves((rp, ro))))

# a host partition between two device partitions
def host_fn(x):
  y = jnp.sin(x)
  z = jax.pure_callback(lambda a: np.cumsum(a, axis=-1).astype(a.dtype),
                        jax.ShapeDtypeStruct(y.shape, y.dtype), y)
  return z * 2.0
hid = sess.compile(host_fn, xs[0])
out["plan_places"] = [q.place for q in sess.report(hid).partitions]
h = sess.run(hid, xs[0])
out["host_equal"] = bool(np.array_equal(h, jax.jit(host_fn)(xs[0])))
out["host_devices"] = devs(h)
out["run_op_devices"] = devs(sess.run_op(jax.lax.exp, xs[0]))

# donation: arrays on the session's device are taken, others copied
on1 = jax.tree.map(lambda a: jax.device_put(a, d1), (rp, ro))
on0 = jax.tree.map(lambda a: jax.device_put(a, d0), (rp, ro))
sess.set_state(gid, *on1, donate=True)
out["taken_on_d1"] = all(a.is_deleted() for a in jax.tree.leaves(on1))
sess.set_state(gid, *on0, donate=True)
out["copied_from_d0"] = not any(a.is_deleted() for a in jax.tree.leaves(on0))
out["state_devices_after_set"] = devs(sess.get_state(gid))

# a checkpoint written by a default session restores onto d1
with tempfile.TemporaryDirectory() as folder:
  plain = js.Session()
  pid = plain.compile(train, p, o, xs[0], state_argnums=(0, 1))
  plain.run(pid, xs[0])
  plain.save(pid, folder, 1)
  plain.wait_until_saved()
  out["restored_step"] = sess.restore(gid, folder)
  out["restored_devices"] = devs(sess.get_state(gid))
  out["restored_equal"] = all(np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(sess.get_state(gid)), jax.tree.leaves(plain.get_state(pid))))
  out["plain_devices"] = devs(plain.get_state(pid))

# js.jit through the session, and a thread running another (default) session
f = js.jit(lambda a: jnp.cos(a) * 3.0, session=sess)
out["jit_devices"] = devs(f(xs[0]))
# an argument committed to d0: jax.jit's placement, as under jax.default_device(d1)
out["jit_committed_d0"] = [devs(f(jax.device_put(xs[0], d0))), len(f.graph_ids)]
seen = {}
def other():
  s2 = js.Session()
  g2 = s2.compile(lambda a: a + 1.0, xs[0])
  seen["other"] = devs(s2.run(g2, xs[0]))
  seen["mine"] = devs(sess.run(hid, xs[0]))
t = threading.Thread(target=other); t.start(); t.join()
out.update(seen)
# a session without the option follows jax's default device per compile: its
# caches are keyed by the device (they handed back cpu1's executables)
free = js.Session()
g_then = None
with jax.default_device(d1):
  g_then = free.compile(lambda a: a * 2.0 + 1.0, xs[0])
  out["free_run_op_d1"] = devs(free.run_op(jax.lax.sin, xs[0]))
g_now = free.compile(lambda a: a * 2.0 + 1.0, xs[0])
out["free_after"] = [devs(free.run(g_now, xs[0])), devs(free.run_op(jax.lax.sin, xs[0]))]

# a graph's state stays on the device it was compiled for, whatever the
# default device when it is bound, read, checkpointed or run
def bump(a, k, x):
  return a * 0.5 + x, k + 1, jnp.sum(a * x)
keep = js.Session()
a0 = rng.standard_normal(4).astype(np.float32)
a0[:3] = [-0.0, np.nan, np.inf]
kid = keep.compile(bump, a0, np.int32(7), xs[0][0], state_argnums=(0, 1))
ref_bump = jax.jit(bump)
values = [jnp.asarray(rng.standard_normal(4).astype(np.float32)),      # uncommitted, d0
          rng.standard_normal(4).astype(np.float32),                    # numpy
          jax.device_put(rng.standard_normal(4).astype(np.float32), d1)]  # committed to d1
kept, ra, rk = [], None, None
with tempfile.TemporaryDirectory() as folder:
  for n, value in enumerate(values):
    with jax.default_device(d1):
      if n == 0:
        keep.set_state(kid, value, np.int32(n))
      elif n == 1:
        keep.replace_state(kid, (0, 1), (value, jnp.int32(n)))
      else:
        keep.set_state(kid, value, jnp.int32(n), donate=True)
      kept.append(devs(keep.get_state(kid)))
      ra, rk = jnp.asarray(np.asarray(value)), jnp.int32(n)
      x = xs[0][n]
      got = keep.run(kid, x)
    ra, rk, want = ref_bump(ra, rk, x)
    kept.append(devs(keep.get_state(kid)))
    got2 = keep.run(kid, xs[1][n])
    ra, rk, want2 = ref_bump(ra, rk, xs[1][n])
    out.setdefault("kept_equal", []).append(
        bool(np.array_equal(got, want) and np.array_equal(got2, want2)))
  keep.save(kid, folder, 3)
  keep.wait_until_saved()
  with jax.default_device(d1):
    keep.restore(kid, folder)
    kept.append(devs(keep.get_state(kid)))
  sunk = keep.run(kid, xs[2][:2], steps=2)
kept.append(devs(keep.get_state(kid)))
out["kept_devices"], out["kept_sunk"] = kept, devs(sunk)
# what a graph builds at run time (sunk steps, a new steps value's chunks,
# a new bucket) goes on the graph's device too
with jax.default_device(d1):
  lid = keep.compile(bump, a0, np.int32(7), xs[0][0], state_argnums=(0, 1))
  bid = keep.compile(lambda w, x: x * w, a0, xs[0][:2], buckets={1: [2, 4, 8]},
                     state_argnums=0, updates_state=False)
late = [devs(keep.run(lid, xs[3][:2], steps=2)),
        devs(keep.run(lid, jax.device_put(xs[3][:3], d1), steps=3)),
        devs(keep.run(bid, xs[3][:3]))]
with jax.default_device(d1):
  late.append(devs(keep.run(bid, xs[4])))  # 5 rows: another bucket
late.append(devs(keep.get_state(lid)))
ra2, rk2 = a0, np.int32(7)
for x in [*xs[3][:2], *xs[3][:3]]:
  ra2, rk2, _ = ref_bump(ra2, rk2, x)
out["late_devices"] = late
# new state a callback makes (a host partition) is put on the slot's device too
def hstep(s, x):
  new = jax.pure_callback(lambda v: (np.sin(v) * 0.5).astype(v.dtype),
                          jax.ShapeDtypeStruct(s.shape, s.dtype), s * 2.0)
  return new, jnp.sum(s * x)
s7 = rng.standard_normal(7).astype(np.float32)
hid2 = keep.compile(hstep, s7, s7, state_argnums=0)
rs7, hgot = s7, []
for n in range(3):
  x7 = rng.standard_normal(7).astype(np.float32)
  with jax.default_device(d1):
    got = keep.run(hid2, x7)
  rs7, want = jax.jit(hstep)(rs7, x7)
  hgot.append(bits(got) == bits(want))
xs7 = rng.standard_normal((3, 7)).astype(np.float32)
with jax.default_device(d1):  # a plan run N times: its stacking built on first use
  hsunk = keep.run(hid2, xs7, steps=3)
wants = []
for x7 in xs7:
  rs7, want = jax.jit(hstep)(rs7, x7)
  wants.append(want)
hgot += [devs(hsunk) == [str(d0)], bits(hsunk) == bits(np.stack(wants))]
out["host_state_on_d1"] = [devs(a) for a in jax.live_arrays() if a.shape == (7,)
                           and devs(a) == [str(d1)]]
# a host-made output of a graph on d1 is a CPU array on d1, as jax.jit's
def hout(s, x):
  return s * 2.0, jax.pure_callback(lambda v: np.cos(v).astype(v.dtype),
                                    jax.ShapeDtypeStruct(x.shape, x.dtype), x)
with jax.default_device(d1):
  oid = keep.compile(hout, s7, s7, state_argnums=0)
out["host_out_devices"] = [devs(keep.run(oid, xs7[0])), devs(keep.run(oid, xs7, steps=3))]
out["host_state_places"] = [q.place for q in keep.report(hid2).partitions]
out["host_state_equal"] = hgot + [bits(keep.get_state(hid2)[0]) == bits(rs7)]
with jax.default_device(d0):  # sharing d1's slots from d0 would copy them every run
  out["across"] = err(lambda: keep.compile(bump, a0, np.int32(7), xs[0][0], state_argnums=(0, 1),
                                           state_from=lid))
out["late_state_equal"] = all(bits(g) == bits(w) for g, w in zip(keep.get_state(lid),
                                                                  (ra2, rk2)))
out["late_bucket_equal"] = bits(keep.run(bid, xs[4])) == bits(jax.jit(lambda w, x: x * w)(a0, xs[4]))
out["kept_state_equal"] = all(np.array_equal(g, w) for g, w in zip(
    keep.get_state(kid), ref_bump(*ref_bump(ra, rk, xs[2][0])[:2], xs[2][1])[:2]))
out["errors"] = [err(lambda: js.SessionOptions(device="cpu:1")),
                 err(lambda: js.SessionOptions(device=d1, mesh=jax.make_mesh((2,), ("d",))))]
print(json.dumps(out))
"""


class OwnDeviceTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.out = run_json(SNIPPET, devices=2)

  def test_everything_lives_on_the_sessions_device_and_equals_jit(self):
    out, d1 = self.out, [self.out["d1"]]
    self.assertEqual(out["device"], out["d1"])
    self.assertNotEqual(out["d0"], out["d1"])
    self.assertEqual(out["losses_equal"], [True] * 4)
    self.assertTrue(out["state_equal"])
    self.assertEqual(out["loss_devices"], [d1] * 3)
    for key in ("sunk_devices", "state_devices", "host_devices", "run_op_devices",
                "state_devices_after_set", "restored_devices", "jit_devices", "mine"):
      self.assertEqual(out[key], d1, key)

  def test_js_jit_runs_where_a_committed_argument_is_as_jax_jit_does(self):
    self.assertEqual(self.out["jit_committed_d0"], [[self.out["d0"]], 1])

  def test_a_host_partition_runs_between_executables_on_the_device(self):
    self.assertEqual(self.out["plan_places"], ["device", "host", "device"])
    self.assertTrue(self.out["host_equal"])

  def test_donation_takes_only_arrays_on_the_sessions_device(self):
    self.assertTrue(self.out["taken_on_d1"])
    self.assertTrue(self.out["copied_from_d0"])

  def test_a_checkpoint_restores_onto_the_device(self):
    self.assertEqual(self.out["restored_step"], 1)
    self.assertTrue(self.out["restored_equal"])
    self.assertEqual(self.out["plain_devices"], [self.out["d0"]])

  def test_other_sessions_and_threads_keep_their_device(self):
    self.assertEqual(self.out["other"], [self.out["d0"]])

  def test_a_session_without_the_option_keys_its_caches_by_the_device(self):
    self.assertEqual(self.out["free_run_op_d1"], [self.out["d1"]])
    self.assertEqual(self.out["free_after"], [[self.out["d0"]]] * 2)

  def test_state_stays_on_its_graphs_device_under_another_default_device(self):
    d0 = [self.out["d0"]]
    self.assertEqual(self.out["kept_equal"], [True] * 3)
    self.assertEqual(self.out["kept_devices"], [d0] * 8)
    self.assertEqual(self.out["kept_sunk"], d0)
    self.assertTrue(self.out["kept_state_equal"])

  def test_what_a_run_builds_goes_on_its_graphs_device(self):
    self.assertEqual(self.out["late_devices"], [[self.out["d1"]]] * 5)
    self.assertTrue(self.out["late_state_equal"])
    self.assertTrue(self.out["late_bucket_equal"])
    self.assertEqual(self.out["host_state_places"], ["device", "host"])
    self.assertEqual(self.out["host_state_equal"], [True] * 6)
    self.assertEqual(self.out["host_out_devices"], [[self.out["d1"]]] * 2)
    self.assertEqual(self.out["host_state_on_d1"], [])
    kind, text = self.out["across"]
    self.assertEqual(kind, "InputError")
    self.assertIn("lives on cpu:1, and this graph would run on cpu:0", text)

  def test_bad_options_are_input_errors(self):
    (kind1, text1), (kind2, text2) = self.out["errors"]
    self.assertEqual((kind1, kind2), ("InputError", "InputError"))
    self.assertIn("SessionOptions.device must be a jax.Device", text1)
    self.assertIn("device and mesh are both set", text2)


if __name__ == "__main__":
  absltest.main()
