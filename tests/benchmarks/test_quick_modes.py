"""Each benchmark's --quick mode runs and produces numbers (never asserts a timing)."""

from __future__ import annotations

import math

from benchmarks import attention_cpu


def test_attention_cpu_quick(capsys):
  rows = attention_cpu.main(["--quick", "--repeats", "1"])
  assert len(rows) == len(attention_cpu.QUICK)
  for row in rows:
    for key in ("reference_ms", "xla_ms", "dense_ms", "xla_temp_mib"):
      assert math.isfinite(row[key]) and row[key] >= 0, (key, row)
    assert row["xla_max_abs_err"] < 1e-4, row  # the timed paths compute the same thing
  assert "| workload |" in capsys.readouterr().out
