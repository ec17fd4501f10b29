"""State bound and updated in part: replace_state, set_state(donate=True),
state_from with state_map, and the order of state_argnums. Every result
equals jax.jit's bit for bit; every bad call is an InputError that changes
nothing."""
from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxsession as js
from jaxsession.errors import InputError
from exact import assert_equal_signed


def _state_bytes(sess, gid):
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(sess.get_state(gid))]


def _decode_step(params, cache, pos, token):
  """One token of a toy decoder with a KV cache: attention over the cache."""
  emb = params["emb"][token]
  k, v = emb @ params["wk"], emb @ params["wv"]
  cache = {"k": cache["k"].at[pos].set(k), "v": cache["v"].at[pos].set(v)}
  mask = jnp.arange(cache["k"].shape[0]) <= pos
  att = jnp.where(mask, cache["k"] @ (emb @ params["wq"]), -jnp.inf)
  out = jax.nn.softmax(att) @ cache["v"]
  return params, cache, jnp.argmax(out @ params["emb"].T).astype(jnp.int32)


class ReplaceStateTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    rng = np.random.default_rng(16)
    self.params = {n: rng.standard_normal(s).astype(np.float32)
                   for n, s in (("emb", (11, 8)), ("wk", (8, 8)), ("wv", (8, 8)),
                                ("wq", (8, 8)))}
    self.cache = {"k": np.zeros((6, 8), np.float32), "v": np.zeros((6, 8), np.float32)}
    self.rng = rng

  def test_a_cache_reset_leaves_the_parameters_and_equals_jit(self):
    sess = js.Session()
    gid = sess.compile(_decode_step, self.params, self.cache, np.int32(0), np.int32(3),
                       state_argnums=(0, 1))
    step = jax.jit(_decode_step)
    for rollout in range(3):
      fresh = {"k": self.rng.standard_normal((6, 8)).astype(np.float32),
               "v": self.rng.standard_normal((6, 8)).astype(np.float32)}
      fresh["k"][0, :2] = [-0.0, np.nan]  # a signed zero and a nan travel as they are
      params_before = sess.get_state(gid)[0]
      sess.replace_state(gid, 1, fresh)
      assert_equal_signed(sess.get_state(gid)[1]["k"], fresh["k"])
      for name, leaf in params_before.items():  # untouched, bit for bit
        self.assertEqual(np.asarray(sess.get_state(gid)[0][name]).tobytes(),
                         np.asarray(leaf).tobytes())
      p, c, token = self.params, fresh, np.int32(rollout + 1)
      for pos in range(6):
        got = sess.run(gid, np.int32(pos), token)
        p, c, want = step(p, c, np.int32(pos), token)
        assert_equal_signed(got, want)
        token = want
      self.assertEqual(_state_bytes(sess, gid),
                       [np.asarray(x).tobytes() for x in jax.tree.leaves((p, c))])

  def test_bad_input_is_an_input_error_and_changes_nothing(self):
    sess = js.Session()
    gid = sess.compile(_decode_step, self.params, self.cache, np.int32(0), np.int32(3),
                       state_argnums=(0, 1))
    sess.run(gid, np.int32(0), np.int32(2))
    before = _state_bytes(sess, gid)
    good = {"k": np.ones((6, 8), np.float32), "v": np.ones((6, 8), np.float32)}
    bad = [((2, good), "index 2 is not a state arg"),
           ((-1, good), "index -1 is not a state arg"),
           ((True, good), "index True"),
           ((1, {"k": good["k"]}), "pytree structure"),
           ((1, {"k": good["k"], "v": good["v"][:3]}), r"state arg 1 at path \['v'\]"),
           ((1, {"k": good["k"], "v": good["v"].astype(np.int32)}), "i32"),
           ((0, good), "pytree structure")]
    for args, message in bad:
      with self.assertRaisesRegex(InputError, message):
        sess.replace_state(gid, *args)
      self.assertEqual(_state_bytes(sess, gid), before)
    with self.assertRaisesRegex(InputError, "donate must be True or False"):
      sess.replace_state(gid, 1, good, donate="yes")
    self.assertEqual(_state_bytes(sess, gid), before)


