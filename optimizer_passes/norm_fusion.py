"""Normalisation fusions (Optimize): LayerNorm and RMSNorm, then their scale
and bias. Forms covered: by hand (mean((x-mean)^2), `/ sqrt` or `* rsqrt`),
flax.linen.LayerNorm (E[x^2]-E[x]^2 clamped at 0, scale folded into the
rsqrt) and flax.linen.RMSNorm. The fused node keeps the user's variance and
inverse forms as params, so its kernel does the same arithmetic.

The normalisation fuses first; a `* scale` and a `+ bias` over the last axis
are then absorbed by two small rules. Run after simplify/remove_nops/fold.
"""
import numpy as np

from jaxsession.optimizer_passes.fusion import _expand, _is_float, _keeps_reduced_axes
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

# -- LayerNorm ------------------------------------------------------------------
_centered = Pat("sub", x, _expanded_mean(x, "mu"), name="d")
_fast_var = Pat.either(Pat("max", Pat.lit(0), Pat("sub", _mean(_square(x), "msq"),
                                                  _square(_mean(x, "mu"))), name="clamped"),
                       Pat("sub", _mean(_square(x), "msq"), _square(_mean(x, "mu"))))
_var_eps = Pat.either(
    Pat("add", _expanded_mean(_square(_centered), "var"), _eps),   # mean((x-mean)^2) + eps
    Pat("add", Pat(_expand, _fast_var, name="var_b"), _eps),        # flax: E[x^2]-E[x]^2
    Pat(_expand, Pat("add", _fast_var, _eps), name="var_b"))
LAYERNORM_FORMS = [
    Pat("mul", _centered, Pat("rsqrt", _var_eps)),                      # * rsqrt(var + eps)
    Pat("div", _centered, Pat("sqrt", _var_eps)),                       # / sqrt(var + eps)
    Pat("mul", _centered, Pat("mul", Pat("rsqrt", _var_eps), _scale_b)),  # flax: scale inside
]

# -- RMSNorm --------------------------------------------------------------------
_ms_eps = Pat.either(Pat("add", _expanded_mean(_square(x), "ms"), _eps),
                     Pat(_expand, Pat("add", _mean(_square(x), "ms"), _eps), name="ms_b"))
RMSNORM_FORMS = [
    Pat("mul", x, Pat("rsqrt", _ms_eps)),
    Pat("div", x, Pat("sqrt", _ms_eps)),
    Pat("mul", x, Pat("mul", Pat("rsqrt", _ms_eps), _scale_b)),        # flax: scale inside
]


def _axes_and_count(c, tag, x):
  """(axes, ok) of the mean captured under `tag`: n must be the reduced size."""
  total = c[f"{tag}_sum"]
  axes = tuple(total.producer.params["axes"])
  n = float(np.prod([x.aval.shape[a] for a in axes]))
  if f"{tag}_n" in c:
    ok = np.isclose(float(c[f"{tag}_n"].value), n, rtol=1e-6)
  else:
    ok = np.isclose(float(c[f"{tag}_inv_n"].value), 1.0 / n, rtol=1e-6)
  return axes, bool(ok)


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


def fuse_layernorm(r, x, **c):
  if not _is_float(x) or r.root.outputs[0].aval.shape != x.aval.shape:
    return None
  axes, ok = _axes_and_count(c, "mu", x)
  var_tag = "var" if "var_sum" in c else "msq"
  var_axes, var_ok = _axes_and_count(c, var_tag, x)
  if not (ok and var_ok and var_axes == axes):
    return None
  if not (_keeps_reduced_axes(c["mu_b"], x, axes) and _keeps_reduced_axes(c["var_b"], x, axes)):
    return None
  scale = _checked_scale(c, x, axes)
  if scale is None:
    return None
  variance = "two_pass" if var_tag == "var" else ("fast_clamped" if "clamped" in c else "fast")
  params = {"axes": axes, "eps": float(c["eps"].value), "variance": variance,
            "inverse": "div_sqrt" if r.root.op == "div" else "rsqrt",
            "scale": bool(scale), "bias": False}
  return r.fused("LayerNorm", [x] + scale, params, r.root.outputs[0].aval,
                 f"fused LayerNorm over axes {axes} ({variance} variance)")


def fuse_rmsnorm(r, x, **c):
  if not _is_float(x) or r.root.outputs[0].aval.shape != x.aval.shape:
    return None
  axes, ok = _axes_and_count(c, "ms", x)
  if not ok or not _keeps_reduced_axes(c["ms_b"], x, axes):
    return None
  scale = _checked_scale(c, x, axes)
  if scale is None:
    return None
  params = {"axes": axes, "eps": float(c["eps"].value),
            "inverse": "div_sqrt" if r.root.op == "div" else "rsqrt",
            "scale": bool(scale), "bias": False}
  return r.fused("RMSNorm", [x] + scale, params, r.root.outputs[0].aval,
                 f"fused RMSNorm over axes {axes}")


# -- absorbing scale and bias into a fused norm -------------------------------------
NORMS = ("LayerNorm", "RMSNorm")
_norm = Pat.either(Pat(NORMS, x, name="norm"), Pat(NORMS, x, Pat.var("scale"), name="norm"))
SCALE = Pat("mul", Pat(NORMS, x, name="norm"), Pat(_expand, Pat.var("new_scale"), name="nb"))
BIAS = Pat("add", _norm, Pat(_expand, Pat.var("bias"), name="nb"))


def absorb_scale(r, x, norm, new_scale, nb):
  p = norm.producer.params
  if p["scale"] or p["bias"] or p["axes"] != (x.aval.ndim - 1,):
    return None
  if not _last_axis_vector(new_scale, nb, x) or r.root.outputs[0].aval.shape != x.aval.shape:
    return None
  return r.fused(norm.producer.op, [x, new_scale], {**p, "scale": True},
                 r.root.outputs[0].aval, f"{norm.producer.op} takes its scale")


def absorb_bias(r, x, norm, bias, nb, scale=None):
  p = norm.producer.params
  if p["bias"] or p["axes"] != (x.aval.ndim - 1,) or norm.producer.op != "LayerNorm":
    return None
  if not _last_axis_vector(bias, nb, x) or r.root.outputs[0].aval.shape != x.aval.shape:
    return None
  inputs = [x] + ([scale] if scale is not None else []) + [bias]
  return r.fused("LayerNorm", inputs, {**p, "bias": True}, r.root.outputs[0].aval,
                 "LayerNorm takes its bias")


NORM_RULES = {
    "fuse_layernorm": [Rule(form, fuse_layernorm) for form in LAYERNORM_FORMS],
    "fuse_rmsnorm": [Rule(form, fuse_rmsnorm) for form in RMSNORM_FORMS],
    "fuse_norm_affine": [Rule(SCALE, absorb_scale), Rule(BIAS, absorb_bias)],
}


def norm_fusion_passes():
  return [RewritePass(name, rules, doc=__doc__) for name, rules in NORM_RULES.items()]
