"""A Session graph runs as it was compiled, whatever jax settings the caller
has at a later call: what the session builds or traces then - a
run(steps=)'s executable, a new shape bucket and its checks, the outputs'
weak types, an eager run under jax.disable_jit, a restore's reads - is built
under the compile's settings (graph/settings.py `restored`), and a plan
converts what crosses the host under the compile's x64 (codegen.py). Before,
each was built under the caller's settings of that call: other random bits
than the same steps run one by one, a valid bucket refused, a float64
result narrowed or refused, a checkpoint called corrupted. run_op and the
compile cache are keyed by the settings. Compared with jax.jit under the
compile's settings, bit for bit."""
import tempfile
from unittest import mock

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jax._src import config as jax_config  # jax_random_seed_offset: no public context manager


def _x(seed, n=5):
  """Fresh random f32 values, with -0.0, nan and inf."""
  x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
  x[:3] = (-0.0, np.nan, np.inf)
  return x


class CompileSettingsTest(absltest.TestCase):

  def test_what_a_session_builds_later_is_built_under_its_compiles_settings(self):
    # run(steps=), a new shape bucket: built at a run, under the caller's
    # settings of that run before (other random bits than the same steps run
    # one by one; a 64-bit graph's first sunk run failed to build)
    def step(key, x):
      key, sub = jax.random.split(key)
      return key, jax.random.normal(sub, (2,)) + x

    key, flip = jax.random.key(3), not jax.config.jax_threefry_partitionable
    with jax.threefry_partitionable(flip):
      session = js.Session()
      gid = session.compile(step, key, jnp.zeros(2), state_argnums=0)
      want, k = [], key
      for _ in range(4):
        k, out = jax.jit(step)(k, jnp.zeros(2))
        want.append(out)
    sunk = session.run(gid, jnp.zeros((4, 2)), steps=4)
    np.testing.assert_array_equal(sunk, np.stack(want))
    np.testing.assert_array_equal(jax.random.key_data(session.get_state(gid)[0]),
                                  jax.random.key_data(k))

    def scaled(x, k):
      return x * jax.random.uniform(k, (x.shape[1],))

    rows = np.random.default_rng(6).standard_normal((9, 5)).astype(np.float32)
    with jax.threefry_partitionable(flip):
      gid = session.compile(scaled, rows[:4], key, buckets={0: "auto"})
      want = {n: jax.jit(scaled)(rows[:n], key) for n in (3, 9)}
    for n in (3, 9):  # 9 rows: a bucket built at this run
      np.testing.assert_array_equal(session.run(gid, rows[:n], key), want[n])

    def divide(c, x):
      return c / 3 + x, jnp.sum(c)

    with jax.enable_x64(True):
      c0 = jnp.asarray(_x(7, 4)[2:], jnp.float64)  # inf and a finite value
      xs = jnp.asarray(_x(8, 6).reshape(3, 2), jnp.float64)
      gid = session.compile(divide, c0, xs[0], state_argnums=0)
      c, want = c0, []
      for i in range(3):
        c, out = jax.jit(divide)(c, xs[i])
        want.append(out)
    np.testing.assert_array_equal(session.run(gid, xs, steps=3), np.stack(want))
    np.testing.assert_array_equal(session.get_state(gid)[0], c)

  def test_a_bucket_met_later_is_checked_and_built_under_the_compiles_settings(self):
    w = np.random.default_rng(1).standard_normal((8, 8)).astype(np.float32)
    rows = np.random.default_rng(2).standard_normal((40, 8)).astype(np.float32)

    def model(x):
      return jnp.tanh(x @ w)

    session = js.Session()
    with jax.default_matmul_precision("highest"):
      gid = session.compile(model, rows[:4], buckets={0: "auto"})
      want = jax.jit(model)(rows)
    # 40 rows: a bucket traced, checked against the probes and built now (it
    # was refused: "fn traced at 64 rows is another program")
    np.testing.assert_array_equal(session.run(gid, rows), want)

    def offset(seed, x):
      return x + jax.random.uniform(jax.random.key(seed))

    with jax_config.random_seed_offset(7):
      gid = session.compile(offset, 0, jnp.zeros(4), buckets={1: "auto"})
      want = jax.jit(offset)(0, jnp.zeros(8))
    np.testing.assert_array_equal(session.run(gid, 0, jnp.zeros(8)), want)

    def wide(x):
      return x.astype(jnp.float64) * 1.0000000001

    with jax.enable_x64(True):
      gid = session.compile(wide, rows[:4], buckets={0: "auto"})
      want = jax.jit(wide)(rows[:3])
    got = session.run(gid, rows[:3])  # padded to 4 rows and sliced: float32 before
    self.assertEqual(got.dtype, np.float64)
    np.testing.assert_array_equal(got, want)

  def test_output_weak_types_are_answered_under_the_compiles_settings(self):
    def fn(x, h, a):
      return jnp.ones((2, 3)) + x, h * 2, a * 2

    x, h = jnp.asarray(_x(3, 3)), jnp.ones(2, jnp.bfloat16)
    session = js.Session()
    gid = session.compile(fn, x, h, jnp.float32(2.0))
    want = jax.jit(fn)(x, h, 2.0)[2]
    self.assertTrue(want.weak_type)
    with jax.numpy_rank_promotion("raise"):  # the first weak 2.0: answered here, kept
      self.assertTrue(session.run(gid, x, h, 2.0)[2].weak_type)
    got = session.run(gid, x, h, 2.0)[2]
    self.assertTrue(got.weak_type)
    np.testing.assert_array_equal(got, want)

  def test_an_x64_graph_with_a_host_callback_runs_and_restores_with_x64_off(self):
    def step(c, x):
      y = jax.pure_callback(lambda v: v * 2 + 1e-9, jax.ShapeDtypeStruct(c.shape, c.dtype),
                            c + x)
      return y, y.sum()

    with jax.enable_x64(True):
      c0 = jnp.asarray(_x(4, 4), jnp.float64)
      x = jnp.asarray(np.random.default_rng(5).standard_normal(4), jnp.float64)
      want = [c0]
      for _ in range(3):
        want.append(jax.jit(step)(want[-1], x)[0])
      session = js.Session()
      gid = session.compile(step, c0, x, state_argnums=0)
    session.run(gid, x)  # the plan: the callback's float64 result was refused
    got = session.get_state(gid)[0]
    self.assertEqual(got.dtype, np.float64)
    np.testing.assert_array_equal(got, want[1])
    with jax.disable_jit():  # op by op: its float64 state was kept as numpy, and narrowed
      session.run(gid, x)
    np.testing.assert_array_equal(session.get_state(gid)[0], want[2])
    session.run(gid, x)
    np.testing.assert_array_equal(session.get_state(gid)[0], want[3])
    with tempfile.TemporaryDirectory() as folder:
      session.save(gid, folder, 1)
      session.wait_until_saved()
      with jax.enable_x64(True):
        other = session.compile(step, jnp.zeros(4, jnp.float64), x, state_argnums=0)
      session.restore(other, folder)  # "checkpoint ... is corrupted" with x64 off
      np.testing.assert_array_equal(session.get_state(other)[0], want[3])

  def test_outputs_a_plan_makes_on_the_host_keep_their_64_bit_types(self):
    def doubled(x):  # the callback's result returned as it is, and a literal
      return jax.pure_callback(lambda v: v * 2 + 1e-9, jax.ShapeDtypeStruct(x.shape, x.dtype),
                               x), 2.0

    with jax.enable_x64(True):
      x = jnp.asarray(_x(10, 4), jnp.float64)
      want = jax.jit(doubled)(x)
      session = js.Session()
      gid = session.compile(doubled, x)
    for got in (session.run(gid, x), session.run(gid, x[None], steps=1)):
      for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        self.assertEqual((g.dtype, g.weak_type), (w.dtype, w.weak_type))
        np.testing.assert_array_equal(np.reshape(g, np.shape(w)), w)

  def test_a_callers_xla_metadata_tags_what_is_compiled_under_it_alone(self):
    from jax.experimental.xla_metadata import set_xla_metadata  # pylint: disable=import-outside-toplevel

    def step(c, x):
      return c + jnp.sin(x), jnp.cos(c).sum()

    def tagged(session, gid):
      return any("probe_tag" in e.as_text() for e in session.executables(gid))

    session = js.Session()
    with set_xla_metadata(probe_tag="compile"):
      inside = session.compile(step, jnp.zeros(3), jnp.ones(3), state_argnums=0)
    outside = session.compile(step, jnp.zeros(3), jnp.ones(3), state_argnums=0)
    self.assertEqual([tagged(session, inside), tagged(session, outside)], [True, False])
    built, compile_lowered = [], jax.stages.Lowered.compile

    def recorded(lowered, *args, **kwargs):
      built.append(lowered.as_text())
      return compile_lowered(lowered, *args, **kwargs)
    with mock.patch.object(jax.stages.Lowered, "compile", recorded), \
        set_xla_metadata(probe_tag="run"):  # a sunk executable built at this run
      session.run(outside, jnp.ones((2, 3)), steps=2)
    self.assertNotEmpty(built)
    self.assertFalse(any("probe_tag" in text for text in built))

  def test_debug_checks_follow_the_caller_of_the_run(self):
    def reused(key):
      return jax.random.normal(key, (2,)) + jax.random.normal(key, (2,))

    key, session = jax.random.key(0), js.Session()
    gid = session.compile(reused, key)
    with jax.debug_key_reuse(True), jax.disable_jit():  # op by op, as jax.jit runs it there
      with self.assertRaises(jax.errors.KeyReuseError):
        jax.jit(reused)(key)
      with self.assertRaises(jax.errors.KeyReuseError):
        session.run(gid, key)

  def test_run_op_is_keyed_by_the_settings(self):
    def draw(key):
      return jax.random.bits(key, (4,))

    key, session = jax.random.key(9), js.Session()
    for flip in (False, True, False):  # the second gave the first's bits
      with jax.threefry_partitionable(flip):
        np.testing.assert_array_equal(session.run_op(draw, key), jax.jit(draw)(key))


if __name__ == "__main__":
  absltest.main()
