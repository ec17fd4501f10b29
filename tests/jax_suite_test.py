"""A quick subset of JAX's own test suite as a judge (benchmarks/jax_suite.py
runs all six modules): lax_numpy_operators_test's testOp* tests but the overloads (one case
per parameterized test, ~350 routed calls), run plain and with jax.jit routed through
jaxsession.jit, every routed call shadow-checked against the real jax.jit
bit for bit. Every test that passes plain must pass routed, and no routed
call may differ from jax.jit, but for the known failures listed here."""
import os
import sys

from absl.testing import absltest
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUITE = os.path.join(REPO, "..", "shared", "jax-tests")
sys.path.insert(0, os.path.join(REPO, "tests", "jax_suite"))

pytestmark = pytest.mark.slow

# test name -> why it still fails routed (issue 15 keeps them open)
KNOWN = {
    "testSpacingSubnormals0": "jnp.spacing of bfloat16 subnormals: other bits than jax.jit",
}


@absltest.skipUnless(os.path.isdir(SUITE), f"JAX's test modules are not at {SUITE}")
class JaxSuiteTest(absltest.TestCase):

  def test_operators_module_routed_equals_plain(self):
    import suite as jax_suite  # pylint: disable=import-outside-toplevel
    module = "lax_numpy_operators_test"
    plain, _ = jax_suite.run_module(SUITE, module, False, cases=1, k="testOp and not Overload")
    routed, _ = jax_suite.run_module(SUITE, module, True, cases=1, k="testOp and not Overload")
    row = jax_suite.compare(plain, routed)
    self.assertGreater(row["passed_plain"], 100)  # the module ran
    self.assertGreater(row["routed_calls"], 250)  # and went through the session
    broken = [t.split("::")[-1] for t in row["broken"]]
    self.assertEqual([t for t in broken if t not in KNOWN], [],
                     f"pass plain, fail routed: {dict(row['causes'])}")
    diffs = [(t, what) for t, what in row["diffs"] if t.split("::")[-1] not in KNOWN]
    self.assertEqual(diffs, [])

if __name__ == "__main__":
  absltest.main()
