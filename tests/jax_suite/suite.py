"""Runs JAX's own test modules plain and routed (the plugin beside this
file) and compares the two records; benchmarks/jax_suite.py prints the
table, tests/jax_suite_test.py runs one module in CI. No absl flags here, so
tests may import it."""
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time

PLUGIN_DIR = os.path.dirname(os.path.abspath(__file__))
MODULES = ["lax_test", "lax_numpy_operators_test", "lax_numpy_reducers_test",
           "lax_numpy_indexing_test", "lax_numpy_einsum_test", "lax_control_flow_test"]


def run_module(suite_dir, module, routed, cases, k=None, timeout=1800):
  """One pytest run of `module`: (the plugin's JSON record, seconds)."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "out.json")
    env = dict(os.environ, JAX_NUM_GENERATED_CASES=str(cases), JAXSESSION_SUITE_OUT=out,
               JAXSESSION_ROUTE="1" if routed else "0",
               PYTHONPATH=os.pathsep.join([PLUGIN_DIR, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-p", "jax_suite_route", "-c", "pytest.ini",
           "-q", "-p", "no:cacheprovider", f"{module}.py"]
    if k:
      cmd += ["-k", k]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=suite_dir, env=env, capture_output=True, text=True,
                          timeout=timeout)
    seconds = time.perf_counter() - start
    if not os.path.exists(out):
      raise RuntimeError(f"{module} ({'routed' if routed else 'plain'}) wrote no record "
                         f"(exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    with open(out) as f:
      return json.load(f), seconds


def cause_of(message):
  """A failure message reduced to its kind (numbers and names of values out)."""
  first = message.strip().splitlines()[0] if message.strip() else "?"
  first = re.sub(r"0x[0-9a-f]+", "0x…", first)
  return re.sub(r"\d+", "N", first)[:140]


def compare(plain, routed):
  """The row of one module, and its routed-only failures by cause."""
  passed_plain = {t for t, o in plain["outcomes"].items() if o == "passed"}
  passed_routed = {t for t, o in routed["outcomes"].items() if o == "passed"}
  broken = sorted(passed_plain - passed_routed)
  causes = collections.Counter(cause_of(routed["causes"].get(t, "not run")) for t in broken)
  stats = routed["stats"]
  return dict(tests=len(plain["outcomes"]), passed_plain=len(passed_plain),
              passed_routed=len(passed_routed), broken=broken, causes=causes,
              routed_calls=stats.get("routed calls", 0),
              shadow_differences=stats.get("shadow differences", 0),
              diffs=routed["diffs"], stats=stats)
