"""The checksums of a checkpoint's leaves (session/checkpoints.py writes and
checks them). orbax stores compressed chunks without a checksum: a flipped
byte read back as other values, silently (a break-it find). Each leaf's
CRC-32 is computed on a thread of its own while orbax writes the step -
computed first, it added about a second to a save of 1.2 GiB on a 2-core
machine (benchmarks/workflows.py, the save row) - and kept in the step's
marker (checkpoint_steps.mark_complete), written once both are done.
Checkpoints written before 2026-12-07 keep them in their meta."""
import threading
import zlib

import numpy as np

from jaxsession.checkpoint_meta import corrupted


def digest(x):
  """CRC-32 of a leaf's bytes, or None where this process does not hold the
  whole array (across processes each holds its shards)."""
  if not getattr(x, "is_fully_addressable", True):
    return None
  host = np.ascontiguousarray(np.asarray(x))
  return zlib.crc32(host.reshape(-1).view(np.uint8)) if host.size else 0


class Beside:
  """The digests of `rows` (per slot, its leaves), computed on a thread
  started here; `result()` waits for them and raises what the thread met.
  Started from the writer thread, the thread has its priority (nice 19)."""

  def __init__(self, rows):
    self._digests = self._error = None
    self._thread = threading.Thread(target=self._work, args=(rows,), daemon=True,
                                    name="jaxsession-checkpoint-digests")
    self._thread.start()

  def _work(self, rows):
    try:
      self._digests = [[digest(x) for x in row] for row in rows]
    except BaseException as exc:  # pylint: disable=broad-except  (raised by result())
      self._error = exc

  def join(self):
    self._thread.join()

  def result(self):
    self.join()
    if self._error is not None:
      raise self._error
    return self._digests


def check(where, name, paths, saved, read):
  """InputError naming the first leaf of `read` (per slot) whose digest is
  not the one `saved` (per slot, None where none was written) holds;
  `paths`: per slot, its leaves' paths."""
  for k, (slot_paths, want_row, row) in enumerate(zip(paths, saved, read)):
    for path, want, x in zip(slot_paths, want_row or [None] * len(row), row):
      if want is not None and digest(x) not in (None, want):
        raise corrupted(where, name, f"state arg {k} at path {path or '(root)'} does not "
                        "match the checksum written with it")
