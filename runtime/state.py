"""Device-resident state: the session's parameter slots.

A slot holds one state argument (a pytree) as device arrays the session owns.
Graphs bind to slots by reference, so two graphs that share a slot see each
other's updates without a copy.
"""
import jax
import numpy as np

from jaxsession.errors import InputError
from jaxsession.ir import aval_str


def owned_copy(x):
  """A device array the session owns: never the caller's buffer, since the
  session donates its state buffers and must not invalidate the caller's."""
  if isinstance(x, jax.Array):
    return jax.numpy.array(x, copy=True)
  return jax.device_put(np.asarray(x))


class StateSlot:
  """One state argument: its pytree structure, leaf avals and current leaves."""

  def __init__(self, name, treedef, avals, leaves):
    self.name = name
    self.treedef = treedef
    self.avals = list(avals)
    self.leaves = tuple(leaves)  # replaced whole on every update, never mutated


def check_matches(slot, treedef, avals, where):
  """Raises InputError unless (treedef, avals) equal the slot's."""
  if treedef != slot.treedef:
    raise InputError(f"{where}: pytree structure {treedef} does not match state "
                     f"slot {slot.name}'s {slot.treedef}")
  for i, (a, b) in enumerate(zip(avals, slot.avals)):
    if a.shape != b.shape or a.dtype != b.dtype:
      raise InputError(f"{where}: leaf {i} is {aval_str(a)}, state slot {slot.name} "
                       f"holds {aval_str(b)}")
