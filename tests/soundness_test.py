"""Soundness: state is never lost, callbacks fail as HostOpError and run as
jax.jit runs them, aliased state stays valid, arguments are conformed or
refused (never a silent recompile). Every comparison with jax.jit is bit for
bit, on fresh random inputs salted with -0.0, NaN and inf."""

from absl.testing import absltest
import pytest
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

import jaxsession as js
from exact import assert_equal_signed


def salted(rng, shape, dtype=np.float32):
  """Standard-normal values with -0.0, NaN, +inf and a large value mixed in."""
  x = rng.standard_normal(shape).astype(dtype)
  flat = x.reshape(-1)
  for i, v in zip(rng.permutation(flat.size)[:4], (-0.0, np.nan, np.inf, 3e7)):
    flat[i] = v
  return jnp.asarray(x)


def assert_trees_equal(a, b, msg=""):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b), msg
  for x, y in zip(la, lb):
    assert_equal_signed(np.asarray(x), np.asarray(y), err_msg=msg)


class Faulty:
  """A numpy host function that counts its calls and raises from call k on."""

  def __init__(self):
    self.calls = 0
    self.fail_at = None

  def __call__(self, a):
    self.calls += 1
    if self.fail_at is not None and self.calls >= self.fail_at:
      raise ValueError(f"injected fault at call {self.calls}")
    return np.tanh(np.asarray(a))

  def cb(self, x):
    return jax.pure_callback(self, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def step_with_callback(where, host):
  """A train step w -> (w', loss) with a callback at `where`."""
  def step(w, x):
    if where == "top":
      h = host.cb(x)
    elif where == "scan":
      h, _ = lax.scan(lambda c, t: (c + host.cb(t), None), jnp.zeros_like(w), x[None])
    elif where == "cond":
      h = lax.cond(x[0] > -100, host.cb, lambda t: t, x)  # False only for NaN/-inf
    elif where == "while":
      h = lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, host.cb(c[1])), (0, x))[1]
    else:  # "host_and_scan": a host partition and a callback inside a device one
      h = host.cb(x) + lax.scan(lambda c, t: (c + host.cb(t), None), w, x[None])[0]
    return w * 0.5 + h, jnp.sum(w * h)
  return step


class FaultInjectionTest(absltest.TestCase):
  """A callback that raises at step k, wherever it is, in single and sunk
  runs: HostOpError with the user's exception as the cause, the state
  bit-identical to before, the session usable, and compile ran no callback."""

  def _check(self, where, options, steps):
    rng = np.random.default_rng(abs(hash((where, steps))) % 2**32)
    host = Faulty()
    step = step_with_callback(where, host)
    w = jnp.asarray(rng.standard_normal(5), jnp.float32)
    xs = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
    sess = js.Session(options)
    gid = sess.compile(step, w, xs[0], state_argnums=0)
    self.assertEqual(host.calls, 0, "compile ran the user's callback")
    sess.run(gid, xs[0])                       # one good step
    before = sess.get_state(gid)[0]
    host.fail_at = host.calls + 2              # fails inside the next call(s)
    with self.assertRaises(js.HostOpError) as caught:
      if steps:
        sess.run(gid, xs, steps=3)
      else:
        sess.run(gid, xs[1])
        sess.run(gid, xs[2])
    self.assertIsInstance(caught.exception.__cause__, ValueError)
    self.assertIn("injected fault", str(caught.exception))
    node_op = {"top": "pure_callback", "host_and_scan": "(pure_callback|scan)"}.get(where, where)
    self.assertRegex(str(caught.exception), rf"node \d+ '{node_op}'")
    after_failure = sess.get_state(gid)[0]
    if steps:  # all-or-nothing: the state is the one before the call
      assert_trees_equal(after_failure, before, f"{where}: state changed by a failed run")
    host.fail_at = None
    # the session is usable and still agrees with jax.jit from its state
    want_w, want_loss = jax.jit(step)(after_failure, xs[2])
    got_loss = sess.run(gid, xs[2])
    assert_trees_equal((sess.get_state(gid)[0], got_loss), (want_w, want_loss), where)

  @pytest.mark.slow
  def test_every_callback_position_single_and_sunk(self):
    for where in ("top", "scan", "cond", "while", "host_and_scan"):
      for steps in (False, True):
        with self.subTest(where=where, steps=steps):
          self._check(where, None, steps)

  def test_callbacks_kept_inside_the_executable(self):
    options = js.SessionOptions(host_callbacks=False)
    for where in ("top", "scan"):
      for steps in (False, True):
        with self.subTest(where=where, steps=steps):
          self._check(where, options, steps)

  def test_single_step_failure_leaves_state_bit_identical(self):
    for where in ("top", "scan", "cond", "while"):
      host = Faulty()
      step = step_with_callback(where, host)
      rng = np.random.default_rng(7)
      w, x = salted(rng, (5,)), jnp.asarray(rng.standard_normal(5), jnp.float32)
      sess = js.Session()
      gid = sess.compile(step, w, x, state_argnums=0)
      host.fail_at = 1
      with self.assertRaises(js.HostOpError):
        sess.run(gid, x)
      assert_trees_equal(sess.get_state(gid)[0], w, where)
      if where != "top":  # top: the callback is a host partition before the update
        self.assertEqual(sum(d.donated for d in sess.report(gid).donations), 0, where)


