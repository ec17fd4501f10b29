"""The call signature and the one leaf check (session/inputs.py): every bad
leaf - deleted, a ShapeDtypeStruct where a value is needed, a non-array
field of a module - is an InputError naming the argument and pytree path,
wherever it is given (compile's examples, run, set_state, state_from,
run_op), and the state is exactly as before after each."""
import dataclasses
import functools

from absl.testing import absltest
import pytest
import jax
import jax.numpy as jnp
import numpy as np

import jaxsession as js
from jaxsession.inputs import ArgSpec
from exact import assert_equal_signed, assert_same_bits
from subproc import HELPERS, run_json


@jax.tree_util.register_pytree_node_class
class Module:
  """An equinox-style module: every field a pytree child, arrays or not."""

  def __init__(self, weight, activation, label):
    self.weight, self.activation, self.label = weight, activation, label

  def tree_flatten(self):
    return (self.weight, self.activation, self.label), None

  @classmethod
  def tree_unflatten(cls, _, children):
    return cls(*children)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w", "config"],
                   meta_fields=[])
@dataclasses.dataclass
class Layer:
  w: jax.Array
  config: object


def _rng_state(seed):
  rng = np.random.default_rng(seed)
  w = rng.standard_normal(5).astype(np.float32)
  w[0], w[1] = -0.0, np.nan  # specials survive a refused call bit for bit
  return {"w": jnp.asarray(w), "inner": {"b": jnp.asarray(rng.standard_normal(3),
                                                          jnp.float32), "none": None},
          "n": jnp.int32(rng.integers(1, 100))}


def step(state, x):
  new = {"w": state["w"] * 0.5 + x.sum(), "inner": {"b": state["inner"]["b"] - x[:3],
                                                    "none": None}, "n": state["n"] + 1}
  return new, new["w"].sum()


class CallSignatureTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.rng = np.random.default_rng(11)
    self.sess = js.Session()
    self.state = _rng_state(3)
    self.x = jnp.asarray(self.rng.standard_normal(4), jnp.float32)
    self.gid = self.sess.compile(step, self.state, self.x, state_argnums=0)
    self.sess.run(self.gid, self.x)
    self.before = self.sess.get_state(self.gid)

  def assert_unchanged(self):
    assert_same_bits(self.sess.get_state(self.gid), self.before, "state after a refused call")
    # and still usable: one more step equals jax.jit's from the same state
    want_state, want_out = jax.jit(step)(self.before[0], self.x)
    assert_same_bits(self.sess.run(self.gid, self.x), want_out, "run after")
    assert_same_bits(self.sess.get_state(self.gid)[0], want_state, "state after the run")

  def assert_refused(self, pattern, call):
    with self.assertRaisesRegex(js.InputError, pattern):
      call()

  def test_the_spec_is_frozen(self):
    spec = ArgSpec("run(t)", [1], [{"a": self.x, "b": (self.x, None)}])
    self.assertEqual(spec.paths, ((r"['a']", r"['b'][0]"),))
    self.assertTrue(all(not a.weak_type for a in spec.avals[0]))
    with self.assertRaises(AttributeError):
      spec.where = "run(other)"
    with self.assertRaisesRegex(js.InputError, r"argument 0 \(position 1 .*\['b'\]\[0\]: "
                                r"expected f32\[4\], got i32\[4\]"):
      spec.conform(({"a": self.x, "b": (jnp.arange(4), None)},))

  def test_deleted_state_example(self):
    gone = _rng_state(4)
    gone["inner"]["b"].delete()
    self.assert_refused(r"example argument at position 0 \(a state argument\), path "
                        r"\['inner'\]\['b'\]: the array has been deleted",
                        lambda: self.sess.compile(step, gone, self.x, state_argnums=0))
    self.assert_unchanged()

  def test_shape_dtype_struct_state_example(self):
    # a state example may be a type (DESIGN.md): the state is unset until bound
    state = _rng_state(5)
    structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    gid = self.sess.compile(step, structs, self.x, state_argnums=0)
    self.assert_refused(rf"run\(graph {gid} 'step'\): state arg 0 .* is unset: it was "
                        "compiled from jax.ShapeDtypeStruct", lambda: self.sess.run(gid, self.x))
    self.sess.set_state(gid, state)
    assert_same_bits(self.sess.run(gid, self.x), jax.jit(step)(state, self.x)[1], "bound")
    self.assert_unchanged()

  def test_shape_dtype_struct_run_example_is_a_type(self):
    fn = lambda x, s: jnp.sin(x) * s
    gid = self.sess.compile(fn, jax.ShapeDtypeStruct((4,), jnp.float32), 0.5)
    for s in (-0.0, 0.25, float("nan")):
      assert_same_bits(self.sess.run(gid, self.x, s), jax.jit(fn)(self.x, s), f"s={s}")

  def test_module_with_non_array_leaves(self):
    # as state, non-array leaves are kept static (tests/static_leaves_test.py);
    # as a run argument they are refused with the ways to make them static
    module = Module(jnp.asarray(self.rng.standard_normal(3), jnp.float32), jnp.tanh, "relu")
    gid = self.sess.compile(lambda m, x: (m, m.activation(x * m.weight[0])), module, self.x,
                            state_argnums=0)
    want = jax.jit(lambda x: jnp.tanh(x * module.weight[0]))(self.x)
    assert_same_bits(self.sess.run(gid, self.x), want, "static leaves")
    self.assertIs(self.sess.get_state(gid)[0].activation, jnp.tanh)
    layer = {"layers": [Layer(jnp.ones(2), object())]}
    self.assert_refused(r"path \['layers'\]\[0\]\.config is a object, not an array.*"
                        r"equinox.partition.*state argument",
                        lambda: self.sess.compile(lambda x, s: x, self.x, layer))
    self.assert_unchanged()

  def test_run_refuses_what_is_not_a_value(self):
    struct = jax.ShapeDtypeStruct((4,), jnp.float32)
    self.assert_refused(r"argument 0 \(position 1 of the function\) at path \(root\) is a "
                        r"jax.ShapeDtypeStruct", lambda: self.sess.run(self.gid, struct))
    self.assert_refused(r"at path \(root\) is a str, not an array",
                        lambda: self.sess.run(self.gid, "x"))
    gone = jnp.asarray(self.rng.standard_normal(4), jnp.float32)
    gone.delete()
    self.assert_refused(r"at path \(root\): the array has been deleted",
                        lambda: self.sess.run(self.gid, gone))
    stacked = jnp.asarray(self.rng.standard_normal((2, 4)), jnp.float32)
    stacked.delete()
    self.assert_refused(r"at path \(root\): the array has been deleted",
                        lambda: self.sess.run(self.gid, stacked, steps=2))
    self.assert_unchanged()

  def test_set_state_refuses_bad_leaves(self):
    new = _rng_state(6)
    for leaf, pattern in ((jax.ShapeDtypeStruct((3,), jnp.float32), "ShapeDtypeStruct"),
                          (jnp.tanh, "PjitFunction, not an array.*static"),
                          (jnp.arange(3), r"expected f32\[3\], got i32\[3\]"),
                          (jnp.ones(3, jnp.bfloat16), r"expected f32\[3\], got bf16\[3\]")):
      bad = jax.tree.map(lambda a: a, new)
      bad["inner"]["b"] = leaf
      self.assert_refused(r"set_state\(graph \d+ 'step'\): value 0 at path \['inner'\]\['b'\]"
                          + ("" if pattern.startswith(r"expected") else " is a ") + ".*"
                          + pattern, lambda: self.sess.set_state(self.gid, bad))
    gone = jax.tree.map(lambda a: a, new)
    gone["w"] = jnp.asarray(self.rng.standard_normal(5), jnp.float32)
    gone["w"].delete()
    self.assert_refused(r"value 0 at path \['w'\]: the array has been deleted",
                        lambda: self.sess.set_state(self.gid, gone))
    self.assert_unchanged()

  def test_weak_types_one_message(self):
    fn = lambda x, lr: x * lr
    x = jnp.asarray(self.rng.standard_normal(3), jnp.bfloat16)
    weak = self.sess.compile(fn, x, 0.1)
    self.assert_refused(r"argument 1 \(position 1 of the function\) at path \(root\) is "
                        r"strongly typed, the value it was compiled for is weakly typed.*"
                        r"Pass a Python scalar", lambda: self.sess.run(weak, x, jnp.float32(2)))
    for s in (-0.0, float("nan"), 3.5):
      assert_same_bits(self.sess.run(weak, x, s), jax.jit(fn)(x, s), f"lr={s}")
    counter = lambda c, x: (c * 0.5 + 1.0, x * (c * 0.5 + 1.0))
    gid = self.sess.compile(counter, jnp.asarray(1.0), x, state_argnums=0)
    before = self.sess.get_state(gid)
    self.assert_refused(r"value 0 at path \(root\) is strongly typed, the value it was "
                        r"compiled for is weakly typed",
                        lambda: self.sess.set_state(gid, jnp.float32(-0.0)))
    assert_same_bits(self.sess.get_state(gid), before, "weakly typed state")
    # where the dtype differs too, the dtype is named (the weak type shown by ~)
    bump = self.sess.compile(lambda s, x: (s + 1, x), jnp.int8(-7), 0.5, state_argnums=0)
    self.assert_refused(r"value 0 at path \(root\): expected i8\[\], got i32\[\]~",
                        lambda: self.sess.set_state(bump, 3))
    self.assert_refused(r"at \(root\): expected an array leaf int8\[\], got a list",
                        lambda: self.sess.set_state(bump, [jnp.int8(1)]))
    self.assertEqual(int(self.sess.get_state(bump)[0]), -7)
    self.assert_unchanged()

  def test_state_from_checks_every_leaf(self):
    other = _rng_state(7)
    other["inner"]["b"] = jnp.asarray(other["inner"]["b"], jnp.float16)
    self.assert_refused(r"state arg 0 \(position 0\) shared from graph \d+ at path "
                        r"\['inner'\]\['b'\]: expected f32\[3\], got f16\[3\]",
                        lambda: self.sess.compile(lambda s: s["w"].sum(), other,
                                                  state_argnums=0, state_from=self.gid,
                                                  updates_state=False))
    gone = _rng_state(8)
    gone["n"].delete()
    self.assert_refused(r"position 0 \(a state argument\), path \['n'\]: the array has been "
                        r"deleted", lambda: self.sess.compile(step, gone, self.x,
                                                              state_argnums=0,
                                                              state_from=self.gid))
    self.assert_unchanged()

  def test_run_op_names_the_argument_and_path(self):
    gone = jnp.asarray(self.rng.standard_normal(3), jnp.float32)
    gone.delete()
    self.assert_refused(r"run_op\(sin\): argument 0: the array has been deleted",
                        lambda: self.sess.run_op(jax.lax.sin_p, gone, accuracy=None))
    tree_fn = lambda t, y: t["a"][1] * y
    ok = jnp.asarray(self.rng.standard_normal(3), jnp.float32)
    self.assert_refused(r"run_op\(<lambda>\): argument 0 at path \['a'\]\[1\]: the array has "
                        r"been deleted", lambda: self.sess.run_op(tree_fn, {"a": (ok, gone)},
                                                                  ok))
    self.assert_refused(r"argument 1 at path \(root\) is a jax.ShapeDtypeStruct",
                        lambda: self.sess.run_op(tree_fn, {"a": (ok, ok)},
                                                 jax.ShapeDtypeStruct((3,), jnp.float32)))
    assert_equal_signed(self.sess.run_op(tree_fn, {"a": (ok, ok)}, -0.0),
                        jax.jit(tree_fn)({"a": (ok, ok)}, -0.0))
    self.assert_unchanged()


