"""The capacity planner and the ``paged-jax plan`` command."""

from __future__ import annotations

import json
import pathlib
import tempfile

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import KVCacheSpec, cli, models, planner


@pytest.mark.parametrize("text,expected", [("16GiB", 16 * 2**30), ("8GB", 8 * 10**9),
                                           ("1.5e9", 1_500_000_000), (4096, 4096),
                                           ("512 MiB", 512 * 2**20), ("2PiB", 2**51),
                                           ("3PB", 3 * 10**15)])
def test_parse_bytes(text, expected):
  assert planner.parse_bytes(text) == expected


def test_parse_bytes_names_the_bound_for_any_unit():
  # "10EiB" was "must be a size like '16GiB'" (the unit unknown), "99999999999GiB" the bound.
  for text in ("10EiB", "2EB", "99999999999GiB"):
    with pytest.raises(ValueError, match=r"must be below 1 EiB"):
      planner.parse_bytes(text)


@pytest.mark.parametrize("text", ["lots", "16XB", ""])
def test_parse_bytes_rejects(text):
  with pytest.raises(ValueError, match="budget="):
    planner.parse_bytes(text)


def test_hand_computed_plan():
  # 10 blocks of Z=4 -> 40 tokens. With sigma 0 every length is the median, 6 tokens.
  # paged: 2 blocks (8 tokens) each -> 5 sequences, 30 / 40 = 75% utilisation.
  # max length 20: 2 sequences, 12 / 40 = 30%. oracle: floor(40 / 6) = 6 sequences, 100%.
  spec = KVCacheSpec(1, 1, 8, 4, 10, jnp.float32)
  plan = planner.plan_capacity(spec, planner.LengthDistribution(median_len=6, sigma=0.0,
                                                                max_len=20))
  assert (plan.paged.num_seqs, plan.paged.tokens_held, plan.paged.tokens_reserved) == (5, 30, 40)
  assert plan.paged.utilization == 0.75
  assert (plan.contiguous_max.num_seqs, plan.contiguous_max.utilization) == (2, 0.3)
  assert (plan.contiguous_oracle.num_seqs, plan.contiguous_oracle.utilization) == (6, 1.0)


def test_paged_waste_is_bounded_by_one_block_per_sequence():
  spec = KVCacheSpec(32, 8, 128, 16, 4096, jnp.bfloat16)
  plan = planner.plan_capacity(spec, planner.LengthDistribution(seed=3))
  waste = plan.paged.tokens_reserved - plan.paged.tokens_held
  assert waste < plan.paged.num_seqs * spec.block_size
  assert plan.contiguous_max.num_seqs <= plan.paged.num_seqs <= plan.contiguous_oracle.num_seqs
  assert plan.paged.tokens_reserved <= spec.max_tokens


