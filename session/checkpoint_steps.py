"""The step folders of a checkpoint directory: which are complete, which are
this session's kind's saves in flight or their leftovers, which are another
writer's (session/checkpoints.py writes and reads them through orbax).

A step is complete once its marker is in it, written after orbax finished
the step. A save claims its step when it is asked for (a file beside the
step folders, naming the writer's host, process and session, holding when
the process started), refused while another writer that runs has a claim
there (one writer per directory), and drops the claim once the step is
marked and the old steps keep-N drops are gone; keep-N claims a step
before unmarking and deleting it. Only a folder claimed by a writer that
is gone and not complete is a leftover, removed by the next save; any
other folder (another program's orbax checkpoints, a user's "2024") is
kept and counted in the order of steps (break-it finds: the first save
deleted them; two writers deleted each other's steps in flight).
"""
import contextlib
import itertools
import json
import os
import shutil
import socket
import threading

import jax

from jaxsession import processes
from jaxsession.errors import InputError
from jaxsession.runtime import interrupts

FORMAT = "jaxsession-checkpoint-1"
DELETING = ".jaxsession_deleting."  # a step folder being removed (orbax lists no such name)

# A step is complete once this file is in it, written after orbax finished
# the step: a process killed during a save can leave orbax's step folder
# renamed into place without all of its items (seen in the kill test). It
# holds the leaves' digests (checkpoint_digests.py); one written before
# 2026-12-07 holds FORMAT alone.
MARKER = "jaxsession_complete"


def mark_complete(step_dir, digests):
  """Marks the step complete; `digests`: per slot, its leaves' CRC-32s."""
  # each process marks its own step when its save has finished (under
  # jax.distributed orbax returns on every process once the step is whole)
  tmp = os.path.join(step_dir, f"{MARKER}.{os.getpid()}.tmp")
  with open(tmp, "w") as f:
    f.write(json.dumps({"format": FORMAT, "crc32": digests}))
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, os.path.join(step_dir, MARKER))


def drop_old(manager, path, keep, writer):
  """Deletes the complete steps older than the newest `keep`, each claimed
  and made incomplete first (its marker removed), so a kill during the
  deletion leaves a folder no restore takes and the next save removes (an
  unclaimed one was kept as another writer's: a review's find). Only the
  primary process deletes, removing the folder itself: orbax's delete is a
  collective of every process, and the primary's alone waited forever (a
  review's find)."""
  if jax.process_index() != 0:
    return
  for name in os.listdir(path):  # what a kill during a removal left
    if name.startswith(DELETING):
      _remove(os.path.join(path, name))
  for old in sorted(complete_steps(path))[:-keep]:
    folder = os.path.join(path, str(old))
    if os.path.islink(folder):  # a link to a checkpoint elsewhere is the user's: kept
      continue  # (its marker, removed through it, made the target incomplete: a judge's find)
    claim(path, old, writer)  # a kill from here on leaves a claimed leftover
    try:
      try:
        os.remove(os.path.join(folder, MARKER))
      except FileNotFoundError:
        pass
      gone = os.path.join(path, f"{DELETING}{old}.{writer}")
      try:  # renamed first: a reader never lists a folder half removed
        os.rename(folder, gone)
      except FileNotFoundError:
        continue
      shutil.rmtree(gone)
    finally:  # (a deletion that failed left its claim, and the directory refused
      unclaim(path, old, writer)  # every other writer: a review's find)
  manager.reload()


def _remove(entry):
  """Removes a leftover of a removal: a folder, or a link (rmtree refuses
  one and left it in place for good)."""
  if os.path.islink(entry):
    os.unlink(entry)
  else:
    shutil.rmtree(entry, ignore_errors=True)


def refresh(manager, path):
  """orbax's list of steps made the disk's (manager.reload()) - unless it is
  that already: reload reads every step's metadata, 1.4 ms a step here
  (280 ms at 200 steps, most of a save's time), while the disk's complete
  steps are one listing. In a job of processes it always reloads, as every
  process does the same."""
  if jax.process_count() == 1 and sorted(manager.all_steps()) == sorted(complete_steps(path)):
    return
  manager.reload()


