"""Timing helpers shared by the benchmarks: medians of repeats, a table printer."""
import platform
import statistics
import time

import jax


def per_call_us(fn, calls, repeats=7, warmup=200):
  """Median over `repeats` of the mean time of one call of `fn()` (µs).
  Blocks on the last result of each repeat, so async dispatch is paid for."""
  out = None
  for _ in range(warmup):
    out = fn()
  jax.block_until_ready(out)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn()
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / calls * 1e6)
  return statistics.median(times)


def machine():
  dev = jax.devices()[0]
  return (f"{platform.node()} / {platform.processor() or platform.machine()} / "
          f"jax {jax.__version__} / {dev.platform}: {dev.device_kind}")


def print_table(title, rows, headers):
  print(f"\n## {title}\n")
  print("| " + " | ".join(headers) + " |")
  print("|" + "|".join("---" for _ in headers) + "|")
  for row in rows:
    print("| " + " | ".join(f"{c:.2f}" if isinstance(c, float) else str(c)
                            for c in row) + " |")
