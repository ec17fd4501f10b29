"""Device-resident state: training through the session equals the plain loop;
shared state across graphs; loop sink equals separate runs; get/set_state."""
import shutil
import tempfile

from absl.testing import absltest
import pytest
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jaxsession.examples import mlp_adam


def _data(seed, steps, batch=16):
  return mlp_adam.make_data(jax.random.key(seed), steps, batch)


def _at(data, i):
  return jax.tree.map(lambda a: a[i], data)


def _init(seed):
  params = mlp_adam.init_params(jax.random.key(seed), (32, 24, 1))
  return params, mlp_adam.adam_init(params)


def _train_session(seed, steps):
  """A session with the MLP+Adam step compiled; its params, opt state, data."""
  params, opt = _init(seed)
  data = _data(seed + 1, steps)
  sess = js.Session()
  gid = sess.compile(mlp_adam.train_step, params, opt, _at(data, 0), state_argnums=(0, 1))
  return sess, gid, params, opt, data


def _assert_trees_close(test, a, b, rtol=1e-6):
  test.assertEqual(jax.tree.structure(a), jax.tree.structure(b))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=1e-7)


class TrainingTest(absltest.TestCase):

  @pytest.mark.slow
  def test_fifty_steps_equal_the_plain_jax_loop(self):
    sess, gid, params, opt, data = _train_session(1, 50)
    step = jax.jit(mlp_adam.train_step)
    p, o = params, opt
    for i in range(50):
      loss = sess.run(gid, _at(data, i))
      p, o, want = step(p, o, _at(data, i))
      np.testing.assert_allclose(loss, want, rtol=1e-6)
    got_p, got_o = sess.get_state(gid)
    _assert_trees_close(self, got_p, p)
    _assert_trees_close(self, got_o, o)
    self.assertEqual(int(got_o["t"]), 50)

  @pytest.mark.slow
  def test_callers_arrays_are_never_donated(self):
    sess, gid, params, opt, data = _train_session(3, 3)
    held = sess.get_state(gid)
    for i in range(3):
      sess.run(gid, _at(data, i))
    for leaf in jax.tree.leaves((params, opt, held, data)):
      self.assertFalse(leaf.is_deleted())
    self.assertEqual(int(held[1]["t"]), 0)  # a copy, not the live slot
    self.assertEqual(sum(d.donated for d in sess.report(gid).donations),
                     len(jax.tree.leaves((params, opt))))

  @pytest.mark.slow
  def test_loop_sink_equals_separate_runs(self):
    params, opt = _init(5)
    data = _data(6, 7)
    a, b = js.Session(), js.Session()
    ga = a.compile(mlp_adam.train_step, params, opt, _at(data, 0), state_argnums=(0, 1))
    gb = b.compile(mlp_adam.train_step, params, opt, _at(data, 0), state_argnums=(0, 1))
    sunk = a.run(ga, data, steps=7)
    one_by_one = [b.run(gb, _at(data, i)) for i in range(7)]
    self.assertEqual(sunk.shape, (7,))
    np.testing.assert_allclose(sunk, np.stack(one_by_one), rtol=1e-6)
    _assert_trees_close(self, a.get_state(ga), b.get_state(gb))
    again = a.run(ga, data, steps=7)  # reuses the sunk executable, state moves on
    self.assertFalse(np.allclose(again, sunk))

  def test_loop_sink_stacks_pytree_outputs(self):
    def step(count, x):
      return count + x.sum(), {"x2": x * 2, "n": count}
    sess = js.Session()
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    gid = sess.compile(step, jnp.float32(0.5), xs[0], state_argnums=0)
    out = sess.run(gid, xs, steps=4)
    np.testing.assert_allclose(out["x2"], xs * 2, rtol=1e-6)
    np.testing.assert_allclose(out["n"], 0.5 + np.concatenate([[0], np.cumsum(xs.sum(1))[:-1]]),
                               rtol=1e-5)
    np.testing.assert_allclose(sess.get_state(gid)[0], 0.5 + xs.sum(), rtol=1e-5)


class SharedStateTest(absltest.TestCase):

  @pytest.mark.slow
  def test_eval_graph_sees_train_updates(self):
    sess, train, params, opt, data = _train_session(7, 5)
    evaluate = sess.compile(mlp_adam.eval_step, params, _at(data, 0), state_argnums=0,
                            state_from=train, updates_state=False)
    before = sess.run(evaluate, _at(data, 0))
    np.testing.assert_allclose(before, mlp_adam.eval_step(params, _at(data, 0)), rtol=1e-6)
    for i in range(5):
      sess.run(train, _at(data, i))
    trained = sess.get_state(train)[0]
    after = sess.run(evaluate, _at(data, 0))
    np.testing.assert_allclose(after, jax.jit(mlp_adam.eval_step)(trained, _at(data, 0)),
                               rtol=1e-6)
    self.assertLess(float(after), float(before))
    _assert_trees_close(self, sess.get_state(evaluate)[0], trained)

  def test_both_graphs_update_one_slot(self):
    def add(s, x):
      return (s + x,)
    def scale(s, k):
      return s * k, s.sum()
    sess = js.Session()
    rng = np.random.default_rng(1)
    s0 = jnp.asarray(rng.standard_normal(4), jnp.float32)
    x = jnp.asarray(rng.standard_normal(4), jnp.float32)
    a = sess.compile(add, s0, x, state_argnums=0)
    b = sess.compile(scale, s0, 2.0, state_argnums=0, state_from=a)
    sess.run(a, x)
    total = sess.run(b, 3.0)
    np.testing.assert_allclose(total, (s0 + x).sum(), rtol=1e-6)
    np.testing.assert_allclose(sess.get_state(a)[0], (s0 + x) * 3.0, rtol=1e-6)

  def test_mismatched_shared_state_is_an_input_error(self):
    sess = js.Session()
    a = sess.compile(lambda s, x: (s + x,), jnp.ones(3) * 0.5, jnp.ones(3) * 2,
                     state_argnums=0)
    with self.assertRaisesRegex(js.InputError,
                                r"at path \(root\): expected f32\[3\], got f32\[4\] \(the state"):
      sess.compile(lambda s: s.sum(), jnp.ones(4) * 0.5, state_argnums=0, state_from=a,
                   updates_state=False)
    # no state args to bind (was accepted, sharing nothing: a break-it find)
    with self.assertRaisesRegex(js.InputError, "state_from is given without state_argnums"):
      sess.compile(lambda s: s.sum(), jnp.ones(3) * 0.5, state_from=a)


