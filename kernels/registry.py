"""The kernel registry: which implementation runs each node.

A kernel is a plain function `fn(node, *args) -> list of outputs` registered for
a primitive or fused-op name with `@register_kernel`. `select_kernel` picks the
highest-priority candidate whose backend, platform and dtypes fit the node and,
when none fits, raises KernelSelectError listing every candidate and why it was
rejected (MindSpore's kernel-select report).
"""
import dataclasses
from typing import Callable, Optional, Tuple

import jax
import numpy as np

from jaxsession.graph import op_properties
from jaxsession.errors import KernelSelectError

BACKENDS = ("xla", "host", "pallas")
ANY_PRIMITIVE = "*"  # registered under this name: fits every primitive node


@dataclasses.dataclass(frozen=True)
class KernelBuildInfo:
  """What SelectKernel writes on a node: the kernel and what it accepts."""
  name: str
  op: str
  fn: Callable
  backend: str = "xla"
  platforms: Optional[Tuple[str, ...]] = None   # None: every platform
  dtypes: Optional[Tuple[str, ...]] = None      # input dtypes; None: any
  out_dtypes: Optional[Tuple[str, ...]] = None  # output dtypes; None: any
  priority: int = 0
  accepts: Optional[Callable] = None  # accepts(node) -> None, or why it cannot run it

  def rejects(self, node, platform):
    """Why this kernel cannot run `node` on `platform`, or None if it can."""
    if self.platforms is not None and platform not in self.platforms:
      return f"platform {platform} not in {list(self.platforms)}"
    if self.op == ANY_PRIMITIVE and node.prim is None:
      return f"{node.op} is a fused op with no primitive to bind"
    if self.backend == "host":
      narrowed = _narrowed_64_bit(node)
      if narrowed is not None:
        return narrowed
    for kind, allowed, values in (("input", self.dtypes, node.inputs),
                                  ("output", self.out_dtypes, node.outputs)):
      if allowed is None:
        continue
      for i, value in enumerate(values):
        dtype = _dtype_name(value.aval)
        if dtype not in allowed:
          return f"{kind} {i} dtype {dtype} not in {list(allowed)}"
    if self.accepts is not None:
      return self.accepts(node)
    return None


def _narrowed_64_bit(node):
  """Why no host kernel takes `node`: it reads or makes a 64-bit value (made
  under jax.enable_x64 inside the function) while the caller has x64 off,
  where jax narrows what crosses to the host and back. Left inside the
  executable, it runs as jax.jit runs it (a callback's operands narrowed to
  32 bits, a 64-bit result refused when it runs); on the host it saw 64-bit
  operands and its 64-bit results came back narrowed (a break-it find)."""
  for value in (*node.inputs, *node.outputs):
    dtype = getattr(value.aval, "dtype", None)
    try:
      narrow = dtype is not None and jax.dtypes.canonicalize_dtype(dtype) != dtype
    except TypeError:  # extended dtypes (PRNG keys) are never narrowed
      narrow = False
    if narrow:
      return (f"a {np.dtype(dtype).name} value crosses to the host while jax_enable_x64 "
              "is off (jax narrows it): it stays inside the executable, as under jax.jit")
  return None


def _dtype_name(aval):
  try:
    return str(np.dtype(aval.dtype))
  except TypeError:  # extended dtypes (PRNG keys)
    return str(aval.dtype)


_REGISTRY = {}


def register_kernel(op, backend="xla", platforms=None, dtypes=None, priority=0, name=None,
                    accepts=None, out_dtypes=None):
  """Decorator: registers `fn(node, *args) -> list` as a kernel for `op`.

  op: a primitive name (e.g. "dot_general"), a fused-op name, or ANY_PRIMITIVE.
  backend: "xla" (jax-traceable, runs inside an executable), "host" (numpy,
  runs between executables) or "pallas".
  Higher priority wins among the kernels that fit. `accepts(node)` may refuse
  a node the other fields admit (a shape a kernel cannot tile), returning why.
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")

  def decorate(fn):
    info = KernelBuildInfo(
        name=name or f"{backend}:{fn.__name__}", op=op, fn=fn, backend=backend,
        platforms=tuple(platforms) if platforms is not None else None,
        dtypes=tuple(str(np.dtype(d)) for d in dtypes) if dtypes is not None else None,
        out_dtypes=(tuple(str(np.dtype(d)) for d in out_dtypes) if out_dtypes is not None
                    else None),
        priority=priority, accepts=accepts)
    unregister_kernel(info.name, op)
    _REGISTRY.setdefault(op, []).append(info)
    _REGISTRY[op].sort(key=lambda k: -k.priority)
    return fn
  return decorate


def unregister_kernel(name, op=None):
  """Removes the kernel called `name` (from `op` only, when given)."""
  for key in ([op] if op is not None else list(_REGISTRY)):
    _REGISTRY[key] = [k for k in _REGISTRY.get(key, []) if k.name != name]


def registered_ops():
  """The primitive and fused-op names with at least one registered kernel."""
  return [op for op, kernels in _REGISTRY.items() if kernels and op != ANY_PRIMITIVE]


def ops_without_facts():
  """Registered ops with no entry in the op table (op_properties): a fused op
  must declare its facts (`register_op`) beside its kernel."""
  return [op for op in registered_ops() if not op_properties.known(op)]


def candidates(op, backends=None):
  """Registered kernels for `op`, then the any-primitive ones, best first."""
  found = _REGISTRY.get(op, []) + _REGISTRY.get(ANY_PRIMITIVE, [])
  if backends is not None:
    found = [k for k in found if k.backend in backends]
  return sorted(found, key=lambda k: -k.priority)


def select_kernel(node, platform, backends=("xla",)):
  """The best kernel for `node` on `platform` among `backends`.

  Raises KernelSelectError listing every candidate and why it was rejected.
  """
  rejected = []
  for kernel in candidates(node.op):
    reason = (f"backend {kernel.backend} not in {list(backends)}"
              if kernel.backend not in backends else kernel.rejects(node, platform))
    if reason is None:
      return kernel
    rejected.append(f"  {kernel.name} (priority {kernel.priority}): {reason}")
  where = f" at {node.source}" if node.source else ""
  listing = "\n".join(rejected) if rejected else "  (no kernel is registered for it)"
  raise KernelSelectError(
      f"no kernel fits node {node.id} '{node.op}'{where} on platform {platform} "
      f"(input dtypes {[str(v.aval.dtype) for v in node.inputs]}); candidates:\n{listing}")