class CompileTest(absltest.TestCase):

  def test_compile_holds_one_copy_of_the_state_and_runs_no_user_code(self):
    host = Faulty()
    step = step_with_callback("top", host)
    rng = np.random.default_rng(11)
    state = {"w": jnp.asarray(rng.standard_normal(5), jnp.float32)}
    x = jnp.asarray(rng.standard_normal(5), jnp.float32)
    sess = js.Session()
    before = {id(a) for a in jax.live_arrays()}
    gid = sess.compile(lambda s, x: ({"w": step(s["w"], x)[0]}, x), state, x,
                       state_argnums=0)
    new = [a for a in jax.live_arrays() if id(a) not in before]
    self.assertEqual(len(new), 1)  # the one session-owned copy of the one leaf
    self.assertIsNot(new[0], state["w"])
    self.assertEqual(host.calls, 0)
    sess.run(gid, x)
    self.assertEqual(host.calls, 1)


class AliasedStateTest(absltest.TestCase):
  """State returned as an output, swapped between slots, forwarded from an
  input: every run equals jax.jit, and no array handed out is invalidated."""

  def _compare(self, step, state, args_per_step, state_argnums, options=None):
    sess = js.Session(options)
    gid = sess.compile(step, *state, *args_per_step[0], state_argnums=state_argnums)
    jitted = jax.jit(step)
    k = len(state)
    handed_out = []
    for args in args_per_step:
      want = jitted(*state, *args)
      got = sess.run(gid, *args)
      state = tuple(want[:k])
      rest = want[k:]
      assert_trees_equal(got, rest[0] if len(rest) == 1 else rest)
      assert_trees_equal(sess.get_state(gid), state)
      handed_out.extend(jax.tree.leaves(got))
      handed_out.extend(jax.tree.leaves(args))
    for x in handed_out:
      self.assertFalse(x.is_deleted())
    return sess, gid

  def test_old_state_returned_beside_a_host_callback(self):
    host = Faulty()
    rng = np.random.default_rng(1)

    def step(w, x):
      return w + host.cb(x), w
    args = [(salted(rng, (6,)),) for _ in range(3)]
    for options in (None, js.SessionOptions(host_callbacks=False)):
      self._compare(step, (jnp.asarray(rng.standard_normal(6), jnp.float32),), args, 0,
                    options)

  def test_one_slots_new_value_is_anothers_old_value(self):
    host = Faulty()
    rng = np.random.default_rng(2)

    def swap(a, b, x):
      return b, 2 * b + host.cb(x), a
    state = (salted(rng, (4,)), jnp.asarray(rng.standard_normal(4), jnp.float32))
    args = [(jnp.asarray(rng.standard_normal(4), jnp.float32),) for _ in range(3)]
    for options in (None, js.SessionOptions(host_callbacks=False)):
      self._compare(swap, state, args, (0, 1), options)

  def test_plain_swap_and_new_state_also_returned(self):
    rng = np.random.default_rng(3)
    state = (jnp.asarray(rng.standard_normal(4), jnp.float32),
             jnp.asarray(rng.standard_normal(4), jnp.float32))
    args = [(salted(rng, (4,)),) for _ in range(3)]
    self._compare(lambda a, b, x: (b, a, a * x), state, args, (0, 1))
    self._compare(lambda a, b, x: (a + x, a + x, a + x), state, args, (0, 1))

  def test_input_forwarded_into_the_state(self):
    rng = np.random.default_rng(4)
    host = Faulty()
    state = (jnp.asarray(rng.standard_normal(4), jnp.float32),)
    args = [(jnp.asarray(rng.standard_normal(4), jnp.float32),) for _ in range(3)]
    self._compare(lambda w, x: (x, jnp.sum(w)), state, args, 0)
    self._compare(lambda w, x: (x, host.cb(w)), state, args, 0)


