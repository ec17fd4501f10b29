"""SessionOptions(device=...): the one device a single-device session runs on.

Such a session runs each public call that traces, compiles, binds state or
conforms arguments under `jax.default_device(device)`; everything that reads
the session's device (runtime/state.py's `session_device`) then reads it.
"""
import functools

import jax

from jaxsession.errors import InputError


# What a session with its own device runs under jax.default_device(device):
# every call that traces, compiles, binds state or conforms arguments.
PLACED_METHODS = ("compile", "run", "run_op", "get_state", "set_state", "replace_state",
                  "save", "restore")


def check(device, platform):
  if device.platform != platform:
    raise InputError(f"SessionOptions.device={device} is a {device.platform} device, but the "
                     f"session's platform is {platform!r}")
  if device not in jax.local_devices(backend=platform):
    raise InputError(f"SessionOptions.device={device} is not addressable by this process "
                     f"(process {jax.process_index()}; its devices: "
                     f"{jax.local_devices(backend=platform)})")


def bind(session, device):
  """Binds the session's public calls to `device`: each runs under
  jax.default_device(device), which is thread-local, so other threads and
  sessions keep theirs; a session without the option pays nothing."""
  for name in PLACED_METHODS:
    method = getattr(session, name)

    def placed(*args, _method=method, **kwargs):
      with jax.default_device(device):
        return _method(*args, **kwargs)
    functools.update_wrapper(placed, method)
    setattr(session, name, placed)
