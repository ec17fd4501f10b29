"""Fuzz: 200 random programs of elementwise, broadcast, reduction and dot ops
(with literals and the shapes fusions look for) through the whole pipeline,
each compared with jax.jit on fresh random inputs."""
from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js

ROWS, COLS = 4, 8
UNARY = {
    "sin": jnp.sin, "tanh": jnp.tanh, "neg": jnp.negative, "abs": jnp.abs,
    "exp_clipped": lambda x: jnp.exp(jnp.clip(x, -4, 4)), "sqrt_abs": lambda x: jnp.sqrt(
        jnp.abs(x)), "relu": jax.nn.relu, "gelu": jax.nn.gelu,
    "times_one": lambda x: x * 1.0, "plus_zero": lambda x: x + 0.0,
    "double_t": lambda x: x.T.T, "softmax": lambda x: jax.nn.softmax(x, -1),
    "square": lambda x: x ** 2, "scale": lambda x: 0.5 * x,
}
BINARY = {
    "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "max": jnp.maximum,
    "min": jnp.minimum, "safe_div": lambda a, b: a / (jnp.abs(b) + 1.0),
}
REDUCE = {  # (4, 8) -> (4, 1), brought back by broadcasting in a binary op
    "sum": lambda x: x.sum(-1, keepdims=True), "max": lambda x: x.max(-1, keepdims=True),
    "mean": lambda x: x.mean(-1, keepdims=True),
}


def make_program(rng, n_inputs=3, n_ops=10):
  """A recipe (ops over a pool of values) and the function that runs it."""
  recipe = []
  pool = n_inputs + 2  # the inputs, a (COLS,) bias and a (COLS, COLS) weight
  for _ in range(n_ops):
    kind = rng.choice(["unary", "binary", "bias", "reduce", "dot", "add3"],
                      p=[0.3, 0.25, 0.1, 0.15, 0.1, 0.1])
    pick = lambda: int(rng.choice([i for i in range(pool) if i not in (n_inputs,
                                                                        n_inputs + 1)]))
    if kind == "unary":
      recipe.append(("unary", str(rng.choice(list(UNARY))), [pick()]))
    elif kind == "binary":
      recipe.append(("binary", str(rng.choice(list(BINARY))), [pick(), pick()]))
    elif kind == "bias":
      recipe.append(("bias", "add", [pick(), n_inputs]))
    elif kind == "reduce":
      recipe.append(("reduce", str(rng.choice(list(REDUCE))), [pick(), pick()]))
    elif kind == "dot":
      recipe.append(("dot", "matmul_bias" if rng.random() < 0.5 else "matmul",
                     [pick(), n_inputs + 1, n_inputs]))
    else:
      recipe.append(("add3", "add", [pick(), pick(), pick()]))
    pool += 1

  def program(*args):
    values = list(args)
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
      elif kind == "dot":
        out = jnp.tanh(xs[0] @ xs[1] * 0.25 + (xs[2] if name == "matmul_bias" else 0.0))
      else:
        out = xs[0] + xs[1] + xs[2]
      values.append(out)
    # the last value and one more from the pool, so dead code exists too
    return values[-1], values[len(values) // 2]
  return recipe, program


def make_inputs(rng, n_inputs=3):
  xs = [rng.standard_normal((ROWS, COLS)) for _ in range(n_inputs)]
  xs += [rng.standard_normal(COLS), rng.standard_normal((COLS, COLS))]
  return [jnp.asarray(x, jnp.float32) for x in xs]


class FuzzTest(absltest.TestCase):

  def test_two_hundred_random_programs(self):
    rng = np.random.default_rng(2026)
    sess = js.Session()
    fused = 0
    for i in range(200):
      recipe, program = make_program(rng)
      gid = sess.compile(program, *make_inputs(rng))
      fused += sum(n.prim is None for n in sess.graph(gid).nodes)
      args = make_inputs(rng)
      got, want = sess.run(gid, *args), jax.jit(program)(*args)
      for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5,
                                   err_msg=f"program {i}: {recipe}")
    self.assertGreater(fused, 50)  # the fusions did fire along the way


if __name__ == "__main__":
  absltest.main()
