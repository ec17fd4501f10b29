"""A quick subset of JAX's own test suite as a judge (benchmarks/jax_suite.py
runs all six modules): lax_numpy_operators_test's testOp* tests but the
overloads (one case per parameterized test, ~350 routed calls) and
lax_test's custom element types, run plain and with jax.jit routed through
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
KNOWN = {}


@absltest.skipUnless(os.path.isdir(SUITE), f"JAX's test modules are not at {SUITE}")
class JaxSuiteTest(absltest.TestCase):

  def check_routed_equals_plain(self, module, k, min_passed, min_calls):
    import suite as jax_suite  # pylint: disable=import-outside-toplevel
    plain, _ = jax_suite.run_module(SUITE, module, False, cases=1, k=k)
    routed, _ = jax_suite.run_module(SUITE, module, True, cases=1, k=k)
    row = jax_suite.compare(plain, routed)
    self.assertGreaterEqual(row["passed_plain"], min_passed)  # the module ran
    self.assertGreaterEqual(row["routed_calls"], min_calls)  # and went through the session
    broken = [t.split("::")[-1] for t in row["broken"]]
    self.assertEqual([t for t in broken if t not in KNOWN], [],
                     f"pass plain, fail routed: {dict(row['causes'])}")
    diffs = [(t, what) for t, what in row["diffs"] if t.split("::")[-1] not in KNOWN]
    self.assertEqual(diffs, [])

  def test_operators_module_routed_equals_plain(self):
    self.check_routed_equals_plain("lax_numpy_operators_test", "testOp and not Overload",
                                   100, 250)

  def test_custom_element_types_routed_equal_plain(self):
    # arrays of a custom extended dtype: the output weak-type guard once read
    # their dtype through jnp.result_type, which refuses them (12 tests failed)
    self.check_routed_equals_plain("lax_test", "CustomElementTypesTest", 20, 20)

if __name__ == "__main__":
  absltest.main()
