"""The serving engine end to end on one GPU: ``LLM`` over each attention impl the GPU offers.

``run.py`` and ``parity.py`` check and time the kernels alone. This script serves requests
through ``LLM`` on a random-weight Llama (no download), once per impl ("auto", "pallas_gpu"
(Triton), "pallas_mosaic_gpu", "xla"), so what a user runs on a GPU (the jitted device
loop, donated pools, the allocator and the sampler on the device, the compilation cache)
has run there at least once:

1. Tokens. A float32 model (2 layers, width 256, vocab 512) serves 6 prompts of 5-300
   tokens, 24 greedy tokens each, in an engine whose pool is small enough to preempt; each
   completion is compared with a dense greedy loop (``model(tokens)``, no cache): the
   number of completions whose tokens all equal it, out of 6. The same with an int8 KV
   cache, whose completions may part from the float32 ones after a near tie: it reports
   the share of tokens equal to the dense loop's up to the first difference.
2. Speed. A bfloat16 model shaped like a small Llama (8 layers, width 2048, 32 query
   heads, 8 KV heads, head dim 64, vocab 32000; about 0.5 B parameters) serves 64
   requests (prompts of ``--prompt-len`` tokens, ``--output-len`` generated, greedy, EOS
   ignored) at ``max_seqs`` 64 and 1024 tokens a step: compile time (every device call, before serving),
   serving time, tokens/s, steady tokens/s, host syncs per token, and tokens/s over the
   "xla" engine's. Engines run one after another, each once after a warm-up round.

Each impl runs in its own try (one that fails or refuses is recorded with its error);
rows are printed as they come, and ``$OUT/engine.md`` is written after the token checks and
again at the end. The time budget is checked before each speed engine is built.

  PYTHONPATH=. python benchmarks/gpu/engine.py [--budget-s 240] [--impls auto,xla]
  PYTHONPATH=. python benchmarks/gpu/engine.py --smoke-cpu   # plumbing, interpret mode
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from paged_jax import LLM, SamplingParams  # noqa: E402
from paged_jax.attention import resolve_impl  # noqa: E402
from paged_jax.models import ModelConfig, init_random  # noqa: E402

IMPLS = ("auto", "pallas_gpu", "pallas_mosaic_gpu", "xla")
CHECK_MODEL = dict(model_type="llama", vocab_size=512, embed_dim=256, mlp_dim=512,
                   num_layers=2, num_heads=8, num_kv_heads=2, head_dim=32, max_seq_len=512,
                   bos_token_id=1, eos_token_ids=(2,))
CHECK_PROMPTS = (5, 17, 64, 100, 250, 300)
CHECK_TOKENS = 24
SPEED_MODEL = dict(model_type="llama", vocab_size=32000, embed_dim=2048, mlp_dim=5632,
                   num_layers=8, num_heads=32, num_kv_heads=8, head_dim=64, max_seq_len=4096,
                   bos_token_id=1, eos_token_ids=(2,))
SMOKE_SPEED_MODEL = dict(CHECK_MODEL, num_layers=1, vocab_size=256)


def dense_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
  """Greedy tokens of ``model``'s dense causal forward, re-run on the growing sequence."""
  width = len(prompt) + max_tokens
  forward = jax.jit(lambda t: model(t)[0])
  seq = list(prompt)
  for _ in range(max_tokens):
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :len(seq)] = seq
    seq.append(int(jnp.argmax(forward(jnp.asarray(tokens))[len(seq) - 1])))
  return seq[len(prompt):]


def _agreement(got: list[int], want: list[int]) -> int:
  """How many leading tokens of ``got`` equal ``want``'s."""
  same = 0
  for a, b in zip(got, want):
    if a != b:
      break
    same += 1
  return same


