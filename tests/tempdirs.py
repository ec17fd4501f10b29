"""A test case with a temporary directory of its own per test (`self.dir`),
removed after it: the checkpoint suites' setUp, written once. (absltest's
create_tempdir reads --test_tmpdir, which pytest leaves unparsed.)"""
import tempfile

from absl.testing import absltest


class TempDirTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    tmp = tempfile.TemporaryDirectory()
    self.addCleanup(tmp.cleanup)
    self.dir = tmp.name
