"""A Ctrl-C at one chosen line: a real SIGINT sent as the line starts in this
thread (sys.settrace picks it; the handler runs at CPython's next check),
for the tests that try a window line by line (break-it finds: a Ctrl-C
inside a lock's or a queue's own Python, between a registration and its
try, ...)."""
import contextlib
import os
import signal
import sys


def line_points(*functions):
  """(code, line) for every line of `functions` but their first (the def)."""
  return [(fn.__code__, line) for fn in functions
          for line in sorted({ln for _, _, ln in fn.__code__.co_lines() if ln})[1:]]


@contextlib.contextmanager
def ctrl_c_at(code, line):
  """Inside: the first time `line` of `code` starts in this thread, a
  SIGINT; yields the list that holds the line once it fired. A
  KeyboardInterrupt raised inside is the caller's to expect."""
  fired = []

  def trace(frame, event, arg):  # pylint: disable=unused-argument
    if frame.f_code is not code:
      return None

    def local(frame, event, arg):  # pylint: disable=unused-argument
      if event == "line" and frame.f_lineno == line and not fired:
        fired.append(line)
        os.kill(os.getpid(), signal.SIGINT)
      return local
    return local
  sys.settrace(trace)
  try:
    yield fired
  finally:
    sys.settrace(None)
