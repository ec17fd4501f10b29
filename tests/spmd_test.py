"""Data-parallel and sharded-state training on a mesh of 8 CPU devices.

Each class runs one subprocess (JAX must be started with 8 CPU devices) that
trains with the session and with single-device `jax.jit` on the global batch,
and returns what the tests compare. The arithmetic differs only in summation
order (each device sums its rows, then the devices' sums are summed - what
XLA's SPMD partitioner does for any data-parallel jit), so results are
compared to 1e-6 relative, the issue's bound, with an absolute floor of
1e-7 for values that cross zero.
"""
from absl.testing import absltest
import pytest

from tests.subproc import SnippetTest, run_json

pytestmark = pytest.mark.slow  # the fast subset: -m "not slow" (docs/testing.md)


TRAIN = r"""
import json, warnings
import numpy as np, jax, jax.numpy as jnp, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jaxsession as js

mesh = Mesh(np.array(jax.devices()), ("data",))
rng = np.random.default_rng(7)
def init(sizes=(16, 32, 32, 4)):
  return [{"w": rng.standard_normal((a, b)).astype(np.float32) / np.sqrt(a),
           "b": rng.standard_normal((b,)).astype(np.float32) * 0.1}
          for a, b in zip(sizes[:-1], sizes[1:])]
params = init()
opt = optax.adamw(1e-2, weight_decay=1e-3)
opt_state = opt.init(params)
def loss_fn(p, batch):
  x = batch["x"]
  for layer in p[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return jnp.mean((x @ p[-1]["w"] + p[-1]["b"] - batch["y"]) ** 2)
def step(p, s, batch):
  loss, g = jax.value_and_grad(loss_fn)(p, batch)
  updates, s = opt.update(g, s, p)
  return optax.apply_updates(p, updates), s, loss
T = 111
data = {"x": rng.standard_normal((T, 64, 16)).astype(np.float32),
        "y": rng.standard_normal((T, 64, 4)).astype(np.float32)}
def batch(t): return {k: v[t] for k, v in data.items()}
def batches(a, b): return {k: v[a:b] for k, v in data.items()}

# single-device jax.jit on the global batch
ref = jax.jit(step)
p, s, ref_losses = params, opt_state, []
first_update = None
for t in range(T):
  p_new, s, l = ref(p, s, batch(t))
  if t == 0:
    first_update = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), p_new, p)
  p = p_new
  ref_losses.append(float(l))
ref_params = p

def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-7 / 1e-6)))  # see docstring
def tree_rel(a, b):
  return max(rel(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

out = {}
for specs in (None, "zero"):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    sess = js.Session(js.SessionOptions(mesh=mesh))
    gid = sess.compile(step, params, opt_state, batch(0), state_argnums=(0, 1),
                       state_specs=specs)
    p0 = sess.get_state(gid)[0]
    losses = [float(sess.run(gid, batch(0)))]
    donated = "input_output_alias" in sess.executables(gid)[0].as_text()
    one = sess.get_state(gid)[0]
    upd = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), one, p0)
    losses += [float(x) for x in sess.run(gid, batches(1, 11), steps=10)]
    losses += [float(x) for x in sess.run(gid, batches(11, 111), steps=100)]
    sp, ss = sess.get_state(gid)
  rep = sess.report(gid)
  key = specs or "replicated"
  out[key] = dict(
      loss_rel=rel(losses, ref_losses), n=len(losses),
      params_rel=tree_rel(sp, ref_params),
      update_rel=tree_rel(upd, first_update),
      update_ratio=float(np.sum(np.abs(np.concatenate([np.ravel(x) for x in jax.tree.leaves(upd)])))
                         / np.sum(np.abs(np.concatenate([np.ravel(x) for x in jax.tree.leaves(first_update)])))),
      donated=bool(donated),
      warnings=[str(w.message) for w in caught if "donat" in str(w.message)],
      state_specs=[str(x.sharding.spec) for x in jax.tree.leaves((sp, ss))],
      replicated=[x.sharding.spec == P() for x in jax.tree.leaves((sp, ss))],
      is_global=all(isinstance(x, jax.Array) and x.sharding.mesh.devices.size == 8
                    for x in jax.tree.leaves((sp, ss))),
      opt_bytes=js.runtime.sharding.device_bytes(jax.tree.leaves(ss)),
      opt_bytes_replicated=sum(x.nbytes for x in jax.tree.leaves(ss)),
      largest_leaf=max(x.nbytes for x in jax.tree.leaves(ss)),
      report_per_device=rep.sharding.state_bytes_per_device,
      report_replicated=rep.sharding.state_bytes_replicated,
      report_text=str(rep),
      dump=sess.graph(gid).dump())
print(json.dumps(out))
"""


