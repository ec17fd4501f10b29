"""The main job: `jaxsession demo`, and --help."""
import contextlib
import io
import re
import subprocess
import sys

from absl import flags
from absl.testing import absltest

from jaxsession import cli

FLAGS = flags.FLAGS


class DemoTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    if not FLAGS.is_parsed():  # under pytest nobody parsed absl's flags
      FLAGS(["cli_test"])

  def test_demo_trains_and_reports(self):
    FLAGS.steps, FLAGS.batch, FLAGS.sink, FLAGS.repeats = 60, 32, 20, 2
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      self.assertEqual(cli.main(["jaxsession", "demo"]), 0)
    text = out.getvalue()
    for expected in ("compile report for graph 'train_step'", "Optimize/dce",
                     "kernels: xla:adam", "xla:matmul_bias_add", "partitions:", "memory: planned peak",
                     "donated", "Session.run per step", "loop sink", "jax.jit"):
      self.assertIn(expected, text)
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", text)]
    self.assertGreater(len(losses), 3)
    self.assertLess(losses[-2], losses[0])  # the last one is the eval graph
    diff = float(re.search(r"plain jax.jit loop params\| = (\S+)", text).group(1))
    self.assertLess(diff, 1e-5)

  def test_unknown_command(self):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
      self.assertEqual(cli.main(["jaxsession", "train"]), 2)
    self.assertIn("expected a command", err.getvalue())

  def test_help(self):
    result = subprocess.run([sys.executable, "-m", "jaxsession", "demo", "--help"],
                            capture_output=True, text=True, timeout=120)
    self.assertEqual(result.returncode, 0)
    self.assertIn("Commands:", result.stdout)
    self.assertIn("--steps", result.stdout)

  def test_out_of_range_flags_are_refused_by_name(self):
    for flag in ("--steps=0", "--steps=-5", "--sink=0", "--repeats=0", "--batch=0"):
      result = subprocess.run([sys.executable, "-m", "jaxsession", "demo", flag],
                              capture_output=True, text=True, timeout=120)
      self.assertNotEqual(result.returncode, 0, flag)
      self.assertIn(f"flag {flag}", result.stderr)
      self.assertIn("not a positive integer", result.stderr)
      self.assertNotIn("Traceback", result.stderr)
      self.assertNotIn("loss", result.stdout)  # refused before any training


if __name__ == "__main__":
  absltest.main()
