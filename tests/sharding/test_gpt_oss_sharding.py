"""gpt-oss under tensor parallelism: the (1 x 2) mesh engine's greedy tokens are the
one-device dense model's argmax at every generated position, log-probs within 1e-5
(``psum`` reorders the head and expert-column sums only). Slow: one subprocess on 2 CPU
devices compiling the sharded engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_model_axis_serves_gpt_oss_like_one_device():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "tests.sharding._run_gpt_oss"], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  base, sharded = result["dense"], result
  assert sharded["tokens"] == base["tokens"]
  assert [len(t) for t in base["tokens"]] == [8, 8, 8]
  diff = max(abs(a - b) for x, y in zip(sharded["logprobs"], base["logprobs"])
             for a, b in zip(x, y))
  assert diff < 1e-5, diff
