"""Python's cyclic garbage collector paused while a graph is built: the one
pause of compile, the pipeline's passes and run_op's.

Tracing, importing and optimising an 11.2k-equation program allocates
millions of small objects; the collector then runs hundreds of times, a few
of them over the whole heap: 0.78 s of a 10-14 s compile, measured with
gc.callbacks (benchmarks/compile.py's tanh/where chain), and on big graphs
it made the passes superlinear. Reference counting still frees everything
that is not in a cycle; the collector runs again when the last pause ends.
Nested and concurrent pauses share one (a count), and the collector's state
before the first is what the last puts back.

Entering and leaving are critical (runtime/interrupts.py): a Ctrl-C there
waits for them, and one that came while entering is raised with the pause
undone (between gc.disable() and the count, or after the entry, it left the
collector off for the process: break-it finds). The work between is not: a
Ctrl-C there raises at once, and leaving puts the collector back.
"""
import gc
import threading

from jaxsession.runtime import interrupts

_LOCK = threading.Lock()
_DEPTH = [0, False]  # pauses now, whether gc was enabled before the first


def _enter():
  with _LOCK:
    if _DEPTH[0] == 0:
      _DEPTH[1] = gc.isenabled()
      gc.disable()
    _DEPTH[0] += 1


def _leave():
  with _LOCK:
    _DEPTH[0] -= 1
    if _DEPTH[0] == 0 and _DEPTH[1]:
      gc.enable()


class _Paused:
  """`with paused():` - the pause around its body."""

  @interrupts.critical
  def __enter__(self):
    lending = interrupts.lend()
    try:
      _enter()
      if interrupts.waiting():  # a Ctrl-C while entering: the body never runs
        _leave()
        interrupts.deliver()
        _enter()  # (a handler of the user's that returns: the body runs, paused)
    finally:
      left_critical = True
      interrupts.leave(lending)

  @interrupts.critical
  def __exit__(self, *exc):
    lending = interrupts.lend()
    try:
      _leave()
    finally:
      left_critical = True
      interrupts.leave(lending)
    return False


def paused():
  return _Paused()