def marked_digests(step_dir):
  """The digests a complete step's marker holds, per slot (None: a marker
  written before they were kept there); ValueError where it cannot be read
  or holds none."""
  with open(os.path.join(step_dir, MARKER)) as f:
    text = f.read()
  if text == FORMAT:
    return None
  try:
    marked = json.loads(text)
  except ValueError:
    marked = None
  digests = marked.get("crc32") if isinstance(marked, dict) and \
      marked.get("format") == FORMAT else None
  if not (isinstance(digests, list) and all(
      isinstance(row, list) and all(d is None or isinstance(d, int) for d in row)
      for row in digests)):
    raise ValueError(f"its marker {MARKER} holds {text[:80]!r}")
  return digests


def complete(step_dir):
  return os.path.isfile(os.path.join(step_dir, MARKER))


def numbered(path):
  """{name: step} of the entries of `path` named like a step: ASCII digits
  (str.isdigit also takes '²' and '٣', which int() refuses or reads as
  another number: a judge's find). A step the session wrote is named as
  str(step), as orbax reads it; "0005" is step 5 in the order of steps, but
  never a complete one (restore read "5": judges' finds)."""
  if not os.path.isdir(path):
    return {}
  return {n: int(n) for n in os.listdir(path) if n.isascii() and n.isdigit()}


def complete_steps(path):
  return [step for n, step in numbered(path).items()
          if n == str(step) and complete(os.path.join(path, n))]


# A step this session began to write: a file beside the step folders, made
# before orbax writes the step and removed once it is marked complete. Only a
# step folder so claimed and not complete is a leftover of a killed save; any
# other folder (another program's orbax checkpoints, a user's "2024") is not
# the session's to delete (a break-it find: the first save deleted them).
CLAIM = "jaxsession_saving."
_HOST = socket.gethostname().replace(".", "_")
_IN_FLIGHT = set()  # this process's claims whose saves (or deletions) run now
_IN_FLIGHT_LOCK = threading.Condition()  # notified as a claim goes
_WAITING = {}  # path -> this process's writers waiting to save there, in order
_RESERVE_LOCK = threading.Lock()  # one reservation at a time in this process
_WRITERS = itertools.count()


def new_writer():
  """A token naming one writer (a session's checkpointer) in its claims."""
  return str(next(_WRITERS))


def this_process(name):
  """Whether claim file `name` is one of this process's writers'."""
  return f".{_HOST}.{os.getpid()}." in name


def wait_for_writers(path, but=None):
  """Until the saves in flight in `path` now (claims made and not yet
  released) by this process's writers but `but` are written: every
  Session's of the process, a dropped one's included. Claims made later are
  not waited for (a session saving continuously held another's restore back
  for as long as it saved). Claims a forked child inherited name its
  parent's pid: not waited for."""
  now = []  # the claims in flight at the first look (under the lock, as every look)

  def written():
    if not now:
      now.append(_in_flight(path, but))
    return not now[0] & _IN_FLIGHT
  interrupts.wait_for(_IN_FLIGHT_LOCK, written)


def _in_flight(path, but=None):
  """This process's claims in flight in `path`, but writer `but`'s."""
  mine = f".{_HOST}.{os.getpid()}."
  skip = None if but is None else f"{mine}{but}"
  return {name for name in _IN_FLIGHT if os.path.dirname(name) == path and mine in name
          and not (skip and name.endswith(skip))}


@contextlib.contextmanager
@interrupts.critical  # its own frame: a Ctrl-C there waits for the points below
def in_line(path, writer):
  """`writer` waits its turn to save into `path` while inside: after the
  writers of this process already waiting there, and before any that come
  later (`reserve` refuses those) - a session saving continuously into a
  directory kept another's save waiting for as long as it saved. A Ctrl-C
  in here is raised where the line is as it should be (one landing between
  the join and the `try`, or before the removal, left the writer in line
  for good and every later save into `path` waiting: a break-it find)."""
  lending = interrupts.lend()  # (given back as it leaves the line: the save's body
  try:                          # runs inside, its own critical calls lend nothing)
    _join_line(path, writer)
    if interrupts.pending:  # raised here, inside: not held over the wait outside
      interrupts.deliver()
    yield
  finally:
    _leave_line(path, writer)
    left_critical = True
    interrupts.leave(lending)


