"""The compile cache (runtime/fingerprint.py, runtime/compile_cache.py): the fingerprint of the
optimised graph, the in-memory ExecutableCache and its use by Build, and
JAX's persistent cache across processes."""
import gc
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import weakref

from absl.testing import absltest
import pytest
import jax
import jax.numpy as jnp
import numpy as np
from jax import tree_util

import jaxsession as js
from exact import assert_equal_signed, assert_same_bits
from jaxsession import gc_pause, pipeline
from jaxsession.errors import HostOpError
from jaxsession.graph.importer import import_jaxpr
from jaxsession.inputs import ArgSpec
from jaxsession.optimizer_passes.base import PassContext
from jaxsession.runtime import build, compile_cache, executor, state_layout
from jaxsession.runtime import fingerprint as fingerprints
from jaxsession.runtime.compile_cache import DoNotStore, ExecutableCache, RecordingCache
from jaxsession.runtime.fingerprint import fingerprint, options_key


def optimised(fn, *args, options=None):
  """fn's KernelGraph after every graph stage, as Session.compile leaves it."""
  options = options or js.SessionOptions()
  closed = jax.make_jaxpr(fn)(*args)
  graph = import_jaxpr(closed, name=getattr(fn, "__name__", "f"))
  ctx = PassContext(platform="cpu", options=options, verify=True)
  optimizer = pipeline.graph_optimizer(options.disabled_passes)
  with gc_pause.paused():
    for stage in pipeline.GRAPH_STAGES:
      optimizer.run_stage(stage, graph, ctx)
  return graph


def fp(fn, *args, options=None):
  options = options or js.SessionOptions()
  graph = optimised(fn, *args, options=options)
  avals = [[jax.api_util.shaped_abstractify(x)] for x in args]
  return fingerprint(graph, avals, options_key(options), "cpu")


def renumber(graph, offset):
  """The same graph with every value and node id moved by `offset`."""
  consts = {}
  for value in graph.values():
    if value.id in graph.const_values:
      consts[value.id + offset] = graph.const_values[value.id]
    value.id += offset
  for node in graph.nodes:
    node.id += offset
  graph.const_values = consts
  return graph


def _host_times(k):
  def times(x):  # a new closure per k: a callback that differs by a cell only
    return jax.pure_callback(lambda a: (a * k).astype(a.dtype),
                             jax.ShapeDtypeStruct(x.shape, x.dtype), x)
  return times


def _inline_callback(x):
  return jnp.sin(jax.pure_callback(lambda a: a + 1, jax.ShapeDtypeStruct(x.shape, x.dtype), x))


X = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float32)