class SubByteArgumentsTest(absltest.TestCase):

  def test_committed_int4_and_float4_arguments_run_as_under_jit(self):
    # jax's AOT executables refuse a committed array of a dtype narrower than
    # a byte (a layout check jax.jit passes): run and js.jit raised jax's
    # ValueError for what jax.jit takes (orbax reads arrays back committed)
    rng = np.random.default_rng(12)
    q = jnp.asarray(rng.integers(-8, 8, 16), jnp.int4)
    f4 = jnp.asarray(rng.standard_normal(16), jnp.float4_e2m1fn)
    w = jnp.asarray(rng.standard_normal(16), jnp.float32)
    fn = lambda q, f4, w: (q + jnp.int4(3)).astype(jnp.float32) * w + f4.astype(jnp.float32)
    dev = jax.devices()[0]
    args = (jax.device_put(q, dev), jax.device_put(f4, dev), w)
    self.assertTrue(args[0].committed)
    want = jax.jit(fn)(*args)
    sess = js.Session()
    gid = sess.compile(fn, q, f4, w)
    assert_equal_signed(sess.run(gid, *args), want)
    assert_equal_signed(js.jit(fn)(*args), want)
    state_gid = sess.compile(lambda q, w: (q + jnp.int4(1), w * q.astype(jnp.float32)), q, w,
                             state_argnums=0)
    sess.set_state(state_gid, args[0], donate=True)
    assert_equal_signed(sess.run(state_gid, w), w * q.astype(jnp.float32))
    assert_equal_signed(sess.get_state(state_gid)[0], q + jnp.int4(1))
    # a committed compile example of the state: every run raised too
    committed = jax.device_put(q, dev)
    first = sess.compile(lambda q, w: (q + jnp.int4(1), w * q.astype(jnp.float32)),
                         committed, w, state_argnums=0)
    assert_equal_signed(sess.run(first, w), w * q.astype(jnp.float32))


