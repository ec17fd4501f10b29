"""Fuzz: 310 random programs through the whole pipeline, each compared with
jax.jit on fresh random inputs, bit for bit (DESIGN.md: "the session's output
equals jax.jit's bit for bit wherever the arithmetic is the same").

Generators with fixed seeds; program i of a test draws from its own generator
(seed, i), so a failure reproduces from its index alone, and every failure
message carries the program's recipe. A test runs all its programs and then
lists every one that failed (a mismatch or a crash).
- stateless (150): elementwise, broadcast, reduction, dot, norm and literal ops
  (the shapes the fusions look for), weak-typed Python scalar args, and inputs
  holding -0.0, NaN, +-inf, huge and subnormal values;
- callbacks and effects (50): `jax.pure_callback` (numpy) at top level and
  inside `lax.scan` / `lax.cond` / `lax.while_loop` / `lax.fori_loop` bodies;
  `io_callback(ordered=False)`, which must run as often and on the same
  arguments as under jax.jit; `jax.random` ops on a key passed as an input
  (threefry, raw uint32[2] and RBG keys); no callback may run at compile;
- stateful (80): `state_argnums` in any order; steps that update, keep, swap,
  rotate and forward state, bump it with a callback, return the old or the new
  state as outputs; pytree state with a counter; read-only steps
  (`updates_state=False`); Adam/AdamW steps with an eval graph sharing the
  params (`state_from`). Three steps each (every third program set_state's
  fresh values before the last); outputs, state and the eval graph compared
  after every step, and every array handed out earlier (args, outputs,
  get_state copies, set_state values) must stay alive and unchanged;
- loop sink (30): the same, then `run(..., steps=3)` on stacked args, which
  must equal three jax.jit steps.
ReducedFindingsTest holds the smallest forms of what the fuzz found.
"""
import contextlib

from absl.testing import absltest
import jax
from jax import lax
from jax.experimental import io_callback
import jax.numpy as jnp
import numpy as np

import jaxsession as js

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


# -- the stateful generators -------------------------------------------------------
class Stateful:
  """A stateful step and everything a check needs to run it."""

  def __init__(self, recipe, fn, example, state_pos, updates, eval_fn=None):
    self.recipe = recipe
    self.fn = fn
    self.example = example           # example(rng, special) -> all args of fn
    self.state_pos = state_pos       # state_argnums, in their order
    self.updates = updates           # updates_state
    self.eval_fn = eval_fn           # eval_fn(state 0, x) sharing slot 0 (state_from), or None


EXPR_UNARY = ["sin", "tanh", "neg", "square", "relu", "softmax", "layernorm", "plus_zero",
              "times_one", "recip", "gelu"]
EXPR_BINARY = ["add", "sub", "mul", "max", "safe_div", "where_gt", "add_nested"]