class StateContractTest(absltest.TestCase):

  def test_eval_step_that_looks_like_an_update_only_reads(self):
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal(4), jnp.float32)
    sess = js.Session()
    train = sess.compile(lambda w, x: (w - 0.1 * x, jnp.sum(w)), w, w, state_argnums=0)
    predict = sess.compile(lambda w, x: (w * x, jnp.sum(w * x)), w, w, state_argnums=0,
                           state_from=train, updates_state=False)
    sess.run(train, w)
    trained = sess.get_state(train)[0]
    x = salted(rng, (4,))
    got = sess.run(predict, x)
    assert_trees_equal(got, (trained * x, jnp.sum(trained * x)))
    assert_trees_equal(sess.get_state(train)[0], trained)  # not overwritten
    self.assertTrue(all(not d.donated for d in sess.report(predict).donations))

  def test_a_step_that_returns_no_state_is_refused_with_the_other_setting(self):
    w = jnp.arange(4.0)
    sess = js.Session()
    with self.assertRaisesRegex(js.InputError, "updates_state=False"):
      sess.compile(lambda w, x: jnp.sum(w * x), w, w, state_argnums=0)
    with self.assertRaisesRegex(js.InputError, "updates_state=False"):
      sess.compile(lambda w, x: ({"w": w}, x), w, w, state_argnums=0)
    with self.assertRaisesRegex(js.InputError, "updates_state must be True or False"):
      sess.compile(lambda w, x: (w, x), w, w, state_argnums=0, updates_state="yes")
    self.assertEqual(sess.compile(jnp.sin, w), 0)  # no failed compile took an id


class CallbackSemanticsTest(absltest.TestCase):

  def test_host_callback_gets_jax_arrays_and_results_convert_like_jit(self):
    seen = []

    def host(a):
      seen.append(type(a))
      return np.asarray(a, np.float64) * 3  # float64 result for an f32 declaration

    def fn(x):
      return jnp.sin(jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x))
    x = salted(np.random.default_rng(6), (5,))
    sess = js.Session()
    gid = sess.compile(fn, x)
    self.assertEqual(sess.report(gid).partitions[0].place, "host")
    got = sess.run(gid, x)
    jit_seen = len(seen)
    assert_equal_signed(got, jax.jit(fn)(x))
    self.assertEqual(seen[0], seen[jit_seen])  # the same type jax.jit passes
    self.assertTrue(issubclass(seen[0], jax.Array))

  def test_results_jit_refuses_are_host_op_errors(self):
    # jax.jit's own words, as its RuntimeError (JAX's python_callback_test matches them)
    for result, what in ((np.zeros(3, np.float32), r"Incorrect output shape for return value "
                          r"#0: Expected: \(4,\), Actual: \(3,\)"),
                         (np.zeros(4, np.int32), "Incorrect output dtype for return value #0: "
                          "Expected: float32, Actual: int32")):
      fn = lambda x, r=result: jax.pure_callback(lambda a: r,
                                                 jax.ShapeDtypeStruct((4,), jnp.float32), x)
      sess = js.Session()
      gid = sess.compile(fn, jnp.arange(4.0))
      with self.assertRaisesRegex(js.HostOpError, what) as caught:
        sess.run(gid, jnp.arange(4.0))
      self.assertIsInstance(caught.exception.__cause__, RuntimeError)


