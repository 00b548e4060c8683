"""The TPU benchmarks' CPU modes run: the accuracy table, and the TPU timing script's dry run
(its rows are checked for shape, never for a timing)."""

from __future__ import annotations

import math

import pytest

from benchmarks import tpu_accuracy
from benchmarks.tpu import run as tpu_run
from benchmarks.tpu import window_pages


@pytest.mark.slow  # a benchmark's quick mode: CI runs it after README's suite
def test_tpu_accuracy_quick(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(tpu_accuracy, "RESULTS_PATH", tmp_path / "RESULTS_tpu_section.md")
  rows = tpu_accuracy.main(["--quick"])
  by_key = {(r["batch"], r["dtype"], r["impl"]): r for r in rows}
  ours = [r for r in rows if r["impl"] == tpu_accuracy.OURS]
  assert {(r["batch"], r["dtype"]) for r in ours} >= {("decode", "float32"),
                                                     ("decode", "bfloat16"),
                                                     ("mixed", "float32")}
  for r in ours:
    assert r["error"] is None, r
    assert math.isfinite(r["max_abs"]) and math.isfinite(r["max_rel"]), r
  for batch in ("decode", "mixed"):
    assert by_key[batch, "float32", tpu_accuracy.OURS]["max_rel"] < 1e-5
  jax_decode = by_key["decode", "float32", tpu_accuracy.JAX_DECODE]
  ours_decode = by_key["decode", "float32", tpu_accuracy.OURS]
  assert jax_decode["error"] is None and math.isfinite(jax_decode["max_rel"]), jax_decode
  assert ours_decode["max_rel"] <= jax_decode["max_rel"]
  # JAX's ragged kernel either has numbers or the error it raised.
  for r in rows:
    if r["impl"] == tpu_accuracy.JAX_RAGGED:
      assert (r["error"] is None) != math.isnan(r["max_rel"]), r
  assert "| batch | dtype | kernel |" in capsys.readouterr().out
  assert "Command: `python -m benchmarks.tpu_accuracy --quick`" in (
      tmp_path / "RESULTS_tpu_section.md").read_text()


@pytest.mark.slow  # a benchmark's quick mode: CI runs it after README's suite
def test_tpu_run_dry_run(tmp_path):
  results = tpu_run.main(["--dry-run", "--out", str(tmp_path)])
  assert results["dry_run"]
  assert results["checks"] and all(c["ok"] for c in results["checks"]), results["checks"]
  impls = {t["impl"] for t in results["timings"]}
  assert impls == {tpu_run.OURS, tpu_run.XLA, tpu_run.JAX_DECODE, tpu_run.JAX_RAGGED,
                   tpu_run.DENSE}
  ours = next(t for t in results["timings"] if t["impl"] == tpu_run.OURS)
  assert "error" not in ours, ours
  for t in results["timings"]:
    assert "error" in t or t["samples"] >= 1, t  # a row, never a timing asserted
    if "max_abs_diff_vs_ours" in t:  # bfloat16 outputs of the same attention
      assert t["max_abs_diff_vs_ours"] < 5e-2, t
  assert (tmp_path / "results.json").exists()
  assert "| case | impl |" in (tmp_path / "results.md").read_text()


@pytest.mark.slow
def test_window_pages_quick():
  # Pages copied per query tile under a window of 256 do not grow from context 512 to
  # 1024, equal the pages the tile's windows touch, and no page is copied twice by an item.
  rows = window_pages.main(["--quick"])
  assert {(r["batch"], r["context"]) for r in rows} == {
      (b, c) for b in window_pages.BATCHES for c in (512, 1024)}
  for r in rows:
    assert r["pages_per_tile"] == r["pages_in_windows_per_tile"], r
    assert r["max_copies_of_a_page"] == 1 and r["max_abs_error"] < 1e-5, r
  for batch in window_pages.BATCHES:
    per_context = {r["context"]: r["pages_per_tile"] for r in rows if r["batch"] == batch}
    assert per_context[512] == per_context[1024], per_context
