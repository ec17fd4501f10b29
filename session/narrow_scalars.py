"""A Python scalar where compile saw a narrow strong scalar (bfloat16,
int8): run converts it to the compiled dtype first, where jax.jit, given
the Python scalar - a weak scalar of the default dtype - may compute in the
wider dtype (`x_f32 + s` rounds s to bfloat16 in the compiled program alone).
compile's weak-type check (tracing.weak_sensitive) asks here whether such a
scalar is used the same way in both programs; run refuses it where not.
"""
import jax
import numpy as np
from jax import tree_util
from jax.extend import core as jcore


DEFAULTS = {"f": np.float64, "i": np.int64, "c": np.complex128}  # canonicalized: the default of a kind
_KINDS = (("f", np.floating), ("i", np.integer), ("c", np.complexfloating))  # bf16: kind 'V'


def python_scalar_traces_other(wrapped, state, dyn_args, i, treedef, leaves, j, aval):
  """For a strong scalar leaf of a narrower dtype than a Python scalar's
  (bfloat16, int8): whether jax.jit, given a Python scalar there - a weak
  scalar of the default dtype - traces other arithmetic than the compiled
  program after the conversion run makes (`x_f32 + s` adds in float32 what
  the bfloat16 program rounds to bfloat16 first: a fuzzer's find)."""
  if aval.shape != () or aval.weak_type:
    return False
  kind = next((k for k, t in _KINDS if jax.numpy.issubdtype(aval.dtype, t)), None)
  if kind is None:
    return False
  default = jax.dtypes.canonicalize_dtype(DEFAULTS[kind])
  if np.dtype(aval.dtype) == default:
    return False  # the weak flip above asked already
  as_python = list(leaves)
  as_python[j] = jax.ShapeDtypeStruct((), default, weak_type=True)
  args = list(dyn_args)
  args[i] = tree_util.tree_unflatten(treedef, as_python)

  def converted(state, *args):  # what run computes: the scalar converted first
    args = list(args)
    flat = tree_util.tree_flatten(args[i])[0]
    flat[j] = jax.lax.convert_element_type(flat[j], aval.dtype)
    args[i] = tree_util.tree_unflatten(treedef, flat)
    return wrapped(state, *args)
  at = next(k for k, leaf in enumerate(tree_util.tree_leaves((state, *args)))
            if leaf is as_python[j])
  integer = kind == "i"
  try:
    traces = [jax.make_jaxpr(fn)(state, *args).jaxpr for fn in (wrapped, converted)]
  except Exception:  # pylint: disable=broad-except  (jax.jit would raise there)
    return True
  jit_uses, run_uses = (_scalar_uses(t, t.invars[at], aval.dtype, integer) for t in traces)
  return jit_uses != run_uses


def _scalar_uses(jaxpr, scalar, dtype, integer, labels=None):
  """What `jaxpr` computes from the input `scalar` (a weak scalar of the
  default dtype), its converts followed: jax.jit converts a weak scalar at
  each use where run converts it once before the program (x * s + s
  converts it twice under jax.jit), so a value converted to `dtype` is one
  label, "S:dtype", wherever it was made. An integer's value fits `dtype`
  (run refuses one that does not), so whatever widths it passed through, a
  convert of it gives the same value as from the scalar; a float's rounding
  to `dtype` is not (x_f32 + s adds the float32 value where the bfloat16
  program adds its rounding). A value returned keeps its dtype: another
  program. Bodies (a scan's, a nested jit's) are followed with the labels
  of what they are given (`labels`: var -> label, `scalar` None)."""
  default = np.dtype(jax.dtypes.canonicalize_dtype(DEFAULTS["i" if integer else "f"])) \
      if scalar is None else np.dtype(scalar.aval.dtype)
  labels = dict(labels or {}) if scalar is None else {scalar: "S"}

  def label(v):  # (a Literal cannot be hashed: a review's find)
    return None if isinstance(v, jcore.Literal) else labels.get(v)

  def kind(v):
    return label(v) or (tuple(v.aval.shape), v.aval.dtype)
  out = []
  for eqn in jaxpr.eqns:
    src = label(eqn.invars[0]) if eqn.invars else None
    if eqn.primitive.name == "convert_element_type" and src is not None:
      got, to = np.dtype(eqn.invars[0].aval.dtype), np.dtype(eqn.outvars[0].aval.dtype)
      if to == got:  # the weak type alone
        labels[eqn.outvars[0]] = src
        continue
      if src == "S" and to == np.dtype(dtype):
        labels[eqn.outvars[0]] = f"S:{to}"
        continue
      if integer:  # one integer value, whichever width it passed through
        labels[eqn.outvars[0]] = "S" if to == default else f"S:{to}"
        continue
    subs = tuple(_body_uses(eqn, body, [label(v) for v in eqn.invars], dtype, integer)
                 for body in bodies(eqn))
    # a body's operands are its uses' to say (a labelled one passes in as it is)
    ins = tuple("S*" if subs and label(v) else kind(v) for v in eqn.invars)
    out.append((eqn.primitive.name, ins, tuple(map(kind, eqn.outvars)), subs))
  out.append(tuple((kind(v), getattr(v.aval, "dtype", None)) for v in jaxpr.outvars))
  return out


def arithmetic_terms(jaxpr):
  """What a jaxpr computes, without its weak-type bookkeeping: each equation's
  primitive and input and output types, sub-jaxprs included; converts that
  change only the weak type are left out. (tracing.arithmetic digests it.)"""
  out = []
  for eqn in jaxpr.eqns:
    ins = tuple((tuple(v.aval.shape), v.aval.dtype) for v in eqn.invars)
    outs = tuple((tuple(v.aval.shape), v.aval.dtype) for v in eqn.outvars)
    if eqn.primitive.name == "convert_element_type" and ins == outs:
      continue
    out.append((eqn.primitive.name, ins, outs, tuple(map(arithmetic_terms, bodies(eqn)))))
  return tuple(out)


def bodies(eqn):
  """The sub-jaxprs an equation's params hold (bodies, branches), as Jaxprs."""
  return [p.jaxpr if hasattr(p, "jaxpr") else p
          for value in eqn.params.values()
          for p in (value if isinstance(value, (tuple, list)) else (value,))
          if isinstance(p, (jcore.ClosedJaxpr, jcore.Jaxpr))]


def _body_uses(eqn, body, given, dtype, integer):
  """_scalar_uses of a body, its inputs labelled as the operands that feed
  them: one for one (a jit call, scan, remat, custom_jvp/vjp), a cond's
  branches all but the index, a while's cond and body their consts and
  the carries; anything else: its arithmetic alone."""
  n = len(body.invars)
  if eqn.primitive.name == "while":  # (told apart by identity: cond_nconsts may equal
    cn, bn = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]  # body_nconsts)
    fed = (given[:cn] if body is eqn.params["cond_jaxpr"].jaxpr else
           given[cn:cn + bn]) + given[cn + bn:]
  elif n == len(given):
    fed = given
  elif n == len(given) - 1 and eqn.primitive.name == "cond":
    fed = given[1:]
  else:
    return arithmetic_terms(body)  # (a raw NameError here: a lint's find)
  return tuple(_scalar_uses(body, None, dtype, integer,
                            {v: g for v, g in zip(body.invars, fed) if g}))
