"""XLA kernels of the fused ops that the fusion passes create. Each repeats the
arithmetic of the subgraph it replaces - the same primitives, on the same
dtype, with the user's literals, association and add operand order, as the
fusion pass recorded them in the node's params - so on CPU its result is
bit-identical to the unfused graph and to jax.jit (tests/fusion_test.py
compares bits). Operand order matters where an add meets a product: XLA on
CPU contracts a*b + c into a fused multiply-add, the first product first.

Reductions go through `lax.reduce` (reduce_sum / reduce_max on the input's own
dtype): jnp.sum would accumulate float16 in float32, which the user's graph
did not do. Constants are made in the input's dtype, never left to promotion.

The arithmetic lives in `*_math` functions over plain arrays, which the Pallas
kernels (kernels/pallas.py) run on their blocks too: one formula, two kernels."""
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
import numpy as np

from jaxsession.graph import op_properties
from jaxsession.kernels.registry import register_kernel


def match_avals(node, outs):
  """The kernel's outputs with the node's weak types: a literal made strong in
  the kernel must not turn a weak result strong (it promotes differently)."""
  fixed = []
  for value, out in zip(node.outputs, outs):
    weak = getattr(value.aval, "weak_type", False)
    if getattr(jax.typeof(out), "weak_type", False) != weak:
      out = lax.convert_element_type_p.bind(out, new_dtype=np.dtype(value.aval.dtype),
                                            weak_type=weak, sharding=None)
    fixed.append(out)
  return fixed


FUSED_OPS = []  # every fused op declared below, in order


def fused_kernel(op, name, **facts):
  """Registers fn(node, *args) -> list as the XLA kernel of fused op `op`,
  and `facts` (op_properties.OpFacts fields) as the op's entry in the op
  table: a fused op is declared once, here."""
  op_properties.register_op(op, **facts)
  FUSED_OPS.append(op)

  def register(fn):
    def kernel(node, *args):
      return match_avals(node, fn(node, *args))
    kernel.__name__ = fn.__name__
    register_kernel(op, backend="xla", name=name)(kernel)
    return fn
  return register


def _const(value, like):
  """A scalar literal recorded by a fusion pass, in the dtype of `like`."""
  return jnp.asarray(value, like.dtype)


def _add(a, b, a_first):
  """a + b in the user's operand order (it decides which product an FMA takes)."""
  a, b = jnp.broadcast_arrays(a, b)
  return a + b if a_first else b + a


def _sum(x, axes):
  """reduce_sum over `axes` in x's own dtype, keeping the reduced axes."""
  return lax.expand_dims(lax.reduce(x, np.array(0, x.dtype), lax.add, tuple(axes)), axes)


def _max(x, axes):
  return lax.expand_dims(lax.reduce(x, np.array(-np.inf, x.dtype), lax.max, tuple(axes)), axes)


def softmax_math(x, axes):
  e = lax.exp(x - _max(x, axes))
  return e / _sum(e, axes)


@fused_kernel("Softmax", "xla:softmax", batch="rows")
def softmax(node, x):
  return [softmax_math(x, node.params["axes"])]


def gelu_tanh_math(x, p):
  """The user's tanh-GELU: their literals, their cube, their association."""
  cube = lax.integer_pow(x, 3) if p["cube"] == "pow" else x * (x * x)
  inner = _add(x, _const(p["c2"], x) * cube, p["x_first"])
  t = _const(p["one"], x) + lax.tanh(_const(p["c1"], x) * inner)
  half = _const(p["half"], x)
  if p["form"] == "x_half_t":
    return x * (half * t)        # jax.nn.gelu
  if p["form"] == "half_x_t":
    return (half * x) * t        # 0.5 * x * (1 + tanh(...))
  return half * (x * t)          # 0.5 * (x * (1 + tanh(...)))


@fused_kernel("GeluTanh", "xla:gelu_tanh", elementwise=True)
def gelu_tanh(node, x):
  return [gelu_tanh_math(x, node.params)]


@fused_kernel("MatMulBiasAdd", "xla:matmul_bias_add", batch="matmul_bias_add", reduces=True,
              contracts=(0, 1))
def matmul_bias_add(node, a, w, bias):
  y = lax.dot_general_p.bind(a, w, **dict(node.params["dot"]))  # the user's dot as written
  return [_add(bias, y, node.params["bias_first"])]