class FingerprintTest(absltest.TestCase):

  def test_two_traces_of_one_program_agree(self):
    def f(x, y):
      return jnp.tanh(x @ y) * 2.0 + jnp.sum(y)
    y = jnp.ones((8, 3))
    self.assertEqual(fp(f, X[None], y), fp(f, X[None], y))

  def test_value_ids_do_not_enter(self):
    def f(x):
      return jnp.cos(x) * 3.0
    a = optimised(f, X)
    b = renumber(optimised(f, X), 1000)
    self.assertNotEqual([v.id for v in a.values()], [v.id for v in b.values()])
    avals = [[jax.api_util.shaped_abstractify(X)]]
    self.assertEqual(fingerprint(a, avals, (), "cpu"), fingerprint(b, avals, (), "cpu"))

  def test_dead_code_removed_gives_the_same_program(self):
    def lean(x):
      return jnp.sin(x) * 2.0

    def with_dead_code(x):
      dead = jnp.exp(x) + jnp.cos(x)
      return (jnp.sin(x) * 2.0, dead)[0]
    self.assertEqual(fp(lean, X), fp(with_dead_code, X))

  def test_literals_differ(self):
    self.assertNotEqual(fp(lambda x: x * 2.0, X), fp(lambda x: x * 3.0, X))
    self.assertNotEqual(fp(lambda x: jnp.maximum(x, 0.0), X),
                        fp(lambda x: jnp.maximum(x, -0.0), X))   # -0.0 is not 0.0
    self.assertNotEqual(fp(lambda x: x + 1, X.astype(jnp.int32)),
                        fp(lambda x: x + 2, X.astype(jnp.int32)))

  def test_consts_differ_by_value(self):
    c1 = jnp.arange(8.0)
    c2 = jnp.arange(8.0).at[3].set(-0.0)
    c3 = jnp.arange(8.0)   # another array with c1's value
    self.assertNotEqual(fp(lambda x: x * c1, X), fp(lambda x: x * c2, X))
    self.assertEqual(fp(lambda x: x * c1, X), fp(lambda x: x * c3, X))

  def test_callbacks_differ_in_the_same_structure(self):
    host = js.SessionOptions()
    inside = js.SessionOptions(host_callbacks=False)  # callbacks inside the executable
    for options in (host, inside):
      two, three = _host_times(2.0), _host_times(3.0)
      self.assertNotEqual(fp(lambda x: jnp.sin(two(x)), X, options=options),
                          fp(lambda x: jnp.sin(three(x)), X, options=options))
      # the same function object twice: one program
      self.assertEqual(fp(lambda x: jnp.sin(two(x)), X, options=options),
                       fp(lambda x: jnp.sin(two(x)), X, options=options))
      # different code, same structure
      self.assertNotEqual(
          fp(lambda x: jax.pure_callback(lambda a: a * 2, jax.ShapeDtypeStruct((8,), X.dtype),
                                         x), X, options=options),
          fp(lambda x: jax.pure_callback(lambda a: a * 3, jax.ShapeDtypeStruct((8,), X.dtype),
                                         x), X, options=options))

  def test_inline_lambda_callback_is_one_program_across_traces(self):
    # a closure-free lambda is a new object at each trace, with one code object
    self.assertEqual(fp(_inline_callback, X), fp(_inline_callback, X))

  def test_callback_inside_a_scan_body_differs(self):
    def scanned(times):
      def f(x):
        return jax.lax.scan(lambda c, a: (c + times(a), None), x, jnp.stack([x, x]))[0]
      return f
    two, three = _host_times(2.0), _host_times(3.0)
    self.assertNotEqual(fp(scanned(two), X), fp(scanned(three), X))
    self.assertEqual(fp(scanned(two), X), fp(scanned(two), X))

  def test_dtype_and_weak_type_differ(self):
    def f(x, s):
      return x * s
    weak = fp(f, X, 2.0)
    strong = fp(f, X, jnp.float32(2.0))
    self.assertNotEqual(weak, strong)
    self.assertNotEqual(fp(jnp.sin, X), fp(jnp.sin, X.astype(jnp.bfloat16)))
    self.assertNotEqual(fp(jnp.sin, X), fp(jnp.sin, X[:4]))

  def test_options_that_change_executables(self):
    base = js.SessionOptions()
    self.assertNotEqual(fp(jnp.sin, X, options=base),
                        fp(jnp.sin, X, options=js.SessionOptions(fold_limit_bytes=16)))
    self.assertNotEqual(fp(jnp.sin, X, options=base),
                        fp(jnp.sin, X, options=js.SessionOptions(host_callbacks=False)))
    # dumps, checks, caches and bookkeeping do not change an executable: each
    # of the fields options.md lists, set away from its default
    with tempfile.TemporaryDirectory() as folder:
      others = dict(save_graphs=folder, verify_graphs=False, run_op_cache_size=3,
                    compile_cache_size=5, compilation_cache_dir=folder,
                    recompile_warn_limit=2, precompile_buckets=True, enable_profiling=True,
                    checkpoint_keep=2)
      self.assertEqual(set(others), set(fingerprints.NOT_EXECUTABLE_OPTIONS))
      for name, value in others.items():
        self.assertEqual(fp(jnp.sin, X, options=base),
                         fp(jnp.sin, X, options=js.SessionOptions(**{name: value})), name)
      self.assertEqual(fp(jnp.sin, X, options=base),
                       fp(jnp.sin, X, options=js.SessionOptions(**others)))

  def test_identity_tokens_are_never_reused(self):
    class Param:  # a param whose repr shows only its address
      pass
    tokens, ids = set(), set()
    for _ in range(200):
      obj = Param()
      ids.add(id(obj))
      tokens.add(fingerprints.canonical(obj))
      del obj                  # CPython hands the address to the next one...
    self.assertLen(tokens, 200)  # ...but never the token
    self.assertLessEqual(len(ids), 200)

  def test_platform_and_extra_enter(self):
    graph = optimised(jnp.sin, X)
    key = fingerprint(graph, [], (), "cpu")
    self.assertNotEqual(key, fingerprint(graph, [], (), "gpu"))
    self.assertNotEqual(key, fingerprint(graph, [], (), "cpu", extra=("tree", 1)))
    self.assertRegex(key, "^[0-9a-f]{64}$")


