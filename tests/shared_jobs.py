"""Subprocess jobs whose one JSON result several tests read, started as a test run begins.

The sharding checks need JAX with 4 or 8 CPU devices, so each runs as one subprocess
(``tests/sharding/_run_*.py``) that writes a JSON file its test module reads. Started by
the first test that needed it, the job held up that test's worker for its whole length
(~80 s), and under pytest-xdist the other worker either waited on it (idle) or ran it a
second time. Now the suite's session fixture (``tests/conftest.py``) starts every job the
collected tests need as soon as a worker begins, once per test run (workers race for an
exclusive marker file), and the job runs beside the other tests; a module's fixture calls
``result`` when its first test comes, by then mostly finished.

``python -m tests.shared_jobs FOLDER NAME`` is the runner each job is started as: it runs
the job's module, renames its output into place on success, and writes ``NAME.rc`` last,
so a waiting test knows the job ended and how.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
TIMEOUT_S = 900
_STARTED: list[subprocess.Popen] = []  # kept for the process's life: never collected running


@dataclasses.dataclass(frozen=True)
class Job:
  test_file: str  # the nodeid prefix of the tests that read it (through a ``run`` fixture)
  module: str  # run as ``python -m module OUT.json``; it adds the CPU device count it needs
  # to XLA_FLAGS itself, before JAX starts


JOBS = {
    "meshes": Job("tests/sharding/test_sharding.py", "tests.sharding._run_meshes"),
    "kv_groups": Job("tests/sharding/test_kv_groups_sharding.py",
                     "tests.sharding._run_kv_groups"),
}


def folder_for_run(tmp_path_factory) -> pathlib.Path:
  """A folder of this test run that every xdist worker sees (their common parent, keyed by
  the run's id), or this process's own temporary folder without xdist."""
  run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
  base = tmp_path_factory.getbasetemp()
  folder = base if run_id is None else base.parent / f"shared-jobs-{run_id}"
  folder.mkdir(exist_ok=True)
  return folder


def start_needed(items, folder: pathlib.Path) -> list[str]:
  """Starts (once per run) each job a test among ``items`` reads; returns their names."""
  needed = [name for name, job in JOBS.items()
            if any(item.nodeid.startswith(job.test_file)
                   and "run" in getattr(item, "fixturenames", ()) for item in items)]
  for name in needed:
    try:  # the first worker to create the marker starts the job; the others see it
      os.close(os.open(folder / f"{name}.started", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
      continue
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    with open(folder / f"{name}.log", "w") as log:
      _STARTED.append(subprocess.Popen(
          [sys.executable, "-m", "tests.shared_jobs", str(folder), name], cwd=ROOT, env=env,
          stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
          start_new_session=True))
  return needed


def result(folder: pathlib.Path, name: str) -> dict:
  """The JSON job ``name`` wrote, waiting for it to end; an AssertionError with the end of
  its log if it failed, or if it was never started (``start_needed`` did not see its tests)."""
  if not (folder / f"{name}.started").exists():
    raise AssertionError(f"shared job {name!r} was not started: no collected test of "
                         f"{JOBS[name].test_file} uses a 'run' fixture")
  rc_file = folder / f"{name}.rc"
  deadline = time.monotonic() + TIMEOUT_S + 60
  while not rc_file.exists():
    if time.monotonic() > deadline:
      raise AssertionError(f"shared job {name!r} did not end within {TIMEOUT_S + 60} s")
    time.sleep(0.2)
  rc = rc_file.read_text().strip()
  if rc != "0":
    log = (folder / f"{name}.log").read_text()
    raise AssertionError(f"shared job {name!r} ({JOBS[name].module}) ended with {rc}:\n"
                         f"{log[-4000:]}")
  return json.loads((folder / f"{name}.json").read_text())


def _run(folder: pathlib.Path, name: str) -> str:
  partial = folder / f"{name}.partial"
  try:
    done = subprocess.run([sys.executable, "-m", JOBS[name].module, str(partial)], cwd=ROOT,
                          timeout=TIMEOUT_S)
  except subprocess.TimeoutExpired:
    return f"a timeout ({TIMEOUT_S} s)"
  if done.returncode != 0:
    return str(done.returncode)
  partial.rename(folder / f"{name}.json")  # only a finished job's output is ever read
  return "0"


if __name__ == "__main__":
  _folder, _name = pathlib.Path(sys.argv[1]), sys.argv[2]
  _rc = _run(_folder, _name)
  (_folder / f"{_name}.rc.partial").write_text(_rc)
  (_folder / f"{_name}.rc.partial").rename(_folder / f"{_name}.rc")
