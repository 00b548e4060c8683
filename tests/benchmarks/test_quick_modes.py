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


def test_gpu_accuracy_quick():
  from benchmarks import gpu_accuracy
  rows = gpu_accuracy.main(["--quick", "--no-write"])
  assert [row["dtype"] for row in rows] == ["bfloat16"]
  for row in rows:
    assert all(math.isfinite(row[k]) for k in ("ours_abs", "ours_rel", "jax_abs", "jax_rel"))
    assert row["ours_rel"] < 1e-2, row  # bfloat16 inputs, float32 accumulation