class ExecutableCacheTest(absltest.TestCase):

  def test_hit_miss_and_lru(self):
    cache = ExecutableCache(maxsize=2)
    made = []

    def thunk(name):
      return lambda: made.append(name) or name
    self.assertEqual(cache.get_or_compile("a", thunk("a")), ("a", False))
    self.assertEqual(cache.get_or_compile("a", thunk("a")), ("a", True))
    cache.get_or_compile("b", thunk("b"))
    cache.get_or_compile("a", thunk("a"))   # a most recent
    cache.get_or_compile("c", thunk("c"))   # evicts b
    self.assertNotIn("b", cache)
    self.assertIn("a", cache)
    self.assertEqual(cache.get_or_compile("b", thunk("b")), ("b", False))
    self.assertEqual(made, ["a", "b", "c", "b"])
    self.assertEqual(cache.cache_info(), (2, 4, 2, 2))

  def test_owners_pin_entries_until_released(self):
    cache = ExecutableCache(maxsize=1)
    cache.get_or_compile("a", lambda: "a", owner=1)
    cache.get_or_compile("b", lambda: "b", owner=2)
    cache.get_or_compile("a", lambda: "never", owner=3)  # shared: a hit, pinned twice
    for key in "cdef":  # unpinned entries: at most maxsize of them are kept
      cache.get_or_compile(key, lambda k=key: k)
    self.assertEqual(sorted(cache._entries), ["a", "b", "f"])
    cache.release_owner(1)
    self.assertIn("a", cache)  # owner 3 still uses it
    cache.release_owner(3)
    cache.release_owner(2)  # a and b unpinned: only the most recent of a, b, f stays
    self.assertEqual(list(cache._entries), ["f"])
    cache.release_owner(2)  # twice, or an owner that pinned nothing: no-op
    cache.release_owner(99)
    nothing_kept = ExecutableCache(maxsize=0)
    nothing_kept.get_or_compile("x", lambda: "x", owner=1)  # kept while owned
    self.assertIn("x", nothing_kept)
    nothing_kept.release_owner(1)
    self.assertNotIn("x", nothing_kept)

  def test_release_frees_the_executables(self):
    def step(w, x):
      return w * 0.5 + x, jnp.sum(w)
    w, x = np.float32([1.0, -2.0, 3.5]), np.float32([0.25, -0.0, 7.0])
    sess = js.Session()
    a = sess.compile(step, w, x, state_argnums=0)
    b = sess.compile(step, w, x, state_argnums=0)  # the same program: shared
    self.assertTrue(sess.report(b).cache.hit)
    self.assertIs(sess.executables(a)[0], sess.executables(b)[0])
    gone = weakref.ref(sess.executables(a)[0])
    sess.release(a)
    assert_equal_signed(sess.run(b, x), jax.jit(step)(w, x)[1])
    sess.release(b)
    gc.collect()
    self.assertIsNone(gone())  # nothing of the session keeps it
    self.assertEqual(len(sess._executables), 0)
    keeps = js.Session(js.SessionOptions(compile_cache_size=4))
    c = keeps.compile(step, w, x, state_argnums=0)
    keeps.release(c)
    d = keeps.compile(step, w, x, state_argnums=0)  # kept after its graph went
    self.assertTrue(keeps.report(d).cache.hit)
    with self.assertRaisesRegex(js.InputError, "compile_cache_size must be an int >= 0"):
      js.SessionOptions(compile_cache_size=-1)

  def test_do_not_store(self):
    cache = ExecutableCache(4)
    for _ in range(2):
      self.assertEqual(cache.get_or_compile("e", lambda: DoNotStore("v")), ("v", False))
    self.assertEqual(cache.cache_info(), (0, 0, 0, 4))

  def test_threads_compile_a_key_once(self):
    cache = ExecutableCache(8)
    calls, results = [], []
    start = threading.Barrier(8)

    def slow():
      calls.append(1)
      time.sleep(0.2)
      return object()

    def worker():
      start.wait()
      results.append(cache.get_or_compile("k", slow))
    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    self.assertLen(calls, 1)
    self.assertLen({id(value) for value, _ in results}, 1)
    self.assertEqual(sorted(hit for _, hit in results), [False] + [True] * 7)
    self.assertEqual(cache.cache_info()[:3], (7, 1, 1))

  def test_a_failed_compile_is_not_stored_and_waiters_retry(self):
    cache = ExecutableCache(8)
    gate = threading.Event()
    outcome = {}

    def failing():
      gate.wait()
      raise RuntimeError("xla failed")

    def first():
      try:
        cache.get_or_compile("k", failing)
      except RuntimeError as exc:
        outcome["first"] = str(exc)

    def second():
      outcome["second"] = cache.get_or_compile("k", lambda: "compiled by the second")
    t1 = threading.Thread(target=first)
    t1.start()
    time.sleep(0.05)  # t1 owns the compile now
    t2 = threading.Thread(target=second)
    t2.start()
    time.sleep(0.05)
    gate.set()
    t1.join()
    t2.join()
    self.assertEqual(outcome["first"], "xla failed")
    self.assertEqual(outcome["second"], ("compiled by the second", False))
    self.assertIn("k", cache)

  def test_bad_maxsize(self):
    with self.assertRaises(ValueError):
      ExecutableCache(-1)


