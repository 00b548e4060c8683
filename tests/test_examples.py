"""``examples/own_model.py`` run as a user would, from a project folder that has its own
``models/`` and ``pallas_kernels/`` packages beside the script: the user's packages are
what ``import models`` gives, and the library (whose import names are ``paged_jax.*``)
still works. ``examples/serve_own_model.py`` runs in ``tests/paged_jax/test_own_model.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DRIVER = textwrap.dedent("""
    import os, runpy, sys
    here = os.path.dirname(os.path.abspath(__file__))
    import models, pallas_kernels  # the user's own packages
    assert models.WHO == "user" and os.path.dirname(models.__file__) == os.path.join(here, "models")
    assert pallas_kernels.WHO == "user"
    import paged_jax
    from paged_jax import (LLM, AttentionMetadata, KVCache, KVCacheSpec, ModelConfig,
                           SamplingParams, allocator, load_pretrained, paged_attention)
    import paged_jax.models, paged_jax.pallas_kernels
    assert not paged_jax.models.__file__.startswith(here), paged_jax.models.__file__
    assert sys.modules["models"] is models and sys.modules["pallas_kernels"] is pallas_kernels
    # The library never imported a top-level models.* / pallas_kernels.* module.
    leaked = [n for n in sys.modules if n.startswith(("models.", "pallas_kernels."))]
    assert not leaked, leaked
    tokens = runpy.run_path(os.path.join(here, "own_model.py"), run_name="__main__")
    print("USER-FOLDER-OK")
""")


def test_decode_loop_example_runs_beside_a_users_own_models_package(tmp_path):
  for package in ("models", "pallas_kernels"):
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text('WHO = "user"\n')
  shutil.copy(os.path.join(ROOT, "examples", "own_model.py"), tmp_path)
  (tmp_path / "run_user.py").write_text(DRIVER)
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "run_user.py"], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  assert "USER-FOLDER-OK" in proc.stdout
  assert proc.stdout.count("= the dense forward's greedy tokens") == 3
