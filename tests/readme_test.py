"""The README's and docs/'s Python examples run as written, and their links resolve."""
import glob
import os
import re

from absl.testing import absltest
import pytest
import jax
import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
README = os.path.join(ROOT, "README.md")
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def python_blocks(path):
  with open(path) as f:
    return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def run_blocks(path):
  """Every ```python block of one file, in order, each in a namespace of its
  own (a reader copies one block: it must stand alone); the last one's."""
  namespace = {}
  for block in python_blocks(path):
    namespace = {}
    exec(compile(block, os.path.relpath(path, ROOT), "exec"), namespace)
  return namespace


class ReadmeTest(absltest.TestCase):

  @pytest.mark.slow
  def test_readme_tour_runs(self):
    namespace = run_blocks(README)
    sess, train = namespace["sess"], namespace["train"]
    self.assertEqual(np.shape(namespace["losses"]), (100,))  # 100 sunk steps, stacked
    params, _ = sess.get_state(train)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(namespace["params"])):
      np.testing.assert_array_equal(got, want)               # set_state took them back

  def test_readme_stays_short(self):
    with open(README) as f:
      self.assertLessEqual(len(f.read().splitlines()), 200)

  def test_docs_blocks_run(self):
    self.assertNotEmpty(DOCS)
    ran = 0
    for path in DOCS:
      with self.subTest(doc=os.path.basename(path)):
        namespace = run_blocks(path)
        ran += len(python_blocks(path))
        if path.endswith("extending.md"):  # (the block asserts it too)
          self.assertEqual(namespace["sess"].graph(namespace["gid"]).nodes[0].kernel.name,
                           "xla:my_tanh")
    self.assertGreaterEqual(ran, 5)

  def test_relative_links_resolve(self):
    for path in [README] + DOCS:
      with open(path) as f:
        links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", f.read())
      for link in links:
        target = os.path.normpath(os.path.join(os.path.dirname(path), link))
        self.assertTrue(os.path.exists(target), f"{os.path.basename(path)}: {link}")


if __name__ == "__main__":
  absltest.main()
