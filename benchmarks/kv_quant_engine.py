"""End to end through ``LLM``: quantised KV pools against the bfloat16 pool.

A tiny random Llama (2 layers, width 128, GQA 4:2, head dim 32, float32 weights) serves 32
prompts (8 to 64 tokens) greedily for 24 tokens from pools of bfloat16, int8, float8_e4m3fn
and float32. For each pool against the bfloat16 one:
- tokens agreeing: generated tokens equal at the same position, over all of them;
- prompts identical: completions equal token for token;
- first-token logprob error: mean |logprob difference| of each completion's first token (the
  same context in every pool, so a pure measure of the pool's error);
- logit error: teacher-forced last-token logits of all 32 prompts (one ragged prefill through
  ``paged_jax.step.forward_step`` into a pool of that dtype), mean and max |difference| from
  the float32 pool's, beside the bfloat16 pool's own.

    python benchmarks/kv_quant_engine.py           # prints the table, writes the section
    python benchmarks/kv_quant_engine.py --quick   # 8 prompts, 8 tokens; never writes
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from paged_jax import LLM, KVCache, KVCacheSpec, SamplingParams, allocator  # noqa: E402
from paged_jax.models import ModelConfig, init_random  # noqa: E402
from paged_jax.step import forward_step  # noqa: E402

RESULTS_PATH = pathlib.Path(__file__).with_name("kv_quant_engine_RESULTS_section.md")
MODEL = dict(model_type="llama", vocab_size=256, embed_dim=128, mlp_dim=256, num_layers=2,
             num_heads=4, num_kv_heads=2, head_dim=32, max_seq_len=512, bos_token_id=1,
             eos_token_ids=(2,))
POOLS = ("bfloat16", "int8", "float8_e4m3fn", "float32")
BLOCK = 16


def _prompts(num, seed=0):
  rng = np.random.default_rng(seed)
  return [[int(t) for t in rng.integers(3, 256, int(n))] for n in rng.integers(8, 65, num)]


def _serve(model, config, dtype, prompts, max_tokens):
  llm = LLM(model, config, kv_cache_dtype=dtype, block_size=BLOCK, num_blocks=256,
            max_seqs=16, max_tokens_per_step=256, token_buckets=(256,),
            compilation_cache=False)
  outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                              logprobs=True))
  return [o.token_ids for o in outs], [o.logprobs for o in outs]


def _prefill_logits(model, config, dtype, prompts):
  """Last-token logits of every prompt after one ragged prefill into a ``dtype`` pool."""
  num_tokens = sum(len(p) for p in prompts)
  blocks = sum(-(-len(p) // BLOCK) for p in prompts)
  spec = KVCacheSpec(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
                     head_dim=config.head_dim, block_size=BLOCK, num_blocks=blocks,
                     dtype=dtype)
  alloc = allocator.init(blocks, BLOCK, len(prompts), max_blocks_per_seq=8)
  tokens_T = jnp.asarray(np.concatenate(prompts), jnp.int32)
  num_new_S = jnp.asarray([len(p) for p in prompts], jnp.int32)
  logits_SV, _, _, ok_S = jax.jit(forward_step)(model, alloc, KVCache.create(spec), tokens_T,
                                                num_new_S)
  assert bool(ok_S.all()) and tokens_T.shape[0] == num_tokens
  return np.asarray(logits_SV, np.float64)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="8 prompts, 8 tokens; never writes")
  ap.add_argument("--no-write", action="store_true", help="do not write the results section")
  args = ap.parse_args(argv)
  num_prompts, max_tokens = (8, 8) if args.quick else (32, 24)
  config = ModelConfig(**MODEL)
  model = init_random(config, seed=0, dtype=jnp.float32, impl="xla")
  prompts = _prompts(num_prompts)
  served = {d: _serve(model, config, jnp.dtype(d), prompts, max_tokens) for d in POOLS}
  logits = {d: _prefill_logits(model, config, jnp.dtype(d), prompts) for d in POOLS}
  base_tokens, base_lps = served["bfloat16"]
  rows = []
  for d in POOLS:
    tokens, lps = served[d]
    same = [a == b for t, u in zip(tokens, base_tokens) for a, b in zip(t, u)]
    err = np.abs(logits[d] - logits["float32"])
    rows.append(dict(
        pool=d, tokens_agree=float(np.mean(same)),
        prompts_identical=sum(t == u for t, u in zip(tokens, base_tokens)),
        first_logprob_err=float(np.mean([abs(a[0] - b[0]) for a, b in zip(lps, base_lps)])),
        logit_err_mean=float(err.mean()), logit_err_max=float(err.max()),
        logit_scale=float(np.abs(logits["float32"]).mean())))
  lines = [f"{num_prompts} prompts (8-64 tokens), {max_tokens} greedy tokens each; agreement "
           "against the bfloat16 pool; logit error against the float32 pool "
           f"(mean |logit| {rows[0]['logit_scale']:.3f}).", "",
           "| pool | tokens agreeing | prompts identical | first-token logprob err | "
           "logit err mean | logit err max |", "|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['pool']} | {r['tokens_agree']:.1%} | {r['prompts_identical']}/"
                 f"{num_prompts} | {r['first_logprob_err']:.2e} | {r['logit_err_mean']:.2e} | "
                 f"{r['logit_err_max']:.2e} |")
  text = "\n".join(lines)
  print(text)
  if not (args.quick or args.no_write):
    RESULTS_PATH.write_text(text + "\n\nCommand: `python benchmarks/kv_quant_engine.py`\n")
  return rows


if __name__ == "__main__":
  main()
