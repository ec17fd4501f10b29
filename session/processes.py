"""Agreement between the processes of a jax.distributed job.

A call that changes what every process holds - compile's program and
initial state, set_state, replace_state, a checkpoint step's claim - goes
ahead on every process with the same inputs, or raises on every process:
a process that went on alone waited forever in the next collective, and a
replicated state set to other values on each process silently gave each
its own results (a review's finds). One allgather of a flag and a checksum
per call, only where there are several processes.
"""
import zlib

import jax
import numpy as np

from jaxsession.errors import InputError


def _host_copy(x):
  """This process's whole value of `x` as numpy, or None where it holds
  only its pieces (a leaf laid out over processes)."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return None
  if isinstance(x, jax.Array):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)  # (numpy takes no typed key: a review's find)
    if not x.is_fully_addressable:
      if not x.sharding.is_fully_replicated:
        return None
      x = x.addressable_data(0)  # a replicated copy: each process's must be the same
  return np.ascontiguousarray(np.asarray(x))


def checksum(leaves, start=0):
  """A checksum of `leaves`' kinds (a host value, or a jax array and its
  layout), types and, where this process holds all of a leaf (a host
  value, a single-device or replicated array), its values; the pieces of a
  leaf laid out over processes are each process's own."""
  leaves = list(leaves)
  digest = zlib.crc32(repr([
      (type(x).__name__ if not isinstance(x, jax.Array) else str(x.sharding.spec) if
       hasattr(x.sharding, "spec") else "array", getattr(x, "shape", None),
       str(getattr(x, "dtype", type(x)))) for x in leaves]).encode(), start)
  for x in leaves:
    host = _host_copy(x)
    if host is not None:
      digest = zlib.crc32(host.reshape(-1).view(np.uint8), digest)
  return digest


def agreed(where, make, digest=lambda result: 0, what="arguments"):
  """`make()` where every process made it without an error and their
  `digest`s of it agree; else an error on every process: this process's
  own, or an InputError naming the processes that refused, or saying the
  digests differ. One allgather; `make` must run no collective (a process
  that refused would not join it). A single process: make() alone."""
  if jax.process_count() == 1:
    return make()
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  error, result, mine = None, None, 0
  try:
    result = make()
    mine = digest(result)
  except Exception as exc:  # pylint: disable=broad-except
    error = exc  # (raised here after the others know: any error, or they wait forever)
  everyone = np.asarray(multihost_utils.process_allgather(np.asarray(
      [error is not None, mine & 0x7FFFFFFF], np.int32))).reshape(-1, 2)  # (int32: no x64)
  if error is not None:
    raise error
  failed = [k for k, (refused, _) in enumerate(everyone.tolist()) if refused]
  n = jax.process_count()
  if failed:
    raise InputError(f"{where}: refused on process(es) {failed} of {n} (each names its "
                     "cause there); nothing changed on any process")
  sums = everyone[:, 1].tolist()
  if len(set(sums)) > 1:
    raise InputError(f"{where}: the {n} processes pass other {what} (checksums {sums}, "
                     f"this is process {jax.process_index()}): every process must pass the "
                     "same; nothing changed on any process")
  return result


def primarys(text):
  """Process 0's `text` (a str or None) on every process."""
  if jax.process_count() == 1:
    return text
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  raw = (b"\x01" + text.encode()[:1000]) if text is not None else b"\x00"
  got = np.asarray(multihost_utils.broadcast_one_to_all(
      np.frombuffer(raw.ljust(1024, b"\x00"), np.uint8))).astype(np.uint8).tobytes()
  return got[1:].rstrip(b"\x00").decode() if got[0] else None