class BuildWithCacheTest(absltest.TestCase):
  """compile_fn, single_program and build_program through the cache, as the
  Session's Build will use them."""

  def test_compile_recorded_keys_on_arg_types_and_donation(self):
    cache = ExecutableCache(8)
    structs = [jax.ShapeDtypeStruct((4,), jnp.float32)]
    compiled = lambda *args, **kw: build.compile_recorded(jnp.sin, None, *args, **kw)[0]
    a = compiled(structs, cache=cache, key="sin")
    b = compiled(structs, cache=cache, key="sin")
    self.assertIs(a, b)
    compiled(structs, (0,), cache=cache, key="sin")
    compiled([jax.ShapeDtypeStruct((4,), jnp.float32, weak_type=True)], cache=cache, key="sin")
    compiled(structs)  # no cache: not counted
    self.assertEqual(cache.cache_info()[:3], (1, 3, 3))

  def _single(self, fn, x, cache):
    graph = optimised(fn, x)
    key = fingerprint(graph, [[jax.api_util.shaped_abstractify(x)]], (), "cpu")
    spec = ArgSpec("run(test)", [0], [x])
    layout = state_layout.state_layout(graph, graph.memory, [], True)
    rest_tree = tree_util.tree_structure(jax.eval_shape(fn, x))
    return executor.Runner(executor.single_program(graph, spec, rest_tree, layout,
                                                   cache=cache, key=key), layout)

  def test_single_runner_reuses_the_executable(self):
    def f(x):
      return {"a": jnp.tanh(x) * 2.0, "b": jnp.cumsum(x)}
    cache = RecordingCache(ExecutableCache(8))
    first = self._single(f, X, cache)
    second = self._single(f, X, cache)
    self.assertIs(first.exe, second.exe)
    self.assertEqual((cache.use.hits, cache.use.misses), (1, 1))
    self.assertFalse(cache.use.hit)  # the first one compiled
    self.assertEqual([(what, hit) for what, hit, _ in cache.use.lookups],
                     [(("single",), False), (("single",), True)])
    assert_same_bits(second.call((X,)), jax.jit(f)(X))
    # another output pytree is another executable
    self._single(lambda x: (jnp.tanh(x) * 2.0, jnp.cumsum(x)), X, cache)
    self.assertEqual(cache.use.misses, 2)

  def test_callback_failure_inside_a_cached_executable_names_the_cause(self):
    def boom(a):
      raise ValueError("user callback failed")

    def f(x):
      return jnp.sin(jax.pure_callback(boom, jax.ShapeDtypeStruct(x.shape, x.dtype), x))
    options = js.SessionOptions(host_callbacks=False)
    cache = ExecutableCache(8)
    runners = []
    for _ in range(2):
      graph = optimised(f, X, options=options)
      key = fingerprint(graph, [[jax.api_util.shaped_abstractify(X)]], options_key(options),
                        "cpu")
      layout = state_layout.state_layout(graph, graph.memory, [], True)
      runners.append(executor.Runner(executor.single_program(
          graph, ArgSpec("run(t)", [0], [X]), tree_util.tree_structure(0), layout,
          cache=cache, key=key), layout))
    self.assertIs(runners[0].exe, runners[1].exe)
    # the cached executable's callbacks write to the first recorder: the
    # second runner reads that one, so the cause is the user's exception
    with self.assertRaises(HostOpError) as caught:
      runners[1].call((X,))
    self.assertIsInstance(caught.exception.__cause__, ValueError)

  def test_build_program_reuses_each_partition(self):
    times = _host_times(2.0)

    def g(x):
      return jnp.cos(times(jnp.sin(x))) + x
    cache = RecordingCache(ExecutableCache(8))
    programs = []
    for _ in range(2):
      graph = optimised(g, X)
      self.assertEqual([p.place for p in graph.partitions], ["device", "host", "device"])
      key = fingerprint(graph, [[jax.api_util.shaped_abstractify(X)]], (), "cpu")
      spec = ArgSpec("run(t)", [0], [X])
      program = build.build_program(graph, graph.partitions, graph.memory, spec, "cpu",
                                    cache=cache, key=key)
      programs.append((graph, program, spec))
    self.assertEqual((cache.use.hits, cache.use.misses), (2, 2))
    self.assertEqual([what for what, _, _ in cache.use.lookups],
                     [("partition", 0), ("partition", 2)] * 2)
    graph, program, spec = programs[1]
    layout = state_layout.state_layout(graph, graph.memory, [], False)
    program = executor.plan_program(graph, program, spec, tree_util.tree_structure(0), layout)
    runner = executor.Runner(program, layout)
    assert_same_bits(runner.call((X,)), jax.jit(g)(X))


