"""Normalisation fusions (Optimize): LayerNorm and RMSNorm, then their scale
and bias. Forms covered: by hand (mean((x-mean)^2), `/ sqrt` or `* rsqrt`),
flax.linen.LayerNorm (E[x^2]-E[x]^2 clamped at 0, scale folded into the
rsqrt) and flax.linen.RMSNorm.

The fused node records the user's arithmetic - each mean as `sum / n` or
`sum * (1/n)` with the user's literal, the variance form, the +0.0 clamp,
eps as written, rsqrt or 1/sqrt, and whether the scale multiplies the inverse
(flax) or the normalised value (by hand) - and its kernel repeats it in that
order, so the result is bit-identical to the unfused graph. A mean's literal
must be exactly the reduced count (or its correctly rounded reciprocal);
anything else is not a mean and does not fuse.

The normalisation fuses first; a `* scale` and a `+ bias` over the last axis
are then absorbed by two small rules. Run after simplify/remove_nops/fold.
"""
import numpy as np

from jaxsession.optimizer_passes.fusion import (PALLAS_NOTE, _expand, _is_float,
                                                _keeps_reduced_axes, _literal, first)
from jaxsession.optimizer_passes.pattern import Pat, RewritePass, Rule

x = Pat.var("x")


def _by_n(total, tag):
  """total / n, or total * (1/n)."""
  return Pat.either(Pat("div", total, Pat.lit(name=f"{tag}_n")),
                    Pat("mul", total, Pat.lit(name=f"{tag}_inv_n")))


def _mean(p, tag):
  """mean of p over some axes (the reduced shape), captured as `tag`."""
  return Pat.either(*_by_n(Pat("reduce_sum", p, name=f"{tag}_sum"), tag).srcs, name=tag)


def _expanded_mean(p, tag):
  """mean of p brought back to p's rank: expand(sum / n) (flax) or
  expand(sum) / n (jnp.mean with keepdims=True); the expand is `{tag}_b`."""
  return Pat.either(Pat(_expand, _mean(p, tag), name=f"{tag}_b"),
                    _by_n(Pat(_expand, Pat("reduce_sum", p, name=f"{tag}_sum"),
                              name=f"{tag}_b"), tag))


def _square(p):
  return Pat.either(Pat("integer_pow", p, params={"y": 2}), Pat("square", p), Pat("mul", p, p))


_eps = Pat.lit(name="eps")
_scale_b = Pat(_expand, Pat.var("scale"), name="scale_b")
_rsqrt = lambda p: Pat("rsqrt", p, params={"accuracy": None})
_sqrt = lambda p: Pat("sqrt", p, params={"accuracy": None})

# -- LayerNorm ------------------------------------------------------------------
_centered = Pat("sub", x, _expanded_mean(x, "mu"), name="d")
_fast_var = Pat.either(Pat("max", Pat.lit(0), Pat("sub", _mean(_square(x), "msq"),
                                                  _square(_mean(x, "mu"))), name="clamped"),
                       Pat("sub", _mean(_square(x), "msq"), _square(_mean(x, "mu"))))
_var_eps = Pat.either(
    Pat("add", _expanded_mean(_square(_centered), "var"), _eps),   # mean((x-mean)^2) + eps
    Pat("add", Pat(_expand, _fast_var, name="var_b"), _eps),        # flax: E[x^2]-E[x]^2
    Pat(_expand, Pat("add", _fast_var, _eps), name="var_b"))
LAYERNORM_FORMS = {
    ("rsqrt", None): Pat("mul", _centered, _rsqrt(_var_eps)),           # * rsqrt(var + eps)
    ("div_sqrt", None): Pat("div", _centered, _sqrt(_var_eps)),         # / sqrt(var + eps)
    ("rsqrt", "inside"): Pat("mul", _centered, Pat("mul", _rsqrt(_var_eps), _scale_b)),  # flax
}