def make_stateful_program(rng, allow_scalar=True):
  """A step over state and input args (all (ROWS, COLS) float32; state 0 may be
  a dict with an int32 step counter, one input may be a Python float): state
  updated, kept, swapped, rotated, forwarded from an input, or bumped by a
  pure_callback; outputs that are the old state, the new state, inputs,
  expressions and callbacks. Read-only (updates_state=False) now and then."""
  n_state, n_in = int(rng.integers(1, 4)), int(rng.integers(1, 3))
  with_scalar = allow_scalar and rng.random() < 0.3
  nargs = n_state + n_in + with_scalar
  order = [int(i) for i in rng.permutation(nargs)]
  state_pos = tuple(order[:n_state])          # any order, not necessarily sorted
  in_pos = sorted(order[n_state:])
  scalar_pos = in_pos.pop(int(rng.integers(len(in_pos)))) if with_scalar else None
  dict_state = rng.random() < 0.25
  updates = rng.random() < 0.8
  # the pool: "s{k}" the old value of state k (its "v" for a dict), "x{j}" input j
  pool = [f"s{k}" for k in range(n_state)] + [f"x{j}" for j in range(n_in)]
  exprs = []
  for e in range(int(rng.integers(1, 5))):
    kind = str(rng.choice(["unary", "binary", "host", "scalar"] if with_scalar
                          else ["unary", "binary", "host"]))
    if kind == "unary":
      exprs.append((kind, str(rng.choice(EXPR_UNARY)), [str(rng.choice(pool))]))
    elif kind == "binary":
      exprs.append((kind, str(rng.choice(EXPR_BINARY)),
                    [str(rng.choice(pool)), str(rng.choice(pool))]))
    elif kind == "host":
      exprs.append((kind, str(rng.choice(list(HOST_FNS))), [str(rng.choice(pool))]))
    else:
      exprs.append((kind, str(rng.choice(list(SCALAR))), [str(rng.choice(pool))]))
    pool.append(f"e{e}")
  news = [None] * n_state
  if updates:
    plain = [k for k in range(n_state) if not (dict_state and k == 0)]
    if len(plain) >= 2 and rng.random() < 0.4:  # swap a pair: return (b, a, ...)
      a, b = rng.choice(plain, 2, replace=False)
      news[a], news[b] = ("state", f"s{b}"), ("state", f"s{a}")
    for k in range(n_state):
      if news[k] is not None:
        continue
      kind = str(rng.choice(["expr", "keep", "forward", "host_add", "other"],
                            p=[0.4, 0.15, 0.15, 0.2, 0.1]))
      if kind == "expr":
        news[k] = ("expr", str(rng.choice(pool[n_state + n_in:])))
      elif kind == "keep":
        news[k] = ("state", f"s{k}")
      elif kind == "forward":
        news[k] = ("input", f"x{int(rng.integers(n_in))}")
      elif kind == "host_add":
        news[k] = ("host_add", str(rng.choice(list(HOST_FNS))), str(rng.choice(pool)))
      else:  # another state's old value (a rotation when several do this)
        others = [f"s{j}" for j in plain if j != k]
        news[k] = ("state", str(rng.choice(others))) if others and k in plain else (
            "state", f"s{k}")
  rest = []
  for _ in range(int(rng.integers(0 if updates else 1, 4))):
    kind = str(rng.choice(["old", "new", "expr", "input", "host", "counter"]
                          if updates else ["old", "expr", "input", "host", "counter"]))
    if kind == "counter" and not dict_state:
      kind = "expr"
    if kind in ("old", "new"):
      rest.append((kind, int(rng.integers(n_state))))
    elif kind == "expr":
      rest.append((kind, str(rng.choice(pool[n_state + n_in:]))))
    elif kind == "input":
      rest.append((kind, f"x{int(rng.integers(n_in))}"))
    elif kind == "host":
      rest.append((kind, str(rng.choice(list(HOST_FNS))), str(rng.choice(pool))))
    else:
      rest.append((kind, 0))

  def fn(*args):
    states = [args[i] for i in state_pos]
    s = args[scalar_pos] if with_scalar else None
    env = {f"x{j}": args[i] for j, i in enumerate(in_pos)}
    for k, st in enumerate(states):
      env[f"s{k}"] = st["v"] if (dict_state and k == 0) else st
    for e, (kind, name, ins) in enumerate(exprs):
      xs = [env[i] for i in ins]
      if kind == "unary":
        env[f"e{e}"] = UNARY[name](xs[0])
      elif kind == "binary":
        env[f"e{e}"] = BINARY[name](xs[0], xs[1])
      elif kind == "host":
        env[f"e{e}"] = host_call(name, xs[0])
      else:
        env[f"e{e}"] = SCALAR[name](xs[0], s)
    new_states = []
    for k, new in enumerate(news if updates else ()):
      if new[0] == "host_add":
        v = env[f"s{k}"] + host_call(new[1], env[new[2]])
      else:
        v = env[new[1]]
      if dict_state and k == 0:
        if new == ("state", "s0"):
          new_states.append(states[0])  # returned unchanged, counter too
          continue
        v = {"v": v, "t": states[0]["t"] + 1}
      new_states.append(v)
    outs = []
    for item in rest:
      kind = item[0]
      if kind == "old":
        outs.append(states[item[1]])
      elif kind == "new":
        outs.append(new_states[item[1]])
      elif kind in ("expr", "input"):
        outs.append(env[item[1]])
      elif kind == "host":
        outs.append(host_call(item[1], env[item[2]]))
      else:
        outs.append((new_states[0] if updates else states[0])["t"])
    if not updates:
      return outs[0] if len(outs) == 1 else tuple(outs)
    return (*new_states, *outs)

  def example(rng, special=False):
    args = [None] * nargs
    for k, i in enumerate(state_pos):
      v = random_array(rng, (ROWS, COLS), special, subnormal=False)
      args[i] = {"v": v, "t": jnp.int32(rng.integers(0, 5))} if (dict_state and k == 0) else v
    for i in in_pos:
      args[i] = random_array(rng, (ROWS, COLS), special, subnormal=False)
    if with_scalar:
      args[scalar_pos] = random_scalar(rng)
    return args

  recipe = dict(state_argnums=state_pos, inputs=in_pos, scalar=scalar_pos,
                dict_state=dict_state, updates_state=updates, exprs=exprs, new_state=news,
                rest=rest)
  return Stateful(recipe, fn, example, state_pos, updates)


