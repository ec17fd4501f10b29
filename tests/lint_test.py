"""Names used but defined nowhere, in the package's own code: such a line
raises a raw NameError only when it runs (a strong bfloat16 scalar beside a
scatter reached one at compile, narrow_scalars.py, found by this check)."""
import os

from absl.testing import absltest
from pyflakes import api, messages, reporter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("session", "runtime", "optimizer_passes", "kernels", "benchmarks", "examples")
UNDEFINED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)


class _Collect(reporter.Reporter):
  """pyflakes' reporter, keeping the messages instead of printing them."""

  def __init__(self):
    super().__init__(None, None)
    self.found = []

  def flake(self, message):
    if isinstance(message, UNDEFINED):
      self.found.append(str(message))

  def syntaxError(self, filename, msg, lineno, offset, text):  # noqa: N802 (pyflakes' name)
    self.found.append(f"{filename}:{lineno}: syntax error {msg}")

  def unexpectedError(self, filename, msg):  # noqa: N802
    self.found.append(f"{filename}: {msg}")


class LintTest(absltest.TestCase):

  def test_no_undefined_names(self):
    collect, files = _Collect(), 0
    for package in PACKAGES:
      for folder, _, names in os.walk(os.path.join(ROOT, package)):
        for name in sorted(names):
          if name.endswith(".py"):
            files += api.checkPath(os.path.join(folder, name), collect) >= 0
    self.assertGreater(files, 100)  # the tree was found
    self.assertEqual(collect.found, [])


if __name__ == "__main__":
  absltest.main()
