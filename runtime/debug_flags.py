"""Whether jax_debug_nans/infs may be on, as one cell a run reads.

A run that donates its state must copy it first while either flag is on
(jax raises after the executable consumed the buffers). Reading both flags
exactly costs two config reads a run; instead `MAYBE[0]` is kept by hooks
chained onto jax's own update hooks of the two flags:
  * a global change (`jax.config.update`, the env var) recomputes it;
  * a thread-local True (`with jax.debug_nans(True):`, in any thread) makes
    it True for good: a thread's local value cannot be read from another
    thread, so after one the run reads the flags exactly (`on()`) each time.
Where jax has no such hooks MAYBE stays True: exact reads on every run.
Not jax's own post-hook state: leaving a `with jax.debug_nans(..)` block
sets it None in the thread, hiding the flag set globally later (jax 0.10.2);
`checks_off()` turns the checks off for a block and puts that state back.
"""
import contextlib

import jax
import numpy as np

MAYBE = [True]

try:  # jax.jit's fast path checks through this post-hook (jax/_src/api.py)
  from jax._src.api import _post_hook_state as _POST_HOOK
except ImportError:  # an internal API: the hook is left as jax leaves it
  _POST_HOOK = None

try:
  from jax._src.config import debug_infs as _INFS, debug_nans as _NANS
except ImportError:  # an internal API: read through the public config
  class _Public:
    def __init__(self, name):
      self.name = name

    @property
    def value(self):
      return getattr(jax.config, self.name)
  _NANS, _INFS = _Public("jax_debug_nans"), _Public("jax_debug_infs")


def on():
  """The exact answer in this thread: is either flag on?"""
  return bool(_NANS.value or _INFS.value)


_sticky = [False]


def _refresh():
  MAYBE[0] = _sticky[0] or bool(_NANS.get_global() or _INFS.get_global())


def _chain(state):
  previous_global = state._update_global_hook  # pylint: disable=protected-access
  previous_local = state._update_thread_local_hook  # pylint: disable=protected-access

  def on_global(value):
    if previous_global is not None:
      previous_global(value)
    _refresh()

  def on_local(value):
    if previous_local is not None:
      previous_local(value)
    if value:
      _sticky[0] = True
    _refresh()

  state._update_global_hook = on_global  # pylint: disable=protected-access
  state._update_thread_local_hook = on_local  # pylint: disable=protected-access


def _install():
  try:
    for state in (_NANS, _INFS):
      state._update_global_hook  # pylint: disable=protected-access,pointless-statement
      state._update_thread_local_hook  # pylint: disable=protected-access,pointless-statement
      state.get_global  # pylint: disable=pointless-statement
  except AttributeError:
    return  # MAYBE stays True: exact reads each run
  for state in (_NANS, _INFS):
    _chain(state)
  # a thread-local value set before this import is invisible here: be exact
  # if this thread has one
  if _NANS.value != _NANS.get_global() or _INFS.value != _INFS.get_global():
    _sticky[0] = True
  _refresh()


_install()


@contextlib.contextmanager
def checks_off():
  """jax_debug_nans/infs off in this thread for the block, and then exactly
  as before: leaving jax's own `with jax.debug_nans(False):` sets jax.jit's
  post-hook to None in the thread, so a flag set globally stopped checking
  the user's already-called jax.jit functions (and the session's) for good
  (a break-it find); the hook's thread-local value is put back here."""
  saved = None if _POST_HOOK is None else _POST_HOOK.get_local()
  try:
    with jax.debug_nans(False), jax.debug_infs(False):
      yield
  finally:
    if _POST_HOOK is not None:
      _POST_HOOK.set_local(saved)


def checked_kinds():
  """The special values the flags on in this thread check for: a subset of
  ('nan', 'inf')."""
  return tuple(kind for kind, flag in (("nan", _NANS), ("inf", _INFS)) if flag.value)


def special_in(x, kinds=None):
  """'nan' or 'inf' where array `x` holds one of `kinds` (by default the
  ones the flags on in this thread check for), else None: jax.jit's own
  check of an output, for a value no executable returns, and the nan
  replay's of each node's outputs."""
  if kinds is None:
    kinds = checked_kinds()
  if not kinds or not hasattr(x, "dtype") or \
      not jax.numpy.issubdtype(x.dtype, jax.numpy.inexact):
    return None  # ints, bools and PRNG keys hold neither
  x = np.asarray(x)
  if "nan" in kinds and np.isnan(x).any():
    return "nan"
  if "inf" in kinds and np.isinf(x).any():
    return "inf"
  return None


def unchecked(fn):
  """`fn`, a call of an executable that only moves data (splits a sunk
  run's stacked arguments), run with the checks off: jax.jit never checks
  its arguments, so a nan the step masks must not be refused there."""
  def call(*args):
    with checks_off():
      return fn(*args)
  return call
