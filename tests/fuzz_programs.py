"""Fuzz programs, part 1: bit-for-bit comparison, random inputs with special
values, and the generators of stateless and callback programs (see fuzz_test.py)."""
import jax
from jax import lax
from jax.experimental import io_callback
import jax.numpy as jnp
import numpy as np


ROWS, COLS = 4, 8
F32 = jnp.float32


# -- comparing bit for bit ---------------------------------------------------------
def _is_key(x):
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _host(x):
  """A leaf as numpy (typed keys as their key data)."""
  return np.asarray(jax.random.key_data(x) if _is_key(x) else x)


def assert_bits_equal(got, want, err_msg):
  """Same pytree, shapes, dtypes and weak types, and every element the same
  bits: -0.0 is not 0.0, and a NaN must carry the same sign and payload."""
  got_leaves, got_tree = jax.tree.flatten(got, is_leaf=lambda x: x is None)
  want_leaves, want_tree = jax.tree.flatten(want, is_leaf=lambda x: x is None)
  if got_tree != want_tree:
    raise AssertionError(f"pytree {got_tree} != {want_tree}\n{err_msg}")
  for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
    where = f"output leaf {i}: {err_msg}"
    if g is None or w is None:
      if not (g is None and w is None):
        raise AssertionError(f"{g!r} vs {w!r}\n{where}")
      continue
    if _is_key(g) or _is_key(w):
      if not (_is_key(g) and _is_key(w)) or g.dtype != w.dtype:
        raise AssertionError(f"key dtype {g.dtype} != {w.dtype}\n{where}")
    if getattr(g, "weak_type", False) != getattr(w, "weak_type", False):
      raise AssertionError(f"weak_type {getattr(g, 'weak_type', None)} != "
                           f"{getattr(w, 'weak_type', None)}\n{where}")
    g, w = _host(g), _host(w)
    if g.dtype != w.dtype:
      raise AssertionError(f"dtype {g.dtype} != {w.dtype}\n{where}")
    if g.shape != w.shape:
      raise AssertionError(f"shape {g.shape} != {w.shape}\n{where}")
    if not (np.issubdtype(g.dtype, np.inexact) or g.dtype == jnp.bfloat16):
      np.testing.assert_array_equal(g, w, err_msg=where, strict=True)
      continue
    bits = np.dtype(f"uint{8 * g.dtype.itemsize}")
    differ = g.view(bits) != w.view(bits)
    if differ.any():
      where = f"max ulp (as float32) {max_ulp(g, w)}; {where}"
      np.testing.assert_array_equal(g, w, err_msg=where, strict=True)  # values differ
      # the values are equal: the sign of a zero or a NaN's bits differ
      idx = tuple(int(i) for i in np.argwhere(differ)[0])
      raise AssertionError(f"{int(differ.sum())} element(s) differ in their bits, first "
                           f"at {idx}: {g[idx]!r} ({g.view(bits)[idx]:#x}) vs {w[idx]!r} "
                           f"({w.view(bits)[idx]:#x})\n{where}")


def max_ulp(g, w):
  """Largest distance in units in the last place between finite elements."""
  g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
  ok = np.isfinite(g) & np.isfinite(w)
  if not ok.any():
    return 0
  gi, wi = g.view(np.int32).astype(np.int64), w.view(np.int32).astype(np.int64)
  gi = np.where(gi < 0, -(gi & 0x7FFFFFFF), gi)  # monotone ordering of floats
  wi = np.where(wi < 0, -(wi & 0x7FFFFFFF), wi)
  return int(np.abs(gi - wi)[ok].max())


def split_outputs(out, k, updates):
  """jax.jit's output of a stateful fn as (new state tuple, what run returns)."""
  if not updates:
    return (), out
  rest = tuple(out[k:])
  return tuple(out[:k]), (None if not rest else rest[0] if len(rest) == 1 else rest)


# -- inputs --------------------------------------------------------------------
SPECIALS = np.array([-0.0, 0.0, np.nan, np.inf, -np.inf, 3.0e38, -1.0e30, 65504.0],
                    np.float32)
SUBNORMALS = np.array([1.0e-40, -1.0e-44], np.float32)
SCALARS = [0.5, -1.25, 3.0, 1e-3, -0.0, 1e30, float("inf"), float("nan")]


