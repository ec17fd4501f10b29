"""fuse_adam (Optimize): the Adam / AdamW update of one parameter - both
moment updates, bias correction, weight decay and the parameter update - is
one fused node with three outputs (new param, new first and second moments).

Forms: optax.adam and optax.adamw (bias-corrected moments, `p + (-lr) * u`),
and the hand-written form that folds the bias correction into one scalar step
size (`p - step * m / (sqrt(v) + eps)`). The scalars shared by all parameters
(bias corrections, step size) stay outside as inputs; the literals become
params (each in its own dtype), and the kernel repeats the user's arithmetic
in the user's order, so the update is bit-identical to the unfused graph.
The fused node goes before the first reader of the new moments (a step that
also returns, say, the norm of mu) - or, when its inputs are not ready there,
the rule does not fire (the rule engine's `exports`).
Runs after the cleanups of its Optimize sweep (fold, simplify, remove_nops).
"""
import numpy as np

from jaxsession.optimizer_passes.fusion import PALLAS_NOTE, _is_float, _literal, first
from jaxsession.optimizer_passes.pattern import Pat, RewritePass, Rule

p, g, m, v = Pat.var("p"), Pat.var("g"), Pat.var("m"), Pat.var("v")
_scalar = lambda name: Pat.var(name, where=lambda value: value.aval.shape == ())

M_NEW = Pat("add", Pat("mul", Pat.lit(name="b1"), m, name="m_decay"),
            Pat("mul", Pat.lit(name="c1"), g), name="m_new")  # b1*m + (1-b1)*g
V_NEW = Pat("add", Pat("mul", Pat.lit(name="b2"), v, name="v_decay"),
            Pat.either(Pat("mul", Pat.lit(name="c2"), Pat.either(
                Pat("integer_pow", g, params={"y": 2}), Pat("square", g), Pat("mul", g, g)),
                name="v_g2"),                                  # (1-b2) * g^2
                Pat("mul", Pat("mul", Pat.lit(name="c2"), g), g, name="v_gg")),  # ((1-b2)*g)*g
            name="v_new")
# optax: u = (m/bc1) / (sqrt(v/bc2 + eps_root) + eps); simplify keeps `+ 0.0`
# (it is not an identity on -0.0), so the default eps_root=0.0 is matched too.
_V_HAT = Pat("div", V_NEW, _scalar("bc2"))
_U = Pat("div", Pat("div", M_NEW, _scalar("bc1")),
         Pat("add", Pat("sqrt", Pat.either(Pat("add", _V_HAT, Pat.lit(name="eps_root")), _V_HAT),
                        params={"accuracy": None}),
             Pat.lit(name="eps")))
ADAM_FORMS = {
    "optax_adam": Pat("add", p, Pat("mul", Pat.lit(name="neg_lr"), _U)),
    "optax_adamw": Pat("add", p, Pat("mul", Pat.lit(name="neg_lr"),
                                     Pat("add", _U, Pat("mul", Pat.lit(name="wd"), p, name="wd_p"),
                                         name="u_wd"))),
    "scaled_step": Pat("sub", p, Pat("div", Pat("mul", _scalar("step"), M_NEW),
                                     Pat("add", Pat("sqrt", V_NEW, params={"accuracy": None}),
                                         Pat.lit(name="eps")))),
}
LITERALS = ("b1", "c1", "b2", "c2", "eps", "eps_root", "neg_lr", "wd")


def _make(form):
  def fuse(r, p, g, m, v, m_new, v_new, m_decay, v_decay, **c):
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
    # the operand order of each add: XLA on CPU contracts a*b + c into an FMA
    params = {"form": form, "v_form": "c2_g2" if "v_g2" in c else "c2g_g",
              "m_decay_first": first(m_new, m_decay), "v_decay_first": first(v_new, v_decay)}
    if form != "scaled_step":
      params["p_first"] = first(r.root.outputs[0], p)
    if form == "optax_adamw":
      params["u_first"] = not first(c["u_wd"], c["wd_p"])
    params.update({name: _literal(c[name]) for name in LITERALS if name in c})
    out = r.emit("Adam", None, params, [p, g, m, v] + scalars,
                 [r.root.outputs[0].aval, m_new.aval, v_new.aval],  # the root's weak type
                 note=f"fused {form} update of one parameter (3 outputs); {PALLAS_NOTE}")
    return out
  fuse.__name__ = f"fuse_{form}"
  return fuse


ADAM_RULES = [Rule(pat, _make(form), exports=("m_new", "v_new"))
              for form, pat in ADAM_FORMS.items()]


class FuseAdam(RewritePass):
  """Optimize: the Adam update of one leaf becomes one node (module docstring)."""
  name = "fuse_adam"
  rules = ADAM_RULES