def make_adam_program(rng):
  """An Adam / AdamW training step on a dict of params ({"w": (ROWS, COLS),
  "b": (COLS,)}) and an optimiser state {"m", "v", "t"}, in one of the forms
  fuse_adam knows; the gradient from jax.grad, an elementwise formula or a
  pure_callback; an eval step shares the params (state_from)."""
  form = str(rng.choice(["scaled_step", "optax_adam", "optax_adamw"]))
  grad_kind = str(rng.choice(["grad", "tanh", "host"]))
  b1, b2 = float(rng.choice([0.9, 0.8])), float(rng.choice([0.999, 0.99]))
  lr, eps, wd = float(rng.choice([1e-2, 3e-3])), 1e-8, 1e-2
  params_first = rng.random() < 0.5   # fn(params, opt, x) or fn(x, opt, params)
  rest = [str(k) for k in rng.choice(["loss", "m_sum", "old_w", "new_params", "t"],
                                     int(rng.integers(0, 3)), replace=False)]

  def loss_fn(params, x):
    return jnp.mean(jnp.tanh(x * params["w"] + params["b"]) ** 2)

  def grads_of(params, x):
    if grad_kind == "grad":
      return jax.grad(loss_fn)(params, x)
    if grad_kind == "tanh":
      return {"w": jnp.tanh(x * params["w"]), "b": jnp.sin(params["b"])}
    return {"w": host_call("np_tanh", x * params["w"]),
            "b": host_call("np_sin", params["b"][None])[0]}

  def step(params, opt, x):
    g = grads_of(params, x)
    t = opt["t"] + 1
    tf = t.astype(F32)
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, opt["m"], g)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, opt["v"], g)
    if form == "scaled_step":
      scale = lr * jnp.sqrt(1 - b2 ** tf) / (1 - b1 ** tf)
      new = jax.tree.map(lambda p, m, v: p - scale * m / (jnp.sqrt(v) + eps), params, m, v)
    else:
      bc1, bc2 = 1 - b1 ** tf, 1 - b2 ** tf

      def update(p, m, v):
        u = (m / bc1) / (jnp.sqrt(v / bc2 + 0.0) + eps)
        if form == "optax_adamw":
          u = u + wd * p
        return p + (-lr) * u
      new = jax.tree.map(update, params, m, v)
    outs = {"loss": loss_fn(params, x), "m_sum": m["w"].sum(), "old_w": params["w"],
            "new_params": new, "t": t}
    return new, {"m": m, "v": v, "t": t}, [outs[k] for k in rest]

  def fn(*args):
    params, opt, x = args if params_first else args[::-1]
    new, new_opt, outs = step(params, opt, x)
    return (new, new_opt, *outs)  # state_argnums order: params, then opt

  def example(rng, special=False):
    params = {"w": random_array(rng, (ROWS, COLS)), "b": random_array(rng, (COLS,))}
    opt = {"m": jax.tree.map(lambda p: 0.1 * random_array(rng, p.shape), params),
           "v": jax.tree.map(lambda p: 0.01 * jnp.abs(random_array(rng, p.shape)), params),
           "t": jnp.int32(rng.integers(0, 5))}
    x = random_array(rng, (ROWS, COLS), special, subnormal=False)
    return [params, opt, x] if params_first else [x, opt, params]

  recipe = dict(kind="adam", form=form, grad=grad_kind, b1=b1, b2=b2, lr=lr,
                params_first=params_first, rest=rest)
  # state slot 0 is the params either way, so an eval step can share it
  return Stateful(recipe, fn, example, (0, 1) if params_first else (2, 1), True,
                  eval_fn=loss_fn)


