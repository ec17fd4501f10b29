"""Runs a test snippet in a fresh Python process and returns what it printed
as JSON: for tests that need JAX initialised differently (several CPU
devices, `jax.distributed`), which a process can do only once."""
import json
import os
import subprocess
import sys
import textwrap

from absl.testing import absltest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The child gets Python's own SIGINT handler whatever it inherited: a suite
# started in the background of a non-interactive shell (`cmd &`) runs with
# SIGINT ignored, which its children inherit, and the interrupt tests' SIGINTs
# would then never arrive (their loops ran until the timeout).
PRELUDE = """
import signal
signal.signal(signal.SIGINT, signal.default_int_handler)
import jax
jax.config.update("jax_num_cpu_devices", {devices})
jax.config.update("jax_enable_x64", {x64})
"""


def run_json(code, devices=8, x64=False, timeout=600, env=None, args=()):
  """Runs `code` (after a prelude that gives JAX `devices` CPU devices) and
  returns the JSON object or list on the last line of its stdout; raises with the
  process's output if it fails."""
  script = PRELUDE.format(devices=devices, x64=x64) + textwrap.dedent(code)
  proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                        timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})})
  if proc.returncode != 0:
    raise AssertionError(f"subprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-6000:]}")
  lines = [line for line in proc.stdout.splitlines() if line.startswith(("{", "["))]
  if not lines:
    raise AssertionError(f"subprocess printed no JSON:\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
  return json.loads(lines[-1])


# Snippets' helper: what `fn()` raised, as [type name, text], or None.
HELPERS = r"""
def err(fn):
  try:
    fn()
  except Exception as exc:  # the test checks the type and the text
    return [type(exc).__name__, str(exc)]
  return None
"""


class SnippetTest(absltest.TestCase):
  """Runs the class's SNIPPET once, in a subprocess with 8 CPU devices; the
  tests read what it printed (`self.out`)."""
  SNIPPET = None

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.out = run_json(HELPERS + cls.SNIPPET)