def add_n_math(xs, steps):
  """The user's tree of adds: step k adds slots i and j (slots are the
  inputs, then the steps' sums), in the user's association and order."""
  slots = list(xs)
  for i, j in steps:
    slots.append(lax.add(slots[i], slots[j]))
  return slots[-1]


@fused_kernel("AddN", "xla:add_n", elementwise=True)
def add_n(node, *xs):
  return [add_n_math(xs, node.params["steps"])]


def _mean(total, how):
  """total / n or total * (1/n), as the user wrote the mean."""
  op, literal = how
  return total / _const(literal, total) if op == "div" else total * _const(literal, total)


def _normalise(centered, var, p, scale):
  """centered * rsqrt(var + eps), or centered / sqrt(var + eps), with the scale
  multiplying the inverse first (flax) or the result (by hand)."""
  var_eps = var + _const(p["eps"], var)
  if p["inverse"] == "div_sqrt":
    y = centered / lax.sqrt(var_eps)
  elif p["scale"] == "inside":
    return centered * (lax.rsqrt(var_eps) * scale[0])
  else:
    y = centered * lax.rsqrt(var_eps)
  return y * scale[0] if p["scale"] == "after" else y


def layer_norm_math(x, p, axes, scale_bias):
  scale_bias = list(scale_bias)
  mean = _mean(_sum(x, axes), p["mean"])
  centered = x - mean
  if p["variance"] == "two_pass":
    var = _mean(_sum(centered * centered, axes), p["var_mean"])
  else:
    var = _mean(_sum(x * x, axes), p["var_mean"]) - mean * mean
    if p["variance"] == "fast_clamped":
      var = lax.max(jnp.zeros_like(var), var)
  scale = scale_bias[:1] if p["scale"] else []
  y = _normalise(centered, var, p, scale)
  if not p["bias"]:
    return y
  return _add(scale_bias[-1], y, p["bias"] == "first")


@fused_kernel("LayerNorm", "xla:layer_norm", batch="rows")
def layer_norm(node, x, *scale_bias):
  return [layer_norm_math(x, node.params, node.params["axes"], scale_bias)]


def rms_norm_math(x, p, axes, scale):
  ms = _mean(_sum(x * x, axes), p["var_mean"])
  return _normalise(x, ms, p, list(scale))


@fused_kernel("RMSNorm", "xla:rms_norm", batch="rows")
def rms_norm(node, x, *scale):
  return [rms_norm_math(x, node.params, node.params["axes"], scale)]


def _batch_norm(p, x, mean, inv, *rest):
  """The user's own BatchNorm arithmetic, on operands already at x's rank."""
  if p["form"] == "scale_after":
    (gamma, beta), rest = rest[:2], rest[2:]
    y = (x - mean) * inv * gamma
  elif p["form"] == "scale_folded":
    (gamma, beta), rest = rest[:2], rest[2:]
    y = (x - mean) * (inv * gamma)
  else:
    (beta,), rest = rest[:1], rest[1:]
    y = (x - mean) * inv
  return _add(beta, y, p["beta_first"]), rest


def _relu(y, params):
  """max(y, +0.0), the only relu the pattern takes; jax.nn.relu's as the
  nested jit it is (params["relu_call"]: that call's primitive and params)."""
  call = params.get("relu_call")
  if call is not None:  # bound as kernels/xla.py binds a primitive node
    prim, call_params = call
    return prim.bind(y, **prim.get_bind_params(call_params))[0]
  return lax.max(y, jnp.zeros_like(y))


@fused_kernel("BatchNormRelu", "xla:batch_norm_relu", elementwise=True)
def batch_norm_relu(node, x, *operands):
  y, _ = _batch_norm(node.params, x, *operands)
  return [_relu(y, node.params)]


@fused_kernel("BatchNormAddRelu", "xla:batch_norm_add_relu", elementwise=True)
def batch_norm_add_relu(node, x, *operands):
  y, (residual,) = _batch_norm(node.params, x, *operands)
  return [_relu(_add(residual, y, node.params["residual_first"]), node.params)]


@fused_kernel("Adam", "xla:adam", elementwise=True)
def adam(node, p, g, m, v, *scalars):
  return list(adam_math(node.params, p, g, m, v, scalars))


