"""Host kernels: code that runs between executables, not inside them."""
import jax
import numpy as np
from jax import tree_util

from jaxsession.kernels.registry import register_kernel


def canonical_result(value, aval, i):
  """A callback result as jax.jit takes it: np.asarray, the canonical dtype
  (float64 -> float32 without x64), then the exact declared shape and dtype."""
  arr = np.asarray(value)
  canonical = jax.dtypes.canonicalize_dtype(arr.dtype)
  if arr.dtype != canonical:
    arr = arr.astype(canonical)
  if arr.shape != tuple(aval.shape) or arr.dtype != np.dtype(aval.dtype):
    raise TypeError(f"callback result {i} is {arr.dtype}{list(arr.shape)}, "
                    f"declared {aval.str_short()}")
  return arr


@register_kernel("pure_callback", backend="host", name="host:pure_callback")
def run_pure_callback(node, *args):
  """Calls the user's callback as jax.jit does: on jax.Arrays on the CPU
  device, with the CPU as default device; results converted and checked the
  way jax.jit checks them."""
  cpu = jax.local_devices(backend="cpu")[0]
  args = jax.device_put(list(args), cpu)
  with jax.default_device(cpu):
    results = tree_util.tree_leaves(node.params["callback"](*args))
  avals = node.params["result_avals"]
  if len(results) != len(avals):
    raise TypeError(f"callback returned {len(results)} results, declared {len(avals)}")
  return [canonical_result(r, a, i) for i, (r, a) in enumerate(zip(results, avals))]
