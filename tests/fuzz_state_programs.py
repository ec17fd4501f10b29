"""Fuzz programs, part 2: the generators of stateful programs (state aliasing,
Adam/AdamW with a shared eval graph) and the record of handed-out arrays."""
import jax
import jax.numpy as jnp

from fuzz_programs import (ROWS, COLS, F32, _host, assert_bits_equal, random_array,
    random_scalar, UNARY, BINARY, SCALAR, HOST_FNS, host_call)


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