class ReplaceSeveralTest(absltest.TestCase):
  """replace_state(gid, (i, j, ...), (a, b, ...)): several state args checked
  together, then bound together."""

  def setUp(self):
    super().setUp()
    rng = np.random.default_rng(29)
    self.params = {n: rng.standard_normal(s).astype(np.float32)
                   for n, s in (("emb", (11, 8)), ("wk", (8, 8)), ("wv", (8, 8)),
                                ("wq", (8, 8)))}
    self.rng = rng

  def _compile(self):
    def step(params, cache, pos, token):
      params, cache, token = _decode_step(params, cache, pos, token)
      return params, cache, pos + 1, token, token
    sess = js.Session()
    cache = {"k": np.zeros((6, 8), np.float32), "v": np.zeros((6, 8), np.float32)}
    gid = sess.compile(step, self.params, cache, np.int32(0), np.int32(3),
                       state_argnums=(0, 1, 2, 3))
    return sess, gid

  def _fresh(self):
    fresh = {"k": self.rng.standard_normal((6, 8)).astype(np.float32),
             "v": self.rng.standard_normal((6, 8)).astype(np.float32)}
    fresh["k"][1, :3] = [-0.0, np.nan, np.inf]
    return fresh

  def test_a_reset_of_three_args_equals_three_resets_and_jit(self):
    one, one_gid = self._compile()
    three, three_gid = self._compile()
    step = jax.jit(_decode_step)
    for request in range(3):
      cache = jax.tree.map(jnp.asarray, self._fresh())
      token = jnp.int32(request + 2)
      params_before = _state_bytes(one, one_gid)[:4]
      one.replace_state(one_gid, (1, 2, 3), [cache, jnp.int32(0), token])
      self.assertEqual(_state_bytes(one, one_gid)[:4], params_before)  # untouched
      for k, v in ((1, cache), (2, jnp.int32(0)), (3, token)):
        three.replace_state(three_gid, k, v)
      self.assertEqual(_state_bytes(one, one_gid), _state_bytes(three, three_gid))
      got = one.run(one_gid, steps=6)
      assert_equal_signed(got, three.run(three_gid, steps=6))
      p, c, want = self.params, cache, []
      for pos in range(6):
        p, c, token = step(p, c, np.int32(pos), token)
        want.append(token)
      assert_equal_signed(got, np.stack(want))
      self.assertEqual(_state_bytes(one, one_gid)[4:6],
                       [np.asarray(x).tobytes() for x in jax.tree.leaves(c)])
      # the caller's arrays are copied, never donated by the runs
      self.assertFalse(any(x.is_deleted() for x in jax.tree.leaves(cache)))
      self.assertFalse(token.is_deleted())

  def test_one_bad_value_binds_none_of_them(self):
    sess, gid = self._compile()
    sess.run(gid, steps=2)
    before = _state_bytes(sess, gid)
    good = self._fresh()
    bad = [(((1, 2), (good, np.int32(0), np.int32(1))), r"names 2 state args: value must be "
            r"a tuple or list of 2 values, one each, got a tuple of 3"),
           (((1, 2), good), "got a dict"),
           (((1, 1), (good, good)), r"index \(1, 1\) names a state arg twice"),
           (((), ()), "index is an empty tuple"),
           (((1, 4), (good, np.int32(0))), "index 4 is not a state arg"),
           (((1, True), (good, np.int32(0))), "index True"),
           (((1, 2, 3), (good, np.int32(0), np.float32(1))),
            r"state arg 3 .*float32|state arg 3 .*f32"),
           (((2, 1), (np.int32(0), {"k": good["k"]})), "state arg 1: pytree structure")]
    for args, message in bad:
      with self.assertRaisesRegex(InputError, message):
        sess.replace_state(gid, *args)
      self.assertEqual(_state_bytes(sess, gid), before)


