"""README's set-up commands and .ci/run stay in step."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
  text = (ROOT / "README.md").read_text()
  return re.findall(r"```bash\n(.+?)\n```", text)


def test_readme_has_exactly_two_setup_commands():
  commands = _readme_commands()
  assert len(commands) == 2, commands
  main_job, tests = commands
  assert main_job.endswith("paged-jax run") and "pip install -e ." in main_job
  assert "pytest" in tests and "torch==2.13.0" in tests and ".[test]" in tests


def test_ci_runs_both_readme_commands_exactly_then_the_slow_tests():
  main_job, test_command = _readme_commands()
  ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
  assert main_job in ci_lines, "the main-job command in .ci/run must be README's, verbatim"
  assert test_command in ci_lines, "the test command in .ci/run must be README's, verbatim"
  # Each in a fresh venv: .venv is removed before each of them, and the main job runs first.
  main_at, tests_at = ci_lines.index(main_job), ci_lines.index(test_command)
  assert main_at < tests_at
  assert "rm -rf .venv" in ci_lines[:main_at]
  assert "rm -rf .venv" in ci_lines[main_at + 1:tests_at]
  slow = [i for i, line in enumerate(ci_lines) if "pytest" in line and "-m slow" in line]
  assert slow and slow[0] > tests_at, "the slow tests must run after README's test command"


def test_core_dependencies_cover_what_the_library_imports():
  """Every third-party module imported by paged_jax, its models and kernels is a core
  dependency (not only a test extra), so README's main-job command works in a fresh venv."""
  import ast
  import tomllib
  deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
  names = {re.split(r"[<>=\[ ]", d, maxsplit=1)[0].lower().replace("-", "_") for d in deps}
  provided_by = {"jax": "jax", "jaxlib": "jaxlib", "flax": "flax", "chex": "chex",
                 "numpy": "numpy", "ml_dtypes": "ml_dtypes", "safetensors": "safetensors",
                 "tokenizers": "tokenizers", "jinja2": "jinja2"}
  stdlib = set(__import__("sys").stdlib_module_names)
  missing = set()
  for folder in ("paged_jax", "models", "pallas_kernels"):
    for path in (ROOT / folder).rglob("*.py"):
      for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
          tops = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
          tops = [node.module.split(".")[0]]
        else:
          continue
        for top in tops:
          if top in stdlib or top == "paged_jax" or top == "__future__":
            continue
          if provided_by.get(top) not in names:
            missing.add(f"{top} ({path.relative_to(ROOT)})")
  assert not missing, f"imported but not a core dependency: {sorted(missing)}"


def _readme_python(marker: str) -> str:
  text = (ROOT / "README.md").read_text()
  return re.search(rf"<!-- {marker} -->\n```python\n(.+?)\n```", text, re.S).group(1)


def test_lower_layers_snippet_runs_and_matches_the_reference():
  # The snippet defines every name it uses; its output is the reference's, per sequence.
  import jax.numpy as jnp
  import numpy as np
  scope: dict = {}
  exec(compile(_readme_python("lower-layers"), "README.md", "exec"), scope)  # noqa: S102
  out = scope["out_THD"]
  assert out.shape == (8, 4, 64) and bool(jnp.isfinite(out).all())
  ref = scope["paged_attention"](scope["q_THD"], scope["cache"], 0, scope["alloc"].seq_lens,
                                 scope["alloc"].block_tables, scope["cu_q_lens"], num_seqs=2,
                                 impl="reference")
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             atol=2e-2, rtol=2e-2)
  # the first row of each sequence attends only to itself: its output is its own V
  v = np.asarray(scope["v_TKD"], np.float32)
  np.testing.assert_allclose(np.asarray(out[5], np.float32).reshape(2, 2, 64),
                             np.broadcast_to(v[5][:, None], (2, 2, 64)), atol=2e-2)
