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


def test_ci_runs_readmes_test_command_exactly():
  test_command = _readme_commands()[1]
  ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
  assert test_command in ci_lines, "the test command in .ci/run must be README's, verbatim"