class DataParallelTrainingTest(SnippetTest):
  """An MLP with optax AdamW, data parallel on 8 devices: 1, 10 and 100
  (sunk) steps, replicated and ZeRO-sharded optimizer state."""

  SNIPPET = TRAIN

  def test_losses_and_params_equal_single_device_jit(self):
    for key in ("replicated", "zero"):
      got = self.out[key]
      self.assertEqual(got["n"], 111)
      self.assertLessEqual(got["loss_rel"], 1e-6, key)
      self.assertLessEqual(got["params_rel"], 1e-6, key)

  def test_gradients_are_reduced_once(self):
    # Reduced twice (an extra psum over 8 devices), the first AdamW update
    # would still be close in sign but the loss curve and the update differ;
    # with plain sums the update would be 8x. Both are pinned here.
    for key in ("replicated", "zero"):
      got = self.out[key]
      self.assertLessEqual(got["update_rel"], 1e-5, key)
      self.assertAlmostEqual(got["update_ratio"], 1.0, places=5)

  def test_state_is_global_resident_and_donated(self):
    for key in ("replicated", "zero"):
      got = self.out[key]
      self.assertTrue(got["is_global"], key)
      self.assertTrue(got["donated"], key)
      self.assertEqual(got["warnings"], [], key)
    self.assertTrue(all(self.out["replicated"]["replicated"]))
    self.assertFalse(all(self.out["zero"]["replicated"]))

  def test_zero_shards_the_optimizer_state(self):
    zero, rep = self.out["zero"], self.out["replicated"]
    self.assertEqual(rep["opt_bytes"], rep["opt_bytes_replicated"])
    self.assertLessEqual(zero["opt_bytes"], rep["opt_bytes"] / 8 + zero["largest_leaf"])
    self.assertIn("'data'", " ".join(zero["state_specs"]))
    self.assertLess(zero["report_per_device"], rep["report_per_device"] / 4)
    self.assertEqual(zero["report_replicated"], rep["report_replicated"])
    self.assertIn("of replicated", zero["report_text"])
    # a leaf "zero" keeps whole says why in dump() (a review: no reason was given)
    self.assertIn("zero: replicated (a scalar)", zero["dump"])  # AdamW's count
    self.assertIn("zero: replicated (no axis of (4,) divides by the 8 devices)", zero["dump"])
    self.assertNotIn("zero: replicated", rep["dump"])

  def test_dump_shows_the_shardings(self):
    dump = self.out["zero"]["dump"]
    self.assertIn("mesh {'data': 8}", dump)
    self.assertIn("@P('data',)", dump)
    self.assertIn("@P()", self.out["replicated"]["dump"])



CNN = r"""
import json
import numpy as np, jax, jax.numpy as jnp, optax, flax.linen as nn
from jax.sharding import Mesh, PartitionSpec as P
import jaxsession as js

class CNN(nn.Module):
  @nn.compact
  def __call__(self, x, train=True):
    for c in (8, 16):
      x = nn.Conv(c, (3, 3))(x)
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
      x = nn.relu(x)
    return nn.Dense(10)(x.mean(axis=(1, 2)))

mesh = Mesh(np.array(jax.devices()), ("data",))
rng = np.random.default_rng(3)
model = CNN()
T = 12
images = rng.standard_normal((T, 32, 8, 8, 3)).astype(np.float32)
labels = rng.integers(0, 10, (T, 32)).astype(np.int32)
variables = model.init(jax.random.PRNGKey(0), images[0])
params, stats = variables["params"], variables["batch_stats"]
opt = optax.sgd(0.05, momentum=0.9)
opt_state = opt.init(params)
def step(params, stats, opt_state, x, y):
  def loss_fn(p):
    logits, upd = model.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), upd
  (loss, upd), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
  updates, opt_state = opt.update(g, opt_state, params)
  return optax.apply_updates(params, updates), upd["batch_stats"], opt_state, loss

ref = jax.jit(step)
state, ref_losses = (params, stats, opt_state), []
for t in range(T):
  *state, l = ref(*state, images[t], labels[t])
  ref_losses.append(float(l))

sess = js.Session(js.SessionOptions(mesh=mesh))
gid = sess.compile(step, params, stats, opt_state, images[0], labels[0], state_argnums=(0, 1, 2))
losses = [float(sess.run(gid, images[0], labels[0]))]
losses += [float(l) for l in sess.run(gid, images[1:T], labels[1:T], steps=T - 1)]
got = sess.get_state(gid)
def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 0.1)))
print(json.dumps(dict(
    loss_rel=rel(losses, ref_losses),
    state_rel=max(rel(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(state))),
    n=len(losses), dump_has_conv="conv_general_dilated" in sess.graph(gid).dump())))
"""


