"""Every benchmark in benchmarks/ runs to its table with tiny flags: a
benchmark whose code rotted fails here, not when its table is wanted
(benchmarks/passes.py called a helper gone since an earlier change and
nobody saw it). The figures of these runs mean nothing and are not read;
jax_suite.py has its own test (jax_suite_test.py)."""
import os
import subprocess
import sys

from absl.testing import absltest, parameterized
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow

# benchmark -> flags small enough for a few seconds each on a 2-core CPU
TINY = {
    "buckets": ["--requests", "10", "--repeats", "1", "--warmup_rounds", "0"],
    "compile": ["--programs", "200", "--trials", "1", "--big_trials", "1",
                "--chain_programs", "200", "--chain_trials", "1", "--where_chain_layers", "20",
                "--where_chain_trials", "1", "--weak_state_leaves", "10",
                "--weak_state_trials", "1", "--persistent_eqns", "100"],
    "decode": ["--decode_tokens", "4", "--decode_calls", "2", "--decode_repeats", "1"],
    "dispatch": ["--calls", "20", "--repeats", "1"],
    "distributed": ["--batch", "16", "--calls", "2", "--sunk", "2", "--repeats", "1"],
    "kernels": ["--rows", "64", "--width", "64", "--adam_elements", "1024", "--repeats", "1",
                "--calls", "2"],
    "partition": ["--repeats", "1", "--calls", "20", "--big_calls", "2", "--overlap_calls", "2",
                  "--host_ms", "0.1"],
    "passes": ["--sizes", "200", "--repeats", "1"],
    "profiler": ["--repeats", "1", "--calls", "20", "--callback_calls", "10"],
    "release": ["--cycles", "10", "--warmup", "2"],
    "state": ["--state_repeats", "1", "--state_calls", "3", "--leaf_bytes", "256"],
    "workflows": ["--wf_repeats", "1", "--big_mib", "16", "--save_mib", "16", "--wf_steps", "20"],
}


class BenchmarksRunTest(parameterized.TestCase):

  def test_every_benchmark_is_listed(self):
    found = {f[:-3] for f in os.listdir(os.path.join(REPO, "benchmarks"))
             if f.endswith(".py") and f not in ("common.py", "jax_suite.py")}
    self.assertEqual(found, set(TINY))

  @parameterized.named_parameters(*[(name, name) for name in sorted(TINY)])
  def test_runs_to_its_table(self, name):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", f"{name}.py"),
                           *TINY[name]], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    out = proc.stdout + proc.stderr
    self.assertEqual(proc.returncode, 0, out[-3000:])
    self.assertIn("machine: ", proc.stdout, out[-3000:])
    self.assertIn("|---|", proc.stdout, out[-3000:])  # a table was printed


if __name__ == "__main__":
  absltest.main()
