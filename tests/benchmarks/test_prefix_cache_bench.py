"""benchmarks/prefix_cache.py --quick (plain and --hybrid) runs, hits the cache and keeps
outputs; benchmarks/prefix_lookup.py --quick gets whole hits at 1, 6 and 31 KV groups
and in a pool full of cached blocks (no
timing)."""

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


@pytest.mark.slow
def test_prefix_cache_hybrid_quick(capsys):
  rows = prefix_cache.main(["--quick", "--hybrid"])  # KV groups on (asserted inside)
  for row in rows:
    assert row["outputs_equal"] and row["hit_rate"] > 0.3, row
  assert "| workload |" in capsys.readouterr().out


@pytest.mark.slow
def test_prefix_lookup_quick_hits_are_whole_at_every_layout(capsys):
  from benchmarks import prefix_lookup
  rows = prefix_lookup.main(["--quick", "--repeats", "1"])
  assert [r["groups"] for r in rows] == [1, 1, 6, 31]
  for row in rows:
    assert row["shortest_hit"] == row["whole"] == 31, row
    assert row["sequences"] >= 1 and row["lookup_ms"] > 0, row
  assert "| layout |" in capsys.readouterr().out