class DonateTest(absltest.TestCase):

  def test_set_state_takes_the_callers_arrays_over(self):
    rng = np.random.default_rng(3)
    params = {"w": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
              "b": jnp.asarray(rng.standard_normal(3), jnp.float32)}
    tx = optax.adam(1e-2)
    def train(p, o, x):
      g = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(p)
      u, o = tx.update(g, o, p)
      return optax.apply_updates(p, u), o, jnp.sum(g["w"])
    opt = tx.init(params)
    sess = js.Session()
    gid = sess.compile(train, params, opt, np.ones((5, 4), np.float32), state_argnums=(0, 1))
    new_p = jax.tree.map(lambda a: a * 1.5, params)
    new_o = tx.init(new_p)
    keep = jax.tree.map(np.array, (new_p, new_o))  # copies: a numpy view would pin the buffer
    pointers = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(new_p)]
    sess.set_state(gid, new_p, new_o, donate=True)
    self.assertTrue(all(x.is_deleted() for x in jax.tree.leaves(new_p)))  # as donate_argnums
    slot_leaves = sess._entry(gid).slots[0].leaves
    self.assertEqual([x.unsafe_buffer_pointer() for x in slot_leaves], pointers)  # no copy
    x = rng.standard_normal((5, 4)).astype(np.float32)
    ref = jax.jit(train)(*keep, x)
    got = sess.run(gid, x)
    assert_equal_signed(got, ref[2])
    self.assertEqual(_state_bytes(sess, gid),
                     [np.asarray(v).tobytes() for v in jax.tree.leaves(ref[:2])])

  def test_donated_under_disable_jit_is_taken_over_too(self):
    # under jax.disable_jit() a jitted call does not donate: the caller's array
    # stayed alive on the state's buffer until a later run's donation deleted it
    rng = np.random.default_rng(4)
    def train(p, x):
      return p - x, jnp.sum(p * x)
    x = jnp.asarray(rng.standard_normal(3), jnp.float32)
    sess = js.Session()
    gid = sess.compile(train, jnp.ones(3), x, state_argnums=0)
    with jax.disable_jit():
      a = jnp.asarray(rng.standard_normal(3), jnp.float32)
      keep = np.array(a)
      pointer = a.unsafe_buffer_pointer()
      sess.set_state(gid, a, donate=True)
    self.assertTrue(a.is_deleted())
    self.assertEqual(sess._entry(gid).slots[0].leaves[0].unsafe_buffer_pointer(), pointer)
    assert_equal_signed(sess.run(gid, x), jax.jit(train)(keep, x)[1])
    assert_equal_signed(sess.get_state(gid)[0], keep - x)

  def test_what_does_not_fit_is_copied_and_the_same_array_taken_once(self):
    sess = js.Session()
    gid = sess.compile(lambda a, b, x: (a + x, b - x, a * b), np.ones(3, np.float32),
                       np.ones(3, np.float32), np.ones(3, np.float32), state_argnums=(0, 1))
    shared = jnp.asarray(np.float32([1.5, -0.0, 3.0]))
    sess.set_state(gid, shared, shared, donate=True)  # twice: taken once, copied once
    a, b = sess.get_state(gid)
    assert_equal_signed(a, [1.5, -0.0, 3.0])
    assert_equal_signed(b, [1.5, -0.0, 3.0])
    # two arrays on one buffer (device_put to its own sharding) are taken once
    # too: donating both raised a RuntimeError (found by the break-it review)
    one = jnp.asarray(np.float32([0.5, np.nan, -2.0]))
    alias = jax.device_put(one, one.sharding)
    sess.set_state(gid, one, alias, donate=True)
    for got in sess.get_state(gid):
      assert_equal_signed(got, [0.5, np.nan, -2.0])
    host = np.float32([2.0, 4.0, 8.0])  # numpy: copied, the caller's untouched
    sess.set_state(gid, host, jnp.asarray(host), donate=True)
    assert_equal_signed(host, [2.0, 4.0, 8.0])
    assert_equal_signed(sess.run(gid, np.ones(3, np.float32)), host * host)
    pinned = jnp.asarray(np.float32([5.0, 6.0, 7.0]))
    view = np.asarray(pinned)  # a numpy view pins the buffer: XLA copies it instead
    sess.set_state(gid, pinned, jnp.asarray(host), donate=True)
    self.assertFalse(pinned.is_deleted())
    assert_equal_signed(sess.get_state(gid)[0], view)
    before = _state_bytes(sess, gid)
    wrong = jnp.ones(4, jnp.float32)
    with self.assertRaisesRegex(InputError, "expected f32\\[3\\], got f32\\[4\\]"):
      sess.set_state(gid, jnp.ones(3, jnp.float32), wrong, donate=True)
    self.assertFalse(wrong.is_deleted())  # nothing taken before every value passed
    self.assertEqual(_state_bytes(sess, gid), before)


