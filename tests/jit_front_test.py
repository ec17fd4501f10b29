"""jaxsession.jit's C++ front: a signature whose graph is one executable and
nothing around it runs in jax.jit's own C++ call, its Python path taken
once; every other call takes the Python path; what the front runs is what
the Python path and jax.jit return, bit for bit, at every call."""
import gc
import threading
import traceback
from unittest import mock

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jaxsession import jitted
import tests.jit_test as jt


def frames(jit, mode, fn, *args):
  """(file, function) of the frames a traceback shows for fn(*args) under
  JAX_TRACEBACK_FILTERING=mode; the exception's type name."""
  before = jax.config.jax_traceback_filtering
  jax.config.update("jax_traceback_filtering", mode)
  try:
    jit(fn)(*args)
  except (AssertionError, TypeError) as exc:  # fn's assert; jax's TypeError
    kept = [(f, line) for f, line in traceback.walk_tb(exc.__traceback__)
            if not (mode == "tracebackhide" and "__tracebackhide__" in f.f_locals)]
    return type(exc).__name__, [(s.filename, s.name)
                                for s in traceback.StackSummary.extract(kept)]
  finally:
    jax.config.update("jax_traceback_filtering", before)
  raise AssertionError("no error")


class PythonCalls:
  """Counts the wrapper's Python path (Jitted._call) calls."""

  def __init__(self, test):
    self.count = 0
    real = jitted.Jitted._call

    def counted(wrapper, *args, **kwargs):
      self.count += 1
      return real(wrapper, *args, **kwargs)
    self.patcher = mock.patch.object(jitted.Jitted, "_call", counted)
    self.patcher.start()
    test.addCleanup(self.stop)

  def stop(self):
    if self.patcher is not None:
      self.patcher.stop()
      self.patcher = None


class JitFrontTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.rng = np.random.default_rng(46)
    self.calls = PythonCalls(self)

  def check(self, fn, *arg_lists, python_calls, **jit_kwargs):
    """fn through js.jit and jax.jit on each argument list three times:
    bit-equal outputs, commitment and weak types included; the Python path
    taken `python_calls` times in all."""
    ours, ref = js.jit(fn, session=js.Session(), **jit_kwargs), jax.jit(fn, **jit_kwargs)
    before = self.calls.count
    for args in arg_lists:
      for _ in range(3):
        got, want = ours(*args), ref(*args)
        jt.same(self, got, want)
        self.assertEqual([x.committed for x in jax.tree.leaves(got)],
                         [x.committed for x in jax.tree.leaves(want)])
    self.assertEqual(self.calls.count - before, python_calls)
    return ours

  def test_a_hot_signature_runs_in_the_front_bit_for_bit(self):
    x = jt.nasty(self.rng, (5, 3))
    y = jt.nasty(self.rng, (3,))
    big = jnp.asarray([2**31 - 1, -2**31, 7], jnp.int32)

    def f(x, y, n):
      return {"s": jnp.sin(x) * y + 1.0, "m": jnp.max(x, axis=0), "n": n * 3 + 1,
              "x": x}  # an input returned as it came
    self.check(f, (x, y, big), (x[::-1], y * 2, big[::-1]), python_calls=1)
    # numpy arguments: another signature to jax's C++ call (no sharding), one graph
    self.check(f, (x, y, big), (np.asarray(x), np.asarray(y), np.asarray(big)),
               python_calls=2)
    self.check(f, (x, y, big), (x[:2], y, big[:1]), python_calls=2)  # another shape

  def test_many_signatures_stay_in_the_front(self):
    ours = js.jit(lambda x: x * 2.0 - 1.0, session=js.Session())
    xs = [jt.nasty(self.rng, (n,)) for n in range(4, 24)]
    for x in xs:
      ours(x)
    before = self.calls.count
    for x in xs:  # (a front keeping 8 signatures took the Python path at each)
      jt.same(self, ours(x), x * 2.0 - 1.0)
    self.assertEqual(self.calls.count, before)

  def test_key_arrays_pythons_scalars_and_x64(self):
    key = jax.random.key(3)
    x = jt.nasty(self.rng, (8,))
    self.check(lambda k, x: x + jax.random.normal(k, x.shape), (key, x),
               (jax.random.split(key)[1], x), python_calls=1)
    # a Python scalar: a weakly typed argument of the signature, as in jax.jit's
    self.check(lambda x, s: x * s, (x, 2.5), (x, -0.0), (x, np.float32(2.5)), python_calls=2)
    with jax.enable_x64(True):
      wide = jnp.asarray([2**62 + 3, -2**63, 0], jnp.int64)
      self.check(lambda a: (a // 3, a.astype(jnp.float64) * 0.1), (wide,), (wide[::-1],),
                 python_calls=1)

  def test_calls_the_front_cannot_run(self):
    x = jt.nasty(self.rng, (4,))
    # keyword arguments: the graph takes them first, the front passes them last
    ours, ref = js.jit(lambda x, *, s: x * s, session=js.Session()), jax.jit(lambda x, *, s: x * s)
    for _ in range(2):
      jt.same(self, ours(x, s=x), ref(x, s=x))
    self.assertEqual(self.calls.count, 2)
    # a host callback between executables; statics (split in Python)
    seen = []

    def logged(x):
      jax.debug.callback(lambda v: seen.append(np.asarray(v)), x)
      return x + 1
    self.check(logged, (x,), python_calls=3)
    self.assertLen(seen, 6)
    # a host op that makes the device partition's input, the output a list: a
    # plan of one executable and a host op (its executable ran alone: a review's find)
    def host_then_device(v):
      y = jax.pure_callback(lambda a: np.sin(np.asarray(a)[:2]) + 100,
                            jax.ShapeDtypeStruct((2,), v.dtype), v)
      return [y * 2.0]
    self.check(host_then_device, (x,), python_calls=3)
    # a static position counted from the end: found per call, in Python
    self.check(lambda x, n: x * n, (x, 3), python_calls=3, static_argnums=-1)
    # an argument committed to the session's device: jax.jit commits the
    # outputs, so does the front (its signature: another one, the same graph)
    committed = jax.device_put(x, jax.devices()[0])
    self.check(lambda x: x * 2, (committed,), (x,), (committed,), python_calls=2)

  def test_static_arguments_key_the_fronts_signatures(self):
    """Statics by position or name: one graph per static value and type (2,
    2.0 and True trace other programs), each run by the front after its
    first call; keyword statics too (no dynamic keyword argument left)."""
    def f(x, k, *, mode="mul"):
      return x * k if mode == "mul" else x - k
    x = jt.nasty(self.rng, (5,))
    for statics in ({"static_argnums": 1}, {"static_argnames": ("k", "mode")},
                    {"static_argnums": (1,), "static_argnames": ("mode",)}):
      wrapped, ref = js.jit(f, session=js.Session(), **statics), jax.jit(f, **statics)
      before = self.calls.count
      for _ in range(3):
        for args, kwargs in (((x, 2), {}), ((x, 2.0), {}), ((x, True), {}),
                             ((x, 3), {"mode": "sub"})):
          if "mode" not in statics.get("static_argnames", ()) and kwargs:
            continue  # mode is no static there: a str argument, jax.jit's TypeError
          jt.same(self, wrapped(*args, **kwargs), ref(*args, **kwargs))
      runs = 4 if "mode" in statics.get("static_argnames", ()) else 3
      self.assertEqual(self.calls.count - before, runs, statics)

  def test_cleared_and_released_graphs_leave_the_front(self):
    scale = [2.0]

    def f(x):
      return x * scale[0]
    sess = js.Session()
    ours, x = js.jit(f, session=sess), jt.nasty(self.rng, (4,))
    ours(x)
    ours(x)
    self.assertEqual(self.calls.count, 1)
    scale[0] = 3.0
    jax.clear_caches()  # jax.jit traces again, so does js.jit: the front forgot
    jt.same(self, ours(x), jax.jit(f)(x))
    self.assertEqual(self.calls.count, 2)
    scale[0] = 4.0
    ours.clear_cache()
    jt.same(self, ours(x), x * 4.0)
    ours(x)
    self.assertEqual(self.calls.count, 3)
    (gid,) = ours.graph_ids
    sess.release(gid)  # by hand: the next call compiles again (its Python path
    jt.same(self, ours(x), x * 4.0)  # finds the graph gone, then compiles: 2)
    ours(x)
    self.assertEqual(self.calls.count, 5)
    self.assertNotIn(gid, ours.graph_ids)
    self.assertLen(ours.graph_ids, 1)

  def test_a_new_wrapper_of_the_function_shares_the_front(self):
    def f(x):
      return jnp.cos(x) - 1.0
    sess, x = js.Session(), jt.nasty(self.rng, (6,))
    js.jit(f, session=sess)(x)
    jt.same(self, js.jit(f, session=sess)(x), jax.jit(f)(x))
    self.assertEqual(self.calls.count, 1)
    js.jit(f, session=js.Session())(x)  # another session: its own graphs
    self.assertEqual(self.calls.count, 2)

  def test_debug_flags_disable_jit_and_traces_after_the_front(self):
    traced = []

    def f(x):
      traced.append(type(x))
      return jnp.log(x) * 2.0
    ours = js.jit(f, session=js.Session())
    x = jnp.asarray(self.rng.uniform(1, 2, (4,)), jnp.float32)
    ours(x)
    ours(x)
    with jax.debug_nans(True):
      with self.assertRaisesRegex(FloatingPointError, "nan"):
        ours(-x)
      with self.assertRaisesRegex(FloatingPointError, "nan"):
        jax.jit(f)(-x)
    del traced[:]
    with jax.disable_jit():  # fn op by op, on arrays
      jt.same(self, ours(x), jnp.log(x) * 2.0)
    self.assertEqual(traced, [type(x)])
    jt.same(self, jax.vmap(ours)(x[:, None]), jax.vmap(jax.jit(f))(x[:, None]))
    jt.same(self, jax.grad(lambda v: ours(v).sum())(x), jax.grad(lambda v: jax.jit(f)(v).sum())(x))
    deleted = jnp.ones(4) + x
    deleted.delete()
    with self.assertRaisesRegex(RuntimeError, "deleted"):
      ours(deleted)

  def test_tracebacks_show_the_frames_jax_jits_show(self):
    self.calls.stop()  # (its frame is this file's: it would show)
    def inner(x):
      assert x.ndim == 7, "wrong rank"

    def nested(jit):  # an error in a jitted function another one calls
      return lambda x: 2 + jit(inner)(x)

    class NoJaxType:
      pass
    for mode in ("remove_frames", "tracebackhide"):
      for make, arg in ((nested, jnp.arange(3.0)), (lambda jit: lambda a: a + 1, NoJaxType())):
        want = frames(jax.jit, mode, make(jax.jit), arg)
        ours = frames(js.jit, mode, make(js.jit), arg)
        self.assertEqual(ours, want)
        self.assertEqual(ours[0], "TypeError" if make is not nested else "AssertionError")
        self.assertNotIn("jaxsession", str(ours))
      # a wrapper with statics: no front, its Python path behind jax's boundary
      self.assertEqual(frames(lambda f: js.jit(f, static_argnums=1), mode,
                              lambda x, n: inner(x * n), jnp.ones(2), 3),
                       frames(lambda f: jax.jit(f, static_argnums=1), mode,
                              lambda x, n: inner(x * n), jnp.ones(2), 3))

  def test_call_through_the_class_and_a_call_kept_alone(self):
    x = jt.nasty(self.rng, (3,))

    def double(v):
      return v * 2.0
    ours = js.jit(double, session=js.Session())
    jt.same(self, type(ours).__call__(ours, x), jax.jit(double)(x))  # as jax.jit's
    self.assertEqual(ours.__call__.__name__, "double")
    kept = js.jit(lambda v: v - 1.0, session=js.Session()).__call__  # the wrapper goes
    for shape in ((3,), (2, 2)):  # a new signature after it went: jax.jit's call
      y = jt.nasty(self.rng, shape)
      jt.same(self, kept(y), y - 1.0)
      jt.same(self, kept(y), y - 1.0)
    wrapper = js.jit(lambda v: v * 3.0, session=js.Session())
    y = jt.nasty(self.rng, (5,))
    wrapper(y)
    wrapper(y)  # the front runs the session's executable
    kept = wrapper.__call__
    self.assertEqual(kept._cache_size(), 1)  # pylint: disable=protected-access
    del wrapper
    gc.collect()  # the wrapper gone: jax.clear_caches() still empties the front kept
    jax.clear_caches()
    self.assertEqual(kept._cache_size(), 0)  # pylint: disable=protected-access
    jt.same(self, kept(y), y * 3.0)
    # an argument jax.jit refuses, found by the Python path in an except clause:
    # jax.jit's error, nothing of the session's chained into it
    with self.assertRaises(TypeError) as refused:
      ours(jax.ShapeDtypeStruct((3,), jnp.float32))
    with self.assertRaises(TypeError) as want:
      jax.jit(double)(jax.ShapeDtypeStruct((3,), jnp.float32))
    self.assertEqual(str(refused.exception), str(want.exception))
    self.assertEqual(repr(refused.exception.__context__), repr(want.exception.__context__))

  def test_pickled_as_jax_jits_function(self):
    import cloudpickle  # pylint: disable=import-outside-toplevel
    x = jt.nasty(self.rng, (4,))
    scale = 3.0
    ours = js.jit(lambda v, n: v * scale + n, static_argnums=1)
    ours(x, 2)
    back = cloudpickle.loads(cloudpickle.dumps(ours))
    self.assertIsInstance(back, jitted.Jitted)
    jt.same(self, back(x, 2), jax.jit(lambda v, n: v * scale + n, static_argnums=1)(x, 2))
    self.assertIs(back.session, js.jit(abs).session)  # the default one, where loaded

  def test_threads_share_the_front(self):
    ours = js.jit(lambda x: jnp.tanh(x) * 3.0, session=js.Session())
    xs = [jt.nasty(self.rng, (16,)) for _ in range(4)]
    want = [jax.jit(lambda x: jnp.tanh(x) * 3.0)(x) for x in xs]
    errors = []

    def worker(i):
      try:
        for _ in range(200):
          jt.same(self, ours(xs[i]), want[i])
      except Exception as exc:  # pylint: disable=broad-except
        errors.append(exc)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    self.assertEqual(errors, [])
    self.assertLessEqual(self.calls.count, 4)  # one per thread at most: compiles race


if __name__ == "__main__":
  absltest.main()
