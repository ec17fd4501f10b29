"""The Pallas kernels (kernels/pallas.py) against their XLA twins, measured in
one run: time per call, ratio, and how far apart their results are.

On a GPU the Pallas kernels run compiled by Triton, which SelectKernel
chooses there; on any other platform they run interpreted (`interpret=True`,
a loop over the blocks: slow, and the CPU check of the same code the tests
make), so the ratio says nothing about speed there. Each kernel is called on
the fused node a Session made of the same program at the same shapes (its
params - the mean's divisor, eps - are the graph's), both sides under
jax.jit, contenders interleaved repeat by repeat.

    python benchmarks/kernels.py [--rows 4096 --width 1024 --adam_elements 1048576]
"""
import sys

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import common  # noqa: E402
import jaxsession as js  # noqa: E402
from jaxsession.examples import mlp_adam  # noqa: E402
from jaxsession.kernels import fused, pallas, registry  # noqa: E402

flags.DEFINE_integer("rows", 4096, "rows of the row-wise kernels' input")
flags.DEFINE_integer("width", 1024, "row length (a power of two: the Pallas kernels tile it)")
flags.DEFINE_integer("adam_elements", 1 << 20, "elements of the Adam kernel's parameter "
                     "(rows x columns of an MLP layer, columns = --width)")
flags.DEFINE_integer("repeats", 7, "interleaved repeats; medians are reported")
flags.DEFINE_integer("calls", 50, "calls per repeat")
FLAGS = flags.FLAGS


def _x(rng, *shape):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def _ln(x, g, b):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * g + b


def _rms(x, g):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def _node(fn, args, op):
  """The fused node of `op` that a Session makes of fn at these shapes."""
  sess = js.Session()
  gid = sess.compile(fn, *args)
  nodes = [n for n in sess.graph(gid).nodes if n.op == op]
  if not nodes:
    raise SystemExit(f"no {op} node in the graph of {fn}: the fusion pass did not match")
  return nodes[0]


def _adam_node(columns, rows):
  """An Adam node of mlp_adam's step for a rows x columns layer."""
  params = mlp_adam.init_params(jax.random.key(0), (rows, columns, 1))
  opt = mlp_adam.adam_init(params)
  batch = jax.tree.map(lambda a: a[0], mlp_adam.make_data(jax.random.key(1), 1, 8, rows))
  sess = js.Session()
  gid = sess.compile(mlp_adam.train_step, params, opt, batch, state_argnums=(0, 1))
  return next(n for n in sess.graph(gid).nodes
              if n.op == "Adam" and n.inputs[0].aval.shape == (rows, columns))


def _apart(a, b):
  """(largest distance in units of the last place, largest absolute
  difference) between two f32 arrays where both are finite, and whether
  their non-finite elements agree. Near zero an ulp is tiny: a value
  computed as x - mean, where mean moved by one ulp of its own, lies many
  of its ulps away, so both measures are shown."""
  a, b = np.asarray(a, np.float32).ravel(), np.asarray(b, np.float32).ravel()
  finite = np.isfinite(a) & np.isfinite(b)
  same_specials = bool(np.array_equal(np.isfinite(a), np.isfinite(b)))
  if not finite.any():
    return 0, 0.0, same_specials
  ia, ib = a[finite].view(np.int32).astype(np.int64), b[finite].view(np.int32).astype(np.int64)
  ia = np.where(ia < 0, np.int64(-(1 << 31)) - ia, ia)  # sign-magnitude -> ordered ints
  ib = np.where(ib < 0, np.int64(-(1 << 31)) - ib, ib)
  diff = float(np.abs(a[finite].astype(np.float64) - b[finite]).max())
  return int(np.abs(ia - ib).max()), diff, same_specials


def cases(rng, rows, width, adam_elements):
  """(name, op, node, inputs) per kernel."""
  x = _x(rng, rows, width)
  g, b = _x(rng, width), _x(rng, width)
  out = [("Softmax", "Softmax", _node(lambda x: jax.nn.softmax(x, -1), (x,), "Softmax"), [x]),
         ("LayerNorm", "LayerNorm", _node(_ln, (x, g, b), "LayerNorm"), [x, g, b]),
         ("RMSNorm", "RMSNorm", _node(_rms, (x, g), "RMSNorm"), [x, g])]
  adam_rows = max(adam_elements // width, 1)
  node = _adam_node(width, adam_rows)
  shape = (adam_rows, width)
  out.append((f"Adam f32[{adam_rows},{width}]", "Adam", node,
              [_x(rng, *shape), _x(rng, *shape), _x(rng, *shape), jnp.abs(_x(rng, *shape)),
               jnp.float32(0.003)]))
  return out


def main(argv):
  del argv
  platform = jax.devices()[0].platform
  interpret = platform != "gpu"
  rng = np.random.default_rng(17)
  rows_out = []
  for name, op, node, inputs in cases(rng, FLAGS.rows, FLAGS.width, FLAGS.adam_elements):
    if op == "Adam":
      twin = jax.jit(lambda *a, node=node: list(fused.adam_math(node.params, *a[:4], a[4:])))
    else:
      kernel = registry.select_kernel(node, "cpu")  # the XLA kernel, on any platform
      twin = jax.jit(lambda *a, node=node, kernel=kernel: kernel.fn(node, *a))
    fn = pallas.INTERPRETED[op] if interpret else getattr(pallas, {
        "Softmax": "softmax", "LayerNorm": "layer_norm", "RMSNorm": "rms_norm",
        "Adam": "adam"}[op])
    kern = jax.jit(lambda *a, node=node, fn=fn: fn(node, *a))
    want, got = twin(*inputs), kern(*inputs)
    apart = [_apart(w, o) for w, o in zip(want, got)]
    worst, diff = max(a[0] for a in apart), max(a[1] for a in apart)
    specials = all(a[2] for a in apart)
    t_xla, t_pallas = common.compare_us([lambda: twin(*inputs), lambda: kern(*inputs)],
                                        FLAGS.calls, FLAGS.repeats, warmup=3)
    rows_out.append((name, f"{t_xla:.1f}", f"{t_pallas:.1f}", f"{t_pallas / t_xla:.2f}",
                     worst, f"{diff:.2g}", "yes" if specials else "NO"))
  print(f"machine: {common.machine()}")
  mode = "interpreted (not a speed measurement)" if interpret else "compiled by Triton"
  common.print_table(
      f"Pallas kernels ({mode}) vs their XLA twins, µs per call, median of "
      f"{FLAGS.repeats} interleaved repeats; rows {FLAGS.rows} x {FLAGS.width}", rows_out,
      ["kernel", "XLA µs", "Pallas µs", "Pallas / XLA", "max ulps apart (finite)",
       "max abs difference", "non-finite alike"])


if __name__ == "__main__":
  app.run(main)
