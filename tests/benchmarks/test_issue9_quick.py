"""Issue 9 benchmarks run in --quick mode and produce finite numbers (never a timing)."""

from __future__ import annotations

import math

from benchmarks import memory


def test_memory_quick_rows():
  rows = memory.main(["--quick"])
  assert [r["policy"] for r in rows] == ["paged", "contiguous (max length)",
                                          "contiguous (oracle length)"]
  for row in rows:
    for key in ("kv_utilization", "budget_holding_tokens", "mean_concurrent",
                "concurrent_vs_max"):
      assert math.isfinite(row[key]), (row["policy"], key)
    assert row["peak_concurrent"] >= 1 and row["steps"] >= 1