class Held:
  """Every array the test was handed or handed over, with a snapshot of its
  value: later runs must neither delete nor overwrite any of them."""

  def __init__(self):
    self.items = []

  def add(self, tree, what):
    for leaf in jax.tree.leaves(tree):
      if isinstance(leaf, jax.Array):
        self.items.append((leaf, _host(leaf).copy(), what))

  def check(self, err_msg):
    for leaf, snapshot, what in self.items:
      if leaf.is_deleted():
        raise AssertionError(f"{what} was deleted by a later run\n{err_msg}")
      assert_bits_equal(_host(leaf), snapshot, f"{what} changed after a later run\n{err_msg}")


# -- checking one program ------------------------------------------------------------
@contextlib.contextmanager
def recipe_on_crash(msg):
  """A crash inside the session (not a mismatch) reported with the recipe."""
  try:
    yield
  except AssertionError:
    raise
  except Exception as exc:
    raise AssertionError(f"crashed: {type(exc).__name__}: {exc}\n{msg}") from exc


def check_stateless(sess, rng, i, fused):
  recipe, program = make_program(rng)
  special = i % 3 == 2
  msg = f"stateless program {i} (special inputs: {special}): {recipe}"
  with recipe_on_crash(msg):
    gid = sess.compile(program, *make_inputs(rng))
    fused.append(sum(n.prim is None for n in sess.graph(gid).nodes))
    jitted = jax.jit(program)
    for _ in range(2):
      args = make_inputs(rng, special=special)
      got, want = sess.run(gid, *args), jitted(*args)
      assert_bits_equal(got, want, f"s={args[-1]!r}; {msg}")


def check_callbacks(sess, rng, i, io_calls, inner_callbacks):
  recipe, program, log = make_callback_program(rng)
  key_kind = KEY_KINDS[i % len(KEY_KINDS)]
  msg = f"callback program {i} (key: {key_kind}): {recipe}"
  with recipe_on_crash(msg):
    host_calls = HOST_CALLS[0]
    gid = sess.compile(program, *callback_inputs(rng, 1, key_kind))
    if log.take() or HOST_CALLS[0] != host_calls:
      raise AssertionError(f"compile ran a callback; {msg}")
    inner_callbacks.append(any(n.op in ("scan", "cond", "while") and "callback" in str(n.params)
                               for n in sess.graph(gid).nodes))
    jitted = jax.jit(program)
    for sign in (1, -1):  # both branches of every cond
      args = callback_inputs(rng, sign, key_kind, special=i % 4 == 3)
      got = sess.run(gid, *args)
      got_calls = log.take()
      want = jitted(*args)
      want_calls = log.take()
      assert_bits_equal(got, want, f"p={args[2]}; {msg}")
      if got_calls != want_calls:
        raise AssertionError(f"io_callback ran {len(got_calls)} times, under jax.jit "
                             f"{len(want_calls)} times (on other arguments: "
                             f"{len(got_calls) == len(want_calls)}); p={args[2]}; {msg}")
      io_calls.append(len(got_calls))
      if any(leaf.is_deleted() for leaf in jax.tree.leaves(args)):
        raise AssertionError(f"run deleted an argument; {msg}")