# -- RMSNorm --------------------------------------------------------------------
_ms_eps = Pat.either(Pat("add", _expanded_mean(_square(x), "ms"), _eps),
                     Pat(_expand, Pat("add", _mean(_square(x), "ms"), _eps), name="ms_b"))
RMSNORM_FORMS = {
    ("rsqrt", None): Pat("mul", x, _rsqrt(_ms_eps)),
    ("div_sqrt", None): Pat("div", x, _sqrt(_ms_eps)),
    ("rsqrt", "inside"): Pat("mul", x, Pat("mul", _rsqrt(_ms_eps), _scale_b)),  # flax
}


def _mean_form(c, tag, x):
  """(axes, ("div", n) or ("mul", 1/n)) of the mean captured under `tag`, the
  literal as the user wrote it; None unless it is exactly the reduced count
  (or that count's correctly rounded reciprocal) - an rtol would take n+1."""
  total = c[f"{tag}_sum"]
  axes = tuple(total.producer.params["axes"])
  n = int(np.prod([x.aval.shape[a] for a in axes]))
  if f"{tag}_n" in c:
    lit = c[f"{tag}_n"]
    exact = float(lit.value) == n
    how = "div"
  else:
    lit = c[f"{tag}_inv_n"]
    dtype = lit.aval.dtype
    exact = np.asarray(lit.value, dtype).tobytes() == np.asarray(1.0 / n, dtype).tobytes()
    how = "mul"
  return (axes, (how, _literal(lit))) if exact else None


def _last_axis_vector(vec, vec_b, x):
  """vec is a vector over x's last axis, brought to x's rank by vec_b."""
  shape = tuple(x.aval.shape)
  if vec.aval.ndim != 1 or not shape or vec.aval.shape[0] != shape[-1]:
    return False
  if vec.aval.dtype != x.aval.dtype:
    return False
  node = vec_b.producer
  if node.op == "broadcast_in_dim":
    return node.params["broadcast_dimensions"] == (len(vec_b.aval.shape) - 1,)
  return tuple(vec_b.aval.shape) == (1,) * (len(shape) - 1) + (shape[-1],)


def _checked_scale(c, x, axes):
  if "scale" not in c:
    return []
  if axes != (x.aval.ndim - 1,) or not _last_axis_vector(c["scale"], c["scale_b"], x):
    return None
  return [c["scale"]]


def _make_layernorm(inverse, scale_form):
  def fuse_layernorm(r, x, **c):
    if not _is_float(x) or r.root.outputs[0].aval.shape != x.aval.shape:
      return None
    var_tag = "var" if "var_sum" in c else "msq"
    mean, var_mean = _mean_form(c, "mu", x), _mean_form(c, var_tag, x)
    if mean is None or var_mean is None or var_mean[0] != mean[0]:
      return None
    axes = mean[0]
    if not (_keeps_reduced_axes(c["mu_b"], x, axes) and _keeps_reduced_axes(c["var_b"], x, axes)):
      return None
    scale = _checked_scale(c, x, axes)
    if scale is None:
      return None
    variance = "two_pass" if var_tag == "var" else ("fast_clamped" if "clamped" in c else "fast")
    params = {"axes": axes, "mean": mean[1], "var_mean": var_mean[1], "variance": variance,
              "eps": _literal(c["eps"]), "inverse": inverse, "scale": scale_form,
              "bias": False}
    return r.fused("LayerNorm", [x] + scale, params, r.root.outputs[0].aval,
                   f"fused LayerNorm over axes {axes} ({variance} variance, {inverse}"
                   f"{', scale inside' if scale_form else ''}); {PALLAS_NOTE}")
  fuse_layernorm.__name__ = f"fuse_layernorm_{inverse}{'_scaled' if scale_form else ''}"
  return fuse_layernorm