class ShapeDtypeStructStateTest(absltest.TestCase):
  """State compiled from jax.ShapeDtypeStructs: unset until bound, then the
  caller's arrays taken over (one copy of the state, never two)."""

  def test_unset_until_bound_then_equals_jit(self):
    rng = np.random.default_rng(8)
    tx = optax.adam(1e-2)
    def train(p, o, x):
      g = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2))(p)
      u, o = tx.update(g, o, p)
      return optax.apply_updates(p, u), o, jnp.sum(g["w"])
    p = {"w": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
         "b": jnp.asarray(rng.standard_normal(3), jnp.float32)}
    o = tx.init(p)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (p, o))
    sess = js.Session()
    gid = sess.compile(train, *structs, jax.ShapeDtypeStruct(x.shape, x.dtype),
                       state_argnums=(0, 1))
    refusals = [(lambda: sess.run(gid, x), "run.* state arg 0 .* is unset"),
                (lambda: sess.run(gid, x[None], steps=1), "is unset"),
                (lambda: sess.get_state(gid), "get_state.* is unset"),
                (lambda: sess.save(gid, "/nonexistent/never", 1), "the state is unset")]
    for call, message in refusals:
      with self.assertRaisesRegex(InputError, message):
        call()
    want = jax.jit(train)(p, o, x)
    sess.replace_state(gid, 0, p)
    with self.assertRaisesRegex(InputError, "state arg 1 .* is unset"):
      sess.run(gid, x)
    taken = jax.tree.map(jnp.copy, o)
    sess.replace_state(gid, 1, taken, donate=True)
    self.assertTrue(all(a.is_deleted() for a in jax.tree.leaves(taken)))
    assert_equal_signed(sess.run(gid, x), want[2])
    self.assertEqual(_state_bytes(sess, gid),
                     [np.asarray(v).tobytes() for v in jax.tree.leaves(want[:2])])
    # an eval graph sharing the unset slots is refused until they are bound
    other = js.Session()
    tid = other.compile(train, *structs, x, state_argnums=(0, 1))
    eid = other.compile(lambda p, x: jnp.sum(x @ p["w"]), structs[0], x, state_argnums=0,
                        state_from=tid, updates_state=False)
    with self.assertRaisesRegex(InputError, "is unset"):
      other.run(eid, x)
    other.set_state(tid, p, o)
    assert_equal_signed(other.run(eid, x), jax.jit(lambda p, x: jnp.sum(x @ p["w"]))(p, x))
    other.release(eid)
    other.release(tid)

  def test_a_structure_error_on_an_unset_slot_names_the_field(self):
    # the difference was looked for against the unset leaves (None): "at
    # ['a']: expected a NoneType" where ['b'] differs (a break-it find)
    state = {"a": jnp.arange(3.0), "b": jnp.ones(2), "n": jnp.int32(0)}
    structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    sess = js.Session()
    gid = sess.compile(lambda s, x: ({k: v + 1 for k, v in s.items()}, x), structs,
                       jnp.ones(1), state_argnums=0)
    with self.assertRaisesRegex(InputError, r"at \['b'\]: expected an array leaf "
                                r"float32\[2\], got a dict"):
      sess.set_state(gid, {"a": state["a"], "b": {"x": state["b"]}, "n": state["n"]})


