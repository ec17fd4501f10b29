"""Failures of user callbacks inside executables, as HostOpError.

Inside an executable (a callback left on the device, or one inside a
`scan`/`cond`/`while` body), XLA reports a failing callback as a
JaxRuntimeError that has lost the user's exception. So every callback compiled
into an executable is wrapped to record the exception it raised, and the
runner turns the runtime error into a HostOpError whose `__cause__` is the
user's exception. (Host-placed callbacks run in kernels/host.py; build.py
turns their failures into HostOpError directly.)
"""
import threading

from jax.extend import core as jcore

from jaxsession.errors import HostOpError
from jaxsession.graph.ir import Node
from jaxsession.graph.op_properties import primitive_props
from jaxsession.graph.text import node_where
from jaxsession.runtime import interrupts
from jaxsession.runtime.state import done_running, running_user_code


where = node_where  # (graph/text.py)


class ErrorRecorder:
  """Where wrapped callbacks leave the exception they raised (per thread: the
  runner that sees the runtime error reads what its own thread's run left)."""

  def __init__(self):
    self._errors = {}
    self._lock = threading.Lock()
    # (slot lock, thread) of the runs executing its executable now
    # (Runner.call): a callback on a thread of XLA's own is refused a call
    # into that state (runtime/state.py's refuse_reentry) instead of waiting
    # on it; one on a run's own thread carries that run's mark already. (Two
    # graphs sharing a cached executable, run at once in two threads: a
    # callback on XLA's thread cannot tell whose it is, and is refused both.)
    self.running = []

  def record(self, exc):
    with self._lock:
      self._errors[threading.get_ident()] = exc
      self._errors["last"] = exc

  def take(self):
    with self._lock:
      exc = self._errors.pop(threading.get_ident(), None)
      last = self._errors.pop("last", None)
      return exc if exc is not None else last


class _Recorded:
  """A callback that records the exception it raises before re-raising it."""

  def __init__(self, fn, recorder):
    self.fn = fn
    self.recorder = recorder

  def __call__(self, *args, **kwargs):
    # a snapshot (one C-level copy, atomic under the GIL): a run on another
    # thread removing its entry meanwhile would make a list iteration skip one
    running, held = tuple(self.recorder.running), None
    if running:
      me = threading.get_ident()
      if all(thread != me for _, thread in running):  # a thread of XLA's
        held = running_user_code(*[lock for lock, _ in running])
    try:
      try:
        return self.fn(*args, **kwargs)
      finally:
        # a SIGINT handler it installed defers at once, not only when the
        # executable returns: run in jax's callback code, it raised a Ctrl-C
        # there, which came out as an Exception (a break-it find)
        interrupts.rewrap()
    except BaseException as exc:
      self.recorder.record(exc)
      raise
    finally:
      if held is not None:
        done_running(held)


def _wrap_params(params, recorder):
  """params with every callback, at any depth of sub-jaxprs, wrapped."""
  return {key: (_Recorded(value, recorder) if key == "callback" and callable(value)
                else _wrap_value(value, recorder))
          for key, value in params.items()}


def _wrap_value(value, recorder):
  """A param value with the jaxprs in it wrapped; tuples (cond's branches,
  custom_linear_solve's namedtuple of jaxprs, with Nones) keep their type."""
  if isinstance(value, jcore.ClosedJaxpr):
    return jcore.ClosedJaxpr(_wrap_jaxpr(value.jaxpr, recorder), value.consts)
  if isinstance(value, jcore.Jaxpr):
    return _wrap_jaxpr(value, recorder)
  if isinstance(value, tuple) and any(isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr))
                                      for v in value):
    items = [_wrap_value(v, recorder) for v in value]
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
  return value


def _wrap_jaxpr(jaxpr, recorder):
  eqns = [eqn.replace(params=_wrap_params(eqn.params, recorder))
          if primitive_props(eqn.primitive.name, eqn.params, eqn.effects).user_code else eqn
          for eqn in jaxpr.eqns]
  return jaxpr.replace(eqns=eqns)


def instrumented(nodes, recorder):
  """The node list an executable is lowered from: nodes that run user code
  are replaced by detached copies whose callbacks record their exceptions."""
  out = []
  for node in nodes:
    if not node.props.user_code:
      out.append(node)
      continue
    copy = Node(node.id, node.op, node.prim, _wrap_params(node.params, recorder),
                node.inputs, node.effects, node.source, node.ctx)
    copy.outputs, copy.kernel, copy.place = node.outputs, node.kernel, node.place
    copy.origin = node.origin
    out.append(copy)
  return out


def callback_failure(nodes, index, exc, recorder):
  """The HostOpError for a runtime error of the executable of partition
  `index`: names its callback nodes, keeps the user's exception as the cause
  (or the runtime error, when no callback recorded one). A KeyboardInterrupt
  or SystemExit the callback raised is returned as it is: wrapped in an
  Exception, an `except Exception` of the caller's swallowed a Ctrl-C."""
  culprits = ", ".join(where(n) for n in nodes if n.props.user_code) or "an effectful node"
  user = recorder.take()
  if user is not None and not isinstance(user, Exception):
    return user  # KeyboardInterrupt, SystemExit: themselves, as a host-placed callback's
  lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
  if user is None and lines and lines[-1].startswith("KeyboardInterrupt"):
    return KeyboardInterrupt()  # a handler's, raised in jax's callback code around the user's
  what = (f"{type(user).__name__}: {user}" if user is not None else
          lines[-1] if lines else type(exc).__name__)
  error = HostOpError(f"a callback in device partition #{index} ({culprits}) raised {what}")
  error.__cause__ = user if user is not None else exc
  return error
