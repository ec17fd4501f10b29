"""A test that hangs fails instead of holding CI until its limit.

Each test runs under faulthandler's alarm: past HANG_S seconds every
thread's stack is written to a file and the process exits (CI once ran out
its 90 minutes on a hang that printed nothing). Under pytest-xdist the
crashed worker is reported naming the test, and the stacks are printed in
the summary; `pytest.ini` lets no worker restart, so the hang ends the run.
The slowest test takes about 30 s on the 2-core CI machine; HANG_S leaves
room for one several times slower.

The tests that send themselves a Ctrl-C need Python's own SIGINT handler: a
suite started in the background of a non-interactive shell (`cmd &`) runs
with SIGINT ignored (pytest-xdist's workers reset it; under `-n 0` those
tests failed). It is put back here, as tests/subproc.py does for children.
"""
import faulthandler
import glob
import os
import shutil
import signal
import tempfile

import pytest

HANG_S = float(os.environ.get("JAXSESSION_TEST_HANG_S", "600"))
_DIR = "JAXSESSION_TEST_HANG_DIR"

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
  signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config):
  if not hasattr(config, "workerinput"):  # the controller (or -n 0): workers inherit it
    os.environ[_DIR] = tempfile.mkdtemp(prefix="jaxsession-hangs-")


def pytest_report_header(config):  # pylint: disable=unused-argument
  return f"hang guard: a test past {HANG_S:g} s is stopped, its stacks in {os.environ[_DIR]}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # pylint: disable=unused-argument
  worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  with open(os.path.join(os.environ[_DIR], f"{worker}-{os.getpid()}.txt"), "w") as dump:
    dump.write(f"{item.nodeid} ran past {HANG_S:g} s:\n")
    dump.flush()
    faulthandler.dump_traceback_later(HANG_S, exit=True, file=dump)
    try:
      yield
    finally:
      faulthandler.cancel_dump_traceback_later()
      dump.truncate(0)


def _dumps():
  """(path, text) of each dump file, the empty ones' text ''."""
  for path in sorted(glob.glob(os.path.join(os.environ.get(_DIR, "/nonexistent"), "*.txt"))):
    with open(path) as f:
      yield path, f.read()


def pytest_terminal_summary(terminalreporter):
  for path, text in _dumps():
    if text:
      terminalreporter.section(f"hung: {os.path.basename(path)}")
      terminalreporter.write(text)


def pytest_unconfigure(config):
  """The controller removes its folder when no test hung (it stays, with the
  stacks, where one did)."""
  if not hasattr(config, "workerinput") and not any(text for _, text in _dumps()):
    shutil.rmtree(os.environ[_DIR], ignore_errors=True)