class SubByteDevicesTest(absltest.TestCase):

  def test_another_device_and_a_mesh(self):
    # an int4 value committed to another device was accepted by set_state,
    # then every run raised jax's raw layout error; under a mesh the first
    # run did (review finds): relaid onto the graph's device, and refused
    # clearly at compile under a mesh
    out = run_json(HELPERS + """
import json
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh
import jaxsession as js
q = jnp.asarray(np.random.default_rng(14).integers(-8, 8, 8), jnp.int4)
step = lambda q, x: (q + jnp.int4(1), q.astype(jnp.float32) * x)
x = jnp.float32(1.5)
sess = js.Session()
gid = sess.compile(step, q, x, state_argnums=0)
other = jax.device_put(q, jax.devices()[1])
sess.set_state(gid, other)
got = sess.run(gid, x)
want = jax.jit(step)(other, x)[1]
mesh = js.Session(js.SessionOptions(mesh=Mesh(np.array(jax.devices()), ("data",))))
print(json.dumps([bool(np.array_equal(np.asarray(got), np.asarray(want))),
                  err(lambda: mesh.compile(step, q, x, state_argnums=0)),
                  err(lambda: mesh.compile(lambda s, r: (s + r, r), q, q, state_argnums=0))]))
""", devices=2)
    self.assertTrue(out[0])
    self.assertEqual(out[1][0], "InputError")
    self.assertIn("narrower than a byte is not supported under a mesh", out[1][1])
    # every narrow leaf named at once (the run argument's alone was named)
    self.assertEqual(out[2][0], "InputError")
    for where in ("run argument", "at position 1", "state argument at position 0"):
      self.assertIn(where, out[2][1])


