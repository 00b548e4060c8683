"""``paged-jax run``: serve a synthetic workload (or a prompt) and print a serving report.

With no arguments it serves ``paged_jax.workload.Workload()`` (64 requests, log-normal prompt
and output lengths) on an embedded tiny Llama with seeded random weights (no download);
``--model DIR`` serves a Hugging Face checkpoint instead, ``--prompt TEXT`` generates from
text where the checkpoint has a tokenizer. Hook it up with ``add_run_parser(subparsers)``.
"""

from __future__ import annotations

import sys
import time

TINY_LLAMA = dict(model_type="llama", vocab_size=256, embed_dim=128, mlp_dim=256, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=32, max_seq_len=512, bos_token_id=1,
                  eos_token_ids=(2,))
"""The embedded demo model: 2 layers, width 128, vocab 256, GQA 4:2, head dim 32."""


def add_run_parser(subparsers) -> None:
  """Add the ``run`` subcommand (``func`` returns the exit code)."""
  from paged_jax.workload import Workload
  w = Workload()
  p = subparsers.add_parser(
      "run", help="serve a synthetic workload on a tiny embedded model and print a report",
      description="Continuous-batching serving run. Without --model: a tiny Llama (2 layers, "
      "width 128, vocab 256) with seeded random weights serves a synthetic workload of "
      "log-normal prompt and output lengths (paged_jax.workload).")
  p.add_argument("--model", help="Hugging Face checkpoint directory to serve")
  p.add_argument("--prompt", help="generate from this text (needs --model with tokenizer.json)")
  p.add_argument("--num-requests", type=int, default=w.num_requests,
                 help=f"synthetic requests (default {w.num_requests})")
  p.add_argument("--prompt-median", type=int, default=w.prompt_median,
                 help=f"median prompt length (default {w.prompt_median})")
  p.add_argument("--output-median", type=int, default=w.output_median,
                 help=f"median output length (default {w.output_median})")
  p.add_argument("--sigma", type=float, default=w.prompt_sigma,
                 help=f"log-normal sigma of both lengths (default {w.prompt_sigma})")
  p.add_argument("--seed", type=int, default=0, help="workload and weight seed (default 0)")
  p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate for --prompt")
  p.add_argument("--temperature", type=float, default=0.0, help="for --prompt (default 0)")
  p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
  p.add_argument("--num-blocks", type=int, default=None,
                 help="KV pool size in blocks (default 64 for the tiny model: small enough "
                 "that the long tail forces a few preemptions)")
  p.add_argument("--max-seqs", type=int, default=16, help="concurrent sequences (default 16)")
  p.add_argument("--max-tokens-per-step", type=int, default=256,
                 help="token budget of one step (default 256)")
  p.add_argument("--steps-per-call", type=int, default=32,
                 help="scheduling steps per device call (default 32)")
  p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                 help="model dtype (default float32 for the tiny model, the checkpoint's "
                 "otherwise)")
  p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
  p.set_defaults(func=_run)


class _Progress:
  """A plain-text progress bar on stderr."""

  def __init__(self, total: int, enabled: bool, width: int = 30):
    self.total, self.enabled, self.width = total, enabled, width
    self.done = self.tokens = 0
    self.t0 = time.perf_counter()

  def update(self, done: int, tokens: int) -> None:
    self.done, self.tokens = done, tokens
    if not self.enabled:
      return
    frac = done / max(self.total, 1)
    bar = "#" * int(frac * self.width) + "." * (self.width - int(frac * self.width))
    dt = time.perf_counter() - self.t0
    sys.stderr.write(f"\r[{bar}] {done}/{self.total} completions, {tokens} tokens, "
                     f"{dt:.1f}s")
    sys.stderr.flush()

  def close(self) -> None:
    if self.enabled:
      sys.stderr.write("\n")
      sys.stderr.flush()