class ArgumentTypesTest(absltest.TestCase):
  """Other argument types run on the compiled executable, converted as jax.jit
  converts them, or are refused; there is one executable whatever comes in."""

  def _labelled_programs(self):
    host = Faulty()
    plain = lambda x, lr: x - lr * jnp.sin(x)
    with_host = lambda x, lr: host.cb(x) - lr * jnp.sin(x)
    return (("one executable", plain), ("host partition", with_host))

  def test_python_scalars_where_an_f32_array_was_given(self):
    x = salted(np.random.default_rng(8), (6,))
    for label, fn in self._labelled_programs():
      sess = js.Session()
      gid = sess.compile(fn, x, jnp.float32(0.5))
      for lr in (0.1, 3.0, np.float32(0.25), 1e-45):
        with self.subTest(label=label, lr=lr):
          assert_equal_signed(sess.run(gid, x, lr),
                              jax.jit(fn)(x, np.float32(lr)))
      for lr in (3, 2**24 + 1):  # jax.jit would trace int arithmetic for an int
        with self.assertRaisesRegex(js.InputError, f"Python int {lr} where f32"):
          sess.run(gid, x, lr)
      with self.assertRaisesRegex(js.InputError, "expected f32\\[\\]"):
        sess.run(gid, x, jnp.zeros(2))

  def test_int_arguments(self):
    fn = lambda x, k: x * k
    x = jnp.asarray(np.random.default_rng(9).integers(-2**30, 2**30, 5), jnp.int32)
    sess = js.Session()
    gid = sess.compile(fn, x, jnp.int32(3))
    assert_equal_signed(sess.run(gid, x, 7), jax.jit(fn)(x, np.int32(7)))
    with self.assertRaisesRegex(js.InputError, "does not fit"):
      sess.run(gid, x, 2**31)
    with self.assertRaisesRegex(js.InputError, "does not fit"):
      sess.run(gid, x, 1.5)

  def test_weak_typed_example(self):
    fn = lambda x, s: x * s
    x = salted(np.random.default_rng(10), (4,))
    sess = js.Session()
    gid = sess.compile(fn, x, 0.5)  # a weak-typed Python float
    for s in (0.25, np.float32(2.5), jnp.float32(-0.0)):
      assert_equal_signed(sess.run(gid, x, s), jax.jit(fn)(x, s))


class ValidationTest(absltest.TestCase):

  def test_steps_checked_before_anything_is_built(self):
    sess = js.Session()
    gid = sess.compile(lambda w, x: (w + x, w), jnp.zeros(2), jnp.ones(2), state_argnums=0)
    for steps in (-1, 0, 1.5, 3.0, "3", True, None.__class__):
      with self.assertRaisesRegex(js.InputError, "steps must be a positive int"):
        sess.run(gid, jnp.ones((3, 2)), steps=steps)
    self.assertEqual(sess.report(gid).loop_sink, {})
    out = sess.run(gid, jnp.ones((3, 2)), steps=np.int64(3))
    self.assertEqual(out.shape, (3, 2))

  def test_graph_ids_are_ints(self):
    sess = js.Session()
    gid = sess.compile(jnp.sin, jnp.ones(2))
    self.assertEqual(gid, 0)
    for bad in (0.0, True, "0", None, 1):
      with self.assertRaises(js.UnknownGraphError):
        sess.run(bad, jnp.ones(2))
    assert_equal_signed(sess.run(np.int64(0), jnp.ones(2)), jnp.sin(jnp.ones(2)))

  def test_argnums(self):
    sess = js.Session()
    f = lambda a, b: (a, b)
    for nums, what in (((0, 0), "twice"), ((True,), "not a position"),
                       ((2,), "not a position"), (("0",), "not a position")):
      with self.assertRaisesRegex(js.InputError, what):
        sess.compile(f, jnp.ones(2), jnp.ones(2), state_argnums=nums)

  def test_release(self):
    sess = js.Session()
    w = jnp.arange(3.0)
    train = sess.compile(lambda w, x: (w + x, jnp.sum(w)), w, w, state_argnums=0)
    reader = sess.compile(lambda w: jnp.sum(w), w, state_argnums=0, state_from=train,
                          updates_state=False)
    solo = sess.compile(lambda v, x: (v * x, x), w, w, state_argnums=0)
    sess.run(train, w)
    sess.release(train)
    for call in (lambda: sess.run(train, w), lambda: sess.get_state(train),
                 lambda: sess.release(train), lambda: sess.report(train)):
      with self.assertRaises(js.UnknownGraphError):
        call()
    self.assertEqual(float(sess.run(reader)), 6.0)  # the shared slot lives on
    live = len(jax.live_arrays())
    sess.release(solo)
    self.assertEqual(len(jax.live_arrays()), live - 1)  # its only owner is gone: freed
    self.assertEqual(sess.compile(jnp.cos, w), 3)  # ids are never reused

  def test_set_state_names_the_differing_field(self):
    sess = js.Session()
    state = {"layer": {"w": jnp.ones(2), "b": jnp.zeros(2)}, "step": jnp.int32(0)}
    gid = sess.compile(lambda s, x: (s, x), state, jnp.ones(1), state_argnums=0)
    bad = {"layer": {"w": jnp.ones(2), "bias": jnp.zeros(2)}, "step": jnp.int32(0)}
    with self.assertRaisesRegex(js.InputError, r"at \['layer'\].*missing \['b'\]"):
      sess.set_state(gid, bad)
    with self.assertRaisesRegex(js.InputError, r"at path \['layer'\]\['w'\]: expected f32\[2\]"):
      sess.set_state(gid, {"layer": {"w": jnp.ones(3), "b": jnp.zeros(2)},
                           "step": jnp.int32(0)})

  def test_set_state_with_a_fresh_flax_train_state(self):
    import optax
    from flax.training import train_state
    params = {"w": jnp.ones((2, 2))}
    make = lambda: train_state.TrainState.create(apply_fn=jnp.dot, params=params,
                                                 tx=optax.adam(1e-3))
    sess = js.Session()
    gid = sess.compile(lambda s, x: (s.replace(step=s.step + 1), x), make(), jnp.ones(1),
                       state_argnums=0)
    with self.assertRaises(js.InputError) as caught:
      sess.set_state(gid, make())
    message = str(caught.exception)
    self.assertIn("static field 'tx'", message)
    self.assertLess(len(message), 600)