def _make_rmsnorm(inverse, scale_form):
  def fuse_rmsnorm(r, x, **c):
    if not _is_float(x) or r.root.outputs[0].aval.shape != x.aval.shape:
      return None
    ms = _mean_form(c, "ms", x)
    if ms is None or not _keeps_reduced_axes(c["ms_b"], x, ms[0]):
      return None
    axes = ms[0]
    scale = _checked_scale(c, x, axes)
    if scale is None:
      return None
    params = {"axes": axes, "var_mean": ms[1], "eps": _literal(c["eps"]), "inverse": inverse,
              "scale": scale_form, "bias": False}
    return r.fused("RMSNorm", [x] + scale, params, r.root.outputs[0].aval,
                   f"fused RMSNorm over axes {axes} ({inverse}"
                   f"{', scale inside' if scale_form else ''}); {PALLAS_NOTE}")
  fuse_rmsnorm.__name__ = f"fuse_rmsnorm_{inverse}{'_scaled' if scale_form else ''}"
  return fuse_rmsnorm


# -- absorbing scale and bias into a fused norm -------------------------------------
NORMS = ("LayerNorm", "RMSNorm")
_norm = Pat.either(Pat(NORMS, x, name="norm"), Pat(NORMS, x, Pat.var("scale"), name="norm"))
SCALE = Pat("mul", Pat(NORMS, x, name="norm"), Pat(_expand, Pat.var("new_scale"), name="nb"))
BIAS = Pat("add", _norm, Pat(_expand, Pat.var("bias"), name="nb"))


def absorb_scale(r, x, norm, new_scale, nb):
  """norm(x) * scale: the scale multiplies the normalised value, last."""
  p = norm.producer.params
  if p["scale"] or p["bias"] or p["axes"] != (x.aval.ndim - 1,):
    return None
  if not _last_axis_vector(new_scale, nb, x) or r.root.outputs[0].aval.shape != x.aval.shape:
    return None
  return _keeping_notes(norm, r.fused(norm.producer.op, [x, new_scale],
                                      {**p, "scale": "after"}, r.root.outputs[0].aval,
                                      f"{norm.producer.op} takes its scale (after)"))


def absorb_bias(r, x, norm, bias, nb, scale=None):
  p = norm.producer.params
  if p["bias"] or p["axes"] != (x.aval.ndim - 1,) or norm.producer.op != "LayerNorm":
    return None
  if not _last_axis_vector(bias, nb, x) or r.root.outputs[0].aval.shape != x.aval.shape:
    return None
  inputs = [x] + ([scale] if scale is not None else []) + [bias]
  bias_first = first(r.root.outputs[0], nb)  # bias + y or y + bias: an FMA either way round
  return _keeping_notes(norm, r.fused("LayerNorm", inputs,
                                      {**p, "bias": "first" if bias_first else "last"},
                                      r.root.outputs[0].aval, "LayerNorm takes its bias"))


def _keeping_notes(norm, new):
  """The absorbing node keeps the notes of the norm it replaces (what was
  fused in the first place), then says what it absorbed."""
  new.producer.notes[:0] = [n for n in norm.producer.notes if n not in new.producer.notes]
  return new


NORM_RULES = {
    "fuse_layernorm": [Rule(pat, _make_layernorm(*form)) for form, pat in LAYERNORM_FORMS.items()],
    "fuse_rmsnorm": [Rule(pat, _make_rmsnorm(*form)) for form, pat in RMSNORM_FORMS.items()],
    "fuse_norm_affine": [Rule(SCALE, absorb_scale), Rule(BIAS, absorb_bias)],
}


class FuseLayerNorm(RewritePass):
  """Optimize: layer norm -> one LayerNorm node (module docstring)."""
  name = "fuse_layernorm"
  rules = NORM_RULES[name]


class FuseRmsNorm(RewritePass):
  """Optimize: RMS norm -> one RMSNorm node (module docstring)."""
  name = "fuse_rmsnorm"
  rules = NORM_RULES[name]


class FuseNormAffine(RewritePass):
  """Optimize: a scale or bias applied after a norm node is absorbed into it (module docstring)."""
  name = "fuse_norm_affine"
  rules = NORM_RULES[name]
