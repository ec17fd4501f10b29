"""Kernel registry and kernel implementations (XLA, host)."""
from jaxsession.kernels.registry import (ANY_PRIMITIVE, BACKENDS, KernelBuildInfo,
                                         candidates, register_kernel, select_kernel,
                                         unregister_kernel)
from jaxsession.kernels import fused as _fused  # registers the fused-op kernels
from jaxsession.kernels import host as _host  # registers the host kernels
from jaxsession.kernels import pallas as _pallas  # registers the Pallas (GPU) kernels
from jaxsession.kernels import xla as _xla    # registers the XLA kernels

__all__ = ["ANY_PRIMITIVE", "BACKENDS", "KernelBuildInfo", "candidates",
           "register_kernel", "select_kernel", "unregister_kernel"]
