"""Errors raised by jaxsession. Each names what is wrong and where."""
try:  # what jax.jit raises for a callback that raised (a RuntimeError)
  from jax.errors import JaxRuntimeError as _JaxRuntimeError
except ImportError:  # an older jax
  _JaxRuntimeError = RuntimeError


class SessionError(Exception):
  """Base class of every error jaxsession raises on purpose."""


class InputError(SessionError, ValueError):
  """Wrong arity, shape, dtype or pytree structure given to run/set_state/compile."""


class UnknownGraphError(SessionError, KeyError):
  """A graph id this session never returned."""

  def __str__(self):  # KeyError would quote the message.
    return str(self.args[0]) if self.args else ""


class KernelSelectError(SessionError):
  """No registered kernel fits a node; the message lists every candidate and why."""


class PartitionError(SessionError):
  """`partition_or_error` is set and the graph needs more than one device partition."""


class HostOpError(SessionError, _JaxRuntimeError):
  """A host kernel or callback raised; the original exception is `__cause__`.
  A jax.errors.JaxRuntimeError (so a RuntimeError) too, as jax.jit's error
  for a raising callback is: code written for jax.jit catches it (a JAX test
  suite's find)."""


class PassError(SessionError):
  """A pass left an invalid graph; names the pass and the passes before it."""