def check_stateful(sess, prog, rng, i, sunk, special):
  """3 single steps (and with `sunk`, then 3 loop-sunk steps) against jax.jit
  from the same initial state: outputs, state, the eval graph sharing the
  state, and every array handed out so far after every run. Every third
  program replaces its state with set_state before the last single step."""
  msg = f"stateful program {i} (loop sink: {sunk}, special inputs: {special}): {prog.recipe}"
  init = prog.example(rng, special)
  state_pos, k = prog.state_pos, len(prog.state_pos)
  dyn_pos = [p for p in range(len(init)) if p not in state_pos]
  held = Held()
  held.add(init, "an example arg given to compile")
  host_calls = HOST_CALLS[0]
  with recipe_on_crash(msg):
    gid = sess.compile(prog.fn, *init, state_argnums=state_pos, updates_state=prog.updates)
  eval_gid = None
  try:
    with recipe_on_crash(msg):
      if prog.eval_fn is not None:
        eval_gid = sess.compile(prog.eval_fn, init[state_pos[0]], init[dyn_pos[-1]],
                                state_argnums=0, state_from=gid, updates_state=False)
      if HOST_CALLS[0] != host_calls:
        raise AssertionError(f"compile ran a pure_callback; {msg}")
      jitted, jitted_eval = jax.jit(prog.fn), jax.jit(prog.eval_fn or (lambda *a: None))
      state = tuple(init[p] for p in state_pos)
      new_args = lambda: [a for p, a in enumerate(prog.example(rng, special)) if p in dyn_pos]

      def jit_step(state, dyn):
        args = list(init)
        for p, v in zip(state_pos, state):
          args[p] = v
        for p, v in zip(dyn_pos, dyn):
          args[p] = v
        new_state, want = split_outputs(jitted(*args), k, prog.updates)
        return (new_state if prog.updates else state), want

      def check_eval(state, where):
        if eval_gid is not None:
          x = new_args()[-1]
          got = sess.run(eval_gid, x)
          assert_bits_equal(got, jitted_eval(state[0], x), f"eval graph {where}: {msg}")
          held.add(got, f"an eval output {where}")

      check_eval(state, "before any step")
      for step in range(3):
        step_msg = f"step {step}; {msg}"
        if step == 2 and i % 3 == 0:  # the caller's values become the state
          state = tuple(prog.example(rng, special)[p] for p in state_pos)
          held.add(state, "a value given to set_state")
          sess.set_state(gid, *state)
        dyn = new_args()
        held.add(dyn, f"an arg given to run at step {step}")
        got = sess.run(gid, *dyn)
        state, want = jit_step(state, dyn)
        assert_bits_equal(got, want, f"outputs: {step_msg}")
        held.add(got, f"an output of step {step}")
        got_state = sess.get_state(gid)
        assert_bits_equal(got_state, state, f"state: {step_msg}")
        held.add(got_state, f"get_state after step {step}")
        check_eval(state, f"after step {step}")
        held.check(step_msg)

      if sunk:
        steps = [new_args() for _ in range(3)]
        stacked = [jax.tree.map(lambda *xs: jnp.stack(xs), *xs) for xs in zip(*steps)]
        held.add(stacked, "a stacked arg given to run(steps=3)")
        got = sess.run(gid, *stacked, steps=3)
        wants = []
        for dyn in steps:
          state, want = jit_step(state, dyn)
          wants.append(want)
        want = jax.tree.map(lambda *xs: jnp.stack(xs), *wants)
        assert_bits_equal(got, want, f"loop-sunk outputs: {msg}")
        held.add(got, "the outputs of run(steps=3)")
        assert_bits_equal(sess.get_state(gid), state, f"state after run(steps=3): {msg}")
        check_eval(state, "after run(steps=3)")
        held.check(f"after run(steps=3); {msg}")
  finally:
    if eval_gid is not None:
      sess.release(eval_gid)
    sess.release(gid)


