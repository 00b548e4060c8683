"""The engine under ``jax_enable_x64``: a user's program that turns it on (float64 KV needs
it) must serve as it does without.

Before, the first ``generate`` failed to trace: ``allocator.fork`` returned ``num_free`` as
int64 and the step's prompt-token counters summed to int64 (``cond`` / ``while_loop``
branches of different types). One subprocess runs a small workload with x64 on; this
process runs the same without; the token ids must be equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest

from tests.reliability import x64_job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_engine_serves_the_same_tokens_with_x64_on():
  assert not jax.config.jax_enable_x64
  env = dict(os.environ, JAX_ENABLE_X64="1")
  run = subprocess.run([sys.executable, "-m", "tests.reliability.x64_job"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-4000:]
  with_x64 = json.loads(run.stdout.strip().splitlines()[-1])
  without = x64_job.outputs()
  assert with_x64 == without
  assert all(o["free"] for o in without.values())
  assert without["small pool"]["preemptions"] > 0
