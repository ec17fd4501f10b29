"""Fuzz programs, part 3: the forms outside judges found wrong bits in (see
fuzz_test.py): nested jits with constant arguments and closed-over constant
subexpressions, host integer chains over every host kernel, bucketed
programs with reductions in every dtype, and weak/strong scalar flips."""
import functools

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from fuzz_programs import COLS, CONST, ROWS
from host_kernels_test import INTS, _host, _made_on_host, _values

F32 = jnp.float32
PRIOR = np.abs(CONST) + np.float32(0.1)  # a closed-over positive array


# -- nested jits with constant arguments, constant subexpressions -----------------------
@functools.partial(jax.jit, static_argnums=2)
def _nested_static(x, c, k):
  return x * c + jnp.sin(c) * k


@jax.jit
def _nested(a, c):
  return a / c.sum() + jnp.tanh(c)


def _scan_with_const(x, key=None):
  def body(carry, row):
    return carry + jax.jit(lambda r, c: r * c)(row, 0.75), carry.sum()
  return lax.scan(body, jnp.zeros(COLS, F32), x)[0] + x


CONST_OPS = {  # x (ROWS, COLS) f32, k a key -> (ROWS, COLS) f32
    "prior_norm": lambda x, k: x * (PRIOR / PRIOR.sum()),
    "div_by_sum": lambda x, k: x / CONST.sum(),
    "linspace_mean": lambda x, k: x * jnp.linspace(.1, 1, COLS).mean(),
    "minus_col_mean": lambda x, k: x - CONST.mean(0),
    "div_by_max": lambda x, k: x / jnp.max(jnp.abs(CONST)),
    "exp_decay": lambda x, k: x * jnp.exp(-jnp.arange(COLS) / 3.0),
    "nested_float": lambda x, k: jax.jit(lambda a, c: a * c + jnp.sin(c))(x, 2.5),
    "nested_static": lambda x, k: _nested_static(x, 0.3, 3),
    "scan_nested_const": _scan_with_const,
    "tanh": lambda x, k: jnp.tanh(x), "mul_x": lambda x, k: x * x,
    "gamma": lambda x, k: x + jax.random.gamma(k, 2.5, x.shape),
    "beta": lambda x, k: x * jax.random.beta(k, 2.0, 3.0, x.shape),
    "dirichlet": lambda x, k: x + jax.random.dirichlet(k, jnp.full(COLS, 1.5), (ROWS,)),
    "student_t": lambda x, k: x - jax.random.t(k, 3.0, x.shape),
    "loggamma": lambda x, k: x + jax.random.loggamma(k, 0.7, x.shape),
    "chisquare": lambda x, k: x * jax.random.chisquare(k, 4.0, x.shape),
    "wald": lambda x, k: x + jax.random.wald(k, 1.5, x.shape),
    "norm_const": lambda x, k: x @ (CONST.T @ CONST / jnp.linalg.norm(CONST)),
    "nested_array": lambda x, k: _nested(x, jnp.asarray(PRIOR)),
    "nested_closed": lambda x, k: _nested(x, PRIOR),
    "row_softmax_const": lambda x, k: x + jax.nn.softmax(CONST, -1),
    "f": lambda x, k: x + jax.random.f(k, 3.0, 4.0, x.shape),
    "generalized_normal": lambda x, k: x + jax.random.generalized_normal(k, 1.5, x.shape),
}

def make_const_program(rng, n_ops=4):
  """fn(x, key): a chain of ops drawn from CONST_OPS (each step's key split)."""
  recipe = [str(rng.choice(list(CONST_OPS))) for _ in range(n_ops)]

  def program(x, key):
    for i, name in enumerate(recipe):
      x = CONST_OPS[name](x, jax.random.fold_in(key, i))
    return x
  return recipe, program


# -- host integer chains ---------------------------------------------------------------
_BINARY = {"add": lax.add, "sub": lax.sub, "mul": lax.mul, "max": lax.max, "min": lax.min,
           "and": lax.bitwise_and, "or": lax.bitwise_or, "xor": lax.bitwise_xor}
_COMPARE = {"eq": lax.eq, "ne": lax.ne, "lt": lax.lt, "le": lax.le, "gt": lax.gt,
            "ge": lax.ge}


def _factor(size, rng):
  """A random shape of `size` elements."""
  dims, left = [], size
  for p in (2, 3, 5, 7):
    while left % p == 0 and rng.random() < 0.7:
      dims.append(p)
      left //= p
  dims.append(left)
  rng.shuffle(dims)
  return tuple(int(d) for d in dims if d != 1 or rng.random() < 0.2) or (size,)


