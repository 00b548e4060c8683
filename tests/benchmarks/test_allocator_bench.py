"""benchmarks/allocator.py --quick runs and produces numbers (never asserts a timing)."""

from __future__ import annotations

import math

import pytest

from benchmarks import allocator as allocator_bench


@pytest.mark.slow  # a benchmark's quick mode: CI runs it after README's suite
def test_allocator_bench_quick(capsys):
  rows = allocator_bench.main(["--quick"])  # --quick never writes the results file
  assert [row["batch"] for row in rows] == list(allocator_bench.QUICK_BATCHES)
  for row in rows:
    for key in ("append_us", "decode_us", "append_over_decode", "host_us", "append_over_host"):
      assert math.isfinite(row[key]) and row[key] > 0, (key, row)
    assert row["repeats"] > 0 and row["crossings_per_step"] > 0, row
  assert "| batch S | append us |" in capsys.readouterr().out
