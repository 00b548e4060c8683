"""The harness that runs the sharding subprocesses once per test run (tests/shared_jobs.py):
what a waiting test sees when its job failed, or was never started."""

from __future__ import annotations

import json
import re

import pytest

from tests import shared_jobs


def _ended(folder, name, rc, log="", result=None):
  (folder / f"{name}.started").touch()
  (folder / f"{name}.log").write_text(log)
  if result is not None:
    (folder / f"{name}.json").write_text(json.dumps(result))
  (folder / f"{name}.rc").write_text(rc)


def test_a_finished_job_gives_its_json(tmp_path):
  _ended(tmp_path, "meshes", "0", result={"num_devices": 8})
  assert shared_jobs.result(tmp_path, "meshes") == {"num_devices": 8}


@pytest.mark.parametrize("rc", ["1", "-9", "a timeout (900 s)"])
def test_a_failed_job_is_an_assertion_with_the_end_of_its_log(tmp_path, rc):
  _ended(tmp_path, "kv_groups", rc, log="x" * 5000 + "Traceback: the real reason")
  match = (r"(?s)'kv_groups' \(tests\.sharding\._run_kv_groups\) ended with "
           rf"{re.escape(rc)}:.*the real reason")
  with pytest.raises(AssertionError, match=match) as e:
    shared_jobs.result(tmp_path, "kv_groups")
  assert len(str(e.value)) < 4200  # the log's end, not all of it


def test_a_job_never_started_says_which_tests_should_have_started_it(tmp_path):
  with pytest.raises(AssertionError, match=r"'meshes' was not started: no collected test of "
                                           r"tests/sharding/test_sharding.py"):
    shared_jobs.result(tmp_path, "meshes")


class _Item:

  def __init__(self, nodeid, fixturenames):
    self.nodeid, self.fixturenames = nodeid, fixturenames


def test_only_jobs_a_collected_test_reads_are_started(tmp_path, monkeypatch):
  started = []
  monkeypatch.setattr(shared_jobs.subprocess, "Popen",
                      lambda argv, **kw: started.append(argv[-1]))
  items = [_Item("tests/sharding/test_sharding.py::test_host_side_spec", ["request"]),
           _Item("tests/sharding/test_kv_groups_sharding.py::test_x[2x1]", ["run"]),
           _Item("tests/paged_jax/test_spec.py::test_y", ["run"])]
  assert shared_jobs.start_needed(items, tmp_path) == ["kv_groups"]
  assert shared_jobs.start_needed(items, tmp_path) == ["kv_groups"]  # a second worker
  assert started == ["kv_groups"]  # started once per run
  assert (tmp_path / "kv_groups.started").exists()
  assert not (tmp_path / "meshes.started").exists()
