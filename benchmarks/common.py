"""Timing helpers shared by the benchmarks: interleaved repeats, medians, a
table printer. These machines are shared and noisy: every comparison runs its
contenders alternately, repeat after repeat, and reports medians."""
import platform
import statistics
import time

import jax
import jax.numpy as jnp


def _time_once(fn, calls):
  start = time.perf_counter()
  out = None
  for _ in range(calls):
    out = fn()
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / calls * 1e6


def compare_us(fns, calls, repeats=7, warmup=100, samples_out=None):
  """Median µs per call of each fn in `fns`, measured in interleaved repeats.
  `samples_out`, a list, receives every repeat's times (one list per fn)."""
  for fn in fns:
    for _ in range(warmup):
      out = fn()
    jax.block_until_ready(out)
  samples = [[] for _ in fns]
  for _ in range(repeats):
    for fn, times in zip(fns, samples):
      times.append(_time_once(fn, calls))
  if samples_out is not None:
    samples_out.extend(samples)
  return [statistics.median(times) for times in samples]


def paired_ratio(a_times, b_times):
  """Median of the per-repeat ratios a/b: neighbours in time share the
  machine's load, so their ratio is steadier than a ratio of medians."""
  return statistics.median(a / b for a, b in zip(a_times, b_times))


def machine():
  dev = jax.devices()[0]
  import os
  return (f"{platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}, jax {jax.__version__}, "
          f"device {dev.platform}: {dev.device_kind}")


def print_table(title, rows, headers):
  print(f"\n### {title}\n")
  print("| " + " | ".join(headers) + " |")
  print("|" + "|".join("---" for _ in headers) + "|")
  for row in rows:
    print("| " + " | ".join(f"{c:.2f}" if isinstance(c, float) else str(c)
                            for c in row) + " |")


def tiny(x):
  """The tiny stateless graph the dispatch benchmarks time."""
  return x * 2.0 + 1.0


def tiny_step(state, x):
  """The tiny stateful step the dispatch benchmarks time."""
  new = state * 0.9 + x
  return new, jnp.sum(new)
