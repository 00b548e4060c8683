"""The GPU session's prepared scripts run end to end on CPU (kernels in interpret mode), so
a GPU session's few minutes are not spent on a script error. Timings are never asserted."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
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
def test_engine_smoke_serves_through_every_impl(tmp_path):
  done = _run_script("engine.py", "--smoke-cpu", "--out", str(tmp_path))
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  table = (tmp_path / "engine.md").read_text()
  for impl in ("auto", "pallas_gpu", "pallas_mosaic_gpu", "xla"):
    for kv in ("float32", "int8"):  # tokens equal to the dense loop, blocks all free
      assert f"| {impl} | {kv} | 2/2 | 100.0% | 0 | True |" in table, table
    speed = [line for line in table.splitlines() if line.startswith(f"| {impl} | ")
             and line.count("|") == 9]
    assert len(speed) == 1 and float(speed[0].split("|")[5]) > 0, table  # tokens/s


def test_engine_refuses_unknown_impls(tmp_path):
  done = _run_script("engine.py", "--impls", "auto,triton", "--out", str(tmp_path),
                     timeout=120)
  assert done.returncode == 2 and "--impls: unknown triton" in done.stderr


@pytest.mark.slow
def test_run_smoke_checks_pass_and_times_every_impl(tmp_path):
  done = _run_script("run.py", "--smoke-cpu", "--out", str(tmp_path))
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  results = json.loads((tmp_path / "results.json").read_text())
  assert results["checks"] and all(c["ok"] for c in results["checks"]), results["checks"]
  swept = [c["name"] for c in results["checks"] if c["name"].startswith("smoke_sweep_bf16")]
  assert len(swept) == 5, swept  # four (J, S) tilings and the wave-balanced splits
  impls = {t["impl"] for t in results["timings"] if "us" in t}
  assert {"pallas_mosaic_gpu (ours)", "pallas_mosaic_gpu, storage bits (ours)",
          "pallas_gpu (ours)", "pallas_gpu, storage bits (ours)",
          "pallas_mosaic_gpu J=64 S=2 (ours)", "pallas_mosaic_gpu J=128 S=3 (ours)",
          "pallas_mosaic_gpu X=waves (ours)", "xla U=2048 (ours)"} <= impls, impls
  # The profiles need the GPU's profiler: on CPU each is recorded as skipped, by name.
  profiles = results["profiles"]
  assert len(profiles) == 4 and all("needs a GPU" in p["error"] for p in profiles)
  assert "Profile decode B=8 ctx=8192, default tiling" in (tmp_path / "results.md").read_text()


def _load_beside_run(name: str):
  spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "gpu" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _program(trace, *, sm, tid, start_ns, regions):
  """Events of one program: ``regions`` = [(name, cycles)] back to back from cycle 0;
  times as the Mosaic GPU profiler writes them, (start ns + cycles) / 1e3."""
  cycle = 0
  for name, cycles in regions:
    for phase, at in (("B", cycle), ("E", cycle + cycles)):
      trace["traceEvents"].append(dict(name=name, ph=phase, ts=(start_ns + at) / 1e3,
                                       pid=sm, tid=tid))
    cycle += cycles


def test_profile_summary_of_a_synthetic_trace():
  profile = _load_beside_run("mosaic_profile")
  chunk = [("pages", 10), ("wait", 300), ("scores", 100), ("softmax", 150), ("update", 100),
           ("refill", 40)]
  trace = {"traceEvents": []}
  # Two programs side by side on SM 1 (the second starts 100 ns into the first), one later
  # on SM 2: 2 chunks each, 700 cycles per chunk, 100 + 1400 + 100 cycles per program.
  for tid, (sm, start) in enumerate([(1, 0), (1, 100), (2, 5000)]):
    _program(trace, sm=sm, tid=tid, start_ns=start,
             regions=[("prologue", 100), *chunk, *chunk, ("epilogue", 100)])
  summary = profile.summarise(trace)
  assert summary["programs"] == 3
  assert summary["chunks_per_program"] == pytest.approx(2.0)
  assert summary["cycles_per_program"] == pytest.approx(1600.0)
  assert summary["cycles_per_chunk"] == pytest.approx(800.0)  # programs' cycles / chunks
  assert summary["max_programs_per_sm"] == 2
  # From the first start (0 ns) to the last end (5000 ns + 1600 cycles at CLOCK_GHZ).
  assert summary["kernel_us"] == pytest.approx((5000 + 1600 / profile.CLOCK_GHZ) / 1e3)
  wait = summary["regions"]["wait"]
  assert wait["count"] == 6 and wait["per_program"] == pytest.approx(2.0)
  assert wait["mean_cycles"] == pytest.approx(300.0)
  assert wait["share"] == pytest.approx(600 / 1600)
  assert list(summary["regions"])[0] == "wait"  # the largest share first
  assert sum(r["share"] for r in summary["regions"].values()) == pytest.approx(1.0)
  table = profile.to_markdown("decode", summary)
  assert "| wait | 2.0 | 300 | 37.5% |" in table and "3 programs" in table


def test_profile_script_prints_the_summary_of_a_trace(tmp_path):
  # RESULTS.md says mosaic_profile.py prints cycles per region; run as a script it printed
  # nothing (no __main__). Given a trace folder it prints its newest trace's table.
  trace = {"traceEvents": []}
  _program(trace, sm=1, tid=0, start_ns=0, regions=[("prologue", 100), ("wait", 300),
                                                     ("epilogue", 100)])
  (tmp_path / "17-trace.json").write_text(json.dumps(trace))
  script = pathlib.Path(__file__).parents[2] / "benchmarks" / "gpu" / "mosaic_profile.py"
  done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                        text=True, timeout=60, check=True)
  assert "1 program," in done.stdout and "| wait | 1.0 | 300 | 60.0% |" in done.stdout


def test_run_batches_small_calls_into_one_dispatch():
  run = _load_beside_run("run")
  # 33 MB a call (batch 1 at 8k): 8 calls a dispatch, two dispatches queued; 34 GB (batch
  # 256 at 32k): one of each; the rotating sets are always all called.
  assert run.repeat_plan(33 << 20, 8) == (8, 2)
  assert run.repeat_plan(4 << 20, 16) == (16, 2)
  assert run.repeat_plan(34 << 30, 1) == (1, 1)
  assert run.repeat_plan(300 << 20, 1) == (4, 2)
  q = np.arange(4, dtype=np.float32).reshape(2, 2)
  calls = run.call_args([(q, "k0"), (q + 1, "k1")], 5)
  assert [rest for _, rest in calls] == ["k0", "k1", "k0", "k1", "k0"]
  firsts = [np.asarray(c[0], np.float32) for c in calls]
  assert all(not np.array_equal(a, b) for i, a in enumerate(firsts) for b in firsts[:i])


def test_profile_case_summarises_the_trace_the_kernel_writes(tmp_path, monkeypatch):
  # run.py's profile stage, with the profiled kernel (a GPU only) replaced by one that
  # writes a synthetic trace where the Mosaic GPU profiler would: the plumbing (tiling,
  # trace folder, summary, the compressed trace under $OUT) is what runs here.
  from paged_jax.pallas_kernels import mosaic_gpu
  run = _load_beside_run("run")
  seen = {}

  def fake_profiled(q, *args, profile_dir, profile_space, tiling, **kwargs):
    seen.update(space=profile_space, tiling=tiling, kv_dtype=kwargs["kv_dtype"])
    trace = {"traceEvents": []}
    _program(trace, sm=1, tid=0, start_ns=0,
             regions=[("prologue", 50), ("wait", 200), ("scores", 100), ("epilogue", 50)])
    pathlib.Path(profile_dir, "123-trace.json").write_text(json.dumps(trace))
    return q

  monkeypatch.setattr(mosaic_gpu, "profiled_attention", fake_profiled)
  row = run.profile_case(2, 256, (128, 1), True, out_dir=tmp_path)
  assert row["label"] == "decode B=2 ctx=256, J=128 S=1, storage bits"
  assert row["programs"] == 1 and row["regions"]["wait"]["mean_cycles"] == pytest.approx(200)
  assert seen["tiling"].chunk_size == 128 and seen["tiling"].num_stages == 1
  assert seen["kv_dtype"] == np.dtype("bfloat16")
  # 8 regions a chunk (7 and a margin) for the chunks of one split, plus 8.
  chunks = math.ceil(math.ceil(256 / 128) / seen["tiling"].num_splits)
  assert seen["space"] == 8 * chunks + 8
  assert (tmp_path / "profile" / "b2_c256_j128_s1_bits.json.gz").stat().st_size > 0
