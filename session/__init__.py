"""jaxsession: a graph-mode session for JAX programs."""
from jaxsession import errors  # first: every other module raises these
from jaxsession.errors import (HostOpError, InputError, KernelSelectError, PartitionError,
                               PassError, SessionError, UnknownGraphError)
from jaxsession.graph.ir import KernelGraph, Literal, Node, Value
from jaxsession.options import SessionOptions
from jaxsession.pipeline import register_pass, unregister_pass
from jaxsession.session import Session
from jaxsession.jitted import jit
from jaxsession.jax_api import hide_frames as _hide_frames

_hide_frames("jaxsession", "jaxsession.runtime", "jaxsession.kernels",
             "jaxsession.optimizer_passes")

__all__ = ["Session", "SessionOptions", "jit", "register_pass", "unregister_pass", "KernelGraph", "Node", "Value", "Literal",
           "errors", "SessionError", "InputError", "UnknownGraphError",
           "KernelSelectError", "PartitionError", "HostOpError", "PassError"]
__version__ = "0.1.0"
