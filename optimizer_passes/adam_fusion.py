"""fuse_adam (Optimize): the Adam / AdamW update of one parameter - both
moment updates, bias correction, weight decay and the parameter update - is
one fused node with three outputs (new param, new first and second moments).

Forms: optax.adam and optax.adamw (bias-corrected moments, `p + (-lr) * u`),
and the hand-written form that folds the bias correction into one scalar step
size (`p - step * m / (sqrt(v) + eps)`). The scalars shared by all parameters
(bias corrections, step size) stay outside as inputs; the literals become
params, and the kernel repeats the user's arithmetic in the user's order.
"""
import numpy as np

from jaxsession.optimizer_passes.fusion import _is_float
from jaxsession.optimizer_passes.pattern import Pat, RewritePass, Rule

p, g, m, v = Pat.var("p"), Pat.var("g"), Pat.var("m"), Pat.var("v")
_scalar = lambda name: Pat.var(name, where=lambda value: value.aval.shape == ())

M_NEW = Pat("add", Pat("mul", Pat.lit(name="b1"), m), Pat("mul", Pat.lit(name="c1"), g),
            name="m_new")                                      # b1*m + (1-b1)*g
V_NEW = Pat("add", Pat("mul", Pat.lit(name="b2"), v),
            Pat.either(Pat("mul", Pat.lit(name="c2"), Pat.either(
                Pat("integer_pow", g, params={"y": 2}), Pat("square", g), Pat("mul", g, g)),
                name="v_g2"),                                  # (1-b2) * g^2
                Pat("mul", Pat("mul", Pat.lit(name="c2"), g), g, name="v_gg")),  # ((1-b2)*g)*g
            name="v_new")
# optax: u = (m/bc1) / (sqrt(v/bc2) + eps)
_U = Pat("div", Pat("div", M_NEW, _scalar("bc1")),
         Pat("add", Pat("sqrt", Pat("div", V_NEW, _scalar("bc2"))), Pat.lit(name="eps")))
ADAM_FORMS = {
    "optax_adam": Pat("add", p, Pat("mul", Pat.lit(name="neg_lr"), _U)),
    "optax_adamw": Pat("add", p, Pat("mul", Pat.lit(name="neg_lr"),
                                     Pat("add", _U, Pat("mul", Pat.lit(name="wd"), p)))),
    "scaled_step": Pat("sub", p, Pat("div", Pat("mul", _scalar("step"), M_NEW),
                                     Pat("add", Pat("sqrt", V_NEW), Pat.lit(name="eps")))),
}
LITERALS = ("b1", "c1", "b2", "c2", "eps", "neg_lr", "wd")


def _make(form):
  def fuse(r, p, g, m, v, m_new, v_new, **c):
    avals = [x.aval for x in (p, g, m, v)]
    if not all(_is_float(x) for x in (p, g, m, v)):
      return None
    if any(a.shape != avals[0].shape or a.dtype != avals[0].dtype for a in avals):
      return None
    if r.root.outputs[0].aval.shape != p.aval.shape:
      return None
    for decay, rest in (("b1", "c1"), ("b2", "c2")):  # an EMA, or not Adam at all
      if not np.isclose(float(c[decay].value) + float(c[rest].value), 1.0, rtol=1e-6):
        return None
    scalars = [c[name] for name in ("bc1", "bc2", "step") if name in c]
    params = {"form": form, "v_form": "c2_g2" if "v_g2" in c else "c2g_g"}
    params.update({name: np.asarray(c[name].value, c[name].aval.dtype)[()]
                   for name in LITERALS if name in c})
    out = r.emit("Adam", None, params, [p, g, m, v] + scalars,
                 [p.aval, m_new.aval, v_new.aval],
                 note=f"fused {form} update of one parameter (3 outputs)")
    return out
  fuse.__name__ = f"fuse_{form}"
  return fuse


ADAM_RULES = [Rule(pat, _make(form), exports=("m_new", "v_new"))
              for form, pat in ADAM_FORMS.items()]


def FuseAdam():
  return RewritePass("fuse_adam", ADAM_RULES, doc=__doc__)
