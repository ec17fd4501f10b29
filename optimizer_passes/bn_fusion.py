"""fuse_bn_relu (HardwareOptimize): BatchNorm in inference form, optionally
plus a residual, followed by ReLU, becomes one BatchNormRelu /
BatchNormAddRelu node (MindSpore's BatchNorm+ReLU fusion).

Per-channel operands (mean, inverse std, gamma, beta) are kept as the user
computed them and brought to x's rank - when they are constants, folding has
already turned them into constant vectors - so the kernel does the same
arithmetic, with the operand order of both adds as written (XLA on CPU
contracts a*b + c into a fused multiply-add), and is bit-identical to the
unfused graph. Forms: by hand, and flax.linen.BatchNorm(use_running_average=True)
(which folds gamma into the inverse std first). The ReLU is max(y, +0.0) only:
max(y, -0.0) returns -0.0 for y = -0.0. jax.nn.relu is a nested jit the
importer keeps as a call (XLA fuses across a call boundary otherwise than
without it); the fused kernel makes the same call, with the same params.

Runs after SelectKernel, before place_nodes, which picks the kernels of the
nodes it makes.
"""
from jax.extend import core as jcore
import numpy as np

from jaxsession.graph import op_properties
from jaxsession.optimizer_passes.fusion import _is_float, first
from jaxsession.optimizer_passes.pattern import Pat, RewritePass, Rule, same_number

x = Pat.var("x")


def _per_channel(value):
  """All dims 1 but at most one (the channel axis)."""
  shape = tuple(getattr(value.aval, "shape", ()))
  return shape != () and sum(d != 1 for d in shape) <= 1


def _pc(name):
  return Pat.var(name, where=_per_channel)


_centered = Pat("sub", x, _pc("mean"))
BN_FORMS = {
    "scale_after": Pat("add", Pat("mul", Pat("mul", _centered, _pc("inv")), _pc("gamma")),
                       _pc("beta"), name="bn"),                         # ((x-m)*inv)*g + b
    "scale_folded": Pat("add", Pat("mul", _centered, Pat("mul", _pc("inv"), _pc("gamma"))),
                        _pc("beta"), name="bn"),                        # (x-m)*(inv*g) + b (flax)
    "no_scale": Pat("add", Pat("mul", _centered, _pc("inv")), _pc("beta"),
                    name="bn"),                                         # (x-m)*inv + b
}


def _relu_call(value):
  """Whether `value` is made by a kept nested jit whose body is max(x, +0.0)
  alone (jax.nn.relu, a called computation for XLA under jax.jit)."""
  body = value.producer.params["jaxpr"].jaxpr
  if len(body.eqns) != 1 or len(body.invars) != 1 or body.constvars:
    return False
  (eqn,) = body.eqns
  if eqn.primitive.name != "max" or eqn.invars[0] is not body.invars[0]:
    return False
  zero = eqn.invars[1]
  return (isinstance(zero, jcore.Literal) and np.ndim(zero.val) == 0
          and same_number(zero.val, 0) and body.outvars == eqn.outvars)


def _relu(p):
  """max(p, +0.0), written out or as jax.nn.relu's nested jit (captured as
  `relu_call`: the kernel calls it as jax.jit would)."""
  return Pat.either(Pat("max", p, Pat.lit(0)),
                    Pat(op_properties.CALLS, p, name="relu_call", where=_relu_call))


def _channel_axis(x, operands):
  """The one axis the per-channel operands vary on (consistent, sized like x's)."""
  axes = set()
  for value in operands:
    shape = value.aval.shape
    if len(shape) != x.aval.ndim:
      return None
    axes.update(i for i, d in enumerate(shape) if d != 1)
  if len(axes) > 1:
    return None
  axis = axes.pop() if axes else x.aval.ndim - 1
  if any(v.aval.shape[axis] not in (1, x.aval.shape[axis]) for v in operands):
    return None
  return axis


def _make(form, with_residual):
  def fuse(r, x, mean, inv, beta, bn, gamma=None, residual=None, with_res=None,
           relu_call=None):
    operands = [mean, inv] + ([gamma] if gamma is not None else []) + [beta]
    out = r.root.outputs[0]
    if not _is_float(x) or out.aval.shape != x.aval.shape:
      return None
    if any(v.aval.dtype != x.aval.dtype for v in operands):
      return None
    if residual is not None and (residual.aval.shape != x.aval.shape
                                 or residual.aval.dtype != x.aval.dtype):
      return None
    axis = _channel_axis(x, operands)
    if axis is None:
      return None
    op = "BatchNormAddRelu" if with_residual else "BatchNormRelu"
    inputs = [x] + operands + ([residual] if with_residual else [])
    params = {"form": form, "channel_axis": axis, "beta_first": first(bn, beta)}
    if with_residual:
      params["residual_first"] = first(with_res, residual)
    if relu_call is not None:
      params["relu_call"] = (relu_call.producer.prim, relu_call.producer.params)
    return r.fused(op, inputs, params, out.aval,
                   f"fused inference BatchNorm ({form}){' + Add' if with_residual else ''}"
                   f" + ReLU over channel axis {axis}")
  fuse.__name__ = f"fuse_bn_{form}{'_add' if with_residual else ''}_relu"
  return fuse


BN_RELU_RULES = (
    [Rule(_relu(Pat("add", pat, Pat.var("residual"), name="with_res")), _make(form, True))
     for form, pat in BN_FORMS.items()] +
    [Rule(_relu(pat), _make(form, False)) for form, pat in BN_FORMS.items()])


class FuseBatchNormRelu(RewritePass):
  """HardwareOptimize: BatchNorm (+ residual) + ReLU -> one node (module docstring)."""
  name = "fuse_bn_relu"
  rules = BN_RELU_RULES
