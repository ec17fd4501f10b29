"""Shape buckets: which executable a batch size runs on, and at what cost.

A bucketed graph marks the leading axis of some run arguments as dynamic.
A batch of n rows runs on the smallest bucket b >= n: the arguments are padded
with zero rows to b, the bucket's executable runs, and the outputs are sliced
back to n rows (the padding analysis, runtime/batch_axis.py, proved that
padded rows never mix with real ones). Sizes above the largest bucket compile
exactly. With "auto", the buckets are chosen from the sizes seen: an exact
dynamic program picks at most K sizes minimising the padded rows of that
histogram (vLLM pads to a fixed list; powers of two waste ~31% of the rows on
sizes uniform in 1..64, seven chosen buckets ~12%). Learning the histogram
compiles no exact sizes: the first requests pad to one learning bucket, which
the chosen buckets keep (BucketPolicy), so learning costs no extra compiles.
"""
import bisect
import collections
import dataclasses
import numbers
from typing import List, Optional

import numpy as np

from jaxsession.errors import InputError

AUTO = "auto"
AUTO_FIRST_CHOICE = 4  # requests padded to the learning bucket before buckets are first
                       # chosen; they are chosen again at 8, 16 and 32 requests
AUTO_RESERVE = 3       # buckets held back at the first choice, one freed at each later one


def _next_pow2(n):
  return 1 << (int(n) - 1).bit_length()


def choose_buckets(histogram, max_buckets, fixed=()):
  """At most `max_buckets` sizes minimising the padded rows
  sum(count(s) * (bucket(s) - s)) of `histogram` - an exact O(K m^2)
  dynamic program over the m candidate sizes (a bucket is only ever worth
  placing at a size that occurs). `fixed` sizes (executables already
  compiled) are buckets whatever they cost and count towards `max_buckets`;
  the largest bucket is the largest seen size, or a larger fixed one. With
  more fixed sizes than `max_buckets`, the fixed sizes are returned (plus the
  largest seen size if none covers it)."""
  fixed = {int(s) for s in fixed}
  cands = sorted(set(histogram) | fixed)
  if not cands:
    return []
  m = len(cands)
  counts = [histogram.get(s, 0) for s in cands]
  prefix_n = [0] * (m + 1)   # requests among cands[:i]
  prefix_r = [0] * (m + 1)   # rows among cands[:i]
  for i, (s, c) in enumerate(zip(cands, counts)):
    prefix_n[i + 1] = prefix_n[i] + c
    prefix_r[i + 1] = prefix_r[i] + c * s

  def waste(lo, hi):  # cands[lo..hi] all padded to cands[hi]
    n = prefix_n[hi + 1] - prefix_n[lo]
    return n * cands[hi] - (prefix_r[hi + 1] - prefix_r[lo])

  is_fixed = [s in fixed for s in cands]
  free = max(max_buckets - len(fixed), 0 if is_fixed[-1] else 1)
  # a bucket at j may follow one at i only if no fixed size lies between them
  first_fixed = next((j for j in range(m) if is_fixed[j]), m)
  inf = float("inf")
  # best[k][j]: least waste covering cands[:j+1] with k free buckets, the last at j
  best = [[inf] * m for _ in range(free + 1)]
  back = [[-1] * m for _ in range(free + 1)]
  for j in range(min(first_fixed + 1, m)):
    k = 0 if is_fixed[j] else 1
    if k <= free:
      best[k][j] = waste(0, j)
  for j in range(m):
    step = 0 if is_fixed[j] else 1
    lo = j - 1
    while lo >= 0 and not is_fixed[lo]:
      lo -= 1
    lo = max(lo, 0)  # the previous bucket lies at or after the nearest fixed size
    for k in range(step, free + 1):
      for i in range(lo, j):
        if best[k - step][i] < inf:
          cost = best[k - step][i] + waste(i + 1, j)
          if cost < best[k][j]:
            best[k][j], back[k][j] = cost, i
  k = min(range(free + 1), key=lambda k: (best[k][m - 1], k))
  chosen, j = [], m - 1
  while j >= 0:
    chosen.append(cands[j])
    j, k = back[k][j], k - (0 if is_fixed[j] else 1)
  return sorted(chosen)


def padding_waste(histogram, buckets):
  """Padded rows per real row, for `histogram` on `buckets` (sizes above the
  largest bucket run exactly, with no padding): 0.31 for powers of two on
  sizes uniform in 1..64."""
  padded = real = 0
  for size, count in histogram.items():
    i = bisect.bisect_left(buckets, size)
    target = buckets[i] if i < len(buckets) else size
    padded += count * (target - size)
    real += count * size
  return padded / real if real else 0.0


