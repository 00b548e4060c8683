"""A model of the user's own served over meshes (``_run_own_model.py``, 4 CPU devices in a
subprocess): data parallel needs nothing of the model, tensor parallel its
``with_model_axis`` and ``param_partition_specs``; a model without ``with_model_axis`` on
a "model" axis > 1 is a clear ``ValueError``. Slow: four engine compilations."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_own_model_over_data_and_model_axes(tmp_path):
  out = tmp_path / "own.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      " --xla_force_host_platform_device_count=4").strip()
  proc = subprocess.run([sys.executable, "-m", "tests.sharding._run_own_model", str(out)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-4000:]
  result = json.loads(out.read_text())
  assert result["num_devices"] == 4
  base = result["unsharded"]
  # qkv kernel [E, H * 3 * D] = [32, 96]: whole on one device, half the heads under m = 2.
  assert base["qkv_kernel_per_device"] == [32, 96]
  for mesh, per_device in (("data_2x1", [32, 96]), ("tp_1x2", [32, 48]),
                           ("tp_2x2", [32, 48])):
    got = result[mesh]
    assert got["tokens"] == base["tokens"], mesh
    diff = max(abs(a - b) for x, y in zip(got["logprobs"], base["logprobs"])
               for a, b in zip(x, y))
    assert diff < 1e-5, (mesh, diff)  # psum reorders the head / column sums only
    assert got["qkv_kernel_per_device"] == per_device, mesh
    assert got["free_blocks"] == 32
  assert "has no method with_model_axis" in result["no_with_model_axis"]
  assert result["precompiled"] == ["abort", "admit", "step T=16"]
  assert result["compiles_while_serving"] == 0
  assert len({tuple(t) for t in base["tokens"]}) > 3  # distinct continuations
