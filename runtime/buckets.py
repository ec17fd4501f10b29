"""Shape buckets: which executable a batch size runs on, and at what cost.

A bucketed graph marks the leading axis of some run arguments as dynamic.
A batch of n rows runs on the smallest bucket b >= n: the arguments are padded
with zero rows to b, the bucket's executable runs, and the outputs are sliced
back to n rows (the padding analysis, runtime/batch_axis.py, proved that
padded rows never mix with real ones). Sizes above the largest bucket compile
exactly. With "auto", the buckets are chosen from the sizes seen: an exact
dynamic program picks at most K sizes minimising the padded rows of that
histogram (vLLM pads to a fixed list; powers of two waste ~31% of the rows on
sizes uniform in 1..64, seven chosen buckets ~12%).
"""
import bisect
import collections
import dataclasses
import numbers
from typing import List, Optional

import numpy as np

from jaxsession.errors import InputError

AUTO = "auto"
AUTO_MIN_SIZES = 8  # distinct sizes seen (or 4x as many requests) before auto buckets
                    # are chosen


def choose_buckets(histogram, max_buckets):
  """At most `max_buckets` sizes, the largest seen among them, minimising the
  padded rows sum(count(s) * (bucket(s) - s)) - an exact O(K m^2) dynamic
  program over the m distinct sizes (a bucket is only ever worth placing at
  a size that occurs)."""
  sizes = sorted(histogram)
  if not sizes:
    return []
  m = len(sizes)
  counts = [histogram[s] for s in sizes]
  prefix_n = [0] * (m + 1)   # requests among sizes[:i]
  prefix_r = [0] * (m + 1)   # rows among sizes[:i]
  for i, (s, c) in enumerate(zip(sizes, counts)):
    prefix_n[i + 1] = prefix_n[i] + c
    prefix_r[i + 1] = prefix_r[i] + c * s

  def waste(lo, hi):  # sizes[lo..hi] all padded to sizes[hi]
    n = prefix_n[hi + 1] - prefix_n[lo]
    return n * sizes[hi] - (prefix_r[hi + 1] - prefix_r[lo])

  k_max = min(max_buckets, m)
  inf = float("inf")
  # best[k][j]: least waste covering sizes[:j+1] with k buckets, the last at j
  best = [[inf] * m for _ in range(k_max + 1)]
  back = [[-1] * m for _ in range(k_max + 1)]
  for j in range(m):
    best[1][j] = waste(0, j)
  for k in range(2, k_max + 1):
    for j in range(k - 1, m):
      for i in range(k - 2, j):
        cost = best[k - 1][i] + waste(i + 1, j)
        if cost < best[k][j]:
          best[k][j], back[k][j] = cost, i
  k = min(range(1, k_max + 1), key=lambda k: best[k][m - 1])
  chosen, j = [], m - 1
  while k >= 1 and j >= 0:
    chosen.append(sizes[j])
    j, k = back[k][j], k - 1
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
    try:
      hint = [int(s) for s in hint]
    except (TypeError, ValueError):
      raise InputError(f"compile: bucket_sizes_hint must be a list of sizes, got "
                       f"{hint!r}") from None
    if not hint or min(hint) < 1:
      raise InputError(f"compile: bucket_sizes_hint must hold sizes >= 1, got {hint!r}")
  return checked, hint


@dataclasses.dataclass
class BucketPolicy:
  """Which size each batch runs at, and the statistics behind it."""
  sizes: Optional[List[int]]      # None until auto buckets are chosen
  auto: bool
  max_buckets: int
  seen: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  rows: int = 0                   # real rows run
  padded: int = 0                 # padding rows run
  expected_waste: Optional[float] = None

  @classmethod
  def make(cls, spec_sizes, max_buckets, hint):
    auto = spec_sizes == AUTO
    policy = cls(None if auto else list(spec_sizes), auto, max_buckets)
    if auto and hint:
      policy.choose(collections.Counter(hint))
    return policy

  def choose(self, histogram, learned=False):
    """The buckets for `histogram`. Learned from the first requests only,
    the largest bucket is raised to the next power of two, so the tail of
    sizes not seen yet still lands in a bucket instead of compiling exactly
    (the expected waste is then of that early histogram)."""
    self.sizes = choose_buckets(histogram, self.max_buckets)
    if learned:
      self.sizes[-1] = 1 << (self.sizes[-1] - 1).bit_length()
    self.expected_waste = padding_waste(histogram, self.sizes)

  def target(self, n):
    """The size to run a batch of n rows at (n itself: exact)."""
    self.seen[n] += 1
    if self.auto and self.sizes is None:
      if len(self.seen) >= AUTO_MIN_SIZES or sum(self.seen.values()) >= 4 * AUTO_MIN_SIZES:
        self.choose(self.seen, learned=True)
      else:
        self.rows += n
        return n  # still learning the traffic: exact
    i = bisect.bisect_left(self.sizes, n)
    size = self.sizes[i] if i < len(self.sizes) else n
    self.rows += n
    self.padded += size - n
    return size

  def measured_waste(self):
    """Padded rows per real row run so far."""
    return self.padded / self.rows if self.rows else 0.0

  def describe(self):
    sizes = "not chosen yet (learning the traffic)" if self.sizes is None else self.sizes
    expected = ("" if self.expected_waste is None
                else f", expected waste {self.expected_waste:.1%}")
    return (f"buckets {sizes}{' (auto, at most %d)' % self.max_buckets if self.auto else ''}"
            f"{expected}, measured waste {self.measured_waste():.1%} over "
            f"{sum(self.seen.values())} runs")


def pad_rows(x, size, axis):
  """`x` with zero rows added along `axis` up to `size`, on the host (numpy):
  the executable's call copies it in as it copies any host argument."""
  x = np.asarray(x)
  if x.shape[axis] == size:
    return x
  shape = list(x.shape)
  shape[axis] = size
  out = np.zeros(shape, x.dtype)
  index = [slice(None)] * x.ndim
  index[axis] = slice(0, x.shape[axis])
  out[tuple(index)] = x
  return out


def slice_rows(x, n, axis):
  """The first `n` rows of a padded output along `axis`: a copy made on the
  host and put back on the output's device (an eager `x[:n]` would compile a
  slice for every n)."""
  import jax  # kept local: the policy above is plain Python
  index = [slice(None)] * np.ndim(x)
  index[axis] = slice(0, n)
  device = next(iter(x.devices())) if isinstance(x, jax.Array) else None
  return jax.device_put(np.array(np.asarray(x)[tuple(index)]), device)  # a private copy