def check_spec(buckets, positions, max_buckets, hint):
  """The buckets argument of compile, checked: {run-arg index: sorted sizes or
  AUTO}, keyed by position of fn; returns {position: sizes or AUTO}."""
  if not isinstance(buckets, dict) or not buckets:
    raise InputError(f"compile: buckets must be a dict {{argnum: [sizes] or 'auto'}}, "
                     f"got {buckets!r}")
  if isinstance(max_buckets, bool) or not isinstance(max_buckets, numbers.Integral) \
      or max_buckets < 1:
    raise InputError(f"compile: max_buckets must be an int >= 1, got {max_buckets!r}")
  checked = {}
  for argnum, sizes in buckets.items():
    if isinstance(argnum, bool) or not isinstance(argnum, numbers.Integral) \
        or int(argnum) not in positions:
      raise InputError(f"compile: buckets names position {argnum!r}, which is not a run "
                       f"argument (run arguments: positions {sorted(positions)}; state "
                       "and static args cannot be bucketed)")
    if isinstance(sizes, str):
      if sizes != AUTO:
        raise InputError(f"compile: buckets[{argnum}] must be a list of sizes or 'auto', "
                         f"got {sizes!r}")
      checked[int(argnum)] = AUTO
      continue
    if not isinstance(sizes, (list, tuple)) or not sizes or not all(
        isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1
        for v in sizes):
      raise InputError(f"compile: buckets[{argnum}] must be a non-empty list of "
                       f"positive ints, got {sizes!r}")
    sizes = sorted({int(v) for v in sizes})
    checked[int(argnum)] = sizes
  kinds = {AUTO if v == AUTO else "list" for v in checked.values()}
  if len(kinds) > 1 or (AUTO not in kinds and len({tuple(v) for v in checked.values()}) > 1):
    raise InputError("compile: every bucketed argument shares one batch axis: give them "
                     "the same bucket list (or all 'auto')")
  if hint is not None:
    if AUTO not in kinds:
      raise InputError("compile: bucket_sizes_hint is for buckets='auto'; the buckets "
                       "here are a fixed list")
    if isinstance(hint, (str, bytes, dict)) or not all(
        isinstance(s, numbers.Integral) and not isinstance(s, bool)
        for s in (hint if isinstance(hint, (list, tuple, np.ndarray)) else [None])):
      raise InputError(f"compile: bucket_sizes_hint must be a list of int sizes (the "
                       f"batch sizes seen), got {hint!r}")
    hint = [int(s) for s in hint]
    if not hint or min(hint) < 1:
      raise InputError(f"compile: bucket_sizes_hint must hold sizes >= 1, got {hint!r}")
  return checked, hint


