"""The engine with KV groups: sliding-window layers give back the blocks behind their window
(``LLM(..., free_outside_window=True)``, ``paged_jax.kv_groups``).

- An all-sliding tiny Mistral (window 16, blocks of 4) generates 200 tokens from a 20-token
  prompt in a pool of 12 blocks (48 tokens), token for token as transformers' ``generate``.
- A Gemma-3-like hybrid (5 sliding layers to 1 full) at a byte budget that holds 8
  sequences of ~150 tokens only when the sliding layers hold just their window: no
  preemption, and the tokens of a run with an unlimited budget; at a third of that budget
  sequences are preempted (every group released) and recomputed, tokens unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from paged_jax import allocator, models  # noqa: E402
from paged_jax.engine import LLM, SamplingParams  # noqa: E402
from paged_jax.kv_groups import KVGroups, sliding_blocks  # noqa: E402
from tests.models import helpers  # noqa: E402


def test_kv_groups_of_layer_patterns():
  # Gemma 3's 5:1 over 6 layers: gcd(5, 1) = 1 layer per group, six groups.
  g = KVGroups.from_layer_windows((16,) * 5 + (None,))
  assert g.windows == (16,) * 5 + (None,) and g.layers_per_group == 1
  assert g.group_of_layer == (0, 1, 2, 3, 4, 5) and g.slot_of_layer == (0,) * 6
  # Gemma 2's alternation over 4 layers: 2 layers per group, one group per kind.
  g = KVGroups.from_layer_windows((8, None, 8, None))
  assert g.windows == (8, None) and g.layers_per_group == 2
  assert g.group_of_layer == (0, 1, 0, 1) and g.slot_of_layer == (0, 0, 1, 1)
  # One kind: the plain layout; without freeing: one full group whatever the kinds.
  assert KVGroups.from_layer_windows((8, 8, 8)).windows == (8,)
  assert KVGroups.from_layer_windows((8, None), free_outside_window=False).windows == (None,)
  # Window 16, Z = 4, 20 tokens a step: positions L - 15 .. L + 19 span 35 tokens, at most
  # ceil(35 / 4) + 1 = 10 blocks.
  assert sliding_blocks(16, 4, 20) == 10
  g = KVGroups.from_layer_windows((16, 16))
  assert g.blocks_held(220, 4, 20) == 10 and g.max_len_in_pool(12, 4, 20, 256) == 256
  g = KVGroups.from_layer_windows((16, None))
  assert g.blocks_held(40, 4, 20) == 10 + 10 and g.max_len_in_pool(20, 4, 20, 256) == 40
  # A window must be an int >= 1 (0, -2, 2.5 were taken, and failed later in the
  # allocator naming its own windows[0]).
  for bad in (0, -2, 2.5, "x", True):
    with pytest.raises(ValueError, match=r"layer_windows\[1\]=.* must be None \(full "
                                         r"attention\) or an int window >= 1"):
      KVGroups.from_layer_windows((8, bad))


def test_for_layer_refuses_a_layer_past_the_groups():
  # With groups, metadata.for_layer(L) returned layer L - 1's cache layer, slots and
  # tables (indexing clamps): an off-by-one loop read and wrote another layer's K/V.
  from paged_jax import AttentionMetadata
  g = KVGroups.from_layer_windows((8, None, 8, None))
  group_L, cache_layer_L = g.layer_arrays()
  tables_gSP = jnp.arange(2 * 2 * 3, dtype=jnp.int32).reshape(2, 2, 3)
  slots_gT = jnp.arange(2 * 5, dtype=jnp.int32).reshape(2, 5)
  m = AttentionMetadata(slots_T=slots_gT[0], kv_lens_S=jnp.zeros(2, jnp.int32),
                        block_tables_SP=tables_gSP[0], cu_q_lens=jnp.zeros(3, jnp.int32),
                        num_seqs=jnp.int32(2), block_tables_gSP=tables_gSP, slots_gT=slots_gT,
                        group_L=group_L, cache_layer_L=cache_layer_L)
  cache_layer, slots_T, tables_SP = m.for_layer(3)
  assert int(cache_layer) == 1 and (slots_T == slots_gT[1]).all()
  for layer in (4, 10, -1):
    with pytest.raises(ValueError, match=rf"layer={layer} must be in \[0, L=4\)"):
      m.for_layer(layer)
  # Traced: a cache layer of -1, which cache.write and paged_attention treat as nothing.
  traced = jax.jit(lambda layer: m.for_layer(layer)[0])
  assert int(traced(jnp.int32(2))) == 1 and int(traced(jnp.int32(4))) == -1


def test_a_window_of_the_whole_context_is_full_attention_to_the_engine():
  # Mistral's 4096 window served at a 4096 context hides no key: it made a sliding group
  # (a mixed model: two groups for nothing) and turned prefix caching off (all sliding).
  from paged_jax.kv_groups import layer_windows_of
  for window, kinds in ((64, (None,)), (10**6, (None,)), (63, (63,))):
    config = models.ModelConfig(model_type="mistral", vocab_size=64, embed_dim=32,
                                mlp_dim=48, num_layers=2, num_heads=2, num_kv_heads=1,
                                head_dim=16, max_seq_len=64, sliding_window=window,
                                layer_types=("sliding_attention",) * 2)
    assert layer_windows_of(config) == kinds * 2
    llm = LLM(models.init_random(config, seed=0, impl="xla"), config, block_size=4,
              kv_budget_bytes=2 * 2 * 4 * 16 * 4 * 40, max_seqs=2)  # windowed freeing
    assert llm.kv_groups.windows == kinds
    assert llm.stats["prefix_caching"] is (kinds == (None,))


def _hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
  with torch.no_grad():
    return hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             min_new_tokens=max_tokens)[0, len(prompt):].tolist()


def _hf_model(model_type: str, seed: int = 0, **overrides):
  hf_dict = helpers.hf_config_dict(model_type, **overrides)
  del hf_dict["model_type"]
  if model_type.startswith("gemma"):
    del hf_dict["hidden_act"]
  config = transformers.AutoConfig.for_model(model_type, **hf_dict)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                        dtype=torch.float32)
  helpers.randomize_torch_model(model, seed)
  if config.tie_word_embeddings:
    model.tie_weights()
  return model.eval()


def test_all_sliding_model_generates_200_tokens_in_12_blocks(tmp_path):
  window, z, prompt_len, max_tokens = 16, 4, 20, 200
  hf_model = _hf_model("mistral", sliding_window=window, max_position_embeddings=256)
  hf_model.save_pretrained(tmp_path)
  prompt = [int(t) for t in np.random.default_rng(3).integers(3, helpers.VOCAB, prompt_len)]
  # The whole sequence needs ceil(220 / 4) = 55 blocks; 12 hold 48 tokens. Scrubbing zeroes
  # each block as the window leaves it: a block given back too early would change tokens.
  llm = LLM.from_pretrained(tmp_path, dtype="float32", impl="xla", block_size=z,
                            num_blocks=12, max_seqs=1, max_tokens_per_step=prompt_len,
                            token_buckets=(prompt_len,), steps_per_call=50,
                            free_outside_window=True, scrub_on_release=True)
  assert llm.kv_groups.windows == (window,) and llm.max_model_len == 256
  assert llm.stats["prefix_caching"] is False  # the allocator's rule, said in the stats
  out, = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
  assert len(out.token_ids) == max_tokens and llm.stats["preemptions"] == 0
  assert llm.stats["peak_blocks_in_use"] <= 12
  want = _hf_greedy(hf_model, prompt, max_tokens)
  assert list(out.token_ids) == want
  allocator.validate(llm.allocator_state)
  # Not vacuous: without the window transformers generates other tokens.
  hf_model.config.sliding_window = 10_000
  for layer in hf_model.model.layers:
    if hasattr(layer.self_attn, "sliding_window"):
      layer.self_attn.sliding_window = 10_000
  assert _hf_greedy(hf_model, prompt, max_tokens) != want


# Two engine compiles (~30 s on a quiet 2-core CPU): with the slow tests.
@pytest.mark.slow
def test_hybrid_model_holds_8_sequences_at_a_budget_only_with_windowed_freeing():
  # Gemma-3-like: 6 layers, 5 sliding (window 16) to 1 full; K = 2, D = 16, float32: a
  # token of one layer costs 2 * 2 * 16 * 4 = 256 B, a block of 8 tokens of one layer 2 KiB.
  window, z, num_layers = 16, 8, 6
  config = helpers.tiny_config("gemma3_text", num_hidden_layers=num_layers,
                               sliding_window=window, max_position_embeddings=256)
  assert config.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
  model = models.init_random(config, seed=0, impl="xla")
  rng = np.random.default_rng(5)
  prompts = [[int(t) for t in rng.integers(3, helpers.VOCAB, 130 + i)] for i in range(8)]
  params = SamplingParams(max_tokens=20, ignore_eos=True)
  seq_len = 130 + 7 + 20  # the longest: 157 tokens, ceil(157 / 8) = 20 blocks
  # Budget: 440 one-layer blocks. With windowed freeing a sequence holds at most
  # 20 + 5 * sliding_blocks(16, 8, 32) = 20 + 5 * 7 = 55 blocks; 8 of them <= 440.
  # Without it each holds 6 * 20 = 120 one-layer blocks: 8 need 960, over twice the budget.
  block_bytes = 2 * 2 * 16 * 4 * z
  budget = 440 * block_bytes
  groups = KVGroups.from_layer_windows((window,) * 5 + (None,))
  assert 8 * groups.blocks_held(seq_len, z, 32) <= 440 < 8 * num_layers * -(-seq_len // z)
  common = dict(block_size=z, max_seqs=8, max_tokens_per_step=32, token_buckets=(32,),
                steps_per_call=32)
  llm = LLM(model, config, kv_budget_bytes=budget, scrub_on_release=True, **common)
  assert llm.kv_groups.windows == groups.windows and llm.spec.num_blocks == 440
  assert llm.stats["kv_pool_bytes"] == budget
  outs = llm.generate(prompts, params)
  assert llm.stats["preemptions"] == 0
  allocator.validate(llm.allocator_state)
  ref = LLM(model, config, num_blocks=8 * 20, free_outside_window=False, **common)
  assert ref.kv_groups.plain and ref.spec.num_layers == num_layers
  want = ref.generate(prompts, params)
  assert ref.stats["preemptions"] == 0
  for got, exp in zip(outs, want):
    assert list(got.token_ids) == list(exp.token_ids)
  # A third of the budget, 60 tokens out: sequences are admitted on their first chunk,
  # then grow past the pool and are preempted (every group's blocks released) and
  # recomputed. (With 20 tokens out, the latest arrival holding its own chunk back now
  # spares it: no preemption at all.)
  longer = SamplingParams(max_tokens=60, ignore_eos=True)
  small = LLM(model, config, kv_budget_bytes=150 * block_bytes, **common)
  outs = small.generate(prompts, longer)
  assert small.stats["preemptions"] > 0
  allocator.validate(small.allocator_state)
  for got, exp in zip(outs, ref.generate(prompts, longer)):
    assert list(got.token_ids) == list(exp.token_ids)
  # The same budget without freeing holds 73 blocks of 8 tokens of all 6 layers: fewer
  # than 4 whole sequences of 20 blocks at once (the planner's figure, not run here).
  assert budget // (num_layers * block_bytes) == 73 < 4 * 20


def test_debug_mode_accepts_blocks_given_back_behind_the_window():
  # One sequence, kv_len 20, its last 4 tokens queried (positions 16..19), Z = 4, W = 6:
  # the first query sees positions 11.. (block 2 on), so blocks 0 and 1 may be NO_BLOCK.
  import jax.numpy as jnp
  from paged_jax import KVCache
  from paged_jax.attention import checked_paged_attention
  rng = np.random.default_rng(0)
  k = rng.standard_normal((1, 1, 8, 4, 8)).astype(np.float32)  # [L, K, N, Z, D]
  v = rng.standard_normal((1, 1, 8, 4, 8)).astype(np.float32)
  k[:, :, [6, 7]] = np.nan  # the given-back blocks hold garbage: never read
  v[:, :, [6, 7]] = np.nan
  cache = KVCache(jnp.asarray(k), jnp.asarray(v))
  q = jnp.asarray(rng.standard_normal((4, 2, 8)).astype(np.float32))
  args = dict(layer=0, kv_lens=jnp.asarray([20], jnp.int32),
              cu_q_lens=jnp.asarray([0, 4], jnp.int32), num_seqs=1)
  held = jnp.asarray([[6, 7, 0, 1, 2]], jnp.int32)
  windowed = jnp.asarray([[-1, -1, 0, 1, 2]], jnp.int32)
  want = checked_paged_attention(q, cache, block_tables=held, sliding_window=6,
                                 impl="reference", **args)
  got = checked_paged_attention(q, cache, block_tables=windowed, sliding_window=6,
                                impl="reference", **args)
  assert np.isfinite(np.asarray(want)).all()
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(ValueError, match=r"block_tables\[0, 0\]=-1 must be a block id"):
    checked_paged_attention(q, cache, block_tables=windowed, impl="reference", **args)
  # The window's first block is still read: giving it back is caught.
  with pytest.raises(ValueError, match=r"block_tables\[0, 2\]=-1 must be a block id"):
    checked_paged_attention(q, cache, block_tables=windowed.at[0, 2].set(-1),
                            sliding_window=6, impl="reference", **args)


def test_every_impl_skips_blocks_given_back_behind_the_window():
  # kv_len 80 (5 blocks of 16), queries at 76..79, window 20: the first query sees 57.., so
  # blocks 0..2 are behind every window. Given back (NO_BLOCK, which a read would wrap to
  # the NaN page 7) or kept (the NaN pages 6, 7 and page 0), the output is the reference's.
  import jax.numpy as jnp
  from paged_jax import KVCache, paged_attention
  rng = np.random.default_rng(1)
  k = rng.standard_normal((1, 1, 8, 16, 128)).astype(np.float32)  # [L, K, N, Z, D]
  v = rng.standard_normal((1, 1, 8, 16, 128)).astype(np.float32)
  k[:, :, [6, 7]] = v[:, :, [6, 7]] = np.nan
  cache = KVCache(jnp.asarray(k), jnp.asarray(v))
  q = jnp.asarray(rng.standard_normal((4, 2, 128)).astype(np.float32))
  args = (jnp.asarray([80], jnp.int32),)
  rest = (jnp.asarray([0, 4], jnp.int32), 1)
  held = jnp.asarray([[6, 7, 0, 1, 2]], jnp.int32)
  given_back = jnp.asarray([[-1, -1, -1, 1, 2]], jnp.int32)
  want = paged_attention(q, cache, 0, *args, held, *rest, sliding_window=20, impl="reference")
  assert np.isfinite(np.asarray(want)).all()
  for impl in ("reference", "xla", "pallas_gpu", "pallas_tpu", "pallas_mosaic_gpu"):
    got = paged_attention(q, cache, 0, *args, given_back, *rest, sliding_window=20, impl=impl,
                          interpret=impl.startswith("pallas"))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6,
                               err_msg=impl)


def test_xla_prefill_tiles_skip_blocks_given_back_behind_the_window():
  # A 300-row chunk (the XLA path's prefill tiles: >= 256 rows) at positions 300..599 of a
  # 600-token sequence, window 64, blocks of 16: its first query sees 237.., so blocks
  # 0..13 (positions < 224) are behind every window. Given back (NO_BLOCK, which a read
  # would wrap to the last page, NaN) or kept (NaN pages), the output is the reference's.
  import jax.numpy as jnp
  from paged_jax import KVCache, paged_attention
  rng = np.random.default_rng(2)
  num_blocks, held_blocks = 40, 38
  k = rng.standard_normal((1, 1, num_blocks, 16, 64)).astype(np.float32)
  v = rng.standard_normal((1, 1, num_blocks, 16, 64)).astype(np.float32)
  k[:, :, held_blocks:] = v[:, :, held_blocks:] = np.nan
  # Kept, the 14 blocks behind the window are the two NaN pages: a read of them shows.
  held = np.concatenate([[held_blocks, held_blocks + 1] * 7, rng.permutation(held_blocks)[:24]])
  given_back = held.copy()
  given_back[:14] = -1
  cache = KVCache(jnp.asarray(k), jnp.asarray(v))
  q = jnp.asarray(rng.standard_normal((300, 4, 64)).astype(np.float32))
  common = (jnp.asarray([600], jnp.int32),)
  rest = (jnp.asarray([0, 300], jnp.int32), 1)
  want = paged_attention(q, cache, 0, *common, jnp.asarray(held[None], jnp.int32), *rest,
                         sliding_window=64, impl="reference")
  assert np.isfinite(np.asarray(want)).all()
  got = paged_attention(q, cache, 0, *common, jnp.asarray(given_back[None], jnp.int32), *rest,
                        sliding_window=64, impl="xla")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


def test_hybrid_model_prefix_hits_reuse_every_groups_blocks():
  # Gemma-3-like (5 sliding layers, window 16, to 1 full), blocks of 4 tokens, groups on
  # (a KV budget). Three prompts share 40 tokens; the first runs alone and registers its
  # blocks. Each later prompt hits the 10 shared levels: the full group's 10 blocks and, in
  # each sliding group, levels 6..9 (a query at 40 reads from 25), of which the first
  # request had given back 6..8 before it ended (cached, not freed). Scrubbing zeroes every
  # block nobody may read, so a hit on a wrong or stale block changes the tokens.
  window, z = 16, 4
  config = helpers.tiny_config("gemma3_text", num_hidden_layers=6, sliding_window=window,
                               max_position_embeddings=128)
  model = models.init_random(config, seed=1, impl="xla")
  rng = np.random.default_rng(11)
  shared = [int(t) for t in rng.integers(3, helpers.VOCAB, 40)]
  prompts = [shared + [int(t) for t in rng.integers(3, helpers.VOCAB, 5)] for _ in range(3)]
  params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True)
  common = dict(block_size=z, max_seqs=2, max_tokens_per_step=16, token_buckets=(16,),
                steps_per_call=16, kv_budget_bytes=200 * 2 * 2 * 16 * 4 * z)
  llm = LLM(model, config, scrub_on_release=True, **common)
  assert llm.kv_groups.slides and llm.stats["prefix_caching"] is True
  first = llm.generate(prompts[:1], params)
  rest = llm.generate(prompts[1:], params)
  assert llm.stats["cached_prompt_tokens"] == 2 * 40, llm.stats
  allocator.validate(llm.allocator_state)
  ref = LLM(model, config, enable_prefix_caching=False, **common)
  want = ref.generate(prompts, params)
  for got, exp in zip(first + rest, want):
    assert list(got.token_ids) == list(exp.token_ids)
    # Log-probs too: a window missing one key moves them long before it moves a token.
    np.testing.assert_allclose(got.logprobs, exp.logprobs, rtol=0, atol=2e-5)


def test_a_prompt_too_long_for_the_groups_is_refused_saying_why():
  # A full and a sliding (window 8) layer, blocks of 4, a pool of 12 blocks (48 token
  # slots): every logical block takes a block in the full group and the sliding group
  # holds its window's, so one sequence fits in 24 tokens, not 48; the refusal says so.
  config = models.ModelConfig(
      model_type="qwen2", vocab_size=128, embed_dim=64, mlp_dim=96, num_layers=2,
      num_heads=4, num_kv_heads=2, head_dim=16, max_seq_len=256,
      layer_types=("full_attention", "sliding_attention"), sliding_window=8)
  llm = LLM(models.init_random(config, seed=0), config, block_size=4, num_blocks=12,
            max_seqs=2, free_outside_window=True)
  assert llm.kv_groups.windows == (None, 8) and llm.max_model_len == 24
  with pytest.raises(ValueError, match=(
      r"prompts\[0\] has 60 tokens; must be < max_model_len=24 \(model context 256, KV pool "
      r"12 blocks x 4 tokens shared by 2 KV groups \(1 full, 1 sliding\): one sequence "
      r"fits in 24 tokens\)")):
    llm.generate([[5] * 60], SamplingParams(max_tokens=4))
  # Asking for more names the same bound (it said num_blocks * block_size=48 before).
  with pytest.raises(ValueError, match=(
      r"max_model_len=30 must be an int in \[2, 24\]: the longest sequence the model and the "
      r"pool allow \(model context 256, KV pool 12 blocks x 4 tokens shared by 2 KV groups "
      r"\(1 full, 1 sliding\): one sequence fits in 24 tokens\)")):
    LLM(llm.model, config, block_size=4, num_blocks=12, max_seqs=2, free_outside_window=True,
        max_model_len=30)
  # Every layer sliding, one group: the refusal said "KV pool 12 blocks x 4 tokens = 48
  # tokens", neither the bound (the context) nor why.
  config = dataclasses.replace(config, layer_types=("sliding_attention",) * 2)
  llm = LLM(models.init_random(config, seed=0), config, block_size=4, num_blocks=12,
            max_seqs=2, max_tokens_per_step=8, free_outside_window=True)
  assert llm.kv_groups.windows == (8,) and llm.max_model_len == 256
  with pytest.raises(ValueError, match=(
      r"prompts\[0\] has 300 tokens; must be < max_model_len=256 \(model context 256, KV "
      r"pool 12 blocks x 4 tokens, every layer sliding \(window 8\): one sequence fits in the "
      r"whole context or more\)")):
    llm.generate([[5] * 300], SamplingParams(max_tokens=4))
