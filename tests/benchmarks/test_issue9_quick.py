"""Issue 9 benchmarks run in --quick mode and produce finite numbers (never a timing)."""

from __future__ import annotations

import math

import pytest

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


def test_memory_pool_dtypes_quick_one_byte_pools_hold_about_twice():
  # Issue 20: at one byte budget an int8 / float8 pool (one byte per value plus a float32
  # scale per token and KV head) holds >= 1.8x the sequences of a bfloat16 one while
  # requests are queued.
  rows = {r["dtype"]: r for r in memory.main(["--pool-dtypes", "--quick"])}
  assert list(rows) == ["bfloat16", "int8", "float8_e4m3fn"]
  bf16 = rows["bfloat16"]
  assert bf16["peak_concurrent"] < memory.QUICK_POOL_DTYPES.num_requests  # the budget binds
  for name in ("int8", "float8_e4m3fn"):
    row = rows[name]
    assert row["total_bytes"] <= bf16["total_bytes"]
    assert row["num_blocks"] >= 1.8 * bf16["num_blocks"], row
    assert row["peak_vs_bf16"] >= 1.8 and row["mean_vs_bf16"] >= 1.8, row
    assert row["steps"] < bf16["steps"], row  # the queue drains sooner


@pytest.mark.slow  # a benchmark's quick mode: CI runs it after README's suite
def test_throughput_quick_rows(capsys):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  from benchmarks import throughput
  result = throughput.main(["--quick"])  # --quick never writes the results file or plot
  rows = result["rows"]
  assert [r["system"] for r in rows] == [throughput.PAGED, throughput.CONTIGUOUS,
                                          throughput.HF]
  for row in rows:
    for key in ("tokens_per_s", "vs_contiguous", "vs_transformers", "same_tokens"):
      assert math.isfinite(row[key]) and row[key] >= 0, (row["system"], key)
  assert rows[1]["batch"] == throughput.QUICK.contiguous_batch
  # The contiguous baseline runs the same model code greedily: the same tokens (a rare
  # near-tie may round differently at another batch shape).
  assert rows[1]["same_tokens"] >= 0.75
  sweep = result["sweep"]
  assert [(r["system"], r["batch"]) for r in sweep] == (
      [(throughput.PAGED, s) for s in throughput.QUICK.sweep_max_seqs]
      + [(throughput.CONTIGUOUS, b) for b in throughput.QUICK.sweep_contiguous])
  assert all(math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 for r in sweep)
  out = capsys.readouterr().out
  assert "| system | batch (max concurrent) |" in out and "| system | batch size" in out


def test_memory_pool_dtypes_quick_one_byte_pools_hold_about_twice():
  # Issue 20: at one byte budget an int8 / float8 pool (one byte per value plus a float32
  # scale per token and KV head) holds >= 1.8x the sequences of a bfloat16 one while
  # requests are queued.
  rows = {r["dtype"]: r for r in memory.main(["--pool-dtypes", "--quick"])}
  assert list(rows) == ["bfloat16", "int8", "float8_e4m3fn"]
  bf16 = rows["bfloat16"]
  assert bf16["peak_concurrent"] < memory.QUICK_POOL_DTYPES.num_requests  # the budget binds
  for name in ("int8", "float8_e4m3fn"):
    row = rows[name]
    assert row["total_bytes"] <= bf16["total_bytes"]
    assert row["num_blocks"] >= 1.8 * bf16["num_blocks"], row
    assert row["peak_vs_bf16"] >= 1.8 and row["mean_vs_bf16"] >= 1.8, row
    assert row["steps"] < bf16["steps"], row  # the queue drains sooner


@pytest.mark.slow  # a benchmark's quick mode: CI runs it after README's suite
def test_decode_step_quick_rows(capsys):
  from benchmarks import decode_step
  result = decode_step.main(["--quick"])
  step = result["step"]
  assert [(r["num_seqs"], r["context"], r["impl"]) for r in step] == [
      (c.num_seqs, c.context, impl) for c in decode_step.QUICK_STEP.cases
      for impl in decode_step.CPU_IMPLS]
  for row in step:
    for key in ("paged_us", "dense_us", "ratio", "attention_paged_us", "attention_dense_us",
                "attention_ratio"):
      assert math.isfinite(row[key]) and row[key] > 0, (row, key)
    assert row["max_abs_logit_diff"] < 1e-4, row  # both steps compute the same logits
  loop = result["loop"]
  assert [r["steps_per_call"] for r in loop] == [decode_step.QUICK_LOOP.steps_per_call, 1]
  for row in loop:
    assert math.isfinite(row["tokens_per_s"]) and row["tokens_per_s"] > 0, row
    assert row["tokens"] == loop[0]["tokens"] and row["device_calls"] >= 1
  assert loop[0]["device_calls"] < loop[1]["device_calls"]  # the loop batches host calls
  out = capsys.readouterr().out
  assert "| S x context | impl |" in out and "| steps_per_call | tokens/s |" in out
  assert "pallas_tpu, pallas_gpu" in out  # said to be skipped on CPU