class TracerTest(absltest.TestCase):
  """A tracer (run, set_state or run_op called inside jax.jit, grad or vmap)
  is an InputError naming the argument, and the state stays as it was."""

  def test_tracers_are_input_errors(self):
    rng = np.random.default_rng(21)
    w = jnp.asarray(rng.standard_normal(3), jnp.float32)
    x = jnp.asarray(rng.standard_normal(3), jnp.float32)
    sess = js.Session()
    gid = sess.compile(lambda w, x: (w + x, jnp.sum(x)), w, x, state_argnums=0)
    calls = {
        "jit run": lambda: jax.jit(lambda v: sess.run(gid, v))(x),
        "grad run": lambda: jax.grad(lambda v: sess.run(gid, v))(x),
        "vmap run": lambda: jax.vmap(lambda v: sess.run(gid, v))(jnp.stack([x, x])),
        "jit set_state": lambda: jax.jit(lambda v: sess.set_state(gid, v))(x),
        "jit run_op": lambda: jax.jit(lambda v: sess.run_op(jnp.sin, v))(x),
    }
    for what, call in calls.items():
      with self.subTest(what):
        with self.assertRaisesRegex(js.InputError, r"argument 0|value 0") as caught:
          call()
        self.assertIn("is a tracer (float32[3])", str(caught.exception))
        assert_same_bits(sess.get_state(gid)[0], w, what)
    assert_equal_signed(sess.run(gid, x), jax.jit(jnp.sum)(x))


class ConstantNewStateTest(absltest.TestCase):
  """A state whose new value is a constant (a jaxpr literal output)."""

  def test_bit_for_bit_with_jit_and_steps(self):
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal(4), jnp.float32)
    cases = [
        (lambda pos: (jnp.int32(0),), (jnp.int32(rng.integers(1, 9)),), 0),
        (lambda a, b, x: (a + x, jnp.float32(-0.0), (a * x).sum()),
         (jnp.asarray(rng.standard_normal(4), jnp.float32), jnp.float32(2.5), x), (0, 1)),
        (lambda s, x: ({"k": jnp.float32(np.nan), "m": s["m"] * 2}, x * s["m"]),
         ({"k": jnp.float32(1.0), "m": jnp.float32(rng.standard_normal())}, x), 0),
    ]
    for k, (fn, args, state_argnums) in enumerate(cases):
      nums = (state_argnums,) if isinstance(state_argnums, int) else state_argnums
      dyn = [a for i, a in enumerate(args) if i not in nums]
      sess = js.Session()
      gid = sess.compile(fn, *args, state_argnums=state_argnums)
      want = jax.jit(fn)(*args)
      out = sess.run(gid, *dyn)
      rest = want[len(nums):]
      assert_same_bits(out, None if not rest else rest[0], f"case {k} output")
      assert_same_bits(sess.get_state(gid), tuple(want[:len(nums)]), f"case {k} state")
      state = tuple(want[:len(nums)])
      outs = []
      for _ in range(3):  # jax.jit's loop from the session's state
        full = list(args)
        for i, s in zip(nums, state):
          full[i] = s
        result = jax.jit(fn)(*full)
        state, outs = tuple(result[:len(nums)]), outs + [result[len(nums):]]
      sunk = sess.run(gid, *[jnp.stack([d] * 3) for d in dyn], steps=3)
      if rest:
        assert_same_bits(sunk, jnp.stack([o[0] for o in outs]), f"case {k} steps outputs")
      assert_same_bits(sess.get_state(gid), state, f"case {k} state after steps")

  def test_with_a_host_partition(self):
    def fn(pos, x):
      y = jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
      return jnp.int32(3), y * 2 + 1
    x = jnp.asarray(np.random.default_rng(2).standard_normal(3), jnp.float32)
    sess = js.Session()
    gid = sess.compile(fn, jnp.int32(5), x, state_argnums=0)
    self.assertGreater(len(sess.report(gid).partitions), 1)
    want = jax.jit(fn)(jnp.int32(5), x)
    assert_same_bits(sess.run(gid, x), want[1], "output")
    assert_same_bits(sess.get_state(gid), (want[0],), "state")