def check_rows(impls, interpret: bool, prompts_lens, max_tokens, *,
               tokens_per_step: int = 256) -> list[dict]:
  config = ModelConfig(**CHECK_MODEL)
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(3, config.vocab_size, n)] for n in prompts_lens]
  want = [dense_greedy(init_random(config, seed=1, impl="xla"), p, max_tokens)
          for p in prompts]
  params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
  rows = []
  for impl in impls:
    for kv in (None, "int8"):
      row = dict(part="tokens", impl=impl, kv=kv or "float32")
      try:
        model = init_random(config, seed=1, impl=impl, interpret=interpret)
        # A pool of ~2 longest sequences: the batch preempts and recomputes.
        llm = LLM(model, config, block_size=16, num_blocks=48, max_seqs=4,
                  max_tokens_per_step=tokens_per_step,
                  max_model_len=max(prompts_lens) + max_tokens, kv_cache_dtype=kv)
        outs = llm.generate(prompts, params)
        same = [_agreement(o.token_ids, w) for o, w in zip(outs, want)]
        row.update(equal=sum(s == max_tokens for s in same), of=len(prompts),
                   leading=sum(same) / (max_tokens * len(prompts)),
                   preemptions=llm.stats["preemptions"],
                   free=llm.stats["num_free_blocks"] == llm.stats["num_blocks"])
      except Exception as e:  # recorded, the next impl runs
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        traceback.print_exc()
      rows.append(row)
      print(_format(row), flush=True)
  return rows


