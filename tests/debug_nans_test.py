"""jax_debug_nans (and _infs) under a Session: a nan is a FloatingPointError
naming the graph (and the node, where the replay finds it), and the state
stays as it was - compiled with the flag or switched on later, one
executable or a plan, packed state, set before or in another thread."""
import subprocess
import sys
import textwrap

from absl.testing import absltest
import pytest
import jax
import jax.numpy as jnp
import numpy as np

import exact
import jaxsession as js
from subproc import run_json


def _nan_where_negative(calls):
  """A callback (numpy): its argument with nan where it is negative; each
  call appended to `calls`."""
  def callback(v):
    calls.append(1)
    v = np.asarray(v)
    return np.where(v < 0, np.float32(np.nan), v).astype(np.float32)
  return callback


class DebugNansTest(absltest.TestCase):
  """jax_debug_nans on (before compile, as jax.jit reads it at trace time):
  a nan is a FloatingPointError naming the graph and the node, and the
  state stays as it was."""

  def test_nan_names_the_node_and_keeps_the_state(self):
    def step(w, x):
      return w * 2.0 + jnp.log(x), jnp.sum(w)

    def plan(w, x):  # the same, with a host partition before it
      y = jax.pure_callback(lambda a: np.asarray(a) * np.float32(2),
                            jax.ShapeDtypeStruct(x.shape, x.dtype), x)
      return w * 2.0 + jnp.log(y), jnp.sum(w)
    rng = np.random.default_rng(11)
    w = jnp.asarray(rng.uniform(1, 2, 5), jnp.float32)
    good, bad = (jnp.asarray(rng.uniform(1, 2, 5), jnp.float32),
                 -jnp.asarray(rng.uniform(1, 2, 5), jnp.float32))
    jax.config.update("jax_debug_nans", True)
    try:
      for fn in (step, plan):
        sess = js.Session()
        gid = sess.compile(fn, w, good, state_argnums=0)
        with self.assertRaisesRegex(
            FloatingPointError, rf"graph {gid} '{fn.__name__}'.*node \d+ 'log'.*nan"):
          sess.run(gid, bad)
        np.testing.assert_array_equal(sess.get_state(gid)[0], w)
        np.testing.assert_array_equal(sess.run(gid, good), jax.jit(fn)(w, good)[1])
        np.testing.assert_array_equal(sess.get_state(gid)[0], jax.jit(fn)(w, good)[0])
    finally:
      jax.config.update("jax_debug_nans", False)

  def test_run_op_nan_is_a_floating_point_error(self):
    with jax.debug_nans(True):
      with self.assertRaisesRegex(FloatingPointError, r"run_op\(log\) produced nan"):
        js.Session().run_op(jnp.log, jnp.float32(-1))

  def test_switched_on_after_compile_keeps_the_state(self):
    """Compiled without the flag, the executables donate the state; switched
    on afterwards, a nan is still a FloatingPointError and nothing is lost."""
    def step(w, x):
      return w * 2.0 + jnp.log(x), jnp.sum(w)

    def plan(w, x):
      y = jax.pure_callback(lambda a: np.asarray(a) * np.float32(2),
                            jax.ShapeDtypeStruct(x.shape, x.dtype), x)
      return w * 2.0 + jnp.log(y), jnp.sum(w)
    rng = np.random.default_rng(12)
    w = jnp.asarray(rng.uniform(1, 2, 5), jnp.float32)
    good = jnp.asarray(rng.uniform(1, 2, 5), jnp.float32)
    bad = -good
    for fn in (step, plan):
      for steps in (None, 3):
        sess = js.Session()
        gid = sess.compile(fn, w, good, state_argnums=0)
        args = (bad,) if steps is None else (jnp.stack([good, bad, good]),)
        jax.config.update("jax_debug_nans", True)
        try:
          with self.assertRaises(FloatingPointError):
            sess.run(gid, *args, steps=steps)
        finally:
          jax.config.update("jax_debug_nans", False)
        np.testing.assert_array_equal(sess.get_state(gid)[0], w)
        np.testing.assert_array_equal(sess.run(gid, good), jax.jit(fn)(w, good)[1])
        np.testing.assert_array_equal(sess.get_state(gid)[0], jax.jit(fn)(w, good)[0])

  def test_packed_state_switched_on_after_compile(self):
    """A packed slot (pack_state_below_bytes): its leaves are slices of the
    buffers the failed run donated; the nan is still a FloatingPointError
    (it was a raw 'Array has been deleted') and the state is kept."""
    rng = np.random.default_rng(15)
    w = {k: jnp.asarray(rng.uniform(1, 2, n), jnp.float32) for k, n in (("a", 3), ("b", 5))}
    step = lambda s, x: (jax.tree.map(lambda v: jnp.log(v * x), s), x)  # noqa: E731
    sess = js.Session(js.SessionOptions(pack_state_below_bytes=1 << 14))
    gid = sess.compile(step, w, jnp.float32(2.0), state_argnums=0)
    self.assertEqual(sess.report(gid).memory.state_buffers, (1,))
    jax.config.update("jax_debug_nans", True)
    try:
      with self.assertRaisesRegex(FloatingPointError, r"node \d+ 'log' at .* produced nan"):
        sess.run(gid, jnp.float32(-1.0))
    finally:
      jax.config.update("jax_debug_nans", False)
    for got, want in zip(jax.tree.leaves(sess.get_state(gid)[0]), jax.tree.leaves(w)):
      np.testing.assert_array_equal(got, want)
    sess.run(gid, jnp.float32(2.0))
    for got, want in zip(jax.tree.leaves(sess.get_state(gid)[0]),
                         jax.tree.leaves(jax.jit(step)(w, jnp.float32(2.0))[0])):
      np.testing.assert_array_equal(got, want)

  def test_a_plan_donating_its_own_buffer_of_a_packed_slot(self):
    """A plan sharing a packed slot (state_from) donates "w", which keeps its
    own buffer there: switched on after compile, a nan after that donation
    still leaves the slot whole (it held a deleted buffer before)."""
    rng = np.random.default_rng(16)
    state = {"a": jnp.asarray(rng.uniform(1, 2, 5), jnp.float32),
             "b": jnp.asarray(rng.uniform(1, 2, 5), jnp.float32),
             "w": jnp.asarray(rng.uniform(1, 2, (5, 5)), jnp.float32)}
    x = jnp.asarray(rng.uniform(1, 2, (2, 5)), jnp.float32)
    sess = js.Session(js.SessionOptions(pack_state_below_bytes=1 << 14))
    train = sess.compile(lambda p, x: ({k: v * 0.5 for k, v in p.items()},
                                       jnp.sum(x @ p["w"])), state, x, state_argnums=0)

    def plan(p, x):
      z = jax.pure_callback(np.asarray, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
      return {**p, "w": p["w"] * jnp.sum(z)}, jnp.log(jnp.sum(z) - 100)
    gid = sess.compile(plan, state, x, state_argnums=0, state_from=train)
    self.assertEqual([d.donated for d in sess.graph(gid).memory.donations],
                     [False, False, True])
    jax.config.update("jax_debug_nans", True)
    try:
      with self.assertRaisesRegex(FloatingPointError, r"node \d+ 'log' at .* produced nan"):
        sess.run(gid, x)
    finally:
      jax.config.update("jax_debug_nans", False)
    for got, want in zip(jax.tree.leaves(sess.get_state(train)[0]), jax.tree.leaves(state)):
      np.testing.assert_array_equal(got, want)

  def test_a_nan_the_step_masks_in_a_sunk_runs_inputs(self):
    """jax.jit never checks its arguments: a nan in a sunk run's stacked
    input that the step masks runs, chunked or through a plan (the
    executables splitting the steps were checked, and raised jax's private
    InternalFloatingPointError: a break-it find)."""
    def step(s, x):
      clean = jnp.where(jnp.isnan(x), 0.0, x)
      return s + clean, jnp.sum(clean)

    def plan(s, x):
      return step(s, jax.pure_callback(lambda a: np.asarray(a).copy(),
                                       jax.ShapeDtypeStruct(x.shape, x.dtype), x))
    rng = np.random.default_rng(17)
    xs = jnp.asarray(rng.standard_normal((5, 4)), jnp.float32).at[2, 1].set(jnp.nan)
    s0 = jnp.asarray(rng.standard_normal(4), jnp.float32)
    for fn, first in ((step, 2), (plan, None)):
      with self.subTest(fn.__name__):
        sess = js.Session()
        gid = sess.compile(fn, s0, xs[0], state_argnums=0)
        if first:  # a first steps value: 5 then runs as chunks of 4 + 1
          sess.run(gid, xs[:first], steps=first)
          sess.set_state(gid, s0)
        with jax.debug_nans(True):
          got = sess.run(gid, xs, steps=5)
          state, want = jax.jit(lambda s, xs: jax.lax.scan(step, s, xs))(s0, xs)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(sess.get_state(gid)[0], state)

  def test_the_flag_set_globally_keeps_checking_after_the_sessions_calls(self):
    """The session turns the checks off around data movement (splitting a
    sunk run's arguments, taking over a donated value). jax's own
    `with jax.debug_nans(False):` left the user's already-called jax.jit
    functions unchecked in the thread for good: after one chunked run, a
    nan passed silently (a break-it find). In a fresh process: any such
    block earlier in this one - the tests' own - already did that."""
    got = run_json("""
        import json
        import jax.numpy as jnp, numpy as np
        import jaxsession as js
        user = jax.jit(lambda x: x * 2.0)
        good, bad = jnp.ones(4), jnp.asarray([1.0, np.nan, 1.0, 1.0], jnp.float32)
        def step(s, x):
          return s + jnp.where(jnp.isnan(x), 0.0, x), jnp.sum(x)
        s0 = jnp.asarray(np.random.default_rng(19).standard_normal(4), jnp.float32)
        jax.config.update("jax_debug_nans", True)
        user(good)
        sess = js.Session()
        gid = sess.compile(step, s0, good, state_argnums=0)
        sess.run(gid, jnp.stack([good] * 2), steps=2)
        sess.run(gid, jnp.stack([good] * 3), steps=3)  # chunks of 2 + 1: split
        sess.set_state(gid, jnp.ones(4) * 2.0, donate=True)  # taken over
        raised = {}
        for what, call in (("user", lambda: user(bad)), ("session", lambda: sess.run(gid, bad))):
          try:
            call()
            raised[what] = False
          except FloatingPointError:
            raised[what] = True
        print(json.dumps(raised))
        """, devices=1)
    self.assertEqual(got, {"user": True, "session": True})

  def test_a_plan_checks_what_crosses_to_the_host(self):
    """A known difference (docs/concepts.md): jax.jit checks its outputs
    alone, a plan each device partition's, values handed to a host op
    included - a nan made there and masked after the host op raises."""
    def step(s, x):
      y = jax.pure_callback(lambda a: np.asarray(a).copy(),
                            jax.ShapeDtypeStruct(x.shape, x.dtype), x * 2.0)
      clean = jnp.where(jnp.isnan(y), 0.0, y)
      return s + clean, jnp.sum(clean)
    s0 = jnp.asarray(np.random.default_rng(18).standard_normal(4), jnp.float32)
    x = jnp.asarray([1.5, np.nan, -0.0, 2.0], jnp.float32)
    sess = js.Session()
    gid = sess.compile(step, s0, x, state_argnums=0)
    with jax.debug_nans(True):
      jax.jit(step)(s0, x)  # no nan in its outputs: runs
      with self.assertRaisesRegex(FloatingPointError, r"node \d+ 'mul'.*nan"):
        sess.run(gid, x)
    np.testing.assert_array_equal(sess.get_state(gid)[0], s0)

  def test_what_a_host_op_returns_is_checked_as_jax_jit_checks_an_output(self):
    # a nan a callback returned as an output, or as new state, was not found
    # (no executable made it: a JAX test suite's find); the state stays
    calls = []
    nan_where_negative = _nan_where_negative(calls)

    def step(s, x):
      y = jax.pure_callback(nan_where_negative, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
      return y, s * 2.0  # the callback's result is the new state
    s0 = jnp.asarray(np.random.default_rng(19).standard_normal(4), jnp.float32)
    sess = js.Session()
    gid = sess.compile(step, s0, s0, state_argnums=0)
    good = jnp.abs(s0) + 1.0
    bad = good.at[2].set(-1.0)
    with jax.debug_nans(True):
      np.testing.assert_array_equal(sess.run(gid, good), s0 * 2.0)
      np.testing.assert_array_equal(sess.get_state(gid)[0], good)
      with self.assertRaisesRegex(FloatingPointError, r"node \d+ 'pure_callback'.*nan"):
        sess.run(gid, bad)
    np.testing.assert_array_equal(sess.get_state(gid)[0], good)
    out_only = sess.compile(lambda x: jax.pure_callback(
        nan_where_negative, jax.ShapeDtypeStruct(x.shape, x.dtype), x), s0)
    np.testing.assert_array_equal(sess.run(out_only, bad), nan_where_negative(bad))  # flag off
    with jax.debug_nans(True):
      with self.assertRaisesRegex(FloatingPointError, r"node \d+ 'pure_callback'.*nan"):
        sess.run(out_only, bad)

  def test_a_sunk_plan_replays_once_a_callback_made_nan(self):
    # a step's own replay ran the callbacks once more before the whole run's
    # (a break-it find); one cut of that leaked jax's private error type
    calls = []
    nan_where_negative = _nan_where_negative(calls)

    def step(s, x):
      return jax.pure_callback(nan_where_negative, jax.ShapeDtypeStruct(x.shape, x.dtype),
                               s + x), jnp.sum(s)
    rng = np.random.default_rng(23)
    s0 = jnp.asarray(rng.uniform(1, 2, 4), jnp.float32)
    xs = jnp.asarray(rng.uniform(1, 2, (3, 4)), jnp.float32).at[1, 0].set(-9.0)
    sess = js.Session()
    gid = sess.compile(step, s0, xs[0], state_argnums=0)
    with jax.debug_nans(True):
      with self.assertRaisesRegex(FloatingPointError, r"node \d+ 'pure_callback' at .*, "
                                  r"step 1 of the 3 steps produced nan"):
        sess.run(gid, xs, steps=3)
    self.assertLen(calls, 4)  # steps 0 and 1, then the whole run's replay of them
    np.testing.assert_array_equal(sess.get_state(gid)[0], s0)

  def test_a_chunked_run_checks_the_state_between_chunks(self):
    """docs/concepts.md: a nan the state holds between two steps, cleared by
    the next, passes one scan (one executable: a first steps value) but not
    a chunked run, whose chunk boundary is an executable's output."""
    def step(s, x):
      s = jnp.where(x < 0, jnp.zeros_like(s), s * x) + jnp.where(x > 1, jnp.nan, 0.0)
      return s, jnp.sum(x)
    s0 = jnp.asarray(np.random.default_rng(20).uniform(1, 2, 4), jnp.float32)
    xs = jnp.asarray([0.5, 2.0, -1.0], jnp.float32)  # the nan after step 1, gone at step 2
    with jax.debug_nans(True):
      jax.jit(lambda s, xs: jax.lax.scan(step, s, xs))(s0, xs)  # runs
      fresh = js.Session()
      gid = fresh.compile(step, s0, xs[0], state_argnums=0)
      fresh.run(gid, xs, steps=3)  # one executable: runs
      chunked = js.Session()
      gid = chunked.compile(step, s0, xs[0], state_argnums=0)
      chunked.run(gid, xs[:1] + 0.0, steps=1)  # 3 then runs as chunks of 2 + 1
      chunked.set_state(gid, s0)
      with self.assertRaises(FloatingPointError):
        chunked.run(gid, xs, steps=3)
    np.testing.assert_array_equal(chunked.get_state(gid)[0], s0)

  def test_a_sunk_run_names_the_node_and_the_step(self):
    """A sunk run's nan is replayed step by step (each step's slice, the
    state carried): the node and the step are named (the replay fed the
    stacked arguments to one step, and named neither)."""
    def step(s, x):
      return s + jnp.log(x), jnp.sum(s)
    rng = np.random.default_rng(21)
    s0 = jnp.asarray(rng.uniform(1, 2, 4), jnp.float32)
    xs = jnp.asarray(rng.uniform(1, 2, (5, 4)), jnp.float32).at[3, 2].set(-1.0)
    sess = js.Session()
    gid = sess.compile(step, s0, xs[0], state_argnums=0)
    with jax.debug_nans(True):
      with self.assertRaisesRegex(FloatingPointError, r"node \d+ 'log' at .*, step 3 of the "
                                  r"5 steps produced nan"):
        sess.run(gid, xs, steps=5)
    np.testing.assert_array_equal(sess.get_state(gid)[0], s0)
    with jax.debug_nans(True):  # every argument unstacked: the steps counted all the same
      with self.assertRaisesRegex(FloatingPointError, r"node \d+ 'log' at .*, step 0 of the "
                                  r"4 steps produced nan"):
        sess.run(gid, xs[3], steps=4, in_axes=(None,))
    np.testing.assert_array_equal(sess.get_state(gid)[0], s0)

  def test_switched_on_after_compile_names_the_node_and_the_step(self):
    """Compiled without the flags, the executables donate: the failed run's
    copies of the state are consumed, so the replay reads the slots (it
    named no node before). A run, a sunk run in one executable, a plan, a
    plan's steps and a chunked run (another steps value first) name the
    node and the step of the whole run, for nans and infs."""
    def step(s, x):
      return s + jnp.log(x) + 1.0 / (x - 2.0), jnp.sum(s)

    def plan(s, x):
      y = jax.pure_callback(lambda a: np.asarray(a) * np.float32(1),
                            jax.ShapeDtypeStruct(x.shape, x.dtype), x)
      return s + jnp.log(y) + 1.0 / (y - 2.0), jnp.sum(s)
    rng = np.random.default_rng(22)
    s0 = jnp.asarray(rng.uniform(3, 4, 4), jnp.float32)
    xs = jnp.asarray(rng.uniform(3, 4, (5, 4)), jnp.float32)
    for flag, bad, op in (("jax_debug_nans", -1.0, "log"), ("jax_debug_infs", 2.0, "div")):
      wrong = xs.at[3, 1].set(bad)
      for fn, first, steps in ((step, None, None), (step, None, 5), (step, 2, 5),
                               (plan, None, None), (plan, None, 5)):
        with self.subTest(flag=flag, fn=fn.__name__, first=first, steps=steps):
          sess = js.Session(js.SessionOptions(pack_state_below_bytes=1 << 14))
          gid = sess.compile(fn, s0, xs[0], state_argnums=0)
          if first is not None:  # 5 then runs as chunks of 4 + 1
            sess.run(gid, xs[:first], steps=first)
            sess.set_state(gid, s0)
          args = wrong[3] if steps is None else wrong
          where = "" if steps is None else ", step 3 of the 5 steps"
          jax.config.update(flag, True)
          try:
            with self.assertRaisesRegex(
                FloatingPointError,
                rf"graph {gid} '{fn.__name__}'\): node \d+ '{op}' at .*{where} produced"):
              sess.run(gid, args, steps=steps)
          finally:
            jax.config.update(flag, False)
          exact.assert_equal_signed(sess.get_state(gid)[0], s0)

  def test_a_nan_in_the_state_can_be_read_and_set_under_the_flag(self):
    """get_state and set_state copy without a computation: the flag checks
    what runs compute, not what the user reads or writes."""
    sess = js.Session()
    gid = sess.compile(lambda s, x: (s + x, x.sum()), jnp.zeros(3), jnp.ones(3),
                       state_argnums=0)
    v = jnp.asarray(np.random.default_rng(14).standard_normal(3), jnp.float32).at[1].set(jnp.nan)
    w = v * 2
    sess.set_state(gid, v)
    with jax.debug_nans(True), jax.debug_infs(True):
      np.testing.assert_array_equal(sess.get_state(gid)[0], v)
      sess.set_state(gid, w)
      np.testing.assert_array_equal(sess.get_state(gid)[0], w)
      with self.assertRaises(FloatingPointError):
        sess.run(gid, jnp.ones(3))
      np.testing.assert_array_equal(sess.get_state(gid)[0], w)

  def test_a_special_value_in_a_state_leaf_the_step_passes_through(self):
    """A nan (inf) already in a state leaf the step returns unchanged: no
    executable returns it, where jax.jit's check sees every output. Each
    form raises as jax.jit does (a single executable, a sunk run, a plan,
    packed state) and keeps the state; an eval graph (updates_state=False)
    and jax.disable_jit() raise no more than jax.jit does there."""
    rng = np.random.default_rng(16)
    p = jnp.asarray(rng.uniform(1, 2, 4), jnp.float32)
    q, x = (jnp.asarray(rng.uniform(1, 2, 4), jnp.float32) for _ in range(2))

    def step(p, q, x):
      return p, q + x, (q * x).sum()

    def plan(p, q, x):  # a host partition: several executables
      y = jax.pure_callback(lambda a: np.asarray(a) * np.float32(2),
                            jax.ShapeDtypeStruct(q.shape, q.dtype), q)
      return p, y + x, (q * x).sum()

    def evaluate(p, q, x):
      return (q * x).sum()

    def raised(fn, *args):
      try:
        jax.block_until_ready(fn(*args))
        return False
      except FloatingPointError:
        return True
    for flag, special in (("jax_debug_nans", np.nan), ("jax_debug_infs", -np.inf)):
      bad = p.at[2].set(special)
      cases = [(step, {}, None), (step, {}, 3), (plan, {}, None), (plan, {}, 2),
               (step, {"pack_state_below_bytes": 1 << 14}, None),
               (evaluate, {}, None)]
      for fn, options, steps in cases:
        with self.subTest(flag=flag, fn=fn.__name__, options=options, steps=steps):
          sess = js.Session(js.SessionOptions(**options))
          gid = sess.compile(fn, bad, q, x, state_argnums=(0, 1),
                             updates_state=fn is not evaluate)
          args = (x,) if steps is None else (jnp.stack([x] * steps),)
          jax.config.update(flag, True)
          try:
            want = raised(jax.jit(fn), bad, q, x)
            if fn is not evaluate:
              self.assertTrue(want)
              with self.assertRaisesRegex(
                  FloatingPointError, rf"graph {gid} '{fn.__name__}'.*state 0 \(arg 0\) "
                  r"holds (nan|inf), a state leaf the step returns as it came.*unchanged"):
                sess.run(gid, *args, steps=steps)
            else:
              self.assertEqual(raised(sess.run, gid, *args), want)
            with jax.disable_jit():
              self.assertEqual(raised(sess.run, gid, x), raised(fn, bad, q, x))
          finally:
            jax.config.update(flag, False)
          got = sess.get_state(gid)
          exact.assert_equal_signed(got[0], bad)
          if fn is not evaluate:  # the failed runs kept q; the op-by-op one advanced it
            np.testing.assert_array_equal(got[1], jax.jit(fn)(bad, q, x)[1])

  @pytest.mark.slow
  def test_flags_set_globally_and_in_another_thread(self):
    """In a fresh process (the run reads one cell kept by hooks on the two
    flags, runtime/debug_flags.py): a global jax_debug_nans and a thread's
    own `with jax.debug_infs(True)`, both set after compile, raise and keep
    the donated state; switched off again, the runs donate and advance."""
    child = textwrap.dedent(r"""
      import json, threading
      import jax, jax.numpy as jnp, numpy as np
      import jaxsession as js
      from jaxsession.runtime import debug_flags
      step = lambda w, x: (w * 2.0 + jnp.log(x), jnp.sum(w))
      inf_step = lambda w, x: (w * 2.0 + 1.0 / x, jnp.sum(w))
      rng = np.random.default_rng(13)
      w = jnp.asarray(rng.uniform(1, 2, 5), jnp.float32)
      good = jnp.asarray(rng.uniform(1, 2, 5), jnp.float32)
      sess = js.Session()
      g, h = (sess.compile(f, w, good, state_argnums=0) for f in (step, inf_step))
      out = {"maybe_at_start": debug_flags.MAYBE[0]}
      def attempt(gid, x):
        try:
          sess.run(gid, x)
          return "ran"
        except FloatingPointError:
          return "raised"
      jax.config.update("jax_debug_nans", True)
      out["maybe_global_on"] = debug_flags.MAYBE[0]
      out["nan"] = attempt(g, -good)
      jax.config.update("jax_debug_nans", False)
      out["maybe_global_off"] = debug_flags.MAYBE[0]
      out["kept_g"] = bool(np.array_equal(sess.get_state(g)[0], w))
      def worker():
        with jax.debug_infs(True):
          out["inf_in_thread"] = attempt(h, jnp.zeros_like(good))
      t = threading.Thread(target=worker)
      t.start(); t.join()
      out["kept_h"] = bool(np.array_equal(sess.get_state(h)[0], w))
      out["off_in_main"] = attempt(h, jnp.zeros_like(good))  # the flag was the thread's
      want = jax.jit(step)(w, good)[0]
      sess.run(g, good)
      out["advanced"] = bool(np.array_equal(sess.get_state(g)[0], want))
      print(json.dumps(out))
    """)
    res = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         timeout=300)
    self.assertEqual(res.returncode, 0, res.stderr[-3000:])
    import json
    self.assertEqual(json.loads(res.stdout.strip().splitlines()[-1]), {
        "maybe_at_start": False, "maybe_global_on": True, "nan": "raised",
        "maybe_global_off": False, "kept_g": True, "inf_in_thread": "raised",
        "kept_h": True, "off_in_main": "ran", "advanced": True})


if __name__ == "__main__":
  absltest.main()