# Programs with host callbacks get no subnormal inputs: under jax.jit a
# pure_callback's numpy code runs with the CPU in flush-to-zero /
# denormals-are-zero mode (XLA's), a host-placed one between executables does
# not, so np.tanh(1e-40) differs (1e-40 vs 0.0). That difference is pinned by
# test_host_callback_on_subnormals_matches_jit on its own, not by the fuzz.
def random_array(rng, shape, special=False, subnormal=True):
  """Standard normal floats, never all zeros or ones; with `special`, a few
  elements replaced by -0.0, NaN, +-inf, huge and (with `subnormal`) subnormal
  values."""
  x = rng.standard_normal(shape).astype(np.float32)
  if rng.random() < 0.2:
    x *= np.float32(1e4)  # large but finite magnitudes
  if special:
    flat = x.reshape(-1)
    n = max(1, flat.size // 8)
    pool = np.concatenate([SPECIALS, SUBNORMALS]) if subnormal else SPECIALS
    flat[rng.choice(flat.size, n, replace=False)] = rng.choice(pool, n)
  return jnp.asarray(x)


def random_scalar(rng):
  """A weak-typed Python float, now and then inf, NaN, -0.0 or huge."""
  if rng.random() < 0.3:
    return float(rng.choice(SCALARS))
  return float(np.float32(rng.standard_normal() * 2))


# -- the stateless generator -----------------------------------------------------
def _ln(x):
  mu = x.mean(-1, keepdims=True)
  return (x - mu) * lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)


def _ln_div(x):
  mu = jnp.mean(x, -1, keepdims=True)
  var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
  return (x - mu) / jnp.sqrt(var + 1e-6)


def _rms(x):
  return x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


# a constant the programs close over (with -0.0 and a huge value in it)
CONST = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
CONST[0, :2] = [-0.0, 3.0e3]

UNARY = {
    "sin": jnp.sin, "cos": jnp.cos, "tanh": jnp.tanh, "neg": jnp.negative, "abs": jnp.abs,
    "exp_clipped": lambda x: jnp.exp(jnp.clip(x, -4, 4)),
    "sqrt_abs": lambda x: jnp.sqrt(jnp.abs(x)), "relu": jax.nn.relu, "gelu": jax.nn.gelu,
    "gelu_erf": lambda x: jax.nn.gelu(x, approximate=False), "sigmoid": jax.nn.sigmoid,
    "times_one": lambda x: x * 1.0, "plus_zero": lambda x: x + 0.0,
    "minus_zero": lambda x: x - 0.0, "one_times": lambda x: 1.0 * x,
    "double_t": lambda x: x.T.T, "double_neg": lambda x: -(-x),
    "softmax": lambda x: jax.nn.softmax(x, -1), "log_softmax": lambda x: jax.nn.log_softmax(x),
    "square": lambda x: x ** 2, "scale": lambda x: 0.5 * x, "recip": lambda x: 1.0 / x,
    "log1p_abs": lambda x: jnp.log1p(jnp.abs(x)), "floor": jnp.floor, "sign": jnp.sign,
    "leaky": lambda x: jnp.where(x > 0, x, 0.1 * x), "clip": lambda x: jnp.clip(x, -1.0, 2.0),
    "bf16_round": lambda x: x.astype(jnp.bfloat16).astype(F32),
    "layernorm": _ln, "layernorm_div": _ln_div, "rmsnorm": _rms,
    # what simplify and remove_nops rewrite, and what they must leave alone
    "div_one": lambda x: x / 1.0, "pow_one": lambda x: x ** 1,
    "lax_pow_one": lambda x: lax.pow(x, 1.0), "max_neg_inf": lambda x: jnp.maximum(x, -jnp.inf),
    "plus_neg_zero": lambda x: x + (-0.0),
    "f16_round": lambda x: x.astype(jnp.float16).astype(F32),
    "int_round": lambda x: jnp.clip(x, -1e6, 1e6).astype(jnp.int32).astype(F32),
    "reshape_rt": lambda x: x.reshape(COLS, ROWS).reshape(ROWS, COLS),
    "stop_gradient": lax.stop_gradient, "sub_self": lambda x: x - x,
    "mul_zero": lambda x: x * 0.0, "select_same": lambda x: jnp.where(x > 0, x, x),
    "log_exp": lambda x: jnp.log(jnp.exp(x)),
    # what fold_constants evaluates at compile time: closed-over arrays and literals
    "const_exp": lambda x: x + jnp.exp(CONST), "const_tanh": lambda x: x * jnp.tanh(CONST),
    "const_sum": lambda x: x - jnp.sum(CONST * CONST, -1, keepdims=True),
    "const_div": lambda x: x / CONST, "const_max": lambda x: jnp.maximum(x, jnp.max(CONST)),
    "literal_chain": lambda x: x * (jnp.float32(3.0) * 0.1 + 2.0),
    "iota": lambda x: x + jnp.arange(COLS, dtype=F32) * 0.1,
}
BINARY = {
    "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "max": jnp.maximum,
    "min": jnp.minimum, "safe_div": lambda a, b: a / (jnp.abs(b) + 1.0), "div": jnp.divide,
    "where_gt": lambda a, b: jnp.where(a > b, a, b), "atan2": jnp.arctan2,
    "add_nested": lambda a, b: a + (b + a), "div_div": lambda a, b: a / b / 3.0,
    "pow": lambda a, b: jnp.power(jnp.abs(a) + 0.5, jnp.clip(b, -3.0, 3.0)),
}
REDUCE = {  # (4, 8) -> (4, 1) or (1, 8), brought back by broadcasting in a binary op
    "sum": lambda x: x.sum(-1, keepdims=True), "max": lambda x: x.max(-1, keepdims=True),
    "mean": lambda x: x.mean(-1, keepdims=True), "min0": lambda x: x.min(0, keepdims=True),
    "sum0": lambda x: x.sum(0, keepdims=True),
}
SCALAR = {  # the weak-typed Python scalar `s` with an array
    "mul_s": lambda x, s: x * s, "add_s": lambda x, s: x + s, "s_minus": lambda x, s: s - x,
    "div_s": lambda x, s: x / s, "max_s": lambda x, s: jnp.maximum(x, s),
}