@dataclasses.dataclass
class BucketPolicy:
  """Which size each batch runs at, and the statistics behind it.

  Auto buckets without a hint learn the traffic without compiling its exact
  sizes: the first AUTO_FIRST_CHOICE requests pad to one learning bucket, the
  next power of two of the largest size seen (~1 compile). Then the buckets
  are chosen by the exact dynamic program with every size already compiled
  kept as a bucket (it costs no compile; the learning bucket stays the top),
  at first with AUTO_RESERVE buckets held back; the histogram is chosen from
  again at 2x, 4x and 8x AUTO_FIRST_CHOICE requests, one held-back bucket
  freed each time (a chosen size never run is dropped for free). So learning
  plus the chosen buckets compile at most max_buckets executables, unless the
  traffic outgrows them: a size above the top bucket runs at its next power
  of two, a new top bucket (one compile, over the budget once it is spent;
  a doubling top costs fewer compiles than exact sizes in a long tail).
  """
  sizes: Optional[List[int]]      # None until auto buckets are chosen
  auto: bool
  max_buckets: int
  seen: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  rows: int = 0                   # real rows run
  padded: int = 0                 # padding rows run
  expected_waste: Optional[float] = None
  learning: Optional[int] = None  # auto: the learning bucket, before the first choice
  learning_rows: int = 0          # real rows run while learning
  learning_padded: int = 0        # padding rows run while learning
  choices: int = 0                # times the buckets were chosen from traffic
  chosen_from: int = 0            # requests in the histogram of the last choice
  next_choice: Optional[int] = None  # request count of the next choice

  @classmethod
  def make(cls, spec_sizes, max_buckets, hint):
    auto = spec_sizes == AUTO
    policy = cls(None if auto else list(spec_sizes), auto, max_buckets)
    if auto and hint:
      policy.choose(collections.Counter(hint))
    elif auto:
      policy.next_choice = AUTO_FIRST_CHOICE
    return policy

  def choose(self, histogram, compiled=()):
    """The buckets for `histogram` (the sizes in `compiled` are kept)."""
    budget = self.max_buckets
    if self.next_choice is not None:  # learning from traffic: some held back
      budget -= max(0, AUTO_RESERVE - self.choices)
    self.sizes = choose_buckets(histogram, budget, fixed=compiled)
    self.expected_waste = padding_waste(histogram, self.sizes)
    self.chosen_from = sum(histogram.values())
    self.choices += 1

  def first_size(self, n):
    """The size the example's batch of n rows compiles at."""
    if self.sizes is None:
      self.learning = _next_pow2(n)  # the first learning bucket
      return self.learning
    larger = [b for b in self.sizes if b >= n]
    return larger[0] if larger else n

  def target(self, n, compiled=()):
    """The size to run a batch of n rows at (n itself: exact), counted in
    the traffic; `compiled`: the sizes that have an executable already."""
    size = self.size_for(n)
    self.record(n, size, compiled)
    return size

  def size_for(self, n):
    """The size a batch of n rows would run at, nothing counted (a run
    refused before it runs must not change the policy: a break-it find)."""
    if self.sizes is None:  # learning the traffic: pad to the learning bucket
      return self.learning if self.learning is not None and n <= self.learning \
          else _next_pow2(n)
    i = bisect.bisect_left(self.sizes, n)
    if i < len(self.sizes):
      return self.sizes[i]
    return _next_pow2(n) if self.auto else n  # auto: the traffic outgrew the top bucket

  def record(self, n, size, compiled=()):
    """Counts a run of n rows at `size` (size_for's) in the traffic; the
    buckets are chosen again when it is time."""
    if n:  # an empty batch takes no bucket slot (a BucketedGraph runs it exactly)
      self.seen[n] += 1
    self.rows += n
    if self.sizes is None:
      self.learning = size
      self.learning_rows += n
      self.learning_padded += size - n
    elif self.auto and (not self.sizes or n > self.sizes[-1]):
      self.sizes.append(size)  # a new top
    self.padded += size - n
    total = sum(self.seen.values())
    if self.next_choice is not None and total >= self.next_choice:
      self.choose(self.seen, set(compiled) | {size})
      self.next_choice = 2 * total if self.choices <= AUTO_RESERVE else None

  def measured_waste(self):
    """Padded rows per real row run so far (the learning phase included)."""
    return self.padded / self.rows if self.rows else 0.0

  def describe(self):
    if self.sizes is None:
      sizes = ("not chosen yet (learning the traffic: padding to "
               f"{self.learning or 'the first learning bucket'})")
    else:
      sizes = self.sizes
    auto = ""
    if self.auto:
      auto = f" (auto, at most {self.max_buckets}"
      if self.chosen_from:
        auto += f", chosen from {self.chosen_from} requests"
      auto += ")"
    expected = ("" if self.expected_waste is None
                else f", expected waste {self.expected_waste:.1%} on that histogram")
    learning = ""
    if self.learning_rows:
      rest = self.rows - self.learning_rows
      after = (self.padded - self.learning_padded) / rest if rest else 0.0
      learning = (f" (learning phase {self.learning_padded / self.learning_rows:.1%}, "
                  f"after it {after:.1%})")
    return (f"buckets {sizes}{auto}{expected}, measured waste "
            f"{self.measured_waste():.1%} over {sum(self.seen.values())} runs{learning}")


def pad_rows(x, size, axis):
  """`x` with rows added along `axis` up to `size`, copies of its last row
  (zeros when it has none), on the host (numpy): the executable's call copies
  it in as it copies any host argument. The padding analysis proves no pad
  row reaches a real one, so any value would do; copies of a real row compute
  what that row computes, so no nan or inf appears that jax.jit on the exact
  shape would not meet (jax_debug_nans: 0 * log(0) on zero rows raised).
  Typed PRNG keys are padded as their key data (a key per row)."""
  import jax  # kept local: the policy above is plain Python
  if _is_key(x):
    if x.shape[axis] == size:
      return x
    return jax.random.wrap_key_data(pad_rows(jax.random.key_data(x), size, axis),
                                    impl=jax.random.key_impl(x))
  x = np.asarray(x)
  n = x.shape[axis]
  if n == size:
    return x
  shape = list(x.shape)
  shape[axis] = size
  out = np.zeros(shape, x.dtype)
  index = [slice(None)] * x.ndim
  index[axis] = slice(0, n)
  out[tuple(index)] = x
  if n:
    index[axis] = slice(n, size)
    out[tuple(index)] = np.take(x, [n - 1], axis=axis)
  return out


def slice_rows(x, n, axis):
  """The first `n` rows of a padded output along `axis`: a copy made on the
  host and put back on the output's device (an eager `x[:n]` would compile a
  slice for every n)."""
  import jax  # kept local: the policy above is plain Python
  index = [slice(None)] * np.ndim(x)
  index[axis] = slice(0, n)
  device = next(iter(x.devices())) if isinstance(x, jax.Array) else None
  if _is_key(x):  # (a key per row: its data sliced)
    return jax.random.wrap_key_data(slice_rows(jax.random.key_data(x), n, axis),
                                    impl=jax.random.key_impl(x))
  return jax.device_put(np.array(np.asarray(x)[tuple(index)]), device)  # a private copy


def _is_key(x):
  import jax  # kept local: the policy above is plain Python
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)

