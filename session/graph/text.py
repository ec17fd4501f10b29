"""How the IR's text (KernelGraph.dump() and to_dot()) shows a node's
params: bodies by their size, ops and the user callbacks inside, callbacks
by the user's function, fixed layouts, long values cut."""
from jaxsession.graph.op_properties import sub_jaxprs


def node_where(node):
  """`node 12 'add' at file.py:3 (fn)`: how errors, notes and checks name a node."""
  return f"node {node.id} '{node.op}'" + (f" at {node.source}" if node.source else "")


def sharded(value):
  """` @P('data')`-style text for a value whose sharding is fixed, else ''."""
  sharding = value.sharding
  return "" if sharding is None else f" @{getattr(sharding, 'spec', sharding)}"


def param_str(value):
  if hasattr(value, "jaxpr") or type(value).__name__ in ("Jaxpr", "ClosedJaxpr"):
    return _body_str(value)
  if isinstance(value, (tuple, list)) and value and hasattr(value[0], "jaxpr"):
    return "[" + ", ".join(_body_str(v) for v in value) + "]"  # cond's branches
  if callable(value):
    return callable_name(value)
  text = str(value)
  return text if len(text) <= 60 else text[:57] + "..."


def callable_name(fn):
  """The user's function a callback param holds, by name (jax wraps it:
  the dump said `_FlatCallback` for every pure_callback, a review's find)."""
  for _ in range(4):  # jax's wrappers: _FlatCallback, functools.partial
    inner = getattr(fn, "callback_func", None) or getattr(fn, "func", None)
    if inner is None or not callable(inner):
      break
    fn = inner
  return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", type(fn).__name__)


def _body_str(jaxpr):
  """A body (scan's, while's, cond's, a kept jit's) as a dump shows it: its
  size, its ops, and the user callbacks anywhere inside, by name (a loop
  body showed `{jaxpr}`: what made its partition one that may fail was
  nowhere in the dump, a review's find)."""
  body = getattr(jaxpr, "jaxpr", jaxpr)
  ops = list(dict.fromkeys(e.primitive.name for e in body.eqns))
  shown = ", ".join(ops[:6]) + (", ..." if len(ops) > 6 else "")
  calls = list(dict.fromkeys(_callbacks_in(body)))
  named = f"; callbacks: {', '.join(calls)}" if calls else ""
  return f"{{{len(body.eqns)} eqns: {shown}{named}}}"


def _callbacks_in(body):
  for eqn in body.eqns:
    if "callback" in eqn.params and callable(eqn.params["callback"]):
      yield f"{callable_name(eqn.params['callback'])} ({eqn.primitive.name})"
    for sub in sub_jaxprs(eqn.params):
      yield from _callbacks_in(sub)


def call_str(node):
  """A kept nested jit's params as a dump shows them: its name and what its
  body does (the shardings and flags jax leaves unspecified say nothing)."""
  return f"name={node.params.get('name')} body={_body_str(node.params['jaxpr'])}"
