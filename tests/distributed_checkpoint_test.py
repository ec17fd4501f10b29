"""Checkpoints of a job over 2 processes x 2 CPU devices (jax.distributed).

A review's finds: keep-N across processes deadlocked (orbax's delete is a
collective of every process, and only the primary called it), and a save
into a directory another writer was saving into was refused on the primary
alone while the other process went on into orbax's collectives and hung.
Each process now ends, with the same steps written or the same error."""
import os
import subprocess
import tempfile

from absl.testing import absltest
import pytest

import jaxsession as js
from tests import distributed_test as dist

pytestmark = pytest.mark.slow  # two processes (docs/testing.md)

CHILD = r"""
import json, os, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
pid = int(sys.argv[2])
jax.distributed.initialize(f"127.0.0.1:{sys.argv[3]}", num_processes=2, process_id=pid,
                           initialization_timeout=120)
import numpy as np
import jax.numpy as jnp
from jax.sharding import Mesh
import jaxsession as js
directory, mode = sys.argv[4], sys.argv[5]
mesh = Mesh(np.array(jax.devices()), ("data",))
w = np.arange(24, dtype=np.float32).reshape(8, 3) - 7.5
sess = js.Session(js.SessionOptions(mesh=mesh, checkpoint_keep=2))
step = lambda w: (w * 1.5 + 1.0, jnp.sum(w))
gid = sess.compile(step, w, state_argnums=0, state_specs="zero")
held = lambda: np.asarray(jax.experimental.multihost_utils.process_allgather(
    sess.get_state(gid)[0], tiled=True)).tolist()
out = {}
if mode == "keep":
  states = {}
  for k in range(1, 5):
    sess.run(gid)
    sess.save(gid, directory, k)
    states[k] = held()
  sess.wait_until_saved()
  out["steps"] = sorted(js.checkpoint_steps.complete_steps(directory))
  sess.run(gid)
  out["restored"] = sess.restore(gid, directory)
  out["equal"] = held() == states[4]
  sess.restore(gid, directory, 3)
  out["equal3"] = held() == states[3]
elif mode == "differ":  # arguments that differ, or that one process refuses
  for name, call in (("save_steps", lambda: sess.save(gid, directory, 5 + pid)),
                     ("save_bad_on_one", lambda: sess.save(gid, directory, -1 if pid else 5)),
                     ("restore_steps", lambda: sess.restore(gid, directory, 1 + pid))):
    try:
      call()
      out[name] = None
    except js.InputError as exc:
      out[name] = str(exc)
  sess.save(gid, directory, 7)
  sess.wait_until_saved()
  out["restored"] = sess.restore(gid, directory)
elif mode == "leftover":  # a killed job's save of step 2 left its folder and claim
  sess.run(gid)
  sess.save(gid, directory, 2)
  sess.wait_until_saved()
  saved = held()
  out["steps"] = sorted(js.checkpoint_steps.complete_steps(directory))
  sess.run(gid)
  out["restored"] = sess.restore(gid, directory)
  out["equal"] = held() == saved
  jax.experimental.multihost_utils.sync_global_devices("listed")
  out["files"] = sorted(n for n in os.listdir(directory) if not n.isdigit())
elif mode == "unwritable":  # process 0's claim file cannot be written (remounted read-only)
  import contextlib
  from unittest import mock
  sess.save(gid, directory, 1)
  sess.wait_until_saved()
  saved = held()
  sess.run(gid)
  read_only = OSError(30, "Read-only file system")
  with (mock.patch.object(js.checkpoint_steps, "_started", side_effect=read_only) if pid == 0
        else contextlib.nullcontext()):
    try:
      sess.save(gid, directory, 2)
      out["refused"] = None
    except js.InputError as exc:
      out["refused"] = str(exc)
  out["restored"] = sess.restore(gid, directory)  # (nothing left in flight: not hung)
  out["equal"] = held() == saved
  sess.save(gid, directory, 2)  # and the directory takes saves again
  sess.wait_until_saved()
  out["steps"] = sorted(js.checkpoint_steps.complete_steps(directory))
elif mode == "partial":  # a part of the checkpoint into another graph's slots
  n = np.int32(3)
  both = sess.compile(lambda s: ({"w": s["w"] * 1.5 + 1.0, "n": s["n"] + 1}, jnp.sum(s["w"])),
                      {"w": w, "n": n}, state_argnums=0, state_specs="zero")
  sess.run(both)
  sess.save(both, directory, 1)
  sess.wait_until_saved()
  saved = np.asarray(jax.experimental.multihost_utils.process_allgather(
      sess.get_state(both)[0]["w"], tiled=True)).tolist()
  out["restored"] = sess.restore(gid, directory, state_map=[(0, "['w']")])
  out["equal"] = held() == saved
  try:  # maps that differ between the processes: refused on both, never a hang
    sess.restore(gid, directory, state_map=[(0, "['w']") if pid else (0, "['n']")])
    out["differ"] = None
  except js.InputError as exc:
    out["differ"] = str(exc)
  out["unchanged"] = held() == saved
else:  # another writer saves into the directory now
  try:
    sess.save(gid, directory, 1)
    sess.wait_until_saved()
    out["refused"] = None
  except js.InputError as exc:
    out["refused"] = str(exc)
  out["steps"] = sorted(js.checkpoint_steps.complete_steps(directory))
print(json.dumps(out))
"""


