"""Sharded serving over ("data", "model") meshes.

The 8-device checks run in ONE subprocess (``tests/sharding/_run_meshes.py``, started with
``--xla_force_host_platform_device_count=8``: this process already initialised JAX with
one CPU device) whose JSON the tests below read. The host-side pieces (slot choice, specs,
report merging, validation) are tested here directly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from paged_jax.models import ModelConfig, init_random
from paged_jax import sharding
from paged_jax.engine import LLM
from tests import shared_jobs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MESHES = ("1x1", "2x4", "1x8", "8x1")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  # The subprocess (8 CPU devices) was started as the test run began (tests/shared_jobs.py):
  # one run shared by every worker, beside the other tests.
  result = shared_jobs.result(shared_jobs.folder_for_run(tmp_path_factory), "meshes")
  assert result["num_devices"] == 8
  return result


def test_prompt_logprobs_over_data_shards(run):
  # Eight data shards of two slots: each shard's scored rows come back at their slots.
  base, got = (run["engines"][k]["prompt_logprobs"] for k in ("unsharded", "8x1"))
  assert [len(lps) for lps, _ in base] == [5, 17, 9, 30, 30, 3, 1]  # prompt 3 forked: n = 2
  for (lps, tops), (want_lps, want_tops) in zip(got, base):
    assert lps[0] is None and tops[0] is None and None not in lps[1:]
    np.testing.assert_allclose(lps[1:], want_lps[1:], rtol=0, atol=1e-5)
    assert [[i for i, _ in t] for t in tops[1:]] == [[i for i, _ in t] for t in want_tops[1:]]


@pytest.mark.parametrize("mesh", MESHES)
def test_mesh_produces_the_unsharded_greedy_tokens(run, mesh):
  base, got = run["engines"]["unsharded"], run["engines"][mesh]
  assert got["tokens"] == base["tokens"]
  assert got["reasons"] == base["reasons"]
  assert len(got["tokens"]) == 21  # 20 prompts, one with n = 2
  diff = max(abs(a - b) for x, y in zip(got["logprobs"], base["logprobs"])
             for a, b in zip(x, y))
  if mesh == "1x1":  # one data shard, m = 1: the unsharded computation exactly
    assert diff == 0.0
  else:  # psum changes the order of the head / MLP-column sums only
    assert diff < 1e-5, diff
  # the fork's top-4 log-probs (each shard's rows of the call's report, merged)
  top = lambda r: [[pair for token in c for pair in token] for c in r["top"]]
  assert [len(c) for c in base["top"]] == [0, 0, 10, 10] + [0] * 17
  assert [[t[0][0] for t in c] for c in base["top"][2:4]] == base["tokens"][2:4]  # greedy
  assert [[i for i, _ in c] for c in top(got)] == [[i for i, _ in c] for c in top(base)]
  np.testing.assert_allclose([[v for _, v in c] for c in top(got)][2:4],
                             [[v for _, v in c] for c in top(base)][2:4], atol=1e-5)
  assert got["num_free_blocks"] == got["num_blocks"] == 128  # every shard freed its pool
  assert got["generated_tokens"] == sum(len(t) for t in base["tokens"])
  assert base["reasons"][6] == ["stop", 73]  # request 5 (after 2's two) meets its stop id
  assert got["stats_after_reset"] == 0


def test_abandoned_stream_frees_every_shard(run):
  assert run["engines"]["8x1"]["free_after_abort"] == 128


@pytest.mark.parametrize("mesh, devices_per_copy", [("1x1", 1), ("2x4", 8), ("1x8", 4),
                                                    ("8x1", 8)])
def test_kv_bytes_per_device(run, mesh, devices_per_copy):
  # Pool: L=2 layers, K=4 KV heads, N=128 blocks of Z=4 tokens, D=16, float32, K and V:
  # 2 * 2 * 4 * 128 * 4 * 16 * 4 B = 524288 B. Each device holds 1 / (d * min(m, K)) of it:
  # (2, 4) -> 1/8; (1, 8) -> K=4 < m=8, each KV head stored twice -> 1/4; (8, 1) -> 1/8.
  got = run["engines"][mesh]
  assert got["kv_total_bytes"] == 524288
  assert got["kv_bytes_per_device"] == [524288 // devices_per_copy]  # every device alike
  assert got["kv_expected_per_device"] == 524288 // devices_per_copy
  d, m = (int(x) for x in mesh.split("x"))
  assert got["num_devices_holding_kv"] == d * m
  assert got["replication"] == max(1, m // 4)
  # Global pages [d, L, K', N/d, Z, D]: each shard's own pool, K' = K * replication heads.
  assert got["cache_shape"] == [d, 2, 4 * max(1, m // 4), 128 // d, 4, 16]


def test_no_collective_moves_the_cache(run):
  # The largest collectives of the (2, 4) device call: the report's top-logprob rings
  # gathered once a call ([d, S/d, steps, 20] = [2, 8, 8, 20]) and the psum of a [T, E] =
  # [16, 64] activation; nothing near a device's pages (2 * 1 * 64 * 4 * 16 elements) moves.
  from paged_jax.sampling import MAX_TOP_LOGPROBS
  sizes = run["engines"]["2x4"]["collective_elems"]
  assert sizes[-2:] == [16 * 64, 2 * 8 * 8 * MAX_TOP_LOGPROBS]
  assert sizes[-1] < run["engines"]["2x4"]["local_pages_elems"]


def test_checkpoint_tensors_load_onto_their_model_slices(run):
  # H=8, K=4, I=96 over m=4: q heads, KV heads and MLP columns split where loaded; over
  # m=8 the K axis (4 heads) stays whole until the engine replicates it.
  got = run["load_placements"]
  assert got["2x4"]["q_EHD"] == ["None", "None", "model", "None"]  # [L, E, H, D]
  assert got["2x4"]["k_EKD"] == ["None", "None", "model", "None"]
  assert got["2x4"]["down_IE"] == ["None", "model", "None"]
  assert got["1x8"]["q_EHD"] == ["None", "None", "model", "None"]
  assert got["1x8"]["k_EKD"] == ["None", "None", "None", "None"]
  assert got["2x4"]["equal"] and got["1x8"]["equal"]


@pytest.mark.parametrize("case", ["4", "8", "8_mqa", "4_pallas_gpu", "4_pallas_tpu"])
def test_sharded_paged_forward_matches_unsharded(run, case):
  got = run["forward"][case]
  assert got["logits_rel"] < 1e-5 and got["k_rel"] < 1e-5 and got["v_rel"] < 1e-5, got
  assert got["replicas_equal"]  # every copy of a replicated KV head holds the same K/V
  assert got["local_heads"] == 1  # m=4, K=4: one head each; m=8, K=4 or 1: one slot each


@pytest.mark.parametrize("case, words", [
    ("axis_names", ("mesh.axis_names=('x', 'y')", "('data', 'model')")),
    ("heads", ("mesh.shape['model']=3", "num_heads=8")),
    ("kv_heads", ("mesh.shape['model']=4", "num_kv_heads=6")),
    ("mlp", ("mesh.shape['model']=4", "mlp_dim=90")),
    ("not_a_mesh", ("mesh=str", "jax.sharding.Mesh")),
    ("max_seqs", ("max_seqs=15", "mesh.shape['data']=2")),
    ("num_blocks", ("num_blocks=100", "mesh.shape['data']=8")),
    ("n", ("params[0].n=3", "8 data shards")),
    # The pool a budget buys must split over the data shards (named "num_blocks=3" before).
    ("budget", ("kv_budget_bytes=", "holds 3 KV block(s)", "8 data shards")),
])
def test_bad_mesh_or_sizes_raise_value_error(run, case, words):
  message = run["errors"][case]
  assert message is not None, case
  for w in words:
    assert w in message, message


# --- host-side pieces, one device ---


def test_pick_slots_balances_and_keeps_a_request_in_one_shard():
  # 3 shards of 4 slots: shard 0 = 0..3, shard 1 = 4..7, shard 2 = 8..11.
  free = [1, 2, 4, 5, 6, 9]  # free counts: shard 0 -> 2, shard 1 -> 3, shard 2 -> 1
  assert sharding.pick_slots(free, 2, 4) == [4, 5]  # the emptiest shard
  assert sharding.pick_slots(free, 3, 4) == [4, 5, 6]
  assert sharding.pick_slots(free, 4, 4) is None  # 6 free in all, but no shard has 4
  assert sharding.pick_slots([1, 2, 9, 10], 2, 4) == [1, 2]  # tie: the lowest shard
  assert sharding.pick_slots([], 1, 4) is None
  # One shard: exactly the first n free slots, as the unsharded engine takes them.
  assert sharding.pick_slots([3, 5, 8], 2, 16) == [3, 5]


def _plan(m=1, k=2, h=4, i=96):
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
  plan = sharding.ShardingPlan.create(mesh, num_heads=h, num_kv_heads=k, mlp_dim=i)
  return plan


def test_param_specs_follow_the_glossary_letters():
  plan = _plan()
  assert plan.param_spec("q_EHD", 4) == P(None, None, "model", None)  # stacked L first
  assert plan.param_spec("k_EKD", 4) == P(None, None, "model", None)
  assert plan.param_spec("o_HDE", 4) == P(None, "model", None, None)
  assert plan.param_spec("gate_EI", 3) == P(None, None, "model")
  assert plan.param_spec("down_IE", 3) == P(None, "model", None)
  assert plan.param_spec("k_bias_KD", 3) == P(None, "model", None)
  assert plan.param_spec("o_bias_E", 2) == P(None, None)  # added once, after the psum
  assert plan.param_spec("embed_VE", 2) == P(None, None)  # replicated
  assert plan.param_spec("lm_head_EV", 2) == P(None, None)
  assert plan.param_spec("scale_E", 2) == P(None, None)
  assert plan.param_spec("impl", 0) == P()


def test_kv_bytes_formula():
  # total / (d * min(m, K)); a (1, 1) plan keeps everything on one device.
  plan = _plan()
  assert plan.replication == 1 and plan.kv_head_slots == 2
  assert plan.kv_bytes_per_device(1 << 20) == 1 << 20


def test_report_merge():
  report = dict(len_S=jnp.arange(6).reshape(2, 3), tokens_SK=jnp.ones((2, 3, 4)),
                steps=jnp.array([5, 7]), generated=jnp.array([10, 20]))
  merged = {k: sharding._merge(k, x) for k, x in report.items()}
  assert merged["len_S"].tolist() == [0, 1, 2, 3, 4, 5]  # slot = shard * S/d + s
  assert merged["tokens_SK"].shape == (6, 4)
  assert int(merged["steps"]) == 7  # shards step side by side
  assert int(merged["generated"]) == 30


def test_mesh_validation_in_process():
  config = ModelConfig(model_type="llama", vocab_size=64, embed_dim=32, mlp_dim=48,
                       num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                       max_seq_len=64)
  model = init_random(config, impl="xla")
  with pytest.raises(ValueError, match=r"mesh.axis_names=\('model', 'x'\)"):
    LLM(model, config, mesh=Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("model", "x")),
        num_blocks=16, max_seqs=2)
  with pytest.raises(ValueError, match="mesh=ndarray"):
    LLM(model, config, mesh=np.array(jax.devices()[:1]), num_blocks=16, max_seqs=2)
  # jax.make_mesh's default axes are Explicit, over which the engine's sharding constraints
  # fail deep in JAX at the first generate; the plan takes the same mesh with Auto axes
  # (the 2x4 engine of the subprocess above is built from such a mesh, and serves).
  explicit = jax.make_mesh((1, 1), (sharding.DATA, sharding.MODEL),
                           axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  plan = LLM(model, config, mesh=explicit, num_blocks=16, max_seqs=2)._plan
  assert plan.mesh.axis_types == (jax.sharding.AxisType.Auto,) * 2
  assert plan.mesh.devices.tolist() == explicit.devices.tolist()


def test_with_model_axis_copies_and_keeps_the_original():
  config = ModelConfig(model_type="llama", vocab_size=64, embed_dim=32, mlp_dim=48,
                       num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                       max_seq_len=64)
  model = init_random(config, impl="xla")
  copy = model.with_model_axis("model")
  assert copy.model_axis == "model" and model.model_axis is None
  with pytest.raises(ValueError, match="model_axis=3"):
    model.with_model_axis(3)


@pytest.mark.slow  # a benchmark's quick mode: CI runs it after README's suite
def test_benchmark_quick_mode(tmp_path):
  # The benchmark sets XLA_FLAGS itself before importing JAX: run it as a script.
  out = tmp_path / "rows.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "benchmarks/sharding.py", "--quick", "--json",
                         str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  rows = json.loads(out.read_text())
  assert [r["data_shards"] for r in rows] == [1, 8]
  for r in rows:
    assert r["tokens_per_s"] > 0 and r["slots_per_shard"] == 2  # never a timing assertion
  assert "| weak | 8 |" in proc.stdout