class Failures:
  """Collects every failing program of a test (a mismatch or a crash) with its
  recipe, so one run reports them all instead of stopping at the first."""

  def __init__(self, test):
    self.test = test
    self.found = []

  def check(self, what, fn, *args):
    try:
      fn(*args)
    except Exception as exc:  # a crash is a finding too: record it, go on
      self.found.append(f"{what}\n  {type(exc).__name__}: {exc}")

  def assert_none(self, total):
    if self.found:
      self.test.fail(f"{len(self.found)} of {total} programs failed:\n\n"
                     + "\n\n".join(self.found))


def _seeded(seed, i):
  """Program i's own generator: each program reproduces from its index alone."""
  return np.random.default_rng([seed, i])


class FuzzTest(absltest.TestCase):

  def test_stateless_random_programs_bit_exact(self):
    sess = js.Session()
    failures, fused, n = Failures(self), [], 150
    for i in range(n):
      failures.check(f"stateless program {i}", check_stateless, sess, _seeded(2026, i), i,
                     fused)
    failures.assert_none(n)
    self.assertGreater(sum(fused), 50)  # the fusions did fire along the way

  def test_callbacks_control_flow_and_random_programs(self):
    sess = js.Session()
    failures, io_calls, inner, n = Failures(self), [], [], 50
    for i in range(n):
      failures.check(f"callback program {i}", check_callbacks, sess, _seeded(7070, i), i,
                     io_calls, inner)
    failures.assert_none(n)
    self.assertGreater(sum(io_calls), 20)  # the effects did run
    self.assertGreater(sum(inner), 15)     # callbacks inside control flow survived to the end

  def test_stateful_random_programs(self):
    sess = js.Session()
    failures, kinds, n = Failures(self), set(), 80
    for i in range(n):
      rng = _seeded(31337, i)
      prog = make_adam_program(rng) if i % 6 == 5 else make_stateful_program(rng)
      kinds.update(new[0] for new in prog.recipe.get("new_state", ()) if new)
      kinds.update(r[0] for r in prog.recipe["rest"] if isinstance(r, tuple))
      failures.check(f"stateful program {i}", check_stateful, sess, prog, rng, i, False,
                     i % 5 == 4)
    failures.assert_none(n)
    # every aliasing form the generator knows came up
    self.assertContainsSubset({"expr", "state", "input", "host_add", "old", "new", "host",
                               "counter"}, kinds)

  def test_stateful_random_programs_loop_sunk(self):
    sess = js.Session()
    failures, n = Failures(self), 30
    for i in range(n):
      rng = _seeded(4242, i)  # no Python-scalar args: they cannot carry a leading axis
      prog = (make_adam_program(rng) if i % 4 == 3
              else make_stateful_program(rng, allow_scalar=False))
      failures.check(f"loop-sunk program {i}", check_stateful, sess, prog, rng, i, True,
                     i % 5 == 4)
    failures.assert_none(n)


