"""Host kernels: numpy code that runs between executables, not inside them."""
import numpy as np

from jaxsession.kernels.registry import register_kernel


@register_kernel("pure_callback", backend="host", name="host:pure_callback")
def run_pure_callback(node, *args):
  """Calls the user's callback on numpy arrays; checks what it returns against
  the result avals it promised."""
  results = node.params["callback"](*[np.asarray(a) for a in args])
  outs = []
  for i, (res, aval) in enumerate(zip(results, node.params["result_avals"])):
    arr = np.asarray(res)
    if arr.shape != tuple(aval.shape) or arr.dtype != np.dtype(aval.dtype):
      raise TypeError(f"callback result {i} is {arr.dtype}{list(arr.shape)}, "
                      f"declared {aval.str_short()}")
    outs.append(arr)
  if len(outs) != len(node.params["result_avals"]):
    raise TypeError(f"callback returned {len(outs)} results, declared "
                    f"{len(node.params['result_avals'])}")
  return outs
