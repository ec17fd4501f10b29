"""Mesh executables on XLA:CPU, dispatched back to back without a result read:
one at a time in the process (runtime/dispatch.py's fast_call). Under jax.jit
two threads each running a mesh program of its own abort the process in
XLA's collective rendezvous after 40 s, and one thread dispatching 8-device
steps back to back hangs there (both reproduced with no session involved);
a lock around each dispatch alone did not help, nor waiting for one output
of the one before at the next dispatch (the caller may delete it). Each case runs in a fresh
process with its own number of CPU devices."""
from absl.testing import absltest

from subproc import run_json

TWO_THREADS = """
  import json, threading
  import jax.numpy as jnp, numpy as np
  import jaxsession as js
  mesh = jax.make_mesh((2,), ("data",))
  def step(w, x):
    g = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
    return w - 0.1 * g, jnp.sum(g)
  def examples(seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((16, 16)).astype(np.float32),
            rng.standard_normal((8, 16)).astype(np.float32))
  def loop(seed, out):
    w, x = examples(seed)
    s = js.Session(js.SessionOptions(mesh=mesh))
    g = s.compile(step, w, x, state_argnums=0)
    for _ in range(300):  # no result read until the end
      l = s.run(g, x)
    out[seed] = [np.asarray(l).tolist(), np.asarray(s.get_state(g)[0]).tolist()]
  threaded = {}
  ts = [threading.Thread(target=loop, args=(seed, threaded)) for seed in range(2)]
  [t.start() for t in ts]
  [t.join() for t in ts]
  alone = {}
  for seed in range(2):
    loop(seed, alone)
  print(json.dumps([threaded[0], threaded[1], alone[0], alone[1]]))
"""

EIGHT_DEVICES = """
  import json
  import jax.numpy as jnp, numpy as np
  import jaxsession as js
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((8,), ("data",))
  def step(w, x):
    g = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
    return w - 0.1 * g, jnp.sum(g)
  rng = np.random.default_rng(7)
  w = rng.standard_normal((64, 64)).astype(np.float32)
  x = jax.device_put(rng.standard_normal((64, 64)).astype(np.float32),
                     NamedSharding(mesh, P("data")))
  s = js.Session(js.SessionOptions(mesh=mesh))
  g = s.compile(step, w, x, state_argnums=0)
  loss = s.compile(lambda w, x: jnp.sum(x @ w), w, x)
  for _ in range(3000):  # no result read
    l = s.run(g, x)
  ws = s.get_state(g)[0]
  for _ in range(3000):
    t = s.run(loss, ws, x)
  xn = np.asarray(x)  # (laid out by the session)
  both = s.compile(step, w, xn)
  rw, rl = s.run(both, w, xn)
  reference = [float(rl), np.asarray(rw).tolist(), float(rl)]  # read at once
  for _ in range(3000):  # no state: the caller drops an output it does not need
    nw, nl = s.run(both, w, xn)  # (ordering by the next dispatch's wait on it
    nw.delete()                  # failed so: a break-it find)
  f = js.jit(step, session=s)  # its calls after the first: jax's C++ front ran the
  for _ in range(3000):        # executable, unordered (a break-it find)
    fw, fl = f(w, xn)
  jw = jax.device_put(w, NamedSharding(mesh, P()))
  f = jax.jit(step)
  for _ in range(3000):  # the same steps, each read (jax.jit hangs otherwise)
    jw, jl = f(jw, x)
    jl.block_until_ready()
  jt = jax.jit(lambda w, x: jnp.sum(x @ w))(jw, x)
  print(json.dumps([np.asarray(s.get_state(g)[0]).tolist(), np.asarray(jw).tolist(),
                    float(l), float(jl), float(t), float(jt),
                    [float(nl), np.asarray(fw).tolist(), float(fl)], reference]))
"""


class CpuMeshDispatchTest(absltest.TestCase):

  def test_two_threads_running_mesh_graphs_of_their_own(self):
    threaded0, threaded1, alone0, alone1 = run_json(TWO_THREADS, devices=2, timeout=300)
    self.assertEqual(threaded0, alone0)  # bit for bit: the same program, the same inputs
    self.assertEqual(threaded1, alone1)
    self.assertNotEqual(threaded0, threaded1)

  def test_eight_devices_dispatched_back_to_back(self):
    ours, jits, loss, jit_loss, total, jit_total, one, read_at_once = run_json(
        EIGHT_DEVICES, devices=8, timeout=300)
    self.assertEqual(ours, jits)  # bit for bit against jax.jit with each step read
    self.assertEqual(loss, jit_loss)
    self.assertEqual(total, jit_total)
    # one step from w (every argument's leading axis split: another program than
    # the jax.jit loop's), stateless and through js.jit, as read at once
    self.assertEqual(one, read_at_once)


if __name__ == "__main__":
  absltest.main()
