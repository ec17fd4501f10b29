"""Python's cyclic garbage collector paused while a compile builds its graph.

Tracing, importing and optimising an 11.2k-equation program allocates
millions of small objects; the collector then runs hundreds of times, a few
of them over the whole heap: 0.78 s of a 10-14 s compile, measured with
gc.callbacks (benchmarks/compile.py's tanh/where chain). Reference counting
still frees everything that is not in a cycle; the collector runs again when
the last concurrent compile ends. Nested and concurrent compiles share one
pause (a count), and the collector's state before the first is what the last
puts back.
"""
import contextlib
import gc
import threading

from jaxsession.runtime import interrupts

_LOCK = threading.Lock()
_DEPTH = [0, False]  # compiles inside the pause, whether gc was enabled before it


@interrupts.critical
def _paused():
  """paused()'s generator. Critical while it runs (entering and leaving the
  pause: a Ctrl-C between gc.disable() and the `try` left the collector off
  for the process, a break-it find); the compile between is not: a Ctrl-C
  there raises at once, and the `finally` puts the collector back."""
  with _LOCK:
    if _DEPTH[0] == 0:
      _DEPTH[1] = gc.isenabled()
      gc.disable()
    _DEPTH[0] += 1
  try:
    if interrupts.pending:  # one that came while entering
      interrupts.deliver()
    yield
  finally:
    with _LOCK:
      _DEPTH[0] -= 1
      if _DEPTH[0] == 0 and _DEPTH[1]:
        gc.enable()
    if interrupts.pending:
      interrupts.deliver()


paused = contextlib.contextmanager(_paused)