def _engine(args):
  import jax.numpy as jnp
  from paged_jax.engine import LLM
  opts = dict(block_size=args.block_size, num_blocks=args.num_blocks, max_seqs=args.max_seqs,
              max_tokens_per_step=args.max_tokens_per_step, steps_per_call=args.steps_per_call)
  if args.model:
    return LLM.from_pretrained(args.model, dtype=args.dtype, **opts)
  from paged_jax.models import ModelConfig, init_random
  config = ModelConfig(**TINY_LLAMA)
  dtype = jnp.float32 if args.dtype is None else jnp.dtype(args.dtype)
  model = init_random(config, seed=args.seed, dtype=dtype)
  if opts["num_blocks"] is None:
    opts["num_blocks"] = 64
  return LLM(model, config, **opts)


def format_report(stats: dict, *, title: str, warmup_s: float | None = None) -> str:
  """The serving report printed by ``paged-jax run``."""
  rows = [("compile + warm-up", f"{warmup_s:.2f} s (not counted below)")] if warmup_s else []
  rows += [
      ("requests", f"{stats['requests']}"),
      ("generated tokens", f"{stats['generated_tokens']}"),
      ("serving wall time", f"{stats['wall_s']:.2f} s"),
      ("tokens/s", f"{stats['tokens_per_s']:.1f}"),
      ("requests/s", f"{stats['requests_per_s']:.2f}"),
      ("KV pool", f"{stats['num_blocks']} blocks, {stats['num_free_blocks']} free at the end"),
      ("peak blocks in use", f"{stats['peak_blocks_in_use']}"),
      ("mean blocks in use", f"{stats['mean_blocks_in_use']:.1f}"),
      ("KV utilisation", f"{stats['kv_utilization']:.1%} (tokens stored / slots of blocks "
                         "in use, mean over steps)"),
      ("preemptions", f"{stats['preemptions']}"),
      ("prefix hit rate", f"{stats['prefix_hit_rate']:.1%}"),
      ("engine steps", f"{stats['steps']} in {stats['device_calls']} device calls"),
      ("host syncs", f"{stats['host_syncs']}"),
      ("host syncs per token", f"{stats['host_syncs_per_token']:.3f}"),
  ]
  width = max(len(k) for k, _ in rows)
  return "\n".join([title] + [f"  {k:<{width}}  {v}" for k, v in rows])


def _run(args) -> int:
  from paged_jax.sampling import SamplingParams
  from paged_jax.workload import Workload, make_requests
  llm = _engine(args)
  if args.prompt is not None:
    if llm.tokenizer is None:
      raise ValueError("--prompt needs --model DIR with a tokenizer.json (the embedded model "
                       "has no tokenizer)")
    out, = llm.generate([args.prompt], SamplingParams(max_tokens=args.max_tokens,
                                                      temperature=args.temperature,
                                                      seed=args.seed))
    print(f"prompt:     {args.prompt}")
    print(f"completion: {out.text}")
    print(format_report(llm.stats, title=f"paged-jax run: 1 prompt, finish_reason "
                        f"{out.finish_reason} (wall time includes compilation)"))
    return 0
  workload = Workload(num_requests=args.num_requests, prompt_median=args.prompt_median,
                      prompt_sigma=args.sigma, output_median=args.output_median,
                      output_sigma=args.sigma, vocab_size=llm.config.vocab_size,
                      max_prompt_len=min(Workload().max_prompt_len, llm.max_model_len // 2),
                      max_output_len=min(Workload().max_output_len, llm.max_model_len // 2),
                      seed=args.seed)
  prompts, params = make_requests(workload)
  t0 = time.perf_counter()
  llm.generate([prompts[0][:4]], SamplingParams(max_tokens=2, ignore_eos=True))  # compiles
  warmup_s = time.perf_counter() - t0
  llm.reset_stats()
  progress = _Progress(len(prompts), enabled=not args.no_progress)
  done = tokens = 0
  for ev in llm.generate_stream(prompts, params):
    if ev.token_id is None:
      done += 1
      progress.update(done, tokens)
    else:
      tokens += 1
      if tokens % 64 == 0:
        progress.update(done, tokens)
  progress.close()
  source = args.model or "embedded tiny Llama (random weights)"
  print(format_report(llm.stats, title=f"paged-jax run: {len(prompts)} synthetic requests on "
                      f"{source}, seed {args.seed}", warmup_s=warmup_s))
  return 0