class TwoProcessCheckpointTest(absltest.TestCase):

  def _run(self, directory, mode):
    port = str(dist._free_port())  # pylint: disable=protected-access
    return dist.run_all([["proc", str(k), port, directory, mode] for k in (0, 1)],
                        script=CHILD)

  def test_keep_n_removes_old_steps_on_every_process(self):
    with tempfile.TemporaryDirectory() as d:
      for out in self._run(d, "keep"):
        self.assertEqual(out["steps"], [3, 4])
        self.assertEqual(out["restored"], 4)
        self.assertTrue(out["equal"])
        self.assertTrue(out["equal3"])

  def test_arguments_that_differ_are_refused_on_every_process(self):
    # (orbax's collectives waited forever where the steps differed, or where
    # one process refused its arguments)
    with tempfile.TemporaryDirectory() as d:
      p0, p1 = self._run(d, "differ")
      for out in (p0, p1):
        for name in ("save_steps", "restore_steps"):
          self.assertIn("the 2 processes pass other directories, steps or state maps",
                        out[name] or "")
        self.assertEqual(out["restored"], 7)
      self.assertIn("refused on process(es) [1] of 2", p0["save_bad_on_one"] or "")
      self.assertIn("step must be an int >= 0, got -1", p1["save_bad_on_one"] or "")

  def test_a_part_of_a_checkpoint_restores_on_every_process(self):
    with tempfile.TemporaryDirectory() as d:
      for out in self._run(d, "partial"):
        self.assertEqual(out["restored"], 1)
        self.assertTrue(out["equal"])
        self.assertIn("the 2 processes pass other directories, steps or state maps",
                      out["differ"] or "")
        self.assertTrue(out["unchanged"])

  def test_a_directory_in_use_is_refused_on_every_process(self):
    with tempfile.TemporaryDirectory() as d:
      js.checkpoint_steps.claim(d, 0, "another-writer")  # this test process saves there
      for out in self._run(d, "busy"):
        self.assertIn("another session or process is saving into", out["refused"] or "")
        self.assertIn("another-writer", out["refused"])
        self.assertEqual(out["steps"], [])

  def test_a_claim_that_cannot_be_written_is_refused_on_every_process(self):
    # process 0 writes the claims: its OSError is every process's InputError,
    # nothing stays in flight, and a later save and restore work
    with tempfile.TemporaryDirectory() as d:
      for out in self._run(d, "unwritable"):
        self.assertRegex(out["refused"] or "", r"save\(graph 0.*\): checkpoint directory .* "
                         r"cannot be written \(OSError: .*Read-only file system\): nothing was "
                         "saved")
        self.assertEqual(out["restored"], 1)
        self.assertTrue(out["equal"])
        self.assertEqual(out["steps"], [1, 2])

  def test_a_killed_jobs_leftover_is_removed_before_its_step_is_saved_again(self):
    # (only a single-process save removed a killed writer's leftover: in a
    # job of 2 processes folder 2 stayed, and the save of step 2 collided)
    with tempfile.TemporaryDirectory() as d:
      gone = _a_finished_pid()
      claim = f"{js.checkpoint_steps.CLAIM}2.{js.checkpoint_steps._HOST}.{gone}.0"  # pylint: disable=protected-access
      open(os.path.join(d, claim), "w").close()
      os.makedirs(os.path.join(d, "2", "state"))
      open(os.path.join(d, "2", "state", "half_written"), "w").close()
      os.makedirs(os.path.join(d, "2.orbax-checkpoint-tmp-1"))
      for out in self._run(d, "leftover"):
        self.assertEqual(out["steps"], [2])
        self.assertEqual(out["restored"], 2)
        self.assertTrue(out["equal"])
        self.assertEqual(out["files"], [])
      self.assertFalse(os.path.exists(os.path.join(d, "2", "state", "half_written")))


def _a_finished_pid():
  child = subprocess.Popen(["true"])
  child.wait()
  return child.pid


if __name__ == "__main__":
  absltest.main()