class KernelAndPassTest(absltest.TestCase):

  def test_kernel_with_wrong_output_shape_is_refused_at_compile(self):
    from jaxsession.kernels import register_kernel, unregister_kernel

    @register_kernel("cos", backend="xla", priority=50, name="xla:bad_cos")
    def bad_cos(node, x):
      return [jnp.cos(x)[:1]]
    try:
      with self.assertRaisesRegex(js.KernelSelectError, "xla:bad_cos.*f32\\[1\\].*f32\\[3\\]"):
        js.Session().compile(jnp.cos, jnp.ones(3))
    finally:
      unregister_kernel("xla:bad_cos")

  def test_nodes_made_by_a_late_user_pass_get_kernels(self):
    from jaxsession.optimizer_passes import Pat, RewritePass, Rule
    x = Pat.var("x")
    # sin(x) -> cos(x - pi/2), emitted in HardwareOptimize after placement
    rule = Rule(Pat("sin", x), lambda r, x: r.bind(lax.cos_p, accuracy=None, inputs=[r.bind(
        lax.sub_p, [x, r.bind(lax.convert_element_type_p, [x], new_dtype=x.aval.dtype,
                              weak_type=False, sharding=None)])]))
    js.register_pass(RewritePass("sin_to_cos", [rule]), stage="HardwareOptimize")
    try:
      sess = js.Session()
      gid = sess.compile(lambda a: jnp.sin(a) * 2, jnp.arange(3.0))
      self.assertIn("cos", [n.op for n in sess.graph(gid).nodes])
      self.assertTrue(all(n.kernel is not None and n.place for n in sess.graph(gid).nodes))
      assert_equal_signed(sess.run(gid, jnp.arange(3.0)), jnp.cos(
          jnp.zeros(3)) * 2)
    finally:
      js.unregister_pass("sin_to_cos")

  def test_a_late_node_no_kernel_fits_names_the_pass(self):
    from jaxsession.optimizer_passes import Pat, RewritePass, Rule
    rule = Rule(Pat("sin", Pat.var("x")),
                lambda r, x: r.fused("NoSuchOp", [x], {}, x.aval, "no kernel"))
    js.register_pass(RewritePass("make_orphan", [rule]), stage="AllocateMemory")
    try:
      with self.assertRaisesRegex(js.PassError, "make_orphan.*NoSuchOp"):
        js.Session().compile(jnp.sin, jnp.arange(3.0))
    finally:
      js.unregister_pass("make_orphan")


class ImportLayeringTest(absltest.TestCase):

  def test_the_graph_layer_imports_nothing_above_it(self):
    """session/graph/ (IR, import, lowering, op table, liveness) and errors.py
    import only each other and the kernels (lowering selects an XLA kernel)."""
    import ast
    import os
    root = os.path.dirname(js.__file__)
    names = ["errors.py"] + [os.path.join("graph", n) for n in
                             sorted(os.listdir(os.path.join(root, "graph"))) if n.endswith(".py")]
    self.assertGreaterEqual(len(names), 6)
    for name in names:
      with open(os.path.join(root, name)) as f:
        tree = ast.parse(f.read())
      imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
      imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                   for a in n.names]
      for module in imported:
        if module and module.startswith("jaxsession"):
          self.assertTrue(any(module.startswith(p) for p in (
              "jaxsession.graph", "jaxsession.errors", "jaxsession.kernels")),
              f"{name} imports {module}")


