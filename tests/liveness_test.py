"""The liveness analysis (session/graph/liveness.py) against a brute-force last use,
on random programs, per node and per partition; and the programs it frees
values in still compute what jax.jit computes."""
from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jaxsession.graph import liveness
from jaxsession.graph.ir import Literal
from jaxsession.runtime.partition import Partition
from tests.exact import assert_same_bits

RNG = np.random.default_rng(2718)
UNARY = (jnp.sin, jnp.tanh, jnp.exp, lambda v: v * 0.5)
BINARY = (jnp.add, jnp.multiply, jnp.subtract, jnp.maximum)


def random_program(seed):
  """fn(x, y) over a random DAG of elementwise ops; some results unused."""
  rng = np.random.default_rng(seed)
  plan = []
  for _ in range(rng.integers(4, 14)):
    if rng.random() < 0.5:
      plan.append((int(rng.integers(len(UNARY))), None, None))
    else:
      plan.append((None, int(rng.integers(len(BINARY))), None))
  picks = [(int(rng.integers(1 << 30)), int(rng.integers(1 << 30))) for _ in plan]
  n_out = int(rng.integers(1, 4))

  def fn(x, y):
    pool = [x, y]
    for (u, b, _), (i, j) in zip(plan, picks):
      a = pool[i % len(pool)]
      pool.append(UNARY[u](a) if u is not None else BINARY[b](a, pool[j % len(pool)]))
    return tuple(pool[-1 - k] for k in range(min(n_out, len(pool))))
  return fn


def brute_force_last(steps, keep):
  """id -> last step reading it; its writer if none does; len(steps) if kept."""
  last = {}
  ids = {vid for reads, writes in steps for vid in (*reads, *writes)} | set(keep)
  for vid in ids:
    readers = [k for k, (reads, _) in enumerate(steps) if vid in reads]
    writers = [k for k, (_, writes) in enumerate(steps) if vid in writes]
    last[vid] = len(steps) if vid in keep else max(readers + writers)
  return last


def _node_steps(nodes):
  return [([v.id for v in n.inputs if not isinstance(v, Literal)], [o.id for o in n.outputs])
          for n in nodes]


class LivenessTest(absltest.TestCase):

  def _graph(self, seed):
    x, y = (RNG.standard_normal((3, 4)).astype(np.float32) for _ in range(2))
    fn = random_program(seed)
    sess = js.Session()
    gid = sess.compile(fn, x, y)
    assert_same_bits(sess.run(gid, x, y), jax.jit(fn)(x, y), f"program {seed}")
    return sess.graph(gid)

  def test_per_node_agrees_with_brute_force_on_random_programs(self):
    for seed in range(8):
      graph = self._graph(seed)
      keep = [v for v in graph.outputs if not isinstance(v, Literal)]
      got = liveness.of_nodes(graph.nodes, keep)
      steps = _node_steps(graph.nodes)
      self.assertEqual(got.last, brute_force_last(steps, {v.id for v in keep}), seed)
      frees = got.frees()
      freed = [vid for free in frees for vid in free]
      self.assertEqual(len(freed), len(set(freed)), seed)  # each value freed once
      self.assertFalse(set(freed) & {v.id for v in keep}, seed)
      for k, free in enumerate(frees):
        for vid in free:  # never read after it is freed
          self.assertFalse(any(vid in reads for reads, _ in steps[k + 1:]), seed)

  def test_per_partition_agrees_with_brute_force_on_random_cuts(self):
    for seed in range(8):
      graph = self._graph(100 + seed)
      nodes = list(graph.nodes)
      cuts = sorted(set(RNG.integers(1, max(len(nodes), 2), size=3).tolist()))
      bounds = [0] + [c for c in cuts if c < len(nodes)] + [len(nodes)]
      parts = [Partition(i, "device", nodes[a:b], "") for i, (a, b)
               in enumerate(zip(bounds, bounds[1:])) if b > a]
      got = liveness.of_partitions(graph, parts)
      steps = []
      for part in parts:
        node_steps = _node_steps(part.nodes)
        steps.append(([v for r, _ in node_steps for v in r], [v for _, w in node_steps for v in w]))
      keep = {v.id for v in graph.inputs} | {v.id for v in graph.outputs
                                             if not isinstance(v, Literal)}
      self.assertEqual(got.last, brute_force_last(steps, keep), seed)
      for vid, (made, last) in got.ranges().items():
        self.assertLessEqual(made, last, seed)
        writers = [k for k, (_, w) in enumerate(steps) if vid in w]
        self.assertEqual(made, writers[0] if writers else -1, seed)

  def test_a_value_made_and_read_in_one_partition_lives_there(self):
    steps = [((), (1,)), ((1,), (2,))]
    self.assertEqual(liveness.analyze(steps).ranges(), {1: (0, 1), 2: (1, 1)})
    merged = liveness.analyze([((1,), (1, 2))])  # one step makes and reads 1
    self.assertEqual(merged.ranges(), {1: (0, 0), 2: (0, 0)})
    self.assertEqual(liveness.analyze(steps, keep=(2,)).live_after(1), [2])


if __name__ == "__main__":
  absltest.main()
