"""Pallas kernels for the fused ops that pay on GPU: Softmax, LayerNorm,
RMSNorm (row-wise over the last axis) and Adam (element-wise). Selected only on
the "gpu" platform, ahead of the XLA kernels; each refuses shapes it cannot
tile (a Triton block is a power of two), and the XLA kernel takes those.

The block bodies run the same `*_math` functions as the XLA kernels. The tests
run every kernel on the CPU with `interpret=True` against its XLA twin: Softmax,
LayerNorm and RMSNorm are bit-identical there at the tested shapes (up to 24
rows; a block holds 8), but not at every shape - XLA:CPU reduces the rows of
the twin's whole input in an order that follows its shape, so at 64 rows of
64-256 they were 3-6 ulps apart (LayerNorm: 1.4e-6 absolute, many ulps near
its zeros; `benchmarks/kernels.py`); Adam's new moments are, and its
new parameter is within 2*(ulp(u) + ulp(p_new)), u the step it subtracts (the
interpreted loop body recomputes m_new and contracts the other product into
the multiply-add). On a GPU, Triton's own reduction order and contractions
apply, which no CPU test can see: the fused node's note says so when one of
these kernels is chosen, and equality with the unfused graph there is not
claimed.
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxsession.kernels import fused
from jaxsession.kernels.registry import register_kernel

FLOATS = ("float32", "float16", "bfloat16")
MAX_ROW = 1 << 14   # one row must fit a block
ROW_BLOCK = 8       # rows per program when the row count allows it
ELEMENT_BLOCK = 1024


def _pow2(n):
  return n > 0 and n & (n - 1) == 0


def rows_fit(node):
  """None if the node normalises over the last axis with a tileable row."""
  x = node.inputs[0].aval
  if tuple(node.params["axes"]) != (x.ndim - 1,):
    return f"axes {node.params['axes']} are not just the last axis"
  if not _pow2(x.shape[-1]) or x.shape[-1] > MAX_ROW:
    return f"row length {x.shape[-1]} is not a power of two <= {MAX_ROW}"
  return None


def elements_fit(node):
  size = node.inputs[0].aval.size
  if size % _element_block(size):
    return f"{size} elements do not split into power-of-two blocks"
  return None


def _element_block(size):
  block = ELEMENT_BLOCK
  while block > 32 and size % block:
    block //= 2
  return block


def _row_call(body, x, vectors, interpret):
  """Runs body(x_block, *vector_blocks) over row blocks of x viewed (rows, n)."""
  n = x.shape[-1]
  rows = x.size // n
  block = ROW_BLOCK if rows % ROW_BLOCK == 0 else 1
  row_spec = pl.BlockSpec((block, n), lambda i: (i, 0))
  vec_spec = pl.BlockSpec((1, n), lambda i: (0, 0))

  def kernel(x_ref, *refs):
    *vec_refs, o_ref = refs
    o_ref[...] = body(x_ref[...], *[r[...] for r in vec_refs]).astype(o_ref.dtype)

  out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((rows, n), x.dtype),
                       grid=(rows // block,), in_specs=[row_spec] + [vec_spec] * len(vectors),
                       out_specs=row_spec, interpret=interpret)(
                           x.reshape(rows, n), *[v.reshape(1, n) for v in vectors])
  return out.reshape(x.shape)


def softmax(node, x, interpret=False):
  return [_row_call(lambda xb: fused.softmax_math(xb, (1,)), x, [], interpret)]


def layer_norm(node, x, *scale_bias, interpret=False):
  body = lambda xb, *vb: fused.layer_norm_math(xb, node.params, (1,), vb)
  return [_row_call(body, x, list(scale_bias), interpret)]


def rms_norm(node, x, *scale, interpret=False):
  body = lambda xb, *vb: fused.rms_norm_math(xb, node.params, (1,), vb)
  return [_row_call(body, x, list(scale), interpret)]


def adam(node, p, g, m, v, *scalars, interpret=False):
  size = p.size
  block = _element_block(size)
  spec = pl.BlockSpec((block,), lambda i: (i,))
  scalar_spec = pl.BlockSpec((1,), lambda i: (0,))

  def kernel(p_ref, g_ref, m_ref, v_ref, *refs):
    scalar_refs, (po, mo, vo) = refs[:len(scalars)], refs[len(scalars):]
    new = fused.adam_math(node.params, p_ref[...], g_ref[...], m_ref[...], v_ref[...],
                          [r[...] for r in scalar_refs])
    for ref, value in zip((po, mo, vo), new):
      ref[...] = value.astype(ref.dtype)

  shape = jax.ShapeDtypeStruct((size,), p.dtype)
  outs = pl.pallas_call(kernel, out_shape=(shape, shape, shape), grid=(size // block,),
                        in_specs=[spec] * 4 + [scalar_spec] * len(scalars),
                        out_specs=(spec, spec, spec), interpret=interpret)(
                            *[a.reshape(size) for a in (p, g, m, v)],
                            *[jnp.reshape(s, (1,)) for s in scalars])
  return [o.reshape(p.shape) for o in outs]


def _register(op, fn, accepts):
  def kernel(node, *args):
    return fused.match_avals(node, fn(node, *args))
  kernel.__name__ = fn.__name__
  register_kernel(op, backend="pallas", platforms=("gpu",), dtypes=None, priority=10,
                  name=f"pallas:{fn.__name__}", accepts=_floats_and(accepts))(kernel)


def _floats_and(accepts):
  def check(node):
    for i, value in enumerate(node.inputs[:1]):
      if str(value.aval.dtype) not in FLOATS:
        return f"input {i} dtype {value.aval.dtype} not in {list(FLOATS)}"
    return accepts(node)
  return check


_register("Softmax", softmax, rows_fit)
_register("LayerNorm", layer_norm, rows_fit)
_register("RMSNorm", rms_norm, rows_fit)
_register("Adam", adam, elements_fit)

INTERPRETED = {op: functools.partial(fn, interpret=True) for op, fn in
               (("Softmax", softmax), ("LayerNorm", layer_norm), ("RMSNorm", rms_norm),
                ("Adam", adam))}
