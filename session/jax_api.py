"""jax.jit as jax defines it, whatever `jax.jit` is rebound to later.

A user may route their code through the session with `jax.jit = jaxsession.jit`
(JAX's own test suite is run that way: benchmarks/jax_suite.py); the
session's own compiles (Build, constant folding, layouts) must not route back
into themselves, so they call this one.
"""
try:
  from jax._src.api import jit as real_jit  # the function `jax.jit` is bound to
except ImportError:  # an internal path: the public name, as it is at import
  from jax import jit as real_jit

try:  # the concrete type of a jax.Array: on a hot path, `type(x) is ARRAY or
  # isinstance(x, jax.Array)` - the type test is ~0.2 µs cheaper than isinstance
  from jax._src.array import ArrayImpl as ARRAY
except ImportError:  # an internal path: the isinstance alone decides
  ARRAY = None


__all__ = ["real_jit", "ARRAY"]