def make_int_chain(rng, n_ops=8):
  """A recipe of host integer ops, each step on the chain's value, and
  fn(seed): every operand made by a callback from the seed, the result read
  by a callback (so the whole chain runs on the host through numpy)."""
  shape, dtype = _factor(int(rng.choice([6, 12, 24, 30])), rng), str(rng.choice(INTS))
  recipe = [("start", shape, dtype)]
  for _ in range(n_ops):
    kind = str(rng.choice(["binary", "compare", "neg", "not", "convert", "select_n",
                           "reshape", "broadcast", "squeeze", "concatenate"]))
    size = int(np.prod(shape))
    if kind in ("binary", "compare"):
      recipe.append((kind, str(rng.choice(list(_BINARY if kind == "binary" else _COMPARE)))))
      if kind == "compare":
        dtype = "bool"
    elif kind == "convert":
      dtype = str(rng.choice(INTS + ("bool",)))
      recipe.append((kind, dtype))
    elif kind == "select_n":
      recipe.append((kind, int(rng.choice([2, 3, 66]))))
    elif kind == "reshape":
      new = _factor(size, rng)
      recipe.append((kind, new, tuple(rng.permutation(len(shape)).tolist())))
      shape = new
    elif kind == "broadcast" and size <= 256:
      lead = int(rng.integers(1, 3))
      recipe.append((kind, lead))
      shape = (lead,) + shape
    elif kind == "squeeze" and 1 in shape:
      recipe.append((kind, shape.index(1)))
      shape = shape[:shape.index(1)] + shape[shape.index(1) + 1:]
    elif kind == "concatenate" and size <= 256:
      axis = int(rng.integers(len(shape)))
      recipe.append((kind, axis))
      shape = shape[:axis] + (shape[axis] * 2,) + shape[axis + 1:]
    elif kind in ("neg", "not") and dtype != "bool":
      recipe.append((kind,))
  recipe.append(("end", shape, dtype))

  def program(seed):
    fresh = iter(range(1000))
    def operand(like, top=None):
      return _made_on_host(seed, (next(fresh),), np.zeros(like.shape, like.dtype), top)
    _, shape0, dtype0 = recipe[0]
    v = operand(np.zeros(shape0, dtype0))
    for step in recipe[1:-1]:
      kind = step[0]
      if kind in ("binary", "compare"):
        op = (_BINARY if kind == "binary" else _COMPARE)[step[1]]
        if v.dtype == jnp.bool_ and step[1] in ("add", "sub", "mul"):
          op = lax.bitwise_xor  # no arithmetic on bool: an op that takes it
        v = op(v, operand(v))
      elif kind == "neg":
        v = lax.neg(v)
      elif kind == "not":
        v = lax.bitwise_not(v)
      elif kind == "convert":
        v = lax.convert_element_type(v, np.dtype(step[1]))
      elif kind == "select_n":
        n = step[1]
        which = operand(np.zeros(v.shape, np.int32), top=n)
        v = lax.select_n(which, v, *[operand(v) for _ in range(n - 1)])
      elif kind == "reshape":
        v = lax.reshape(v, step[1], step[2])
      elif kind == "broadcast":
        v = lax.broadcast_in_dim(v, (step[1],) + v.shape, tuple(range(1, v.ndim + 1)))
      elif kind == "squeeze":
        v = lax.squeeze(v, (step[1],))
      elif kind == "concatenate":
        v = lax.concatenate([v, operand(v)], step[1])
    return _host(v)
  return recipe, program


# -- bucketed programs with reductions, every dtype ---------------------------------------
BUCKET_DTYPES = ("float32", "bfloat16", "float16", "int32", "int8", "uint8", "bool")
ROW_OPS = {  # x (n, COLS) -> (n, ...): rows never mix
    "double": lambda x: x + x, "sum": lambda x: x.sum(1), "max": lambda x: x.max(1),
    "min_keep": lambda x: x - x.min(1, keepdims=True) if x.dtype != jnp.bool_ else x,
    "cumsum": lambda x: jnp.cumsum(x, 1), "argmax": lambda x: jnp.argmax(x, 1),
    "where": lambda x: jnp.where(x > 0, x, -x) if x.dtype != jnp.bool_ else ~x,
    "f32_mean": lambda x: x.astype(F32).mean(1), "transpose_rows": lambda x: x[:, ::-1],
    "outer": lambda x: x[:, :, None] * x[:, None, :3],
}


def make_bucket_program(rng, n_ops=3):
  dtype = str(rng.choice(BUCKET_DTYPES))
  recipe = [str(rng.choice(list(ROW_OPS))) for _ in range(n_ops)]

  def program(x):
    return tuple(ROW_OPS[name](x) for name in recipe)
  return dtype, recipe, program


def bucket_rows(rng, n, dtype):
  if dtype in ("float32", "bfloat16", "float16"):
    x = rng.standard_normal((n, COLS)).astype(np.float32)
    if n >= 2:
      x[0, 0], x[1, 1] = -0.0, np.inf
    return jnp.asarray(x, dtype)
  return jnp.asarray(_values(rng, (n, COLS), dtype))


def float_reduction(recipe, dtype):
  """Whether a padded run may round otherwise than the exact-shape jax.jit
  (docs/numerics.md: XLA reduces a small exact shape in another order)."""
  floats = dtype in ("float32", "bfloat16", "float16")
  return "f32_mean" in recipe or (floats and bool({"sum", "cumsum"} & set(recipe)))