class SetStateTest(absltest.TestCase):

  def test_set_state_then_run(self):
    sess = js.Session()
    rng = np.random.default_rng(2)
    w = {"a": jnp.asarray(rng.standard_normal(3), jnp.float32), "b": jnp.float32(0.25)}
    gid = sess.compile(lambda w, x: ({"a": w["a"] + x, "b": w["b"] * 2}, w["a"].sum()),
                       w, w["a"], state_argnums=0)
    new = {"a": np.asarray(rng.standard_normal(3), np.float32), "b": np.float32(1.5)}
    sess.set_state(gid, new)
    x = jnp.asarray(rng.standard_normal(3), jnp.float32)
    np.testing.assert_allclose(sess.run(gid, x), new["a"].sum(), rtol=1e-6)
    got = sess.get_state(gid)[0]
    np.testing.assert_allclose(got["a"], new["a"] + x, rtol=1e-6)
    self.assertEqual(float(got["b"]), 3.0)

  def test_numpy_values_are_copied_not_kept(self):
    """set_state, replace_state and compile copy a numpy value: the caller may
    refill its buffer at once. On the CPU, device_put kept a 64-byte aligned
    buffer as the array's own, so the state followed the caller's refill."""
    def aligned(values):  # a 64-byte aligned float32 buffer holding `values`
      raw = np.empty(values.size * 4 + 64, np.uint8)
      off = (-raw.ctypes.data) % 64
      buf = raw[off:off + values.size * 4].view(np.float32)
      buf[:] = values
      return buf
    step = lambda w, x: (w + x, jnp.sum(w * x))  # noqa: E731
    rng = np.random.default_rng(5)
    a = rng.standard_normal(1024).astype(np.float32)
    x = jnp.asarray(rng.standard_normal(1024), jnp.float32)
    want = jax.jit(step)(jnp.asarray(a), x)
    sess = js.Session()
    base = sess.compile(step, jnp.zeros(1024, jnp.float32), x, state_argnums=0)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    for api in ("set_state", "replace_state", "compile", "compile under a mesh"):
      with self.subTest(api=api):
        staging = aligned(a)
        runner = sess
        if api == "set_state":
          sess.set_state(base, staging)
          gid = base
        elif api == "replace_state":
          sess.replace_state(base, 0, staging)
          gid = base
        elif api == "compile":
          gid = sess.compile(step, staging, x, state_argnums=0)
        else:  # the state laid out through put_global's shards
          runner = js.Session(js.SessionOptions(mesh=mesh))
          gid = runner.compile(step, staging, x, state_argnums=0)
        staging[:] = 0.0  # the caller refills its buffer
        np.testing.assert_array_equal(runner.run(gid, x), want[1])
        np.testing.assert_array_equal(runner.get_state(gid)[0], want[0])

  def test_static_argnums_are_baked_in(self):
    sess = js.Session()
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal(5), jnp.float32)
    gid = sess.compile(lambda x, n: x ** n, x, 3, static_argnums=1)
    np.testing.assert_allclose(sess.run(gid, x), x ** 3, rtol=1e-6)

  def test_closed_jaxpr_input(self):
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 3)), jnp.float32)
    closed = jax.make_jaxpr(lambda a: jnp.tanh(a) @ a.T)(x)
    sess = js.Session()
    gid = sess.compile(closed, x)
    y = jnp.asarray(rng.standard_normal((2, 3)), jnp.float32)
    np.testing.assert_allclose(sess.run(gid, y), jnp.tanh(y) @ y.T, rtol=1e-6)



class BindUnderATraceTest(absltest.TestCase):

  def test_binding_inside_a_jax_transformation_is_refused_and_loses_nothing(self):
    # the session's copies, made inside jax.jit's trace, were tracers: the
    # state held them, and every later call raised (a review's find)
    sess = js.Session()
    w = np.random.default_rng(6).standard_normal(4).astype(np.float32)
    gid = sess.compile(lambda w, x: (w + x, w * x), w, w, state_argnums=0)
    d = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, d, True)
    sess.save(gid, d, 1)
    sess.wait_until_saved()
    calls = {"set_state": lambda: sess.set_state(gid, np.ones(4, np.float32)),
             "replace_state": lambda: sess.replace_state(gid, 0, np.ones(4, np.float32)),
             "restore": lambda: sess.restore(gid, d)}
    for name, call in calls.items():
      with self.subTest(name):
        with self.assertRaisesRegex(js.InputError, "while a jax transformation traces"):
          jax.jit(lambda x, call=call: (call(), x)[1])(jnp.ones(4))
        np.testing.assert_array_equal(sess.get_state(gid)[0], w)
    np.testing.assert_array_equal(sess.run(gid, w), w * w)


if __name__ == "__main__":
  absltest.main()