class BatchNormCnnTest(absltest.TestCase):

  def test_flax_cnn_with_batchnorm_equals_jit(self):
    out = run_json(CNN)
    self.assertEqual(out["n"], 12)
    # BatchNorm statistics over the global batch: the batch mean is a sum of
    # per-device sums, so 1e-6 relative (floored at 0.1 for values near zero,
    # where a relative bound means nothing; measured ~1e-7).
    self.assertLessEqual(out["loss_rel"], 1e-6)
    self.assertLessEqual(out["state_rel"], 1e-6)
    self.assertTrue(out["dump_has_conv"])

CONTRACT = r"""
import json, threading
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import jaxsession as js
from jaxsession import errors

mesh = Mesh(np.array(jax.devices()), ("data",))
rng = np.random.default_rng(11)
out = {}

def step(w, x, scale):
  loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
  return w - scale * g, loss
w0 = rng.standard_normal((4, 8)).astype(np.float32)
x = rng.standard_normal((16, 4)).astype(np.float32)
sess = js.Session(js.SessionOptions(mesh=mesh))
out["indivisible"] = err(lambda: sess.compile(step, w0, x[:12], 0.1, state_argnums=0))
out["bad_axis"] = err(lambda: sess.compile(step, w0, x, 0.1, state_argnums=0,
                                           in_specs=(P("model"), P())))
out["bad_zero"] = err(lambda: sess.compile(step, w0, x, 0.1, state_argnums=0, in_specs="zero"))
out["no_mesh"] = err(lambda: js.Session().compile(step, w0, x, 0.1, state_argnums=0,
                                                  state_specs="zero"))
out["buckets"] = err(lambda: sess.compile(step, w0, x, 0.1, state_argnums=0, buckets={1: [8, 16]}))
gid = sess.compile(step, w0, x, 0.1, state_argnums=0, state_specs=P(None, "data"))
def shards():
  (w,) = sess.get_state(gid)
  return [np.asarray(s.data).tolist() for s in w.addressable_shards], str(w.sharding.spec)
before = shards()
out["bad_shape"] = err(lambda: sess.run(gid, x[:8], 0.1))
out["bad_dtype"] = err(lambda: sess.run(gid, x.astype(np.int32), 0.1))
out["unchanged_after_bad"] = shards() == before
ref_w, ref_l = jax.jit(step)(w0, x, 0.1)
l = sess.run(gid, x, 0.1)  # a Python float: weak-typed, as jit sees it
out["run_equal"] = [abs(float(l) - float(ref_l)) / abs(float(ref_l)), float(np.max(np.abs(np.asarray(sess.get_state(gid)[0]) - np.asarray(ref_w))))]
out["state_spec"] = shards()[1]

# set_state: host, one device, another sharding -> the slot's layout, values exact
for name, value in [("host", w0 + 1), ("device", jax.device_put(w0 + 2, jax.devices()[3])),
                    ("resharded", jax.device_put(w0 + 3, NamedSharding(mesh, P())))]:
  sess.set_state(gid, value)
  (w,) = sess.get_state(gid)
  out["set_" + name] = [str(w.sharding.spec), bool(np.array_equal(np.asarray(w), np.asarray(value)))]
out["caller_alive"] = not value.is_deleted()
sess.run(gid, x, 0.1)
out["caller_alive_after_run"] = not value.is_deleted()

# state_from: an eval graph sees the train graph's updates
def evaluate(w, x):
  return jnp.mean((x @ w) ** 2)
eid = sess.compile(evaluate, w0, x, state_argnums=0, state_from=gid, updates_state=False)
(w,) = sess.get_state(gid)
out["eval_equal"] = float(sess.run(eid, x)) == float(jax.jit(evaluate)(np.asarray(w), x))

# specials and integers, elementwise per shard: bit for bit against jit
def special(s, x, k):
  return s + 1, jnp.where(x > 0, x * 2.0, -x), k * 3 + s
xs = np.array([-0.0, 0.0, np.nan, np.inf, -np.inf, 1e38, -1e-45, 3.5] * 2, np.float32)
ks = np.array([2**31 - 1, -2**31, 7, -7] * 4, np.int32)
sid = sess.compile(special, np.int32(0), xs, ks, state_argnums=0)
got = sess.run(sid, xs, ks)
want = jax.jit(special)(np.int32(0), xs, ks)[1:]
out["specials_bits"] = [np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(got, want)]

# a sharding constraint in the user's program survives the passes
def constrained(w, x):
  h = jax.lax.with_sharding_constraint(jnp.tanh(x @ w), NamedSharding(mesh, P(None, "data")))
  return w, jnp.sum(h * 2.0, axis=0)
cid = sess.compile(constrained, w0, x, state_argnums=0)
out["constraint_kept"] = [n.op for n in sess.graph(cid).nodes].count("sharding_constraint")
# the sum over the batch crosses devices: summation order only, 1e-6 relative
out["constraint_equal"] = bool(np.allclose(np.asarray(sess.run(cid, x)),
                                           np.asarray(jax.jit(constrained)(w0, x)[1]), rtol=1e-6))

# threads: runs on one state are serialised, none lost
def count(c, x):
  return c + 1, jnp.sum(x)
tid = sess.compile(count, np.int32(0), x, state_argnums=0)
def worker():
  for _ in range(5):
    # each result read: XLA:CPU's in-process all-reduce can hang when 8
    # device threads on 2 cores queue steps back to back (jax.jit too)
    float(sess.run(tid, x))
threads = [threading.Thread(target=worker) for _ in range(4)]
[t.start() for t in threads]; [t.join() for t in threads]
out["thread_count"] = int(sess.get_state(tid)[0])

# host work under a mesh: a top-level callback runs on the host between the
# SPMD executables; a callback that would stay inside one (host_callbacks=
# False, or nested in control flow) is refused - it would run on one device,
# and when it raises XLA:CPU aborts the process
calls = []
def clip(g):
  calls.append(1)
  if len(calls) == 4:
    raise RuntimeError("disk full")
  return np.clip(np.asarray(g), -0.5, 0.5)
def clipped(w, x):
  loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
  g = jax.pure_callback(clip, jax.ShapeDtypeStruct(g.shape, g.dtype), g)
  return w - 0.1 * g, loss
def plain_clipped(w, x):  # what the callback computes, for jax.jit
  loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
  return w - 0.1 * jnp.clip(g, -0.5, 0.5), loss
hid = sess.compile(clipped, w0, x, state_argnums=0, state_specs=P(None, "data"))
out["host_partitions"] = [p.place for p in sess.report(hid).partitions]
hl = [float(sess.run(hid, x)), float(sess.run(hid, x))]
hl += [float(v) for v in sess.run(hid, np.stack([x]), steps=1)]  # 3 callbacks so far
rw, rl = w0, []
for _ in range(3):
  rw, l = jax.jit(plain_clipped)(rw, x)
  rl.append(float(l))
(hw,) = sess.get_state(hid)
out["host_equal"] = [max(abs(a - b) / abs(b) for a, b in zip(hl, rl)),
                     float(np.max(np.abs(np.asarray(hw) - np.asarray(rw)))), str(hw.sharding.spec)]
snap = [np.asarray(s.data).tolist() for s in hw.addressable_shards]
out["host_fault"] = err(lambda: sess.run(hid, x))
out["unchanged_after_host_fault"] = snap == [np.asarray(s.data).tolist()
                                              for s in sess.get_state(hid)[0].addressable_shards]
calls.clear()
snap = [np.asarray(s.data).tolist() for s in sess.get_state(hid)[0].addressable_shards]
out["sunk_host_fault"] = err(lambda: sess.run(hid, np.stack([x] * 5), steps=5))  # 4th step
out["unchanged_after_sunk_host_fault"] = snap == [
    np.asarray(s.data).tolist() for s in sess.get_state(hid)[0].addressable_shards]

def with_callback(w, x):
  y = jax.pure_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct((4, 8), np.float32), w)
  return w + y, jnp.sum(x)
def callback_in_scan(w, x):
  def body(c, _):
    return jax.pure_callback(lambda a: np.asarray(a) + 1, jax.ShapeDtypeStruct((4, 8), np.float32), c), None
  return jax.lax.scan(body, w, None, length=2)[0], jnp.sum(x)
inside = js.Session(js.SessionOptions(mesh=mesh, host_callbacks=False))
out["inside_refused"] = err(lambda: inside.compile(with_callback, w0, x, state_argnums=0))
out["scan_refused"] = err(lambda: sess.compile(callback_in_scan, w0, x, state_argnums=0))

# a fault in a sunk run (the 3rd step's batch is bad): every shard unchanged
snap = shards()
out["sunk_fault"] = err(lambda: sess.run(gid, np.stack([x, x, np.zeros_like(x)])[:, :12], 0.1, steps=3))
out["unchanged_after_sunk_fault"] = shards() == snap

# a 2-d mesh with explicit specs: batch over "data", weight columns over "model"
mesh2 = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
s2 = js.Session(js.SessionOptions(mesh=mesh2))
g2 = s2.compile(step, w0, x, 0.1, state_argnums=0, state_specs=P(None, "model"))
l2 = [float(s2.run(g2, x, 0.1)) for _ in range(3)]
w, ref2 = w0, []
for _ in range(3):
  w, l = jax.jit(step)(w, x, 0.1)
  ref2.append(float(l))
out["mesh2"] = [float(np.max(np.abs(np.array(l2) - np.array(ref2)) / np.abs(ref2))),
                str(s2.get_state(g2)[0].sharding.spec)]
print(json.dumps(out))
"""


