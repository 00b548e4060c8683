"""benchmarks/prefix_cache.py --quick runs, hits the cache and keeps outputs (no timing)."""

from __future__ import annotations

import math

import pytest

from benchmarks import prefix_cache


@pytest.mark.slow  # a benchmark's quick mode: CI runs it after README's suite
def test_prefix_cache_quick(capsys):
  rows = prefix_cache.main(["--quick"])
  assert [r["workload"] for r in rows] == [w.name for w in prefix_cache.QUICK_WORKLOADS]
  for row in rows:
    assert row["outputs_equal"], row  # the cache changes speed, never tokens
    # 6 prompts of a 40-token prefix + suffix (Z=16): the first prompt misses, the others
    # may take the 2 full prefix blocks at least.
    assert row["hit_rate"] > 0.3, row
    for key in ("off_req_s", "on_req_s", "off_tok_s", "on_tok_s", "speedup"):
      assert math.isfinite(row[key]) and row[key] > 0, (key, row)
  assert "| workload |" in capsys.readouterr().out