def adam_math(k, p, g, m, v, scalars):
  """One parameter's Adam/AdamW step, in the arithmetic order of the form
  it was fused from; returns (new param, new m, new v)."""
  lit = lambda name: _const(k[name], p)
  m_new = _add(lit("b1") * m, lit("c1") * g, k["m_decay_first"])
  g2 = lit("c2") * (g * g) if k["v_form"] == "c2_g2" else lit("c2") * g * g
  v_new = _add(lit("b2") * v, g2, k["v_decay_first"])
  if k["form"] == "scaled_step":
    (step,) = scalars
    return p - step * m_new / (lax.sqrt(v_new) + lit("eps")), m_new, v_new
  bc1, bc2 = scalars
  v_hat = v_new / bc2
  if "eps_root" in k:
    v_hat = v_hat + lit("eps_root")  # optax's eps_root, 0.0 by default: kept as written
  u = (m_new / bc1) / (lax.sqrt(v_hat) + lit("eps"))
  if k["form"] == "optax_adamw":
    u = _add(u, lit("wd") * p, k["u_first"])
  return _add(p, lit("neg_lr") * u, k["p_first"]), m_new, v_new


# -- the all-reduce plan's ops (runtime/allreduce.py) ---------------------------------
# They exist only under a mesh, after the batch-axis analysis: no batch rule.
# the primitives a dp_partial may compute (the all-reduce plan picks only these)
PARTIAL_PRIMITIVES = {"reduce_sum": lax.reduce_sum_p, "dot_general": lax.dot_general_p}


def _constrain(x, sharding):
  return x if sharding is None else lax.with_sharding_constraint(x, sharding)


@fused_kernel("dp_partial", "xla:dp_partial")
def dp_partial(node, *operands):
  """The node's reduction computed per device on its own rows: each split
  operand axis becomes [devices, rows per device] and the primitive is
  vmapped over the devices; [devices, *S], laid out one partial per device."""
  p = node.params
  devices = p["devices"]
  prim, params = PARTIAL_PRIMITIVES[p["reduces"]], dict(p["params"])
  split, in_axes = [], []
  for x, axis in zip(operands, p["split"]):
    if axis is not None:
      axis = int(axis)  # the batch rules may hand a numpy int; vmap takes only ints
      shape = tuple(np.shape(x))
      x = lax.reshape(x, shape[:axis] + (devices, shape[axis] // devices) + shape[axis + 1:])
    split.append(x)
    in_axes.append(axis)
  out = jax.vmap(lambda *ops: prim.bind(*ops, **params), in_axes=in_axes)(*split)
  return [_constrain(out, node.outputs[0].sharding)]


@fused_kernel("dp_reduce_scatter", "xla:dp_reduce_scatter")
def dp_reduce_scatter(node, partial):
  """The per-device partials ([devices, *S], one on each device) summed
  over the devices, each device keeping only its shard of axis `dim` - one
  reduce-scatter (shard_map's psum_scatter: GSPMD would all-reduce and
  slice) - laid out as the state leaf it is for."""
  p = node.params
  sharding = node.outputs[0].sharding
  axis, dim = p["mesh_axis"], int(p["dim"])

  def body(x):
    return lax.psum_scatter(x[0], axis, scatter_dimension=dim, tiled=True)
  return [jax.shard_map(body, mesh=sharding.mesh, in_specs=P(axis),
                        out_specs=sharding.spec)(partial)]


@fused_kernel("allreduce_bucket", "xla:allreduce_bucket")
def allreduce_bucket(node, *partials):
  """Every partial flattened to [devices, n_i], concatenated, summed over the
  devices (one all-reduce under GSPMD), then split back into the values."""
  devices = node.params["devices"]
  flat = [lax.reshape(x, (devices, n)) for x, n in zip(partials, node.params["sizes"])]
  stacked = flat[0] if len(flat) == 1 else lax.concatenate(flat, 1)
  stacked = _constrain(stacked, node.inputs[0].sharding)
  total = lax.reduce(stacked, np.array(0, stacked.dtype), lax.add, (0,))
  total = _constrain(total, node.outputs[0].sharding)
  outs, start = [], 0
  for value, n in zip(node.outputs, node.params["sizes"]):
    outs.append(lax.reshape(lax.slice(total, (start,), (start + n,)), tuple(value.aval.shape)))
    start += n
  return outs