class SpmdContractTest(SnippetTest):
  """Errors, state layout, sharing, threads and host work under a mesh."""

  SNIPPET = CONTRACT

  def test_errors_name_what_is_wrong(self):
    kind, text = self.out["indivisible"]
    self.assertEqual(kind, "InputError")
    self.assertIn("position 1", text)
    self.assertIn("do not divide over the 8 devices", text)
    self.assertEqual(self.out["bad_axis"][0], "InputError")
    self.assertIn("'model'", self.out["bad_axis"][1])
    self.assertIn("state_specs only", self.out["bad_zero"][1])
    self.assertIn("need SessionOptions(mesh", self.out["no_mesh"][1])
    self.assertIn("buckets= under a mesh", self.out["buckets"][1])
    for key in ("bad_shape", "bad_dtype"):
      self.assertEqual(self.out[key][0], "InputError", key)
      self.assertIn("argument 0", self.out[key][1])
    self.assertTrue(self.out["unchanged_after_bad"])

  def test_runs_equal_jit_and_state_keeps_its_layout(self):
    loss_rel, max_diff = self.out["run_equal"]
    # the mean's and the gradient's sums over 8 devices vs one device:
    # summation order only, 1e-6 of values ~1
    self.assertLess(loss_rel, 1e-6)
    self.assertLess(max_diff, 1e-6)
    self.assertIn("'data'", self.out["state_spec"])

  def test_set_state_reshards_and_never_takes_the_callers_buffer(self):
    for name in ("host", "device", "resharded"):
      spec, equal = self.out["set_" + name]
      self.assertIn("'data'", spec, name)
      self.assertIn("None", spec, name)
      self.assertTrue(equal, name)
    self.assertTrue(self.out["caller_alive"])
    self.assertTrue(self.out["caller_alive_after_run"])

  def test_shared_state_specials_and_constraints(self):
    self.assertTrue(self.out["eval_equal"])
    self.assertEqual(self.out["specials_bits"], [True, True])
    self.assertEqual(self.out["constraint_kept"], 1)
    self.assertTrue(self.out["constraint_equal"])

  def test_threads_lose_no_update(self):
    self.assertEqual(self.out["thread_count"], 20)

  def test_host_partitions_between_spmd_executables(self):
    self.assertEqual(self.out["host_partitions"], ["device", "host", "device"])
    loss_rel, state_diff, spec = self.out["host_equal"]
    # the gradient's sums over 8 devices vs one: summation order only
    self.assertLess(loss_rel, 1e-6)
    self.assertLess(state_diff, 1e-6)
    self.assertIn("'data'", spec)

  def test_a_host_fault_leaves_every_shard(self):
    for key in ("host_fault", "sunk_host_fault"):
      kind, text = self.out[key]
      self.assertEqual(kind, "HostOpError", key)
      self.assertIn("disk full", text)
    self.assertTrue(self.out["unchanged_after_host_fault"])
    self.assertTrue(self.out["unchanged_after_sunk_host_fault"])

  def test_callbacks_inside_an_spmd_executable_are_refused(self):
    for key in ("inside_refused", "scan_refused"):
      kind, text = self.out[key]
      self.assertEqual(kind, "PartitionError", key)
      self.assertIn("host work under this mesh is not supported", text)
      self.assertIn("inside the SPMD executable", text)
    self.assertIn("scan", self.out["scan_refused"][1])

  def test_a_failed_sunk_run_leaves_every_shard(self):
    self.assertEqual(self.out["sunk_fault"][0], "InputError")
    self.assertTrue(self.out["unchanged_after_sunk_fault"])

  def test_two_dimensional_mesh_with_explicit_specs(self):
    rel, spec = self.out["mesh2"]
    self.assertLess(rel, 1e-6)
    self.assertIn("'model'", spec)

if __name__ == "__main__":
  absltest.main()