def speed_rows(impls, interpret: bool, model_fields: dict, num_requests: int,
               prompt_len: int, output_len: int, deadline: float, *,
               tokens_per_step: int = 1024) -> list[dict]:
  config = ModelConfig(**model_fields)
  rng = np.random.default_rng(1)
  prompts = [[int(t) for t in rng.integers(3, config.vocab_size, prompt_len)]
             for _ in range(num_requests)]
  params = SamplingParams(max_tokens=output_len, ignore_eos=True)
  blocks = num_requests * -(-(prompt_len + output_len) // 16) + 64
  # One draw of the weights (half a billion on the host takes seconds); each engine gets
  # the model with its impl set (a new structure: its own compilation).
  model = init_random(config, seed=2, dtype=jnp.bfloat16, impl="xla", interpret=interpret)
  rows = []
  for impl in impls:
    row = dict(part="speed", impl=impl)
    if time.perf_counter() > deadline:
      row["error"] = "skipped: past --budget-s"
      rows.append(row)
      print(_format(row), flush=True)
      continue
    try:
      model.impl = impl
      llm = LLM(model, config, block_size=16, num_blocks=blocks, max_seqs=num_requests,
                max_tokens_per_step=max(tokens_per_step, num_requests),
                max_model_len=prompt_len + output_len)
      t0 = time.perf_counter()
      llm.precompile()
      row["compile_s"] = time.perf_counter() - t0
      llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
      llm.reset_stats()
      outs = llm.generate(prompts, params)
      stats = llm.stats
      row.update(tokens=sum(len(o.token_ids) for o in outs), wall_s=stats["wall_s"],
                 tokens_per_s=stats["tokens_per_s"],
                 steady=stats.get("steady_tokens_per_s"),
                 syncs_per_token=stats.get("host_syncs_per_token"))
    except Exception as e:
      row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
      traceback.print_exc()
    rows.append(row)
    print(_format(row), flush=True)
  base = next((r["tokens_per_s"] for r in rows if r["impl"] == "xla" and "tokens_per_s" in r),
              None)
  for row in rows:
    if base and "tokens_per_s" in row:
      row["vs_xla"] = row["tokens_per_s"] / base
  return rows


def _format(row: dict) -> str:
  if "error" in row:
    return f"{row['part']:6} {row['impl']:18} {row.get('kv', ''):8} {row['error']}"
  if row["part"] == "tokens":
    return (f"tokens {row['impl']:18} {row['kv']:8} {row['equal']}/{row['of']} completions "
            f"equal the dense loop, {row['leading']:.0%} of tokens before a first "
            f"difference, {row['preemptions']} preemptions, all blocks free: {row['free']}")
  return (f"speed  {row['impl']:18} compile {row['compile_s']:.1f} s, {row['tokens']} tokens "
          f"in {row['wall_s']:.2f} s, {row['tokens_per_s']:.0f} tokens/s")


def _table(check: list[dict], speed: list[dict], header: str) -> str:
  lines = [header, "", "| impl | KV | completions equal to the dense loop | tokens before a "
           "first difference | preemptions | blocks all free |", "|---|---|---|---|---|---|"]
  for r in check:
    if "error" in r:
      lines.append(f"| {r['impl']} | {r['kv']} | {r['error']} | | | |")
    else:
      lines.append(f"| {r['impl']} | {r['kv']} | {r['equal']}/{r['of']} | "
                   f"{r['leading']:.1%} | {r['preemptions']} | {r['free']} |")
  lines += ["", "| impl | compile s | tokens | serving s | tokens/s | steady tokens/s | "
            "host syncs / token | tokens/s / xla's |", "|---|---|---|---|---|---|---|---|"]
  for r in speed:
    if "error" in r:
      lines.append(f"| {r['impl']} | {r['error']} | | | | | | |")
      continue
    steady = "" if r["steady"] is None else f"{r['steady']:.0f}"
    syncs = "" if r["syncs_per_token"] is None else f"{r['syncs_per_token']:.3f}"
    ratio = f"{r['vs_xla']:.2f}x" if "vs_xla" in r else ""
    lines.append(f"| {r['impl']} | {r['compile_s']:.1f} | {r['tokens']} | {r['wall_s']:.2f} | "
                 f"{r['tokens_per_s']:.0f} | {steady} | {syncs} | {ratio} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.environ.get("OUT", "./out"))
  parser.add_argument("--budget-s", type=float, default=240.0,
                      help="build no new speed engine after this many seconds (default 240)")
  parser.add_argument("--impls", default=",".join(IMPLS),
                      help=f"comma-separated impls (default: {','.join(IMPLS)})")
  parser.add_argument("--prompt-len", type=int, default=512)
  parser.add_argument("--output-len", type=int, default=128)
  parser.add_argument("--smoke-cpu", action="store_true",
                      help="plumbing test on CPU: tiny models, Pallas kernels interpreted")
  args = parser.parse_args(argv)
  impls = [i.strip() for i in args.impls.split(",") if i.strip()]
  unknown = sorted(set(impls) - set(IMPLS))
  if unknown:
    parser.error(f"--impls: unknown {', '.join(unknown)}; choose from {', '.join(IMPLS)}")
  deadline = time.perf_counter() + args.budget_s
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  device = jax.devices()[0]
  header = (f"Engine end to end: {device.device_kind} ({jax.default_backend()}), jax "
            f"{jax.__version__}; impl 'auto' is {resolve_impl('auto')!r} here.")
  print(header, flush=True)
  if args.smoke_cpu:
    # Small steps (the 21-token prompt is prefilled in two chunks): each bucket's device
    # call compiles interpreted kernels, and those of 256 or 1024 tokens served nothing here.
    check = check_rows(impls, True, (5, 21), 4, tokens_per_step=16)
    speed = speed_rows(impls, True, SMOKE_SPEED_MODEL, 2, 8, 3, deadline, tokens_per_step=16)
  else:
    check = check_rows(impls, False, CHECK_PROMPTS, CHECK_TOKENS)
    (out / "engine.md").write_text(_table(check, [], header))
    speed = speed_rows(impls, False, SPEED_MODEL, 64, args.prompt_len, args.output_len,
                       deadline)
  table = _table(check, speed, header)
  (out / "engine.md").write_text(table)
  print(table, flush=True)
  failed = [r for r in check if "error" in r or r["equal"] < r["of"] and r["kv"] == "float32"]
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
