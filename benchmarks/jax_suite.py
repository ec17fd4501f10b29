"""JAX's own test modules as a judge: each run twice, plain and with jax.jit
routed through a jaxsession Session (tests/jax_suite/jax_suite_route.py),
every routed call shadow-checked against the real jax.jit bit for bit.

Prints per module: tests, passed plain, passed routed, tests that pass plain
and fail routed (grouped by cause), routed calls, shadow differences, and
the seconds each run took.

    python benchmarks/jax_suite.py [--modules lax_test,...] [--cases 3] [--k EXPR]

The modules are in ../shared/jax-tests (--suite_dir); they need pytest,
hypothesis, cloudpickle, portpicker, scipy, opt_einsum (the README's test
extras install them).
"""
import collections
import json
import os
import sys

from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests", "jax_suite"))
from suite import MODULES, compare, run_module  # noqa: E402

flags.DEFINE_string("suite_dir", os.path.join(REPO, "..", "shared", "jax-tests"),
                    "the folder of JAX's test modules")
flags.DEFINE_list("modules", MODULES, "the modules to run (names without .py)")
flags.DEFINE_integer("cases", 3, "JAX_NUM_GENERATED_CASES: cases per parameterized test")
flags.DEFINE_string("k", None, "a pytest -k expression selecting tests")
flags.DEFINE_integer("timeout", 1800, "seconds per pytest run")
flags.DEFINE_string("json_out", None, "also write the whole result here as JSON")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  rows, everything = [], {}
  for module in FLAGS.modules:
    plain, t_plain = run_module(FLAGS.suite_dir, module, False, FLAGS.cases, FLAGS.k,
                                FLAGS.timeout)
    routed, t_routed = run_module(FLAGS.suite_dir, module, True, FLAGS.cases, FLAGS.k,
                                  FLAGS.timeout)
    row = compare(plain, routed)
    row.update(seconds_plain=round(t_plain), seconds_routed=round(t_routed))
    everything[module] = row
    rows.append(row | {"module": module})
    print(f"# {module}: {row['tests']} tests, plain {row['passed_plain']} passed "
          f"({row['seconds_plain']} s), routed {row['passed_routed']} passed "
          f"({row['seconds_routed']} s), {row['shadow_differences']} shadow differences",
          flush=True)
    if FLAGS.json_out:
      with open(FLAGS.json_out, "w") as f:
        json.dump({m: {k: (dict(v) if isinstance(v, collections.Counter) else v)
                       for k, v in r.items()} for m, r in everything.items()}, f, indent=1)
  print(f"JAX's test modules (jax {_jax_version()}), JAX_NUM_GENERATED_CASES={FLAGS.cases}"
        + (f", -k {FLAGS.k!r}" if FLAGS.k else ""))
  print()
  print("| module | tests | passed plain | passed routed | pass plain, fail routed "
        "| routed calls | shadow differences | s plain / routed |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(f"| {r['module']} | {r['tests']} | {r['passed_plain']} | {r['passed_routed']} | "
          f"{len(r['broken'])} | {r['routed_calls']} | {r['shadow_differences']} | "
          f"{r['seconds_plain']} / {r['seconds_routed']} |")
  for r in rows:
    if r["causes"]:
      print(f"\n{r['module']}: pass plain, fail routed, by cause")
      for cause, n in r["causes"].most_common():
        print(f"  {n:4d}  {cause}")
    if r["diffs"]:
      print(f"\n{r['module']}: shadow differences (first {min(len(r['diffs']), 20)})")
      for test, what in r["diffs"][:20]:
        print(f"  {test.split('::')[-1] if test else '?'}: {what}")


def _jax_version():
  import jax  # pylint: disable=import-outside-toplevel
  return jax.__version__


if __name__ == "__main__":
  app.run(main)
