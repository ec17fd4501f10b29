"""Every host kernel honours every parameter of its primitive: a rule table.

Each op the table marks `host` (op_properties.ops_with(host=True)) has a
generator of random cases over its parameter space - dtypes (wrap-around at
the extremes), shapes, and the primitive's own params (reshape's
`dimensions`, broadcast_in_dim's dims, select_n's case count past numpy's 64,
concatenate's axis...). All of an op's cases run as one graph whose integers
are made by a callback and read only by another, so the session runs them on
the host through numpy; the test checks that they did run there, and that
the results equal jax.jit's, bit for bit. An op marked `host` without a row
here fails the coverage test.
"""
from absl.testing import absltest, parameterized
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jaxsession.graph import op_properties

INTS = ("int8", "uint8", "int16", "uint16", "int32", "uint32")
INTS64 = ("int64", "uint64")
CASES_PER_OP = 6


def _values(rng, shape, dtype):
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return rng.integers(0, 2, shape).astype(bool)
  info = np.iinfo(dtype)
  out = rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)
  flat = out.reshape(-1)
  if flat.size:  # the extremes and zero, where wrap-around shows
    picks = rng.integers(0, flat.size, 3)
    flat[picks] = [info.min, info.max, 0][:len(picks)]
  return out


def _shape(rng, rank=None, ones=0.25):
  rank = int(rng.integers(0, 4)) if rank is None else rank
  return tuple(1 if rng.random() < ones else int(rng.integers(2, 5)) for _ in range(rank))


# op -> fn(rng, ints) -> [(fn(*operands) -> result, operands)], one per case
def _binary(prim, kinds="int"):
  def make(rng, ints):
    dtypes = list(ints) + (["bool"] if kinds == "int+bool" else [])
    dtype = dtypes[int(rng.integers(len(dtypes)))]
    shape = _shape(rng)
    return prim, [_values(rng, shape, dtype), _values(rng, shape, dtype)]
  return make


def _unary(prim, kinds="int"):
  def make(rng, ints):
    dtypes = list(ints) + (["bool"] if kinds == "int+bool" else [])
    dtype = dtypes[int(rng.integers(len(dtypes)))]
    return prim, [_values(rng, _shape(rng), dtype)]
  return make


def _convert(rng, ints):
  dtypes = list(ints) + ["bool"]
  src, dst = (dtypes[int(i)] for i in rng.choice(len(dtypes), 2, replace=False))
  return (lambda x: lax.convert_element_type(x, np.dtype(dst))), [_values(rng, _shape(rng), src)]


def _select_n(rng, ints):
  n = int(rng.choice([1, 2, 3, 65, 100]))
  shape = _shape(rng)
  dtype = ints[int(rng.integers(len(ints)))]
  cases = [_values(rng, shape, dtype) for _ in range(n)]
  which_shape = () if rng.random() < 0.3 else shape
  if n <= 2 and rng.random() < 0.5:
    which = rng.integers(0, n, which_shape).astype(bool) if n == 2 else np.zeros(which_shape, bool)
  else:
    which = rng.integers(0, n, which_shape).astype(np.int32)
  return (lambda w, *cs: lax.select_n(w, *cs)), [which, *cases]


def _broadcast_in_dim(rng, ints):
  out_shape = _shape(rng, rank=int(rng.integers(1, 4)), ones=0.1)
  dims = tuple(sorted(rng.choice(len(out_shape), int(rng.integers(0, len(out_shape) + 1)),
                                 replace=False).tolist()))
  in_shape = tuple(1 if rng.random() < 0.4 else out_shape[d] for d in dims)
  dtype = ints[int(rng.integers(len(ints)))]
  return ((lambda x: lax.broadcast_in_dim(x, out_shape, dims)),
          [_values(rng, in_shape, dtype)])


def _reshape(rng, ints):
  while True:  # a case that is not the identity (lax drops those)
    shape = _shape(rng, rank=int(rng.integers(1, 4)), ones=0.1)
    size = int(np.prod(shape))
    new = [size] if rng.random() < 0.3 else [int(n) for n in rng.permutation(list(shape))]
    if len(new) > 1 and rng.random() < 0.5:
      new = [new[0] * new[1]] + new[2:]
    if rng.random() < 0.3:
      new = new + [1]
    dims = None if rng.random() < 0.3 else tuple(rng.permutation(len(shape)).tolist())
    if tuple(new) != shape or (dims is not None and dims != tuple(range(len(shape)))):
      break
  dtype = ints[int(rng.integers(len(ints)))]
  return (lambda x: lax.reshape(x, tuple(new), dims)), [_values(rng, shape, dtype)]