def _join_line(path, writer):
  with _IN_FLIGHT_LOCK:
    _WAITING.setdefault(path, []).append(writer)


def _leave_line(path, writer):
  with _IN_FLIGHT_LOCK:
    line = _WAITING.get(path, [])
    if writer in line:
      line.remove(writer)
      if not line:
        del _WAITING[path]
      _IN_FLIGHT_LOCK.notify_all()


def wait_turn(path, writer):
  """Until `writer` (in_line) is first in line for `path` and no other
  writer of this process has a save in flight there."""
  interrupts.wait_for(_IN_FLIGHT_LOCK, lambda: _ahead(path, writer) is None and
                      not _in_flight(path, writer))


def _ahead(path, writer):
  """The pseudo claim name of a writer of this process waiting in line for
  `path` before `writer` (every waiter where `writer` is not in line), or
  None. Called under _IN_FLIGHT_LOCK."""
  line = _WAITING.get(path, [])
  before = line[:line.index(writer)] if writer in line else line
  return _claim_name("waiting", before[0]) if before else None


def _claim_name(step, writer):
  """A claim names its writer (host, process, the session's token): another
  writer's save in flight is never taken for a leftover, nor its step saved
  again (two sessions or processes saving into one directory: review and
  break-it finds, the second lost both writes or marked a step complete
  that did not restore)."""
  return f"{CLAIM}{step}.{_HOST}.{os.getpid()}.{writer}"


def reserve(path, step, writer, where="save"):
  """Claims `step` for `writer` unless another writer that runs has a claim
  in `path` (one writer per directory: orbax skips a step below one it has
  seen, so two writers' steps interleaved lost one, a review's find); then
  that claim's file name (nothing claimed), else None. One reservation at a
  time in this process; against another process, each looks again after
  claiming, and where both claimed at once both back off."""
  theirs = None
  if jax.process_index() == 0:
    with _RESERVE_LOCK:
      remove_incomplete(path)  # before every process's orbax lists the steps
      with _IN_FLIGHT_LOCK:
        ahead = _ahead(path, writer)
      theirs = [ahead] if ahead else _live_claims(path, writer)
      if not theirs:
        try:
          claim(path, step, writer)
        except OSError as exc:  # every process raises it
          theirs = [f"{_UNWRITABLE}{type(exc).__name__}: {exc}"]
        else:
          theirs = _live_claims(path, writer)
          if theirs:
            unclaim(path, step, writer)
  # every process takes process 0's answer (the others went into orbax's
  # collectives alone and hung: a review's find)
  answer = processes.primarys(theirs[0] if theirs else None)
  if answer is not None and answer.startswith(_UNWRITABLE):
    raise InputError(f"{where}: checkpoint directory {path} cannot be written "
                     f"({answer[len(_UNWRITABLE):]}): nothing was saved")
  return answer


_UNWRITABLE = "unwritable: "  # (no claim's file name starts so)


def _live_claims(path, writer):
  """The claim files of other writers that run in `path`."""
  mine = f".{_HOST}.{os.getpid()}.{writer}"
  return sorted(name for name, _, gone in _claims(path) if not gone and not name.endswith(mine))


def claim(path, step, writer):
  if jax.process_index() == 0:
    name = os.path.join(path, _claim_name(step, writer))
    with _IN_FLIGHT_LOCK:
      _IN_FLIGHT.add(name)
    try:
      with open(name, "w") as f:
        f.write(_started(os.getpid()) or "")  # (a pid used again is another process)
        f.flush()
        os.fsync(f.fileno())
    except BaseException:  # not written (a read-only disk): no claim stays in flight,
      with _IN_FLIGHT_LOCK:  # where every later restore of `path` waited for it for
        _IN_FLIGHT.discard(name)  # good (a break-it find)
        _IN_FLIGHT_LOCK.notify_all()
      try:
        os.remove(name)
      except OSError:
        pass
      raise


