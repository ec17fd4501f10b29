"""The README's Python examples run as written."""
import os
import re

from absl.testing import absltest

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


class ReadmeTest(absltest.TestCase):

  def test_python_blocks_run(self):
    with open(README) as f:
      blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    self.assertGreaterEqual(len(blocks), 3)
    namespace = {}
    for block in blocks:  # in order: later blocks use earlier imports
      exec(compile(block, "README.md", "exec"), namespace)
    self.assertIn("sess", namespace)
    self.assertEqual(namespace["sess"].graph(namespace["gid"]).nodes[0].kernel.name,
                     "xla:my_tanh")


if __name__ == "__main__":
  absltest.main()
