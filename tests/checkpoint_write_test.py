"""How a checkpoint is written: Python's thread switch interval while the
writer runs (session/checkpoint_thread.py), and the leaves' digests, computed
beside orbax's write and kept in the step's marker (checkpoint_digests.py),
read back by restore - and those of checkpoints written before, in the meta."""
import json
import os
import tempfile

from absl.testing import absltest
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jaxsession import checkpoint_steps
from subproc import run_json
from exact import assert_equal_signed


class SwitchIntervalTest(absltest.TestCase):

  def test_the_interval_is_quick_while_no_one_waits_and_put_back_after(self):
    # the interval was never put back (1e-4 reads back as 9.999999999999999e-05):
    # after one save every thread of the process switched every 0.1 ms, and a
    # 1.2 GiB save waited for took 3.8-8.4 s against orbax's 2.1-2.2 s
    out = run_json("""
      import json, sys, tempfile, threading, time
      import numpy as np, jax.numpy as jnp
      import jaxsession as js
      from jaxsession import checkpoint_digests
      sys.setswitchinterval(0.004)
      seen, release = {}, threading.Event()
      real = checkpoint_digests.digest
      def digest(x):  # on the writer's digest thread, while orbax writes
        if "waited" in seen:  # (the second save's)
          return real(x)
        seen["writing"] = sys.getswitchinterval()
        release.wait(60)
        deadline = time.monotonic() + 30  # until wait_until_saved waits
        while sys.getswitchinterval() < 0.001 and time.monotonic() < deadline:
          time.sleep(0.01)
        seen["waited"] = sys.getswitchinterval()
        return real(x)
      checkpoint_digests.digest = digest
      sess = js.Session()
      w = np.random.default_rng(0).standard_normal(64).astype(np.float32)
      gid = sess.compile(lambda w: (w * 2.0, jnp.sum(w)), w, state_argnums=0)
      d = tempfile.mkdtemp()
      sess.save(gid, d, 1)
      deadline = time.monotonic() + 30
      while "writing" not in seen and time.monotonic() < deadline:
        time.sleep(0.01)
      release.set()
      sess.wait_until_saved()
      after_one = sys.getswitchinterval()
      sess.run(gid)
      sess.save(gid, d, 2)
      sess.wait_until_saved()
      print(json.dumps([seen.get("writing"), seen.get("waited"), after_one, sys.getswitchinterval()]))
    """, devices=1, timeout=300)
    writing, waited, after_one, after_two = out
    self.assertAlmostEqual(after_one, 0.004)  # put back
    self.assertAlmostEqual(after_two, 0.004)
    self.assertIsNotNone(writing)  # the digests are computed while orbax writes
    self.assertLess(writing, 0.001)  # quick while only the training thread may want the GIL
    self.assertAlmostEqual(waited, 0.004)  # the user's own while wait_until_saved waits

  def test_an_interval_set_meanwhile_is_kept(self):
    out = run_json("""
      import json, sys, tempfile, threading
      import numpy as np, jax.numpy as jnp
      import jaxsession as js
      from jaxsession import checkpoint_digests
      real = checkpoint_digests.digest
      def digest(x):
        sys.setswitchinterval(0.02)  # the user's, set while the write runs
        return real(x)
      checkpoint_digests.digest = digest
      sess = js.Session()
      w = np.random.default_rng(1).standard_normal(8).astype(np.float32)
      gid = sess.compile(lambda w: (w + 1.0, jnp.sum(w)), w, state_argnums=0)
      sess.save(gid, tempfile.mkdtemp(), 0)
      sess.wait_until_saved()
      print(json.dumps([sys.getswitchinterval()]))
    """, devices=1, timeout=300)
    self.assertAlmostEqual(out[0], 0.02)


def _flip_middle_byte(step_dir):
  chunk = max((os.path.join(root, n) for root, _, names in os.walk(step_dir)
               for n in names if os.sep + "d" + os.sep in os.path.join(root, n) + os.sep),
              key=os.path.getsize)
  with open(chunk, "r+b") as f:
    data = bytearray(f.read())
    data[len(data) // 2] ^= 0xFF
    f.seek(0)
    f.write(data)


class DigestsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    self.dir = tmp.name
    self.w = np.random.default_rng(2).standard_normal(1000).astype(np.float32)
    self.w[:3] = [-0.0, np.nan, np.inf]
    self.step = lambda s, x: (s + x, jnp.sum(x))
    self.x = np.ones(1000, np.float32)

  def _saved(self, step=1):
    sess = js.Session()
    gid = sess.compile(self.step, self.w, self.x, state_argnums=0)
    sess.save(gid, self.dir, step)
    sess.wait_until_saved()
    return os.path.join(self.dir, str(step))

  def _other(self):
    other = js.Session()
    gid = other.compile(self.step, self.w * 2, self.x, state_argnums=0)
    return other, gid

  def test_the_marker_holds_the_digests_and_restore_checks_them(self):
    step_dir = self._saved()
    with open(os.path.join(step_dir, checkpoint_steps.MARKER)) as f:
      marked = json.load(f)
    self.assertEqual(marked["format"], checkpoint_steps.FORMAT)
    self.assertLen(marked["crc32"], 1)
    self.assertLen(marked["crc32"][0], 1)
    other, gid = self._other()
    self.assertEqual(other.restore(gid, self.dir), 1)
    assert_equal_signed(other.get_state(gid)[0], self.w)
    _flip_middle_byte(step_dir)
    with self.assertRaisesRegex(js.InputError, r"checkpoint .*/1 is corrupted: state arg 0 at "
                                r"path \(root\) does not match the checksum"):
      other.restore(gid, self.dir)
    assert_equal_signed(other.get_state(gid)[0], self.w)  # as the intact restore left it

  def test_a_marker_that_cannot_be_read_is_a_corrupted_checkpoint(self):
    step_dir = self._saved()
    other, gid = self._other()
    for garbage in ('{"format": "jaxsession-checkpoint-1", "crc32": [["x"]]}', "{not json",
                    '{"format": "jaxsession-checkpoint-1"}'):
      with open(os.path.join(step_dir, checkpoint_steps.MARKER), "w") as f:
        f.write(garbage)
      with self.assertRaisesRegex(js.InputError, r"checkpoint .*/1 is corrupted: its marker "
                                  r"jaxsession_complete holds"):
        other.restore(gid, self.dir)
      assert_equal_signed(other.get_state(gid)[0], self.w * 2)

  def test_a_checkpoint_written_before_keeps_its_digests_in_the_meta(self):
    # written before 2026-12-07: the marker holds the format alone, the meta the digests
    step_dir = self._saved()
    marker = os.path.join(step_dir, checkpoint_steps.MARKER)
    with open(marker) as f:
      digests = json.load(f)["crc32"]
    with open(marker, "w") as f:
      f.write(checkpoint_steps.FORMAT)
    meta_file = os.path.join(step_dir, "meta", "metadata")
    with open(meta_file) as f:
      meta = json.load(f)
    for saved, row in zip(meta["slots"], digests):
      saved["crc32"] = row
    with open(meta_file, "w") as f:
      json.dump(meta, f)
    other, gid = self._other()
    self.assertEqual(other.restore(gid, self.dir), 1)
    assert_equal_signed(other.get_state(gid)[0], self.w)
    _flip_middle_byte(step_dir)
    with self.assertRaisesRegex(js.InputError, r"checkpoint .*/1 is corrupted: state arg 0"):
      other.restore(gid, self.dir)
    assert_equal_signed(other.get_state(gid)[0], self.w)


if __name__ == "__main__":
  absltest.main()