X64_SNIPPET = HELPERS + r"""
import json
import jax.numpy as jnp
import numpy as np
import jaxsession as js
sess = js.Session()
out = {}
w = jnp.asarray(np.random.default_rng(1).standard_normal(3))  # float64 under x64
fn = lambda w, x, n: (w * x, jnp.int64(-7), w.sum())
gid = sess.compile(fn, w, 0.5, jnp.int64(2), state_argnums=(0, 2))
out["run"] = np.asarray(sess.run(gid, -0.0)).tobytes().hex()
out["state"] = [np.asarray(s).tobytes().hex() for s in sess.get_state(gid)]
out["want"] = [np.asarray(s).tobytes().hex() for s in jax.jit(fn)(w, -0.0, jnp.int64(2))]
sds = sess.compile(lambda w: (w * 2,), jax.ShapeDtypeStruct((3,), "float64"), state_argnums=0)
out["sds"] = err(lambda: sess.run(sds))  # a type: the state is unset until bound
gone = jnp.ones(3)
gone.delete()
out["deleted"] = err(lambda: sess.set_state(gid, {"a": gone}["a"], jnp.int64(1)))
out["f32"] = err(lambda: sess.set_state(gid, jnp.ones(3, jnp.float32), jnp.int64(1)))
print(json.dumps(out))
"""

MESH_SNIPPET = HELPERS + r"""
import json
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
import jaxsession as js
mesh = Mesh(np.array(jax.devices()), ("data",))
sess = js.Session(js.SessionOptions(mesh=mesh))
out = {}
gone = jnp.ones(4)
gone.delete()
x = jnp.ones((4, 2))
out["deleted"] = err(lambda: sess.compile(lambda s, x: (s, x.sum()), {"a": gone}, x,
                                          state_argnums=0))
sid = sess.compile(lambda s, x: ({"a": s["a"] * 2.0}, x.sum() * s["a"][0]),
                   {"a": jax.ShapeDtypeStruct((4,), "float32")}, x, state_argnums=0,
                   state_specs="zero")
out["struct"] = err(lambda: sess.run(sid, x))
a = np.asarray([-0.0, 3.0, np.nan, 1e-30], np.float32)
sess.set_state(sid, {"a": a})
out["struct_run"] = float(sess.run(sid, x))
bound = sess.get_state(sid)[0]["a"]
out["struct_state"] = [np.asarray(bound).tobytes().hex(), str(bound.sharding.spec)]
gid = sess.compile(lambda s, x: (jnp.float32(-0.0), x.sum() * s), jnp.float32(2), x,
                   state_argnums=0)
out["const"] = [float(sess.run(gid, x)), np.asarray(sess.get_state(gid)[0]).tobytes().hex()]
print(json.dumps(out))
"""


@pytest.mark.slow  # fresh interpreters
class SubprocessTest(absltest.TestCase):

  def test_x64(self):
    out = run_json(X64_SNIPPET, devices=1, x64=True)
    self.assertEqual(out["state"], out["want"][:2])  # bit for bit: -0.0 * w
    self.assertEqual(out["run"], out["want"][2])
    self.assertEqual(out["sds"][0], "InputError")
    self.assertIn("state arg 0 (<lambda>:state0(arg 0)) is unset", out["sds"][1])
    self.assertEqual(out["deleted"][0], "InputError")
    self.assertIn("value 0 at path (root): the array has been deleted", out["deleted"][1])
    self.assertEqual(out["f32"][0], "InputError")
    self.assertIn("expected f64[3], got f32[3]", out["f32"][1])

  def test_under_a_mesh(self):
    out = run_json(MESH_SNIPPET, devices=2)
    self.assertEqual(out["deleted"][0], "InputError")
    self.assertIn("path ['a']: the array has been deleted", out["deleted"][1])
    # a ShapeDtypeStruct state is unset until bound, then laid out as compiled
    self.assertEqual(out["struct"][0], "InputError")
    self.assertIn("is unset", out["struct"][1])
    self.assertEqual(out["struct_run"], 2.0 * -0.0)
    a = np.asarray([-0.0, 3.0, np.nan, 1e-30], np.float32)
    self.assertEqual(out["struct_state"], [(a * np.float32(2)).tobytes().hex(),
                                           "P('data',)"])
    self.assertEqual(out["const"][1], np.float32(-0.0).tobytes().hex())


if __name__ == "__main__":
  absltest.main()