def test_capacity_samples_only_what_fits():
  # The stream is drawn in growing draws until every strategy overflows: the same counts
  # as fitting the whole max_tokens + 1 stream, without holding it (a 100 TiB budget of a
  # real model is 1e9 lengths).
  spec = KVCacheSpec(2, 1, 8, 16, 20000, jnp.bfloat16)  # 320,000 tokens
  dist = planner.LengthDistribution(median_len=32, sigma=1.0, max_len=1024, seed=4)
  plan = planner.plan_capacity(spec, dist)
  stream = dist.sample(spec.max_tokens + 1)
  for placement, reserved in ((plan.paged, -(-stream // 16) * 16),
                              (plan.contiguous_max, np.full_like(stream, 1024)),
                              (plan.contiguous_oracle, stream)):
    n, held, used = planner._fit_prefix(stream, reserved, spec.max_tokens)
    assert (placement.num_seqs, placement.tokens_held, placement.tokens_reserved) == (
        n, held, used)
  assert plan.contiguous_oracle.num_seqs > 4096  # more than the first draw holds


def test_cli_plan_huge_budget_and_a_closed_pipe(tmp_path):
  import subprocess
  import sys
  run = lambda cmd: subprocess.run(["bash", "-c", cmd], capture_output=True, text=True,
                                   timeout=120)
  python = f"{sys.executable} -m paged_jax.cli plan"
  big = run(f"{python} --budget 100TiB")
  assert big.returncode == 0 and "| paged |" in big.stdout, big.stderr
  closed = run(f"{python} | true")  # the reader left at once: no traceback
  assert closed.stderr == "", closed.stderr
  # A config named by a relative path: the model is named after its folder.
  (tmp_path / "config.json").write_text(json.dumps(
      dict(num_attention_heads=4, num_hidden_layers=2, hidden_size=256)))
  named = run(f"cd {tmp_path} && {python} --config config.json")
  assert f"model      : {tmp_path.name}: L=2" in named.stdout, named.stderr


def test_length_distribution_is_seeded_and_clipped():
  dist = planner.LengthDistribution(median_len=100, sigma=2.0, max_len=300, seed=1)
  a, b = dist.sample(1000), dist.sample(1000)
  np.testing.assert_array_equal(a, b)
  assert a.min() >= 1 and a.max() <= 300
  with pytest.raises(ValueError, match="median_len"):
    planner.LengthDistribution(median_len=0)


def test_model_shape_from_config(tmp_path):
  config = dict(num_attention_heads=32, num_hidden_layers=4, hidden_size=2048,
                num_key_value_heads=4, torch_dtype="float16")
  (tmp_path / "config.json").write_text(json.dumps(config))
  shape = planner.model_shape_from_config(tmp_path)
  assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (4, 4, 64)
  assert shape.dtype == jnp.float16
  (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
  with pytest.raises(ValueError, match="num_attention_heads"):
    planner.model_shape_from_config(tmp_path)
  with pytest.raises(FileNotFoundError, match="config="):
    planner.model_shape_from_config(tmp_path / "missing")


def test_cli_plan_default_and_config(tmp_path, capsys):
  assert cli.main(["plan"]) == 0
  out = capsys.readouterr().out
  assert "per block  : 2097152 bytes" in out and "blocks     : 8192" in out
  assert "| paged |" in out and "| contiguous, max length | 32 |" in out
  config = dict(num_attention_heads=4, num_hidden_layers=2, hidden_size=256,
                torch_dtype="bfloat16")
  (tmp_path / "config.json").write_text(json.dumps(config))
  assert cli.main(["plan", "--config", str(tmp_path), "--budget", "64MiB",
                   "--block-size", "8", "--max-len", "512", "--median-len", "64"]) == 0
  out = capsys.readouterr().out
  # 2 * 2 layers * 4 heads * 64 dims * 2 bytes = 2048 bytes per token; 16 KiB per block.
  assert "per token  : 2048 bytes" in out and "per block  : 16384 bytes" in out


def test_cli_plan_errors_exit_2(capsys):
  # Each named by the option (they named the planner's budget_bytes / budget), and a
  # config.json that is a directory is an error line, not IsADirectoryError's traceback.
  # One block of the Llama-3-8B shape: 2 * 32 layers * 8 heads * 128 dims * 16 * 2 bytes.
  for argv, message in ((["--budget", "10"], "--budget=10 is smaller than one KV block "
                         "(2097152 bytes at --block-size 16)"),
                        (["--budget", "1e300"], "--budget='1e300' must be below 1 EiB"),
                        (["--budget", "lots"], "--budget='lots' must be a size like"),
                        (["--config", "DIR"], "config.json' is not a file")):
    if argv[0] == "--config":
      folder = pathlib.Path(tempfile.mkdtemp())
      (folder / "config.json").mkdir()
      argv = ["--config", str(folder)]
    with pytest.raises(SystemExit) as exc:
      cli.main(["plan", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_cli_plan_says_what_the_options_override(tmp_path, capsys):
  # The model line kept the default's title under overrides, and --num-layers dropped a
  # config's sliding-window pattern without a word; sizes under 1 GiB read as 0.00 GiB.
  assert cli.main(["plan", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "32",
                   "--dtype", "float32", "--budget", "1MiB"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("model      : Llama-3-8B shape (embedded default) with --num-layers 2, "
                        "--num-kv-heads 2, --head-dim 32, --dtype float32: L=2 K=2 D=32")
  assert "budget     : 1.0 MiB (1048576 bytes)" in out
  assert "per block  : 16384 bytes (16.0 KiB)" in out and "(1.0 MiB used)" in out
  config = dict(model_type="gemma3_text", num_hidden_layers=6, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, hidden_size=32, sliding_window=8)
  (tmp_path / "config.json").write_text(json.dumps(config))
  assert cli.main(["plan", "--config", str(tmp_path), "--num-layers", "12",
                   "--budget", "1MiB"]) == 0
  out = capsys.readouterr().out
  assert ("--num-layers 12 differs from the config's 6 layers: its per-layer sliding-window "
          "pattern no longer applies, every layer is planned as full attention") in out


def test_cli_plan_shows_per_layer_kv_cost_of_sliding_and_full_layers(tmp_path, capsys):
  # Gemma 3 1B's attention shape: 26 layers, 5 sliding (window 512) to 1 full (the default
  # pattern when the config lists no layer_types), K=1, D=256, bfloat16.
  config = dict(model_type="gemma3_text", num_hidden_layers=26, num_attention_heads=4,
                num_key_value_heads=1, head_dim=256, hidden_size=1152, sliding_window=512,
                torch_dtype="bfloat16")
  (tmp_path / "config.json").write_text(json.dumps(config))
  assert cli.main(["plan", "--config", str(tmp_path), "--block-size", "16",
                   "--budget", "64MiB"]) == 0
  out = capsys.readouterr().out
  # One layer's block: 2 (K and V) * 16 tokens * 1 head * 256 dims * 2 bytes = 16384 bytes.
  assert "| 22 (0, 1, 2, 3, 4, 6, ...) | sliding, window 512 | 16384 bytes | 360448 bytes |" in out
  assert "| 4 (5, 11, 17, 23) | full | 16384 bytes | 65536 bytes |" in out
  assert "per block  : 425984 bytes" in out  # 26 * 16384: sliding layers hold every block
  # KV groups: gcd(22, 4) = 2 layers per group, 11 sliding and 2 full groups; a group's
  # token costs 2 * 2 * 1 * 256 * 2 = 2048 bytes, its block 32768 bytes (64 MiB: 2048).
  assert "KV groups  : 13 groups of 2 layers, one pool of 2048 blocks of 32768 bytes" in out
  assert "| sliding, window 512 | 11 | 2048 bytes |" in out and "| full | 2 | 2048 bytes |" in out
  # Without freeing a 64 MiB pool holds 157 blocks of 16 tokens of all 26 layers.
  assert "| without (every layer holds every block) |" in out
  assert "| with (sliding groups hold their window) |" in out
  # A plain Llama config: one row, no note.
  (tmp_path / "config.json").write_text(json.dumps(dict(
      model_type="llama", num_hidden_layers=2, num_attention_heads=4, hidden_size=256)))
  assert cli.main(["plan", "--config", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert "| 2 (0, 1) | full |" in out and "KV groups" not in out


def test_plan_windowed_gemma3_like_5_to_1_at_8k():
  # 6 layers, 5 sliding (window 1024) to 1 full, K = 1, D = 128, bfloat16, Z = 16: one
  # layer's block = 2 * 16 * 128 * 2 = 8192 bytes. Budget: 10 whole 8192-token sequences
  # without freeing = 10 * 512 blocks * 6 layers * 8192 bytes.
  model = planner.ModelShape(num_layers=6, num_kv_heads=1, head_dim=128,
                             layer_types=("sliding_attention",) * 5 + ("full_attention",),
                             sliding_window=1024)
  budget = 10 * 512 * 6 * 8192
  dist = planner.LengthDistribution(median_len=8192, sigma=0.0, max_len=8192)
  plan = planner.plan_windowed(model, budget, 16, dist)
  assert plan.groups.windows == (1024,) * 5 + (None,) and plan.group_spec.num_blocks == 30720
  # With freeing a sequence holds 512 full blocks + 5 * (ceil(1024 / 16) + 1) = 837 blocks:
  # 30720 // 837 = 36 sequences, 3.6x the 10 without.
  assert plan.without.num_seqs == 10 and plan.with_.num_seqs == 36
  assert "| with (sliding groups hold their window) | 36 | 3.60x |" in planner.format_windowed(
      plan)


def test_plan_notes_what_it_assumed_of_an_unknown_config(tmp_path, capsys):
  # An int4 torch_dtype is planned as float32 (load_pretrained loads a dtype it does not
  # know as float32) and an unknown model_type from its attention shape; both said under
  # the model line, the dtype note gone once --dtype chooses.
  (tmp_path / "config.json").write_text(json.dumps(dict(
      model_type="mamba_like", num_hidden_layers=2, num_attention_heads=4, hidden_size=256,
      torch_dtype="int4")))
  assert cli.main(["plan", "--config", str(tmp_path)]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0].endswith("L=2 K=4 D=64 dtype=float32")
  assert out[1].startswith("note       : the config's dtype 'int4' is not a float dtype; "
                           "planned as float32")
  assert out[2].startswith("note       : model_type='mamba_like' is not a family")
  assert "gemma3_text" in out[2] and out[3].startswith("budget")
  assert cli.main(["plan", "--config", str(tmp_path), "--dtype", "float16"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0].endswith("dtype=float16") and "model_type='mamba_like'" in out[1]
  assert out[2].startswith("budget")
  # A known family in a float dtype: no note.
  (tmp_path / "config.json").write_text(json.dumps(dict(
      model_type="qwen3", num_hidden_layers=2, num_attention_heads=4, hidden_size=256,
      torch_dtype="float32")))
  assert planner.model_shape_from_config(tmp_path).notes == ()


def test_a_config_without_dtype_is_planned_as_the_engine_serves_it(tmp_path, capsys):
  # No torch_dtype / dtype: load_pretrained loads float32, so the engine's pool holds half
  # the blocks a bfloat16 plan promised (36 against 73 in 300,000 bytes). The plan now
  # says float32, the engine's own count, and notes why.
  # L=4, K=2, D=16, float32: 2 * 4 * 2 * 16 * 4 = 1024 bytes a token, 8192 a block of 8.
  (tmp_path / "config.json").write_text(json.dumps(dict(
      model_type="llama", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
      hidden_size=64, intermediate_size=96, vocab_size=64)))
  assert cli.main(["plan", "--config", str(tmp_path), "--budget", "300000",
                   "--block-size", "8"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0].endswith("L=4 K=2 D=16 dtype=float32")
  assert out[1].startswith("note       : config.json declares no dtype; planned as float32")
  assert "per block  : 8192 bytes" in out[4] and out[5].startswith("blocks     : 36 ")
  model = planner.model_shape_from_config(tmp_path)
  engine_spec = KVCacheSpec.from_budget(300000, model.num_layers, model.num_kv_heads,
                                        model.head_dim, 8, models.loader._default_dtype(
                                            models.ModelConfig.from_json(
                                                str(tmp_path / "config.json"))))
  assert engine_spec.num_blocks == 36


@pytest.mark.parametrize("fields, match", [
    (dict(num_attention_heads=0), "num_attention_heads=0 must be an int >= 1"),
    (dict(num_attention_heads="abc"), "num_attention_heads='abc' must be an int >= 1"),
    (dict(num_key_value_heads=0), "num_key_value_heads=0 must be an int >= 1"),
    (dict(num_attention_heads=-32), "num_attention_heads=-32"),
    (dict(hidden_size=None), "hidden_size=None"),
    (dict(num_attention_heads=128), r"head_dim=0 \(hidden_size / num_attention_heads"),
])
def test_config_fields_are_refused_by_their_keys(tmp_path, fields, match):
  # Before: a ZeroDivisionError, int()'s message naming nothing, and a K of 0 quietly
  # taken as num_attention_heads.
  config = dict(model_type="llama", num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, hidden_size=64)
  (tmp_path / "config.json").write_text(json.dumps({**config, **fields}))
  with pytest.raises(ValueError, match=match):
    planner.model_shape_from_config(tmp_path)


def test_budgets_past_what_the_plan_can_draw_are_refused_in_one_line(capsys):
  # 1e309 was an OverflowError traceback; 1e17 bytes drew lengths until out of memory.
  for args, match in ((["--budget", "1e309"], "must be below 1 EiB"),
                      (["--budget", "1e400GiB"], "must be below 1 EiB"),
                      (["--budget", "1e17"], "--budget=1e17 holds 47683715820 KV blocks "
                                             "of 16 tokens, more than int32 slot ids address"),
                      (["--budget", "20TiB", "--median-len", "1", "--sigma", "0",
                        "--max-len", "1"], "holds more than 8,388,608 sequences"),
                      (["--seed=-1"], "--seed=-1 must be >= 0"),
                      (["--max-len=0"], "--max-len=0 must be >= 1")):
    with pytest.raises(SystemExit) as exc:
      cli.main(["plan", *args])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and match in err and "Traceback" not in err, err


def test_a_ratio_to_nothing_is_not_a_ratio():
  # 16 GiB of Llama-3-8B holds no max-length sequence of 131,072 tokens (16 GiB); paged
  # holds some. "vs max-length" said 45.00x (a division by max(0, 1)); now n/a.
  spec = KVCacheSpec.from_budget(4 * 2**30, 32, 8, 128, 16, jnp.bfloat16)
  dist = planner.LengthDistribution(max_len=131072)
  plan = planner.plan_capacity(spec, dist)
  assert plan.contiguous_max.num_seqs == 0 and plan.paged.num_seqs > 0
  table = planner.format_plan(plan, planner.LLAMA3_8B, 4 * 2**30)
  assert f"| paged | {plan.paged.num_seqs} |" in table and "| n/a |" in table


def test_a_multimodal_config_is_planned_from_its_text_config(tmp_path):
  # Gemma 3 27B as published: the attention shape lives under text_config; the plan said
  # "lacks 'num_attention_heads'". The dtype is the outer config's.
  (tmp_path / "config.json").write_text(json.dumps(dict(
      model_type="gemma3", torch_dtype="bfloat16",
      text_config=dict(model_type="gemma3_text", num_hidden_layers=62, num_attention_heads=32,
                       num_key_value_heads=16, head_dim=128, hidden_size=5376,
                       sliding_window=1024),
      vision_config=dict(num_attention_heads=16, hidden_size=1152))))
  model = planner.model_shape_from_config(tmp_path)
  assert (model.num_layers, model.num_kv_heads, model.head_dim) == (62, 16, 128)
  assert jnp.dtype(model.dtype) == jnp.bfloat16 and model.unknown_dtype is None
  # Gemma 3's default pattern: every 6th layer full, the others slide (52 of 62).
  assert model.layer_types.count("sliding_attention") == 52 and model.sliding_window == 1024
  assert len(model.notes) == 1 and "multimodal: planned from its text_config" in model.notes[0]


def test_a_sparse_gemma3_text_config_takes_transformers_defaults(tmp_path):
  # Gemma 3 4B as published lists only what differs from transformers' Gemma3TextConfig:
  # no heads, no head_dim ("lacks 'num_attention_heads'" before); defaults 8, 4 and 256.
  (tmp_path / "config.json").write_text(json.dumps(dict(
      model_type="gemma3", torch_dtype="bfloat16", eos_token_id=[1, 106],
      text_config=dict(model_type="gemma3_text", hidden_size=2560, intermediate_size=10240,
                       num_hidden_layers=34, sliding_window=1024,
                       rope_scaling=dict(factor=8.0, rope_type="linear")))))
  model = planner.model_shape_from_config(tmp_path)
  assert (model.num_layers, model.num_kv_heads, model.head_dim) == (34, 4, 256)
  assert model.layer_types.count("full_attention") == 5 and model.sliding_window == 1024
  assert "the text decoder load_pretrained serves" in model.notes[0]
  config = models.ModelConfig.from_json(tmp_path)  # what load_pretrained would build
  assert (config.model_type, config.num_heads, config.vocab_size) == ("gemma3_text", 8, 262_208)
  assert config.eos_token_ids == (1, 106) and config.rope_scaling == models.LinearRopeScaling(8.0)


def test_a_config_file_is_named_after_itself_and_its_model_type(tmp_path, capsys):
  # "cfg/gemma2.json" was planned as "cfg" (its folder), and the window's formula read
  # "ceil((4096 - 1 + 1) / Z) + 1"; a median above the maximum was clipped silently.
  (tmp_path / "gemma2.json").write_text(json.dumps(dict(
      model_type="gemma2", num_attention_heads=8, num_key_value_heads=4, head_dim=256,
      num_hidden_layers=4, hidden_size=2304, sliding_window=4096, torch_dtype="bfloat16")))
  assert cli.main(["plan", "--config", str(tmp_path / "gemma2.json"), "--median-len",
                   "9000"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("model      : gemma2.json (gemma2): L=4 K=4 D=256"), out
  assert "min(ceil(n / Z), ceil(4096 / Z) + 1)" in out, out
  assert ("note       : the median 9000 is above the maximum 4096: most lengths are clipped "
          "to the maximum") in out, out