class VerifyTest(absltest.TestCase):

  def test_verify_catches_avals_that_disagree_with_the_primitive(self):
    from jaxsession.graph import importer
    closed = jax.make_jaxpr(lambda a, b: jnp.sin(a) + b)(jnp.ones(3), jnp.ones(3))
    graph = importer.import_jaxpr(closed)
    self.assertTrue(graph.verify())
    add = graph.nodes[-1]
    add.outputs[0].aval = jax.core.ShapedArray((4,), jnp.float32)
    with self.assertRaisesRegex(ValueError, "f32\\[4\\] but add of its inputs gives"):
      graph.verify()
    add.outputs[0].aval = jax.core.ShapedArray((3,), jnp.float32, weak_type=True)
    with self.assertRaisesRegex(ValueError, "f32\\[3\\]~"):
      graph.verify()
    # a node checked once is checked again when a pass changes what its shape
    # rule reads: a param, or an input rewired to another value
    add.outputs[0].aval = jax.core.ShapedArray((3,), jnp.float32)
    self.assertTrue(graph.verify())
    shaped = importer.import_jaxpr(jax.make_jaxpr(lambda a: jnp.reshape(a, (3, 1)) * 2.0)(
        jnp.ones(3)))
    self.assertTrue(shaped.verify())
    reshape = shaped.nodes[0]
    reshape.params["new_sizes"] = (1, 3)
    with self.assertRaisesRegex(ValueError, "f32\\[3,1\\] but reshape of its inputs gives"):
      shaped.verify()


class CallbackRaisesKeyboardInterruptTest(absltest.TestCase):
  """A callback that raises KeyboardInterrupt (or SystemExit) itself: raised
  as it is wherever the callback runs, the state as before. From inside an
  executable it was a HostOpError, an Exception that a caller's `except
  Exception` swallowed, where a host-placed callback's was raw."""

  def test_raised_as_it_is_and_the_state_kept(self):
    spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    raising = [None]

    def cb(v):
      if raising[0] is not None:
        raise raising[0]()
      return np.asarray(v) * np.float32(0.5)

    def top(s, x):
      y = jax.pure_callback(cb, spec, x * s)
      return s + y, y.sum()

    def in_scan(s, x):
      c, _ = jax.lax.scan(lambda c, _: (c + jax.pure_callback(cb, spec, c * x), None), s,
                          None, length=2)
      return c, x.sum()

    def in_cond(s, x):
      return jax.lax.cond(x[0] > 0, lambda: s + jax.pure_callback(cb, spec, x),
                          lambda: s), x.sum()

    rng = np.random.default_rng(3)
    s0, x = rng.standard_normal(4).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    x[0], s0[1] = abs(x[0]) + 0.5, -0.0
    cases = [(top, js.SessionOptions(), None), (top, js.SessionOptions(host_callbacks=False), None),
             (in_scan, js.SessionOptions(), None), (in_cond, js.SessionOptions(), None),
             (top, js.SessionOptions(), 3), (in_scan, js.SessionOptions(), 3)]
    for fn, options, steps in cases:
      for kind in (KeyboardInterrupt, SystemExit):
        with self.subTest(fn=fn.__name__, host_callbacks=options.host_callbacks, steps=steps,
                          kind=kind.__name__):
          raising[0] = None
          sess = js.Session(options)
          gid = sess.compile(fn, s0, x, state_argnums=0)
          args = (x,) if steps is None else (np.stack([x] * steps),)
          sess.run(gid, *args, steps=steps)
          before = np.asarray(sess.get_state(gid)[0])
          raising[0] = kind
          with self.assertRaises(kind) as caught:
            sess.run(gid, *args, steps=steps)
          self.assertNotIsInstance(caught.exception, js.HostOpError)
          np.testing.assert_array_equal(sess.get_state(gid)[0], before)
          raising[0] = None
          sess.run(gid, x)
          np.testing.assert_array_equal(sess.get_state(gid)[0], jax.jit(fn)(before, x)[0])


if __name__ == "__main__":
  absltest.main()