def make_program(rng, n_inputs=3, n_ops=10):
  """A recipe (ops over a pool of values) and the function that runs it. The
  function takes the inputs, a (COLS,) bias, a (COLS, COLS) weight and `s`, a
  Python float."""
  recipe = []
  bias, weight = n_inputs, n_inputs + 1
  pool = n_inputs + 2
  for _ in range(n_ops):
    kind = rng.choice(["unary", "binary", "bias", "reduce", "dot", "add3", "scalar", "affine"],
                      p=[0.3, 0.2, 0.08, 0.12, 0.1, 0.08, 0.07, 0.05])
    pick = lambda: int(rng.choice([i for i in range(pool) if i not in (bias, weight)]))
    if kind == "unary":
      recipe.append(("unary", str(rng.choice(list(UNARY))), [pick()]))
    elif kind == "binary":
      recipe.append(("binary", str(rng.choice(list(BINARY))), [pick(), pick()]))
    elif kind == "bias":
      recipe.append(("bias", "add", [pick(), bias]))
    elif kind == "reduce":
      recipe.append(("reduce", str(rng.choice(list(REDUCE))), [pick(), pick()]))
    elif kind == "dot":
      recipe.append(("dot", str(rng.choice(["linear", "matmul_bias", "matmul"])),
                     [pick(), weight, bias]))
    elif kind == "add3":
      recipe.append(("add3", "add", [pick(), pick(), pick()]))
    elif kind == "scalar":
      recipe.append(("scalar", str(rng.choice(list(SCALAR))), [pick()]))
    else:  # a norm with scale and bias over the last axis
      recipe.append(("affine", str(rng.choice(["layernorm", "rmsnorm"])), [pick(), bias]))
    pool += 1

  def program(*args):
    *values, s = args
    for kind, name, ins in recipe:
      xs = [values[i] for i in ins]
      if kind == "unary":
        out = UNARY[name](xs[0])
      elif kind == "binary":
        out = BINARY[name](xs[0], xs[1])
      elif kind == "bias":
        out = xs[0] + xs[1]
      elif kind == "reduce":
        out = xs[1] - REDUCE[name](xs[0])
      elif kind == "dot" and name == "linear":  # what fuse_matmul_bias looks for
        out = xs[0] @ xs[1] + xs[2]
      elif kind == "dot":
        out = jnp.tanh(xs[0] @ xs[1] * 0.25 + (xs[2] if name == "matmul_bias" else 0.0))
      elif kind == "add3":
        out = xs[0] + xs[1] + xs[2]
      elif kind == "scalar":
        out = SCALAR[name](xs[0], s)
      else:  # what fuse_norm_affine looks for
        out = UNARY[name](xs[0]) * xs[1] + xs[1]
      values.append(out)
    # the last value and one more from the pool, so dead code exists too
    return values[-1], values[len(values) // 2]
  return recipe, program


def make_inputs(rng, n_inputs=3, special=False):
  xs = [random_array(rng, (ROWS, COLS), special) for _ in range(n_inputs)]
  xs += [random_array(rng, (COLS,), special), random_array(rng, (COLS, COLS), special)]
  return xs + [random_scalar(rng)]


# -- the callback / control-flow / random generator --------------------------------
HOST_CALLS = [0]  # pure_callback calls so far: compile must not add any


def _numpy(fn):
  """A host function: numpy on the argument, cast back to its dtype, quiet
  about the NaNs and infs the special inputs bring."""
  def host_fn(a):
    HOST_CALLS[0] += 1
    with np.errstate(all="ignore"):
      return np.ascontiguousarray(fn(a)).astype(a.dtype)
  return host_fn


HOST_FNS = {
    "np_sin": _numpy(np.sin), "np_tanh": _numpy(np.tanh),
    "np_cumsum": _numpy(lambda a: np.cumsum(a, axis=-1)),
    "np_sort": _numpy(lambda a: np.sort(a, axis=-1)), "np_flip": _numpy(lambda a: a[..., ::-1]),
    "np_sq": _numpy(lambda a: a * a),
}


def host_call(name, x):
  return jax.pure_callback(HOST_FNS[name], jax.ShapeDtypeStruct(x.shape, x.dtype), x)


class IoLog:
  """An effectful callback (io_callback, unordered) that records the bytes of
  every argument it is called with."""

  def __init__(self):
    self.calls = []

  def __call__(self, a):
    a = np.asarray(a)
    self.calls.append(a.tobytes())
    with np.errstate(all="ignore"):
      return np.cos(a).astype(a.dtype)

  def op(self, x):
    return io_callback(self, jax.ShapeDtypeStruct(x.shape, x.dtype), x, ordered=False)

  def take(self):
    calls, self.calls = self.calls, []
    return sorted(calls)  # unordered: the order of calls is not part of the contract


def _inner_fn(name, log):
  """A function of one array used inside a control-flow body."""
  if name == "io":
    return log.op
  if name in HOST_FNS:
    return lambda v: host_call(name, v)
  return {"sin": jnp.sin, "tanh": jnp.tanh, "half": lambda v: v * 0.5}[name]


INNER = list(HOST_FNS) + ["io", "sin", "tanh", "half"]
CALLBACK_KINDS = {  # kind: probability (the random ops are the slow ones to compile)
    "elementwise": 0.17, "host": 0.17, "io": 0.1, "scan": 0.15, "cond": 0.15, "while": 0.1,
    "fori": 0.07, "random": 0.06, "random_scan": 0.03,
}


def make_callback_program(rng, n_ops=5):
  """Ops over a pool of (ROWS, COLS) values from inputs x, y; the program also
  takes a float32 scalar p (the branch predicate) and a PRNG key, and returns
  two values of the pool and the key."""
  recipe = []
  pool = 2
  pick = lambda: int(rng.integers(pool))
  inner = lambda: str(rng.choice(INNER))
  for _ in range(n_ops):
    kind = str(rng.choice(list(CALLBACK_KINDS), p=list(CALLBACK_KINDS.values())))
    if kind == "elementwise":
      name = str(rng.choice(["sin", "tanh", "add", "mul", "sub", "max"]))
      recipe.append((kind, name, [pick(), pick()]))
    elif kind == "host":
      recipe.append((kind, str(rng.choice(list(HOST_FNS))), [pick()]))
    elif kind == "io":
      recipe.append((kind, "io", [pick()], bool(rng.random() < 0.3)))  # result unused?
    elif kind in ("scan", "cond"):
      recipe.append((kind, (inner(), inner()), [pick(), pick()]))
    elif kind in ("while", "fori"):
      recipe.append((kind, inner(), [pick(), pick()], int(rng.integers(1, 4))))
    elif kind == "random":
      recipe.append((kind, str(rng.choice(["normal", "uniform", "bernoulli"])),
                     [pick(), pick()], int(rng.integers(100))))
    else:
      recipe.append((kind, "normal", [pick()], int(rng.integers(100))))
    if not (kind == "io" and recipe[-1][3]):
      pool += 1
  log = IoLog()
  elementwise = {"sin": lambda a, b: jnp.sin(a), "tanh": lambda a, b: jnp.tanh(b),
                 "add": jnp.add, "mul": jnp.multiply, "sub": jnp.subtract, "max": jnp.maximum}

  def program(x, y, p, key):
    values = [x, y]
    for op in recipe:
      kind, name, ins = op[:3]
      xs = [values[i] for i in ins]
      if kind == "elementwise":
        out = elementwise[name](*xs)
      elif kind == "host":
        out = host_call(name, xs[0])
      elif kind == "io":
        out = log.op(xs[0])
        if op[3]:
          continue  # the effect only: it must not go as dead code
      elif kind == "scan":  # over the rows of xs[1], the carry from a row of xs[0]
        f, g = _inner_fn(name[0], log), _inner_fn(name[1], log)

        def body(c, a, f=f, g=g):
          return c * 0.5 + f(a), g(c) + a
        carry, ys = lax.scan(body, xs[0][0], xs[1])
        out = ys - carry
      elif kind == "cond":
        f, g = _inner_fn(name[0], log), _inner_fn(name[1], log)
        out = lax.cond(p > 0, lambda u, v, f=f: f(u) * 2.0 + v,
                       lambda u, v, g=g: g(v) - u, xs[0], xs[1])
      elif kind == "while":
        f, n = _inner_fn(name, log), op[3]
        _, out = lax.while_loop(lambda c, n=n: c[0] < n,
                                lambda c, f=f, v=xs[1]: (c[0] + 1, f(c[1]) * 0.9 + v),
                                (0, xs[0]))
      elif kind == "fori":
        f, n = _inner_fn(name, log), op[3]
        out = lax.fori_loop(0, n, lambda i, c, f=f: f(c) + i * 0.5, xs[0] * xs[1])
      elif kind == "random":
        k = jax.random.fold_in(key, op[3])
        if name == "normal":
          out = jax.random.normal(k, (ROWS, COLS)) * 0.5 + xs[0]
        elif name == "uniform":
          out = xs[0] * jax.random.uniform(k, (ROWS, COLS), minval=-1.0)
        else:
          out = jnp.where(jax.random.bernoulli(k, 0.3, (ROWS, COLS)), xs[0], xs[1])
      else:  # a key per row, split, scanned over
        keys = jax.random.split(jax.random.fold_in(key, op[3]), ROWS)
        _, rows = lax.scan(lambda c, kr: (c, c + jax.random.normal(kr, (COLS,))),
                           xs[0][0], keys)
        out = rows * xs[0]
      values.append(out)
    return values[-1], values[len(values) // 2], key
  return recipe, program, log


KEY_KINDS = ("threefry", "raw", "rbg")  # a typed key, a raw uint32[2] key, an RBG key


def callback_inputs(rng, sign, key_kind, special=False):
  """x, y, the predicate p with the sign asked for, and a key of `key_kind`."""
  x, y = (random_array(rng, (ROWS, COLS), special, subnormal=False) for _ in range(2))
  p = jnp.float32(sign * (0.1 + rng.random()))
  seed = int(rng.integers(1 << 30))
  key = (jax.random.PRNGKey(seed) if key_kind == "raw" else
         jax.random.key(seed, impl="rbg" if key_kind == "rbg" else "threefry2x32"))
  return [x, y, p, key]