_PERSISTENT_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import jax, jax.numpy as jnp
    from jaxsession.runtime.compile_cache import enable_persistent_cache

    events, durations = [], {}
    jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: durations.setdefault(name, []).append(secs))
    path = sys.argv[1]
    assert enable_persistent_cache(path) == os.path.abspath(path)
    assert enable_persistent_cache(path) == os.path.abspath(path)   # idempotent
    assert jax.config.values["jax_persistent_cache_min_compile_time_secs"] == 0

    def chain(x):
        for i in range(300):   # a moderately big program: 300 chained ops
            x = jnp.sin(x) * 1.0001 + i if i % 2 else jnp.cos(x) - x * 0.5
        return x

    start = time.perf_counter()
    exe = jax.jit(chain).lower(jax.ShapeDtypeStruct((128,), jnp.float32)).compile()
    seconds = time.perf_counter() - start
    out = exe(jnp.linspace(0, 1, 128, dtype=jnp.float32))
    hits = events.count("/jax/compilation_cache/cache_hits")

    # a Session's executables go through the same cache (process-wide)
    import jaxsession as js
    def train_step(w, x):
        for i in range(50):
            x = jnp.tanh(x @ w) + 0.01 * i
        return w * 0.999, jnp.sum(x)
    sess = js.Session()
    gid = sess.compile(train_step, jnp.eye(8) * 0.3, jnp.ones((2, 8)), state_argnums=0)
    loss = float(sess.run(gid, jnp.ones((2, 8))))
    print(json.dumps({
        "hits": hits,
        "session_hits": events.count("/jax/compilation_cache/cache_hits") - hits,
        "requests": events.count("/jax/compilation_cache/compile_requests_use_cache"),
        "seconds": seconds,
        "saved": sum(durations.get("/jax/compilation_cache/compile_time_saved_sec", [])),
        "checksum": [float(jnp.sum(out)), loss],
    }))
    """)


@pytest.mark.slow
class PersistentCacheTest(absltest.TestCase):

  def _run(self, folder):
    result = subprocess.run([sys.executable, "-c", _PERSISTENT_SCRIPT, folder],
                            capture_output=True, text=True, timeout=600)
    self.assertEqual(result.returncode, 0, result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])

  def test_a_second_process_skips_xla_compilation(self):
    with tempfile.TemporaryDirectory() as folder:
      cold = self._run(folder)
      entries = sorted(os.listdir(folder))
      self.assertNotEmpty(entries)  # the executable was written
      warm = self._run(folder)
      self.assertEqual(cold["hits"], 0)
      self.assertGreaterEqual(cold["requests"], 1)
      self.assertGreaterEqual(warm["hits"], 1)   # loaded, not compiled
      self.assertEqual(cold["session_hits"], 0)
      self.assertGreaterEqual(warm["session_hits"], 1)
      self.assertEqual(warm["checksum"], cold["checksum"])
      self.assertEqual(sorted(os.listdir(folder)), entries)  # nothing new to write
      print(f"persistent cache: cold compile {cold['seconds']:.3f} s, warm "
            f"{warm['seconds']:.3f} s (jax reports {warm['saved']:.3f} s saved)")

  def test_enable_checks_its_argument(self):
    with self.assertRaises(TypeError):
      compile_cache.enable_persistent_cache(3)


class WeakTypeCheckCostTest(absltest.TestCase):
  """compile's weak-type check (session/tracing.py) traces the program again
  per numeric run argument, unless no weak type can matter
  (weak_type_is_moot: one default dtype, or bool, everywhere); the skip must
  agree with the re-traces it replaces."""

  @staticmethod
  def programs():
    f32 = lambda *s: jnp.asarray(np.random.default_rng(0).standard_normal(s), jnp.float32)
    w = f32(4, 4)
    scan = lambda x, s: jax.lax.scan(lambda c, _: (c * s + 1.0, c), x, None, length=3)
    return [  # (name, fn, args, moot)
        ("f32 mlp, weak scalar", lambda x, s: jnp.tanh(x @ w * s + 1) - 2, (f32(3, 4), 0.5),
         True),
        ("f32 mlp, strong scalar", lambda x, s: jnp.tanh(x @ w * s + 1), (f32(3, 4),
                                                                          jnp.float32(0.5)),
         True),
        ("f32 where, comparisons", lambda x, s: jnp.where(x > s, x * 2, s), (f32(5), 0.1),
         True),
        ("f32 scan", lambda x, s: scan(x, s), (f32(4), 0.3), True),
        ("f32 cond (an int32 branch index: not moot, checked by retracing)",
         lambda x, s: jax.lax.cond(s > 0, lambda: x * s, lambda: x), (f32(4), 0.3), False),
        ("int32 with python ints", lambda i, j: i * 2 + j // 3,
         (jnp.arange(4, dtype=jnp.int32), 7), True),
        ("bf16 times a weak f32", lambda x, lr: x * lr, (f32(3).astype(jnp.bfloat16), 0.1),
         False),
        ("f32 plus an int32 arange", lambda x, s: x * s + jnp.arange(3), (f32(3), 2.0), False),
        ("int32 divided: f32", lambda i, s: i / s, (jnp.arange(3, dtype=jnp.int32), 2), False),
        ("f16 mixed with f32", lambda x, s: x.astype(jnp.float16) * s, (f32(3), 0.5), False),
    ]

  def test_skip_agrees_with_the_retraces(self):
    from jaxsession import tracing  # pylint: disable=import-outside-toplevel
    for name, fn, args, moot in self.programs():
      wrapped = tracing.stateful_fn(fn, name, args, (), list(range(len(args))), False)
      closed = jax.make_jaxpr(wrapped)((), *args)
      self.assertEqual(tracing.weak_type_is_moot(closed.jaxpr), moot, name)
      slow = tracing.weak_sensitive(wrapped, closed, [], list(args), fast=False)
      fast = tracing.weak_sensitive(wrapped, closed, [], list(args))
      if moot:
        self.assertEqual(slow, [], name)
        self.assertEqual(fast, [], name)
        # flipping every subset of the leaves at once changes nothing either
        arithmetic = tracing._arithmetic  # pylint: disable=protected-access
        base = arithmetic(closed.jaxpr)
        avals = [jax.api_util.shaped_abstractify(a) for a in args]
        for mask in range(1, 1 << len(args)):
          flipped = [jax.ShapeDtypeStruct(a.shape, a.dtype,
                                          weak_type=a.weak_type ^ bool(mask >> k & 1))
                     for k, a in enumerate(avals)]
          again = jax.make_jaxpr(wrapped)((), *flipped)
          self.assertEqual(arithmetic(again.jaxpr), base, f"{name}, flips {mask:b}")
      else:
        self.assertEqual(fast, slow, name)
    self.assertNotEqual(slow, [])  # the f16 program: its scalar's weak type matters

  def test_compile_traces_an_all_float32_program_once(self):
    traces = []

    def f32_program(x, s):
      traces.append(1)
      return jnp.tanh(x * s) + 1.0
    js.Session().compile(f32_program, jnp.ones((2, 3)), 0.5)
    self.assertLen(traces, 1)
    traces.clear()

    def mixed(x, s):
      traces.append(1)
      return x * s
    js.Session().compile(mixed, jnp.ones(3, jnp.bfloat16), 0.5)
    self.assertGreater(len(traces), 1)  # the check traces again: the weak type matters


class ManyScalarArgumentsTest(absltest.TestCase):

  def test_a_weak_type_past_the_eighth_argument_is_still_guarded(self):
    # flipping x and y together cancels out (weak bf16 times weak f32 is f32):
    # each candidate is traced on its own, however many there are
    def f(d0, d1, d2, d3, d4, d5, d6, d7, x, y):
      return x * y, d0 + d1 + d2 + d3 + d4 + d5 + d6 + d7
    ds = [jnp.float32(i) for i in range(8)]
    x = jnp.asarray(np.random.default_rng(3).standard_normal(3), jnp.bfloat16)
    sess = js.Session()
    gid = sess.compile(f, *ds, x, jnp.float32(1.3))
    got = sess.run(gid, *ds, x, jnp.float32(1.3))[0]
    assert_equal_signed(got, jax.jit(f)(*ds, x, jnp.float32(1.3))[0])
    with self.assertRaisesRegex(js.InputError, "argument 9 .* weakly typed"):
      sess.run(gid, *ds, x, 1.3)  # jax.jit gives bf16 here, the graph f32


if __name__ == "__main__":
  absltest.main()
