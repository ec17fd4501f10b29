"""Fuzz: 278 random programs through the whole pipeline, each compared with
jax.jit on fresh random inputs, bit for bit (DESIGN.md: "the session's output
equals jax.jit's bit for bit wherever the arithmetic is the same").

Generators with fixed seeds; program i of a test draws from its own generator
(seed, i), so a failure reproduces from its index alone, and every failure
message carries the program's recipe. A test runs all its programs and then
lists every one that failed (a mismatch or a crash).
- stateless (80): elementwise, broadcast, reduction, dot, norm and literal ops
  (the shapes the fusions look for), weak-typed Python scalar args, and inputs
  holding -0.0, NaN, +-inf, huge and subnormal values;
- callbacks and effects (30): `jax.pure_callback` (numpy) at top level and
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
- loop sink (24): the same, then `run(..., steps=3)` on stacked args, which
  must equal three jax.jit steps;
- outside judges' forms (64, generators in fuzz_judges.py): nested jits with
  constant arguments and closed-over constant subexpressions (divisions by
  reductions, a linspace mean), host integer chains over every host kernel
  with random parameters (all placed on the host, checked), bucketed
  row-wise programs with reductions in every dtype (bf16, f16, ints, bool:
  jax.jit's bits at the bucket's shape, and the exact shape's where no float
  reduction rounds), and weak/strong scalar flips between example and run
  (jax.jit's bits and types, or an InputError naming the weak type).
ReducedFindingsTest holds the smallest forms of what the fuzz found.
"""
import contextlib

from absl.testing import absltest
import pytest
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from exact import assert_equal_signed

from fuzz_programs import (ROWS, COLS, assert_bits_equal, max_ulp, split_outputs,
    random_array, CONST, make_program, make_inputs, HOST_CALLS, host_call,
    make_callback_program, KEY_KINDS, callback_inputs)
from fuzz_state_programs import (make_stateful_program, make_adam_program, Held)  # noqa: F401
from fuzz_judges import (make_const_program, make_int_chain, make_bucket_program, bucket_rows,
                         float_reduction)
from jaxsession.errors import InputError
from jaxsession.graph import op_properties

pytestmark = pytest.mark.slow  # the fast subset: -m "not slow" (docs/testing.md)


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


def check_constants(sess, rng, i):
  """Nested jits with constant arguments and closed-over constant
  subexpressions (divisions by reductions, samplers with constant
  parameters): jax.jit's bits, never the session's own folding."""
  recipe, program = make_const_program(rng)
  msg = f"constant program {i}: {recipe}"
  with recipe_on_crash(msg):
    gid = sess.compile(program, random_array(rng, (ROWS, COLS)), jax.random.key(i))
    jitted = jax.jit(program)
    for r in range(2):
      args = (random_array(rng, (ROWS, COLS), special=i % 3 == 2), jax.random.key(1000 * r + i))
      assert_bits_equal(sess.run(gid, *args), jitted(*args), msg)
  sess.release(gid)


def check_int_chain(sess, rng, i, host_ops):
  """A chain of host integer ops with random parameters: every one placed on
  the host (numpy), every bit jax.jit's."""
  recipe, program = make_int_chain(rng)
  msg = f"host integer chain {i}: {recipe}"
  with recipe_on_crash(msg):
    gid = sess.compile(program, jnp.uint32(i))
    hosted = set(op_properties.ops_with(host=True))
    for node in sess.graph(gid).nodes:
      if node.op in hosted:
        if not node.kernel.name.startswith("host:"):
          raise AssertionError(f"node {node.op} ran as {node.kernel.name}; {msg}")
        host_ops.add(node.op)
    jitted = jax.jit(program)
    for seed in (i + 7000, i + 9000):
      assert_bits_equal(sess.run(gid, jnp.uint32(seed)), jitted(jnp.uint32(seed)), msg)
  sess.release(gid)


def check_bucketed(sess, rng, i, exact_counts):
  """A bucketed row-wise program (reductions along the row, every dtype):
  each batch size gives jax.jit's bits at the bucket's shape, the real rows
  sliced out; and the exact-shape jax.jit's bits wherever no float reduction
  is involved (docs/numerics.md)."""
  dtype, recipe, program = make_bucket_program(rng)
  msg = f"bucketed program {i} ({dtype}): {recipe}"
  with recipe_on_crash(msg):
    gid = sess.compile(program, bucket_rows(rng, 16, dtype), buckets={0: [4, 8, 16]})
    jitted = jax.jit(program)
    for n in sorted(set(int(n) for n in rng.integers(1, 17, 3))):
      x = bucket_rows(rng, n, dtype)
      size = next(b for b in (4, 8, 16) if b >= n)
      padded = jnp.concatenate([x, jnp.zeros((size - n, COLS), x.dtype)])
      got = sess.run(gid, x)
      at_bucket = jax.tree.map(lambda o: o[:n], jitted(padded))
      exact = jitted(x)
      assert_bits_equal([np.asarray(g) for g in got], [np.asarray(w) for w in at_bucket],
                        f"n={n} against jax.jit at the bucket; {msg}")
      jax.tree.map(lambda g, w: _same_type(g, w, f"n={n}; {msg}"), got, exact)
      if not float_reduction(recipe, dtype):
        assert_bits_equal(got, exact, f"n={n} against exact-shape jax.jit; {msg}")
        exact_counts.append(n)
  sess.release(gid)


