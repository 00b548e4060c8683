"""KV groups under a mesh (``_run_kv_groups.py``, 4 CPU devices in a subprocess): with
``free_outside_window=True`` each data shard's allocator gives back the blocks behind a
sliding group's window, for an all-sliding Mistral-like model (one group) and a
Gemma-3-like hybrid (a sliding and a full group), over (2 x 1) and (2 x 2) meshes: greedy
tokens equal the unsharded engine's, in a pool that holds the four sequences only because
blocks are given back (no preemption in any run). Slow: six engine compilations (~55 s)."""

from __future__ import annotations

import pytest

from tests import shared_jobs


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  # The subprocess (4 CPU devices) was started as the test run began (tests/shared_jobs.py):
  # one run shared by every worker, beside the other tests.
  result = shared_jobs.result(shared_jobs.folder_for_run(tmp_path_factory), "kv_groups")
  assert result["num_devices"] == 4
  return result


# Per model: layer windows, group windows, pool (total over shards), blocks four 60-token
# sequences hold if nothing is given back (15 a group each), table shapes per run.
CASES = {
    "mistral": ([16, 16], [16], 40, 4 * 15,
                {"unsharded": [4, 64], "2x1": [2, 2, 64], "2x2": [2, 2, 64]}),
    "gemma3": ([16, None], [16, None], 104, 4 * 2 * 15,
               {"unsharded": [2, 4, 64], "2x1": [2, 2, 2, 43], "2x2": [2, 2, 2, 43]}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("mesh", ["2x1", "2x2"])
def test_sharded_engine_gives_back_blocks_behind_the_window(run, name, mesh):
  layer_windows, windows, num_blocks, held_without_freeing, shapes = CASES[name]
  runs = run[name]
  assert runs["layer_windows"] == layer_windows
  base, got = runs["unsharded"], runs[mesh]
  for r, key in ((base, "unsharded"), (got, mesh)):
    assert r["windows"] == windows
    assert r["block_tables_shape"] == shapes[key]
    assert r["num_blocks"] == num_blocks < held_without_freeing
    assert r["preemptions"] == 0
    assert r["generated_tokens"] == 4 * 40
    assert r["num_free_blocks"] == num_blocks  # every shard's groups released at the end
    # The four sequences ran side by side (~42 steps; one after another would take 160+),
    # so at their peak they held fewer blocks than without freeing.
    assert r["steps"] < 60
    assert r["peak_blocks_in_use"] <= num_blocks
    # Mid-run the sliding group's tables hold NO_BLOCK behind the window, the full's none.
    sliding, *full = r["given_back_mid_run"]
    assert sliding > 0 and full in ([], [0])
  assert got["tokens"] == base["tokens"]
  assert len({tuple(t) for t in base["tokens"]}) == 4
  diff = max(abs(a - b) for x, y in zip(got["logprobs"], base["logprobs"])
             for a, b in zip(x, y))
  # 2x2: psum reorders the head / MLP-column sums. 2x1 (data parallel only): each shard
  # computes what the one device did for its half of the slots, but XLA:CPU's code for a
  # batch of 2 may round otherwise than for 4 (1.4e-6 apart with its loop emitters, which
  # the tests use; bit-equal with its fusion emitters).
  assert diff < 1e-5, diff
