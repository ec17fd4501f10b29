"""Functions that switch a jax setting inside themselves - jax.enable_x64,
jax.threefry_partitionable - against jax.jit, bit for bit: the session binds
every op again, under the settings its equation was traced under
(graph/settings.py) and with its 64-bit constants kept 64-bit
(lowering.typed). Before, a 64-bit value made inside `enable_x64` failed to
compile, and random bits drawn under a switched threefry_partitionable came
out as the caller's setting draws them."""
from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js


def _x(seed, n=5):
  """Fresh random f32 values, with -0.0, nan and inf."""
  x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
  x[:3] = (-0.0, np.nan, np.inf)
  return x


def _session_call(fn, *args):
  session = js.Session()
  return session.run(session.compile(fn, *args), *args)


def _as_bits(x):
  return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x


class InnerSettingsTest(absltest.TestCase):

  def assert_as_jit(self, fn, *args):
    want = jax.jit(fn)(*args)
    for name, call in (("js.jit", js.jit(fn)), ("Session.run", lambda *a: _session_call(fn, *a))):
      got = call(*args)
      got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
      self.assertLen(got_leaves, len(want_leaves), name)
      for g, w in zip(got_leaves, want_leaves):
        self.assertEqual((g.dtype, getattr(g, "weak_type", None)),
                         (w.dtype, getattr(w, "weak_type", None)), name)
        np.testing.assert_array_equal(_as_bits(g), _as_bits(w), err_msg=name)

  def test_values_made_under_enable_x64_inside(self):
    def literal(x):  # a 64-bit literal read by the op it feeds
      with jax.enable_x64(True):
        y = jnp.asarray(x, jnp.float64) * 3.1
        return y.astype(jnp.float32) + x, y, jnp.sum(y)

    def folded(x):  # scalar arithmetic the fold pass computes
      with jax.enable_x64(True):
        third = jnp.float64(1.0) / jnp.float64(3.0)
        return jnp.asarray(x, jnp.float64) * third + np.float64(1e-300)

    def captured(x):  # a captured 64-bit numpy constant
      c = np.random.default_rng(3).standard_normal(5)
      with jax.enable_x64(True):
        return jnp.asarray(c) * jnp.asarray(x, jnp.float64)

    def large_ints(x):  # int64 beyond int32: truncated, the bits are wrong
      with jax.enable_x64(True):
        return (jnp.asarray(jnp.nan_to_num(x) * 1000, jnp.int64) * (2**33) + 7,
                jnp.arange(4, dtype=jnp.uint64) + np.uint64(2**63))

    def in_a_scan(x):
      def body(c, xi):
        with jax.enable_x64(True):
          c = c * 0.5 + jnp.asarray(xi, jnp.float64) * 2.5
        return c, c.astype(jnp.float32)
      with jax.enable_x64(True):
        return jax.lax.scan(body, jnp.float64(0.1), x)

    self.assertFalse(jax.config.jax_enable_x64)
    for fn in (literal, folded, captured, large_ints, in_a_scan):
      with self.subTest(fn.__name__):
        self.assert_as_jit(fn, _x(0))

  def test_values_made_without_x64_inside_an_x64_caller(self):
    def narrow(x):
      with jax.enable_x64(False):
        c = np.linspace(-1, 1, 5)
        y = jnp.asarray(x, jnp.float32) * 1.7 + 3
        return y * jnp.asarray(c) + jnp.float32(1) / jnp.float32(3), jnp.arange(3) + 5, x * 2.0

    with jax.enable_x64(True):
      x = _x(1).astype(np.float64)
      x[3] = 1e300  # inf in 32 bits
      self.assert_as_jit(narrow, x)

  def test_callbacks_on_64_bit_values_under_a_32_bit_caller_run_as_jax_jit_runs_them(self):
    # they stay inside the executable: jax narrows their operands to 32 bits
    # and refuses a 64-bit result when it runs; on the host they saw 64-bit
    # operands, and a 64-bit result came back narrowed (2**40 + 5 as 5)
    seen = []

    def host(a):
      seen.append(a.dtype)
      return np.float32(float(a[1]) * 3 - 1)

    def operand(x):
      with jax.enable_x64(True):
        y = jnp.asarray(x, jnp.float64) / 3
        return jax.pure_callback(host, jax.ShapeDtypeStruct((), jnp.float32), y)

    def result(x):
      with jax.enable_x64(True):
        return jax.pure_callback(lambda a: np.asarray(a, np.int64) + 2**40 + 5,
                                 jax.ShapeDtypeStruct((5,), jnp.int64), x)

    def read_on_the_device(x):
      with jax.enable_x64(True):
        y = jnp.asarray(x, jnp.float64) * 1.25
        z = jax.pure_callback(np.cos, jax.ShapeDtypeStruct((5,), jnp.float64), y)
        return z * 2.0 + y

    x = np.arange(5, dtype=np.float32)
    self.assert_as_jit(operand, x)
    self.assertEqual(set(seen), {np.dtype(np.float32)})
    for fn in (result, read_on_the_device):
      for call in (jax.jit(fn), js.jit(fn), lambda a, fn=fn: _session_call(fn, a)):
        with self.subTest(fn.__name__), self.assertRaises(jax.errors.JaxRuntimeError):
          jax.block_until_ready(call(x))
    with jax.enable_x64(True):  # with x64 on for the call, they run as jax.jit's
      self.assert_as_jit(result, x)
      self.assert_as_jit(read_on_the_device, _x(4))

  def test_random_bits_under_a_switched_threefry_partitionable(self):
    flip = not jax.config.jax_threefry_partitionable

    def draws(key):
      with jax.threefry_partitionable(flip):
        inner = jax.random.bits(key, (7,))  # random_bits: no nested jit around it
        keys = jax.random.split(key, 3)
        folded = jax.vmap(lambda k: jax.random.fold_in(k, 2))(keys)
      outer = jax.random.bits(key, (7,))  # the same op on the same key: CSE keeps both
      return inner, outer, folded

    for seed in (0, 11):
      self.assert_as_jit(draws, jax.random.key(seed))
    inner, outer, _ = js.jit(draws)(jax.random.key(0))
    self.assertFalse(np.array_equal(inner, outer))  # the two settings draw apart

  def test_sunk_steps_draw_under_the_switched_setting(self):
    flip = not jax.config.jax_threefry_partitionable

    def step(key, total):
      key, sub = jax.random.split(key)
      with jax.threefry_partitionable(flip):
        total = total + jax.random.bits(sub, (4,))
      return key, total

    key, total = jax.random.key(5), jnp.zeros(4, jnp.uint32)
    want = (key, total)
    for _ in range(3):
      want = jax.jit(step)(*want)
    session = js.Session()
    gid = session.compile(step, key, total, state_argnums=(0, 1))
    session.run(gid, steps=3)
    got = session.get_state(gid)
    np.testing.assert_array_equal(jax.random.key_data(got[0]), jax.random.key_data(want[0]))
    np.testing.assert_array_equal(got[1], want[1])

  def test_scan_bodies_of_other_settings_share_no_executable(self):
    # the compile cache keys a body's equations by their settings too: the
    # second program reused the first's executable (the same draws) before
    def drawing(flip):
      def fn(key):
        def body(k, _):
          k, sub = jax.random.split(k)
          with jax.threefry_partitionable(flip):
            return k, jax.random.bits(sub, (3,))
        return jax.lax.scan(body, key, None, length=4)[1]
      return fn

    session = js.Session()
    key = jax.random.key(2)
    for flip in (jax.config.jax_threefry_partitionable, not jax.config.jax_threefry_partitionable):
      fn = drawing(flip)
      np.testing.assert_array_equal(session.run(session.compile(fn, key), key), jax.jit(fn)(key))

  def test_xla_metadata_set_inside_reaches_the_ops_it_covers(self):
    from jax.experimental.xla_metadata import set_xla_metadata  # pylint: disable=import-outside-toplevel

    def fn(x):
      with set_xla_metadata(probe_tag="inside"):
        y = jnp.sin(x) * 2
      return y + 1

    def tagged(hlo):
      return sorted(line.split("=", 1)[1].split("(", 1)[0].split()[-1]
                    for line in hlo.splitlines() if 'probe_tag="inside"' in line)

    x = _x(5)
    want = tagged(jax.jit(fn).lower(x).compile().as_text())
    session = js.Session()
    gid = session.compile(fn, x)
    self.assertEqual(want, ["multiply", "sine"])
    self.assertEqual(tagged(session.executables(gid)[0].as_text()), want)
    np.testing.assert_array_equal(session.run(gid, x), jax.jit(fn)(x))

  def test_dump_names_a_node_of_other_settings(self):
    flip = not jax.config.jax_threefry_partitionable

    def fn(key, x):
      with jax.threefry_partitionable(flip):
        bits = jax.random.bits(key, (3,))
      return bits, jnp.sin(x)

    session = js.Session()
    text = session.graph(session.compile(fn, jax.random.key(0), _x(2, 3))).dump()
    lines = [line for line in text.splitlines() if "settings:" in line]
    self.assertLen(lines, 1)
    self.assertIn("random_bits", lines[0])
    self.assertIn(f"threefry_partitionable={flip}", lines[0])


if __name__ == "__main__":
  absltest.main()