def _squeeze(rng, ints):
  shape = list(_shape(rng, rank=int(rng.integers(1, 4)), ones=0.5))
  shape[int(rng.integers(len(shape)))] = 1  # at least one dimension to squeeze
  ones = [i for i, n in enumerate(shape) if n == 1]
  dims = tuple(sorted(rng.choice(ones, int(rng.integers(1, len(ones) + 1)),
                                 replace=False).tolist()))
  dtype = ints[int(rng.integers(len(ints)))]
  return (lambda x: lax.squeeze(x, dims)), [_values(rng, tuple(shape), dtype)]


def _concatenate(rng, ints):
  shape = _shape(rng, rank=int(rng.integers(1, 4)), ones=0.2)
  axis = int(rng.integers(len(shape)))
  k = int(rng.integers(1, 5))
  dtype = (list(ints) + ["bool"])[int(rng.integers(len(ints) + 1))]
  xs = []
  for _ in range(k):
    s = list(shape)
    s[axis] = int(rng.integers(0, 4))
    xs.append(_values(rng, tuple(s), dtype))
  return (lambda *xs: lax.concatenate(xs, axis)), xs


RULES = {
    "add": _binary(lax.add), "sub": _binary(lax.sub), "mul": _binary(lax.mul),
    "neg": _unary(lax.neg), "max": _binary(lax.max, "int+bool"),
    "min": _binary(lax.min, "int+bool"),
    "and": _binary(lax.bitwise_and, "int+bool"), "or": _binary(lax.bitwise_or, "int+bool"),
    "xor": _binary(lax.bitwise_xor, "int+bool"), "not": _unary(lax.bitwise_not, "int+bool"),
    "eq": _binary(lax.eq, "int+bool"), "ne": _binary(lax.ne, "int+bool"),
    "lt": _binary(lax.lt), "le": _binary(lax.le), "gt": _binary(lax.gt), "ge": _binary(lax.ge),
    "convert_element_type": _convert, "select_n": _select_n,
    "broadcast_in_dim": _broadcast_in_dim, "reshape": _reshape, "squeeze": _squeeze,
    "concatenate": _concatenate,
}


def _host(x):
  """An identity callback: its result is a host value (numpy)."""
  return jax.pure_callback(lambda a: np.asarray(a), jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def _program(cases):
  """fn(*all operands) -> every case's result, each case's operands made on
  the host by a callback and its result read only by another callback."""
  def fn(*flat):
    outs, i = [], 0
    for prim, operands in cases:
      ins = [_host(x) for x in flat[i:i + len(operands)]]
      i += len(operands)
      outs.append(_host(prim(*ins)))
    return outs
  return fn


class HostKernelRulesTest(parameterized.TestCase):

  def test_every_host_op_has_a_rule(self):
    self.assertEqual(sorted(op_properties.ops_with(host=True)), sorted(RULES))

  def check(self, op, ints, seed):
    rng = np.random.default_rng(seed)
    cases = [RULES[op](rng, ints) for _ in range(CASES_PER_OP)]
    flat = [jnp.asarray(x) for _, operands in cases for x in operands]
    fn = _program(cases)
    sess = js.Session()
    gid = sess.compile(fn, *flat)
    # (a case lax or the session's no-op pass makes the identity has no node)
    placed = [n.kernel.name for n in sess.graph(gid).nodes if n.op == op]
    self.assertGreaterEqual(len(placed), CASES_PER_OP // 2)
    self.assertEqual(set(placed), {f"host:{op}"})  # numpy ran them, not XLA
    # fresh operands of the same types for the run itself
    rng2 = np.random.default_rng(seed + 1)
    run_args = []
    for _, operands in cases:
      for x in operands:
        if op == "select_n" and x is operands[0]:
          n = len(operands) - 1
          top = n if x.dtype != bool else min(n, 2)
          run_args.append(jnp.asarray(rng2.integers(0, top, x.shape).astype(x.dtype)))
        else:
          run_args.append(jnp.asarray(_values(rng2, x.shape, x.dtype)))
    got, want = sess.run(gid, *run_args), jax.jit(fn)(*run_args)
    for k, (g, w) in enumerate(zip(got, want)):
      self.assertEqual((g.dtype, g.shape), (w.dtype, w.shape), f"{op} case {k}")
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{op} case {k}")

  @parameterized.named_parameters((op, op) for op in sorted(RULES))
  def test_rule(self, op):
    self.check(op, INTS, seed=sorted(RULES).index(op))

  @parameterized.named_parameters((op, op) for op in sorted(RULES))
  def test_rule_x64(self, op):
    with jax.enable_x64(True):
      self.check(op, INTS64, seed=100 + sorted(RULES).index(op))


if __name__ == "__main__":
  absltest.main()