class ReducedFindingsTest(absltest.TestCase):
  """Programs the fuzz found, reduced to the smallest that shows each."""

  def assert_matches_jit(self, fn, *args):
    sess = js.Session()
    gid = sess.compile(fn, *args)
    assert_bits_equal(sess.run(gid, *args), jax.jit(fn)(*args),
                      f"nodes: {[n.op for n in sess.graph(gid).nodes]}")

  def test_add_n_keeps_the_users_association(self):
    rng = np.random.default_rng(3)
    a, b, c, d = (random_array(rng, (ROWS, COLS)) for _ in range(4))
    self.assert_matches_jit(lambda a, b, c: a + (b + c), a, b, c)
    self.assert_matches_jit(lambda a, b, c, d: (a + b) + (c + d), a, b, c, d)
    self.assert_matches_jit(lambda a, b, c: a + ((b + c) + a) + b, a, b, c)

  def test_division_split_by_a_host_callback(self):
    # jax.jit's XLA rewrites 1 / (a / b) as b / a inside one executable. The
    # session runs the callback between two executables, so XLA never sees the
    # two divides together and they are computed as written: two roundings
    # against XLA's one, each at most half an ulp of relative error, so the
    # result is within 2 ulp of jax.jit's (1 ulp seen). With the callback kept
    # inside the executable (host_callbacks=False) XLA sees the whole program
    # and the result is bit-identical. README: "Host partitions and XLA".
    def f(a, b):
      q = a / b
      return host_call("np_tanh", a), 1.0 / q
    rng = np.random.default_rng(4)
    args = [random_array(rng, (ROWS, COLS)) for _ in range(2)]
    sess = js.Session()
    got = sess.run(sess.compile(f, *args), *args)
    want = jax.jit(f)(*args)
    assert_bits_equal(got[0], want[0], "the callback's output")
    self.assertLessEqual(max_ulp(got[1], want[1]), 2)
    inside = js.Session(js.SessionOptions(host_callbacks=False))
    assert_bits_equal(inside.run(inside.compile(f, *args), *args), want, "one executable")

  def test_arithmetic_on_a_closed_over_array_matches_jit(self):
    # jax.jit embeds a closed-over array C as an HLO constant, and XLA's
    # simplifier rewrites around constants: x / C as x * (1 / C) (1 ulp),
    # (x * C) ** 2 as (x * x) * (C * C) with C * C folded (up to 3 ulps). An
    # executable that gets C as an argument does the arithmetic as written.
    c = np.random.default_rng(6).standard_normal((ROWS, COLS)).astype(np.float32)
    x = random_array(np.random.default_rng(7), (ROWS, COLS))
    self.assert_matches_jit(lambda x: x / c, x)
    self.assert_matches_jit(lambda x: (x * c) ** 2, x)
    self.assert_matches_jit(lambda x: jnp.tanh(x) / CONST, x)

  def test_host_callback_on_subnormals(self):
    # Under jax.jit a pure_callback runs on an XLA thread that flushes
    # subnormals to zero (FTZ/DAZ): np.tanh(1e-40) is 0.0 there. A host-placed
    # callback runs in the calling thread with the CPU's IEEE default, so the
    # two differ exactly where subnormals go in or come out, and nowhere else.
    # Kept inside the executable (host_callbacks=False) it is bit-identical.
    # README: "Host partitions and XLA".
    x = np.random.default_rng(5).standard_normal((ROWS, COLS)).astype(np.float32)
    x[0, :4] = [1e-40, -1e-44, 1.2e-38, -0.0]
    fn = lambda x: host_call("np_tanh", x)
    want = np.asarray(jax.jit(fn)(jnp.asarray(x)))
    sess = js.Session()
    got = np.asarray(sess.run(sess.compile(fn, jnp.asarray(x)), jnp.asarray(x)))
    tiny = np.finfo(np.float32).tiny
    subnormal = (np.abs(x) < tiny) & (x != 0)
    np.testing.assert_array_equal(got[~subnormal], want[~subnormal])
    np.testing.assert_array_equal(want[subnormal], 0.0)
    inside = js.Session(js.SessionOptions(host_callbacks=False))
    assert_bits_equal(inside.run(inside.compile(fn, jnp.asarray(x)), jnp.asarray(x)),
                      want, "one executable")


if __name__ == "__main__":
  absltest.main()