class StateMapTest(absltest.TestCase):

  def test_an_eval_graph_binds_a_subset_in_another_order(self):
    rng = np.random.default_rng(4)
    a, b, c = (rng.standard_normal(4).astype(np.float32) for _ in range(3))
    def train(a, b, c, x):
      return a + x, b * x, c - x, jnp.sum(a)
    def evaluate(c, a, x):
      return jnp.sum(c * x) - jnp.sum(a)
    sess = js.Session()
    tid = sess.compile(train, a, b, c, a, state_argnums=(0, 1, 2))
    eid = sess.compile(evaluate, c, a, a, state_argnums=(0, 1), state_from=tid,
                       state_map=(2, 0), updates_state=False)
    ra, rb, rc = a, b, c
    for _ in range(3):
      x = rng.standard_normal(4).astype(np.float32)
      sess.run(tid, x)
      ra, rb, rc, _ = jax.jit(train)(ra, rb, rc, x)
      assert_equal_signed(sess.run(eid, x), jax.jit(evaluate)(rc, ra, x))
    # a graph that updates through the map writes the train graph's slots
    def bump(c, x):
      return c * 2.0, jnp.sum(c)
    bid = sess.compile(bump, c, a, state_argnums=0, state_from=tid, state_map=(2,))
    sess.run(bid, a)
    assert_equal_signed(sess.get_state(tid)[2], rc * 2.0)
    assert_equal_signed(sess.get_state(tid)[0], ra)

  def test_bad_maps_and_orders_are_input_errors(self):
    sess = js.Session()
    v = np.float32([1.0, 2.0])
    tid = sess.compile(lambda a, b, x: (a + x, b + 1, x), v, v.astype(np.int32), v,
                       state_argnums=(0, 1))
    reader = lambda a, x: jnp.sum(a) + x  # noqa: E731
    cases = [(dict(state_from=tid, state_map=(2,)), "not a slot"),
             (dict(state_from=tid, state_map=(0, 1)), "2 entries for 1 state args"),
             (dict(state_from=tid, state_map=(True,)), "not a slot"),
             (dict(state_from=tid, state_map=5), "must be a sequence"),
             (dict(state_map=(0,)), "without state_from"),
             (dict(state_from=tid, state_map=(1,)), "expected i32")]  # slot 1 holds ints
    for kwargs, message in cases:
      with self.assertRaisesRegex(InputError, message):
        sess.compile(reader, v, np.float32(1.0), state_argnums=0, updates_state=False,
                     **kwargs)
    with self.assertRaisesRegex(InputError, "twice"):
      sess.compile(lambda a, b, x: a.sum() + b.sum(), v, v, v, state_argnums=(0, 1),
                   state_from=tid, state_map=(0, 0), updates_state=False)

  def test_state_argnums_order_is_the_order_of_the_new_values(self):
    # state_argnums=(2, 0): state arg 0 is position 2, and fn returns its new
    # value first (the order as listed, not the positions' order), as the fuzz
    # checks against jax.jit over random orders
    a, b = np.float32([1.0, 2.0]), np.float32([10.0, 20.0])
    def step(a, x, b):
      return b + x, a - x, jnp.sum(a * b)  # new b first, then new a
    sess = js.Session()
    gid = sess.compile(step, a, np.float32([0.5, 0.25]), b, state_argnums=(2, 0))
    x = np.float32([0.5, 0.25])
    sess.run(gid, x)
    new_b, new_a = sess.get_state(gid)
    assert_equal_signed(new_b, b + x)
    assert_equal_signed(new_a, a - x)


class NumpyScalarStateTest(absltest.TestCase):
  def test_a_numpy_scalar_is_bound_strong_as_jax_jit_sees_it(self):
    # np.float64 subclasses float; jax.jit treats it as strong, so must the slot
    sess = js.Session()
    gid = sess.compile(lambda s, x: (s * x, s), jnp.float32(2.5), jnp.bfloat16(1.5),
                       state_argnums=(0,))
    sess.replace_state(gid, 0, np.float64(-0.0))
    got = sess.get_state(gid)[0]
    self.assertFalse(got.weak_type)
    want = jax.jit(lambda s: s)(np.float64(-0.0))
    self.assertEqual(got.dtype, want.dtype)
    assert_equal_signed(np.signbit(got), np.signbit(want))

  def test_a_bound_value_takes_the_slots_weak_type(self):
    # the slot's weak type is the program's: a Python scalar bound to a strong
    # float32 leaf is strong (as every later run's state is), a strong value
    # bound to a weak leaf weak - by set_state, replace_state, and donated
    def step(s, w, x):
      return s * x + w, w - x, s + w
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal(), jnp.float32)
    for donate in (False, True):
      sess = js.Session()
      gid = sess.compile(step, jnp.float32(2.5), 1.5, x, state_argnums=(0, 1))
      strong, weak = sess.get_state(gid)
      self.assertEqual((strong.weak_type, weak.weak_type), (False, True))
      sess.set_state(gid, -0.0, jnp.asarray(rng.standard_normal(), jnp.float32),
                     donate=donate)
      got = sess.get_state(gid)
      self.assertEqual([g.weak_type for g in got], [False, True])
      self.assertEqual([g.dtype for g in got], [np.float32, np.float32])
      self.assertTrue(np.signbit(got[0]))
      w0 = np.asarray(got[1])
      sess.replace_state(gid, 0, 3.0)
      self.assertFalse(sess.get_state(gid)[0].weak_type)
      out = sess.run(gid, x)
      want = jax.jit(step)(jnp.float32(3.0), w0, x)  # the state as the slots hold it
      assert_equal_signed(out, want[2])
      assert_equal_signed(sess.get_state(gid)[0], want[0])
      # after a run, the state is the program's outputs, typed as jax.jit's
      self.assertEqual([g.weak_type for g in sess.get_state(gid)],
                       [want[0].weak_type, want[1].weak_type])


if __name__ == "__main__":
  absltest.main()
