"""Bit-for-bit comparison and the awkward inputs the rewrite tests feed.

A rewrite keeps the user's arithmetic, so its result is compared bit for bit:
same pytree, dtypes, shapes, and bits - -0.0 is not 0.0 - except NaN payloads,
which XLA does not promise (any NaN equals any NaN here).
"""
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jaxsession import pipeline


def _bits(a):
  a = np.asarray(a)
  return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype.itemsize in (1, 2, 4, 8) else a


def assert_same_bits(got, want, msg=""):
  """got and want are the same pytree of the same arrays, bit for bit (NaN
  payloads aside)."""
  got_leaves, got_tree = jax.tree.flatten(got)
  want_leaves, want_tree = jax.tree.flatten(want)
  assert got_tree == want_tree, f"{msg}: pytree {got_tree} != {want_tree}"
  for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
    g, w = np.asarray(g), np.asarray(w)
    where = f"{msg} (leaf {i})"
    assert g.dtype == w.dtype and g.shape == w.shape, (
        f"{where}: {g.dtype}{g.shape} != {w.dtype}{w.shape}")
    if not jnp.issubdtype(g.dtype, jnp.inexact):
      np.testing.assert_array_equal(g, w, err_msg=where)
      continue
    wide = np.complex128 if np.iscomplexobj(g) else np.float64  # numpy knows no bfloat16 NaN
    g_nan, w_nan = np.isnan(g.astype(wide)), np.isnan(w.astype(wide))
    differ = (g_nan != w_nan) | ((_bits(g) != _bits(w)) & ~(g_nan & w_nan))
    assert not differ.any(), (f"{where}: {differ.sum()} of {differ.size} differ, first at "
                              f"{np.argwhere(differ)[:5].tolist()}: got {g[differ][:5]}, "
                              f"want {w[differ][:5]}")


def assert_equal_signed(got, want, err_msg=""):
  """np.testing.assert_array_equal, which counts -0.0 and 0.0 equal, plus
  the sign of every zero: a value check that also sees a lost -0.0, for
  comparisons against numpy values or lists of another dtype (where the
  dtypes match, assert_same_bits is the stricter check)."""
  np.testing.assert_array_equal(got, want, err_msg=err_msg)
  g, w = np.asarray(got), np.asarray(want)
  if g.dtype == object or w.dtype == object:
    return
  if np.issubdtype(np.result_type(g.dtype, w.dtype), np.inexact) or \
      g.dtype.name == "bfloat16" or w.dtype.name == "bfloat16":
    g64, w64 = (np.broadcast_to(x.astype(np.complex128 if np.iscomplexobj(x) else np.float64),
                                np.broadcast_shapes(g.shape, w.shape)) for x in (g, w))
    zero = (g64 == 0) & (w64 == 0)
    for part in ((g64.real, w64.real), (g64.imag, w64.imag)) if np.iscomplexobj(g64) else \
        ((g64, w64),):
      differ = zero & (np.signbit(part[0]) != np.signbit(part[1]))
      assert not differ.any(), (f"{err_msg}: the sign of {differ.sum()} zeros differs, first "
                                f"at {np.argwhere(differ)[:5].tolist()}")


def ulps_apart(got, want):
  """The largest distance, in units in the last place, between two float32 arrays."""
  g = np.asarray(got, np.float32).view(np.int32).astype(np.int64)
  w = np.asarray(want, np.float32).view(np.int32).astype(np.int64)
  g = np.where(g < 0, np.int64(-2**31) - g, g)  # sign-magnitude -> a monotone line
  w = np.where(w < 0, np.int64(-2**31) - w, w)
  return int(np.max(np.abs(g - w))) if g.size else 0


def normal(rng, *shape, dtype=jnp.float32, scale=1.0, shift=0.0):
  """Fresh random values (never all zeros or ones)."""
  return jnp.asarray(rng.standard_normal(shape) * scale + shift).astype(dtype)


def wide(rng, *shape, dtype=jnp.float32):
  """Random values over many magnitudes, so rounding and association show."""
  mags = np.exp(rng.uniform(-12, 12, shape))
  return jnp.asarray(rng.standard_normal(shape) * mags).astype(dtype)


def with_specials(x, kinds=("neg_zero", "nan", "inf", "-inf", "big", "subnormal")):
  """x with a few entries replaced by -0.0, NaN, +-inf, a value past 2**24 and
  a subnormal (for float32; the dtype's own for others)."""
  x = np.array(x)
  flat = x.reshape(-1)
  info = jnp.finfo(x.dtype)
  values = {"neg_zero": -0.0, "nan": np.nan, "inf": np.inf, "-inf": -np.inf,
            "big": min(float(info.max) / 4, 2.0 ** 24 * 3 + 1),
            "subnormal": float(info.tiny) / 8}
  for i, kind in enumerate(kinds):
    if i * 7 < flat.size:
      flat[i * 7] = values[kind]
  return jnp.asarray(x)


def fusion_pass_names():
  return [name for name in pipeline.optional_pass_names() if name.startswith("fuse_")]


def unfused_session():
  """A Session that runs every pass but the fusions: what a fusion must equal."""
  return js.Session(js.SessionOptions(disabled_passes=fusion_pass_names()))


def only_session(*passes):
  """A Session with every optional pass off but `passes`."""
  return js.Session(js.SessionOptions(
      disabled_passes=[n for n in pipeline.optional_pass_names() if n not in passes]))


def count_compiles(test):
  """A list that grows by one per XLA compile (jax's own backend_compile
  event) until `test` (a TestCase) ends."""
  from jax._src import monitoring  # pylint: disable=import-outside-toplevel
  compiles = []

  def listener(event, duration, **_):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(duration)
  jax.monitoring.register_event_duration_secs_listener(listener)
  test.addCleanup(monitoring.unregister_event_duration_listener, listener)
  return compiles