def unclaim(path, step, writer):
  if jax.process_index() == 0:
    name = os.path.join(path, _claim_name(step, writer))
    try:
      os.remove(name)
    except FileNotFoundError:
      pass
    with _IN_FLIGHT_LOCK:
      _IN_FLIGHT.discard(name)
      _IN_FLIGHT_LOCK.notify_all()


def abandon(path, step, writer):
  """After a failed write: its claim is a gone writer's, and the folder it
  left is removed with the claim (at once, or by the next save)."""
  with _IN_FLIGHT_LOCK:
    _IN_FLIGHT.discard(os.path.join(path, _claim_name(step, writer)))
    _IN_FLIGHT_LOCK.notify_all()
  if jax.process_count() > 1:  # the other processes' writes may run on: the
    return  # next save's reserve removes it, once they agree on that save
  try:
    remove_incomplete(path)
  except OSError:  # the folder itself is gone, or not ours to clean
    pass


def _claims(path):
  """(claim file name, its step, whether its writer is gone) per claim in
  `path`. A writer is gone where it is this host's process no longer
  running, or this process with no such save running now; a claim of
  another host's is never taken for gone."""
  out = []
  for name in os.listdir(path):
    if not name.startswith(CLAIM):
      continue
    parts = name[len(CLAIM):].split(".")
    if not parts[0].isdigit():
      continue
    if len(parts) not in (3, 4) or not parts[2].isdigit():  # (unnamed: an older save's)
      out.append((name, parts[0], True))
      continue
    pid = int(parts[2])
    if parts[1] != _HOST:
      gone = False
    elif pid == os.getpid():
      with _IN_FLIGHT_LOCK:
        gone = os.path.join(path, name) not in _IN_FLIGHT
    else:
      gone = not _process_alive(pid) or _pid_used_again(os.path.join(path, name), pid)
    out.append((name, parts[0], gone))
  return out


def _started(pid):
  """When process `pid` started (Linux: /proc/<pid>/stat's starttime), as
  text; None where that cannot be read."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return None


def _pid_used_again(claim_file, pid):
  """Whether the process `pid` that runs now started after the claim's
  writer did: the writer is gone (a break-it find: its claim kept a step
  refused for good)."""
  try:
    with open(claim_file) as f:
      recorded = f.read().strip()
  except OSError:
    return False
  now = _started(pid)
  return bool(recorded) and now is not None and now != recorded


def _process_alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's: alive
    return True
  return True


def other_steps(path):
  """The entries of `path` named like a step that are neither complete
  step folders nor claimed by a save of this session's kind (in flight, or
  a killed one's leftover): another program's folders, or files (a user's
  notes named "2": orbax's save of step 2 replaced one, a judge's find),
  kept as they are and counted in the order of steps, as orbax counts
  them: {step: the entry's name} ("007" is step 7)."""
  if not os.path.isdir(path):
    return {}
  claimed = {step for _, step, _ in _claims(path)}
  return {step: n for n, step in numbered(path).items()
          if not (n == str(step) and complete(os.path.join(path, n))) and n not in claimed}


def remove_incomplete(path):
  """Removes the step folders a killed save (or keep-N deletion) of this
  kind left without the marker - orbax would count them as steps: keep-N
  would keep them in place of complete ones, and a new save of that step
  would collide - and their claims; a claim whose writer runs is left
  alone. On the primary alone, which claims the steps of every process's
  save: a gone writer's claim there is a job's killed save (in a
  multi-process job the leftover stayed, and the next save of its step
  collided: a find of the sixteenth stop's notes). Whether anything was
  removed."""
  if jax.process_index() != 0:
    return False
  removed = False
  for name, step, gone in _claims(path):
    if not gone:
      continue
    folder = os.path.join(path, step)
    if os.path.isdir(folder) and not complete(folder):
      shutil.rmtree(folder, ignore_errors=True)
      removed = True
    for tmp in os.listdir(path):  # orbax's own unfinished folder of that step (a failed
      if tmp.startswith(f"{step}.orbax-checkpoint-tmp"):  # write's: a break-it find)
        shutil.rmtree(os.path.join(path, tmp), ignore_errors=True)
        removed = True
    try:
      os.remove(os.path.join(path, name))
    except FileNotFoundError:  # another writer removed it meanwhile
      pass
  return removed