def _same_type(got, want, msg):
  if (got.shape, got.dtype, got.weak_type) != (want.shape, want.dtype, want.weak_type):
    raise AssertionError(f"{got.shape} {got.dtype} weak={got.weak_type} against jax.jit's "
                         f"{want.shape} {want.dtype} weak={want.weak_type}; {msg}")


def check_weak_flip(sess, rng, i, verdicts):
  """Compiled with a weak Python float and run with a strong float32 (or the
  other way): jax.jit's bits and types, or an InputError naming the weak
  type, never other bits."""
  recipe, base = make_program(rng)
  mixed = i % 2 == 1  # a bfloat16 product: the scalar's weak type changes the program
  program = (lambda *a: (base(*a), a[0].astype(jnp.bfloat16) * a[-1])) if mixed else base
  args = make_inputs(rng)
  weak_first = i % 4 < 2
  s = float(args[-1])
  example = args[:-1] + [s if weak_first else jnp.float32(s)]
  msg = f"weak flip program {i} (compiled {'weak' if weak_first else 'strong'}, " \
        f"bf16 product: {mixed}): {recipe}"
  with recipe_on_crash(msg):
    gid = sess.compile(program, *example)
    run_args = make_inputs(rng)
    r = float(run_args[-1])
    flipped = run_args[:-1] + [(jnp.float32(r) if i % 3 else np.float32(r)) if weak_first
                               else r]
    try:
      got = sess.run(gid, *flipped)
    except InputError as exc:
      if "weakly typed" not in str(exc) and "strongly typed" not in str(exc):
        raise
      verdicts.append("refused")
    else:
      assert_bits_equal(got, jax.jit(program)(*flipped), msg)
      verdicts.append("ran")
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

  def programs(self, what, n, seed, check, *extra):
    """check(session, program i's generator, i, *extra) for i < n, in one
    Session; then fails listing every program that failed."""
    sess = js.Session()
    for i in range(n):
      self.check(f"{what} {i}", check, sess, _seeded(seed, i), i, *extra)
    self.assert_none(n)

  def assert_none(self, total):
    if self.found:
      self.test.fail(f"{len(self.found)} of {total} programs failed:\n\n"
                     + "\n\n".join(self.found))


def _seeded(seed, i):
  """Program i's own generator: each program reproduces from its index alone."""
  return np.random.default_rng([seed, i])


class FuzzTest(absltest.TestCase):

  def test_stateless_random_programs_bit_exact(self):
    fused = []
    Failures(self).programs("stateless program", 80, 2026, check_stateless, fused)
    self.assertGreater(sum(fused), 50)  # the fusions did fire along the way

  def test_callbacks_control_flow_and_random_programs(self):
    io_calls, inner = [], []
    Failures(self).programs("callback program", 30, 7070, check_callbacks, io_calls, inner)
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
    failures, n = Failures(self), 24
    for i in range(n):
      rng = _seeded(4242, i)  # no Python-scalar args: they cannot carry a leading axis
      prog = (make_adam_program(rng) if i % 4 == 3
              else make_stateful_program(rng, allow_scalar=False))
      failures.check(f"loop-sunk program {i}", check_stateful, sess, prog, rng, i, True,
                     i % 5 == 4)
    failures.assert_none(n)

  def test_nested_jits_and_constant_subexpressions(self):
    Failures(self).programs("constant program", 6, 515, check_constants)

  def test_host_integer_chains(self):
    host_ops = set()
    Failures(self).programs("host integer chain", 24, 616, check_int_chain, host_ops)
    # the chains reached every host kernel the table has
    self.assertContainsSubset(set(op_properties.ops_with(host=True)), host_ops)

  def test_buckets_over_reductions_and_every_dtype(self):
    exact = []
    Failures(self).programs("bucketed program", 10, 717, check_bucketed, exact)
    self.assertGreater(len(exact), 8)  # many runs were held to exact-shape jax.jit

  def test_weak_strong_scalar_flips(self):
    verdicts = []
    Failures(self).programs("weak flip program", 24, 818, check_weak_flip, verdicts)
    self.assertGreater(verdicts.count("ran"), 5)
    self.assertGreater(verdicts.count("refused"), 5)


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
    # jax.jit's XLA rewrites 1 / (a / b) as b / a inside one executable. Split
    # by the callback, the two divides were computed as written (1 ulp off);
    # move_into_readers keeps them in one executable, where XLA sees them
    # together as jax.jit's does: bit-identical, as with the callback kept
    # inside the executable (host_callbacks=False).
    def f(a, b):
      q = a / b
      return host_call("np_tanh", a), 1.0 / q
    rng = np.random.default_rng(4)
    args = [random_array(rng, (ROWS, COLS)) for _ in range(2)]
    sess = js.Session()
    got = sess.run(sess.compile(f, *args), *args)
    want = jax.jit(f)(*args)
    assert_bits_equal(got[0], want[0], "the callback's output")
    assert_bits_equal(got[1], want[1], "1 / (a / b)")
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
    assert_equal_signed(got[~subnormal], want[~subnormal])
    assert_equal_signed(want[subnormal], np.copysign(np.float32(0), x[subnormal]))  # flushed
    inside = js.Session(js.SessionOptions(host_callbacks=False))
    assert_bits_equal(inside.run(inside.compile(fn, jnp.asarray(x)), jnp.asarray(x)),
                      want, "one executable")


if __name__ == "__main__":
  absltest.main()
