"""The GPU session's prepared scripts run end to end on CPU (kernels in interpret mode), so
a GPU session's few minutes are not spent on a script error. Timings are never asserted."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run_script(name: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu" / name), *args],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_parity_smoke_checks_every_impl_against_the_reference(tmp_path):
  done = _run_script("parity.py", "--smoke-cpu", "--out", str(tmp_path))
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  table = (tmp_path / "parity.md").read_text()
  assert "0 failing cell(s)" in table
  rows = [line for line in table.splitlines() if line.startswith("| f32 ")
          or line.startswith("| bf16 all ") or line.startswith("| int8 all ")
          or line.startswith("| fp8 ")]
  assert len(rows) == 4, table
  for row in rows:  # an error (not a number) in any impl's cell would show here
    cells = [c.strip() for c in row.strip("|").split("|")][2:]
    assert len(cells) == 4 and all(float(c) >= 0 for c in cells), row


def test_parity_refuses_unknown_cases_and_impls(tmp_path):
  done = _run_script("parity.py", "--cases", "bf16 nope", "--out", str(tmp_path), timeout=120)
  assert done.returncode == 2 and "--cases" in done.stderr and "bf16 all" in done.stderr
  done = _run_script("parity.py", "--impls", "triton", "--out", str(tmp_path), timeout=120)
  assert done.returncode == 2 and "--impls" in done.stderr


@pytest.mark.slow
def test_run_smoke_checks_pass_and_times_every_impl(tmp_path):
  done = _run_script("run.py", "--smoke-cpu", "--out", str(tmp_path))
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["checks"] and all(c["ok"] for c in results["checks"]), results["checks"]
  impls = {t["impl"] for t in results["timings"] if "us" in t}
  assert {"pallas_mosaic_gpu (ours)", "pallas_mosaic_gpu, storage bits (ours)",
          "pallas_gpu (ours)", "pallas_gpu, storage bits (ours)"} <= impls, impls
