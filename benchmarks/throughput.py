"""Serving throughput at equal KV budget: the paged engine vs a contiguous static batch vs
Hugging Face transformers ``generate``, on one checkpoint and one long-tailed queue.

Checkpoint: a tiny random Llama made with transformers (``LlamaConfig`` +
``LlamaForCausalLM``, ``torch.manual_seed``; weights re-drawn at O(1) scale, since
transformers' 0.02-std init makes greedy decoding a tie-break of near-uniform logits), saved
with ``save_pretrained`` into a temporary directory. Our engine loads it with
``LLM.from_pretrained`` (float32, impl "xla"); transformers loads it back with
``LlamaForCausalLM.from_pretrained``.

Workload (``paged_jax.workload``): ``num_requests`` requests queued at t = 0, log-normal
prompt and output lengths (the long tail: most requests short, a few long), greedy,
``ignore_eos`` so every request generates exactly its drawn ``max_tokens``. The declared
maximum length of a request is ``max_prompt_len + max_output_len`` (what a server must
reserve when it does not know the output length).

KV budget: N blocks of Z tokens. The three systems:

- paged: ``LLM(max_seqs=S, num_blocks=N, max_tokens_per_step=T, steps_per_call=K)``:
  continuous batching, chunked prefill, blocks taken as sequences grow; the whole queue in
  one ``generate``.
- contiguous: static batches of B = N // ceil(max_len / Z) requests in arrival order (all the
  budget holds when each reserves the declared maximum length). Built from the same model
  code: ``Decoder.paged_forward`` with a fixed identity block table (sequence b owns blocks
  ``[b * P, (b + 1) * P)``: contiguous memory) and the same XLA attention. One jitted call
  per batch prefills every prompt (one ragged forward, T padded to a power of two) and
  decodes in a device ``while_loop`` until the batch's longest request is done (the
  finished rows idle until then), greedy.
- transformers: ``generate`` on batches of B requests (its cache then holds at most B x
  max_len tokens: the same budget), left-padded with an attention mask, its default
  (dynamic) cache, greedy, ``max_new_tokens`` = the batch's longest request, each output
  cut to its own length.

Tokens/s = generated tokens (the sum of ``max_tokens``) / wall time serving the whole queue.
Each round runs the three systems once, in an order rotated per round; the table reports
medians over ``rounds``. Outputs are compared with the paged engine's (the fraction of
requests with identical tokens). The sweep serves the same queue with the paged engine at
several ``max_seqs`` and with contiguous static batches of every power of two up to B (same
budget), and with transformers at ``sweep_hf`` batch sizes above B (its cache may then
outgrow the budget), and plots tokens/s against batch size into ``throughput_batch.png``
beside RESULTS.md when matplotlib is importable.

    python benchmarks/throughput.py            # full; writes throughput_RESULTS_section.md
    python benchmarks/throughput.py --quick    # seconds; never writes
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from paged_jax.models import AttentionMetadata  # noqa: E402
from paged_jax import KVCache  # noqa: E402
from paged_jax.engine import LLM  # noqa: E402
from paged_jax.workload import Workload, make_requests  # noqa: E402

HERE = pathlib.Path(__file__).parent
RESULTS_PATH = HERE / "throughput_RESULTS_section.md"
PLOT_PATH = HERE / "throughput_batch.png"
PAGED, CONTIGUOUS, HF = "paged engine", "contiguous static batch", "transformers generate"


@dataclasses.dataclass(frozen=True)
class TinyLlama:
  """The checkpoint's shape (transformers ``LlamaConfig`` fields)."""

  vocab_size: int = 256
  hidden_size: int = 128
  intermediate_size: int = 256
  num_hidden_layers: int = 2
  num_attention_heads: int = 4
  num_key_value_heads: int = 2
  head_dim: int = 32
  max_position_embeddings: int = 512
  seed: int = 0


@dataclasses.dataclass(frozen=True)
class ThroughputBench:
  model: TinyLlama
  workload: Workload
  block_size: int  # Z
  num_blocks: int  # N, the KV budget
  max_seqs: int  # S of the paged engine
  max_tokens_per_step: int  # T of the paged engine
  steps_per_call: int
  rounds: int
  sweep_max_seqs: tuple[int, ...]
  sweep_rounds: int
  sweep_contiguous: tuple[int, ...] | None = None  # None: every power of two up to B, and B
  sweep_hf: tuple[int, ...] = ()  # transformers batch sizes beyond B (their cache may
  # outgrow the budget)

  @property
  def max_len(self) -> int:
    return self.workload.max_prompt_len + self.workload.max_output_len

  @property
  def blocks_per_seq(self) -> int:
    return math.ceil(self.max_len / self.block_size)

  @property
  def contiguous_batch(self) -> int:
    """B: sequences the budget holds when each reserves the declared maximum length. Also
    the transformers batch at equal budget: its cache holds B x (the batch's longest prompt
    + longest output) <= B x max_len tokens."""
    return self.num_blocks // self.blocks_per_seq


FULL = ThroughputBench(model=TinyLlama(), workload=Workload(num_requests=256), block_size=16,
                       num_blocks=144, max_seqs=32, max_tokens_per_step=64,
                       steps_per_call=16, rounds=3, sweep_max_seqs=(8, 16, 32, 48, 64),
                       sweep_rounds=2, sweep_hf=(32,))
QUICK = ThroughputBench(
    model=TinyLlama(vocab_size=128, hidden_size=64, intermediate_size=128, head_dim=16,
                    max_position_embeddings=64),
    workload=Workload(num_requests=8, prompt_median=6, max_prompt_len=16, output_median=4,
                      max_output_len=16, vocab_size=128),
    block_size=8, num_blocks=8, max_seqs=8, max_tokens_per_step=32, steps_per_call=8,
    rounds=1, sweep_max_seqs=(8,), sweep_rounds=1, sweep_contiguous=(2,))


def save_checkpoint(m: TinyLlama, path) -> None:
  """A seeded random Llama saved with ``save_pretrained`` (safetensors, config.json)."""
  import torch
  import transformers

  torch.manual_seed(m.seed)
  config = transformers.LlamaConfig(
      vocab_size=m.vocab_size, hidden_size=m.hidden_size,
      intermediate_size=m.intermediate_size, num_hidden_layers=m.num_hidden_layers,
      num_attention_heads=m.num_attention_heads, num_key_value_heads=m.num_key_value_heads,
      head_dim=m.head_dim, max_position_embeddings=m.max_position_embeddings,
      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
  model = transformers.LlamaForCausalLM(config)
  with torch.no_grad():  # O(1) scale: matrices N(0, 1/fan_in), norms 1 + N(0, 0.01)
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape)
      if name.endswith("norm.weight"):
        p.copy_(1 + 0.1 * noise)
      elif "embed_tokens" in name:
        p.copy_(noise)
      else:
        p.copy_(noise * p.shape[-1] ** -0.5)
  model.save_pretrained(path)


# ----------------------------------------------------------------------------- contiguous


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new", "blocks_per_seq"),
                   donate_argnames=("cache",))
def _static_batch(graphdef, params, cache, tokens_T, prompt_len_B, max_new_B, *,
                  max_new: int, blocks_per_seq: int):
  """Prefill a static batch, then decode it greedily until its longest request is done.

  tokens_T: the prompts packed back to back (then padding); prompt_len_B, max_new_B: i32[B].
  Sequence b owns blocks ``[b * P, (b + 1) * P)``. Returns ``(tokens_BM, cache)``, M =
  ``max_new`` (row b is valid up to ``max_new_B[b]``).
  """
  model = nnx.merge(graphdef, params)
  num_rows, num_tokens = prompt_len_B.shape[0], tokens_T.shape[0]
  z = cache.block_size
  row_B = jnp.arange(num_rows, dtype=jnp.int32)
  tables_BP = row_B[:, None] * blocks_per_seq + jnp.arange(blocks_per_seq, dtype=jnp.int32)
  first_slot_B = row_B * blocks_per_seq * z
  cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(prompt_len_B)])
  t_T = jnp.arange(num_tokens, dtype=jnp.int32)
  seq_T = jnp.clip(jnp.searchsorted(cu, t_T, side="right") - 1, 0, num_rows - 1)
  live_T = t_T < cu[-1]
  pos_T = jnp.where(live_T, t_T - cu[seq_T], 0)
  prefill = AttentionMetadata(slots_T=jnp.where(live_T, first_slot_B[seq_T] + pos_T, -1),
                              kv_lens_S=prompt_len_B, block_tables_SP=tables_BP, cu_q_lens=cu,
                              num_seqs=jnp.int32(num_rows))
  logits_BV, cache = model.paged_forward(tokens_T, pos_T, cache, prefill,
                                         logits_indices=jnp.clip(cu[1:] - 1, 0, num_tokens - 1))
  tok_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  out_BM = jnp.zeros((num_rows, max_new), jnp.int32).at[:, 0].set(tok_B)
  one_each = jnp.arange(num_rows + 1, dtype=jnp.int32)

  def decode(carry):
    i, tok_B, len_B, cache, out_BM = carry
    active_B = i < max_new_B  # finished rows idle (their slot writes nothing)
    meta = AttentionMetadata(slots_T=jnp.where(active_B, first_slot_B + len_B, -1),
                             kv_lens_S=len_B + 1, block_tables_SP=tables_BP,
                             cu_q_lens=one_each, num_seqs=jnp.int32(num_rows))
    logits_BV, cache = model.paged_forward(tok_B, len_B, cache, meta)
    tok_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    out_BM = out_BM.at[row_B, jnp.where(active_B, i, max_new)].set(tok_B, mode="drop")
    return i + 1, tok_B, len_B + active_B, cache, out_BM

  init = (jnp.int32(1), tok_B, prompt_len_B, cache, out_BM)
  _, _, _, cache, out_BM = jax.lax.while_loop(lambda c: c[0] < jnp.max(max_new_B), decode,
                                              init)
  return out_BM, cache


class ContiguousStaticBatch:
  """Static batching over a contiguous cache: B rows of ``max_len`` reserved positions."""

  def __init__(self, model, *, batch: int, max_len: int, max_new: int, block_size: int):
    self.graphdef, self.params = nnx.split(model)
    self.batch, self.max_new = batch, max_new
    self.blocks_per_seq = math.ceil(max_len / block_size)
    spec = model.kv_cache_spec(block_size=block_size, num_blocks=batch * self.blocks_per_seq)
    self.cache = KVCache.create(spec)

  def generate(self, prompts, max_tokens) -> list[list[int]]:
    outputs = []
    for start in range(0, len(prompts), self.batch):
      batch_prompts = list(prompts[start:start + self.batch])
      batch_new = list(max_tokens[start:start + self.batch])
      real = len(batch_prompts)
      batch_prompts += [batch_prompts[0][:1]] * (self.batch - real)  # idle padding rows
      batch_new += [1] * (self.batch - real)
      flat = np.concatenate([np.asarray(p, np.int32) for p in batch_prompts])
      tokens_T = np.zeros(max(16, 1 << (len(flat) - 1).bit_length()), np.int32)
      tokens_T[:len(flat)] = flat
      out_BM, self.cache = _static_batch(
          self.graphdef, self.params, self.cache, jnp.asarray(tokens_T),
          jnp.asarray([len(p) for p in batch_prompts], jnp.int32),
          jnp.asarray(batch_new, jnp.int32), max_new=self.max_new,
          blocks_per_seq=self.blocks_per_seq)
      out_BM = np.asarray(out_BM)
      outputs += [out_BM[b, :batch_new[b]].tolist() for b in range(real)]
    return outputs


# ----------------------------------------------------------------------------- transformers


def hf_generate(model, prompts, max_tokens, batch: int) -> list[list[int]]:
  """Batched greedy ``generate``: left padding, attention mask, the default cache."""
  import torch

  outputs = []
  for start in range(0, len(prompts), batch):
    group = prompts[start:start + batch]
    new = max_tokens[start:start + batch]
    width = max(len(p) for p in group)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in group])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
    with torch.inference_mode():
      out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(new),
                           do_sample=False, pad_token_id=0)
    outputs += [out[b, width:width + new[b]].tolist() for b in range(len(group))]
  return outputs


# ----------------------------------------------------------------------------- runs


def _paged_engine(path, bench: ThroughputBench, max_seqs: int) -> LLM:
  return LLM.from_pretrained(
      path, dtype="float32", impl="xla", block_size=bench.block_size,
      num_blocks=bench.num_blocks, max_seqs=max_seqs,
      max_tokens_per_step=max(bench.max_tokens_per_step, 2 * max_seqs),
      max_model_len=bench.max_len, steps_per_call=bench.steps_per_call,
      enable_prefix_caching=False)


def _timed(fn) -> tuple[float, object]:
  start = time.perf_counter()
  out = fn()
  return time.perf_counter() - start, out


def run(bench: ThroughputBench) -> dict:
  """The main comparison (rows) and the batch-size sweep (sweep rows)."""
  import torch
  import transformers

  w = bench.workload
  prompts, params = make_requests(w)
  max_tokens = [p.max_tokens for p in params]
  num_tokens = sum(max_tokens)
  with tempfile.TemporaryDirectory() as path:
    save_checkpoint(bench.model, path)
    engines = {bench.max_seqs: _paged_engine(path, bench, bench.max_seqs)}
    hf_model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
  hf_model.eval()
  hf_model.generation_config.eos_token_id = None  # ignore_eos, as the other two
  hf_model.generation_config.pad_token_id = 0
  model = engines[bench.max_seqs].model
  contiguous = {}

  def contiguous_for(batch):
    if batch not in contiguous:
      contiguous[batch] = ContiguousStaticBatch(model, batch=batch, max_len=bench.max_len,
                                                max_new=w.max_output_len,
                                                block_size=bench.block_size)
    return contiguous[batch]

  b = bench.contiguous_batch
  if b < 1:
    raise ValueError(f"num_blocks={bench.num_blocks} holds no sequence of the declared "
                     f"maximum length {bench.max_len}")
  systems = {
      PAGED: lambda: [list(o.token_ids)
                      for o in engines[bench.max_seqs].generate(prompts, params)],
      CONTIGUOUS: lambda: contiguous_for(b).generate(prompts, max_tokens),
      HF: lambda: hf_generate(hf_model, prompts, max_tokens, b),
  }
  outputs = {name: fn() for name, fn in systems.items()}  # warm-up: every compile
  seconds = {name: [] for name in systems}
  names = list(systems)
  for r in range(bench.rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      engines[bench.max_seqs].reset_stats()
      dt, outputs[name] = _timed(systems[name])
      seconds[name].append(dt)
      if name == PAGED:
        stats = engines[bench.max_seqs].stats
  reference = outputs[PAGED]
  batch_of = {PAGED: bench.max_seqs, CONTIGUOUS: b, HF: b}
  reserved = {PAGED: f"{bench.num_blocks * bench.block_size} (pool)",
              CONTIGUOUS: f"{b * bench.blocks_per_seq * bench.block_size} ({b} x "
                          f"{bench.blocks_per_seq * bench.block_size})",
              HF: f"at most {b * bench.max_len} (grows per batch)"}
  rows = []
  for name in names:
    same = np.mean([a == o for a, o in zip(reference, outputs[name])])
    rows.append(dict(system=name, batch=batch_of[name], kv_tokens=reserved[name],
                     tokens_per_s=num_tokens / statistics.median(seconds[name]),
                     same_tokens=float(same)))
  by = {r["system"]: r["tokens_per_s"] for r in rows}
  for row in rows:
    row["vs_contiguous"] = row["tokens_per_s"] / by[CONTIGUOUS]
    row["vs_transformers"] = row["tokens_per_s"] / by[HF]

  # Sweep: tokens/s against batch size at the same budget.
  sweep = []
  contiguous_batches = list(bench.sweep_contiguous or ())
  if bench.sweep_contiguous is None:
    contiguous_batches = [1 << i for i in range(b.bit_length())]
    if contiguous_batches[-1] != b:
      contiguous_batches.append(b)
  missing = [s for s in bench.sweep_max_seqs if s not in engines]
  if missing:
    with tempfile.TemporaryDirectory() as path:
      save_checkpoint(bench.model, path)
      for s in missing:
        engines[s] = _paged_engine(path, bench, s)
  runs = [(PAGED, s, lambda s=s: engines[s].generate(prompts, params))
          for s in bench.sweep_max_seqs]
  runs += [(CONTIGUOUS, c, lambda c=c: contiguous_for(c).generate(prompts, max_tokens))
           for c in contiguous_batches]
  runs += [(HF, h, lambda h=h: hf_generate(hf_model, prompts, max_tokens, h))
           for h in bench.sweep_hf]
  for _, _, fn in runs:  # warm-up: XLA compiles; torch builds its kernels for each new shape
    fn()  # (a cold transformers run at a new batch size measured ~50x slower here)
  times = {(name, size): [] for name, size, _ in runs}
  preempted = {}
  for _ in range(bench.sweep_rounds):
    for name, size, fn in runs:
      if name == PAGED:
        engines[size].reset_stats()
      times[name, size].append(_timed(fn)[0])
      if name == PAGED:
        preempted[size] = engines[size].stats["preemptions"]
  for name, size, _ in runs:
    sweep.append(dict(system=name, batch=size,
                      tokens_per_s=num_tokens / statistics.median(times[name, size]),
                      preemptions=preempted.get(size, 0) if name == PAGED else 0))
  return dict(rows=rows, sweep=sweep, num_tokens=num_tokens, engine_stats=stats,
              torch_threads=torch.get_num_threads())


# ----------------------------------------------------------------------------- report


def main_table(rows) -> str:
  lines = ["| system | batch (max concurrent) | KV token slots | tokens/s | vs contiguous "
           "| vs transformers | same tokens as paged |",
           "|---|---:|---|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['system']} | {r['batch']} | {r['kv_tokens']} | "
                 f"{r['tokens_per_s']:.0f} | {r['vs_contiguous']:.2f}x | "
                 f"{r['vs_transformers']:.2f}x | {100 * r['same_tokens']:.0f}% |")
  return "\n".join(lines)


def sweep_table(sweep) -> str:
  lines = ["| system | batch size (max_seqs / B) | tokens/s | preemptions |",
           "|---|---:|---:|---:|"]
  for r in sweep:
    lines.append(f"| {r['system']} | {r['batch']} | {r['tokens_per_s']:.0f} | "
                 f"{r['preemptions']} |")
  return "\n".join(lines)


def plot(result: dict, bench: ThroughputBench, path: pathlib.Path) -> str:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return "matplotlib is not importable here: no plot written"
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, marker in ((PAGED, "o"), (CONTIGUOUS, "s")):
    pts = [(r["batch"], r["tokens_per_s"]) for r in result["sweep"] if r["system"] == name]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=name)
  hf = sorted([(r["batch"], r["tokens_per_s"]) for r in result["rows"] if r["system"] == HF]
              + [(r["batch"], r["tokens_per_s"]) for r in result["sweep"]
                 if r["system"] == HF])
  ax.plot([p[0] for p in hf], [p[1] for p in hf], marker="^", label=HF)
  ax.axvline(bench.contiguous_batch, color="grey", linestyle=":", linewidth=1)
  ax.text(bench.contiguous_batch, ax.get_ylim()[1] * 0.95, " contiguous limit",
          color="grey", fontsize=8, va="top")
  ax.set_xlabel("batch size (max_seqs for paged, B for contiguous and transformers)")
  ax.set_ylabel("generated tokens/s")
  ax.set_title(f"{bench.workload.num_requests} long-tailed requests, KV budget "
               f"{bench.num_blocks} x {bench.block_size} tokens")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  return f"plot written to {path.name}"


def machine() -> str:
  load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
  return (f"{platform.machine()} CPU, {os.cpu_count()} cores visible, shared with other jobs "
          f"(load average {load} at the end); jax {jax.__version__}, backend "
          f"{jax.default_backend()}")


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="tiny queue, seconds; no files")
  args = parser.parse_args(argv)
  bench = QUICK if args.quick else FULL
  start = time.perf_counter()
  result = run(bench)
  w, m = bench.workload, bench.model
  import torch
  import transformers
  desc = (
      f"{w.num_requests} requests queued at t=0 (`paged_jax.workload`: prompts log-normal "
      f"median {w.prompt_median} sigma {w.prompt_sigma} max {w.max_prompt_len}; outputs "
      f"median {w.output_median} sigma {w.output_sigma} max {w.max_output_len}; seed "
      f"{w.seed}; {result['num_tokens']} generated tokens; greedy, ignore_eos); declared "
      f"max length {bench.max_len}. Checkpoint: random Llama L={m.num_hidden_layers} "
      f"E={m.hidden_size} I={m.intermediate_size} H={m.num_attention_heads} "
      f"K={m.num_key_value_heads} D={m.head_dim} V={m.vocab_size}, float32. KV budget "
      f"N={bench.num_blocks} blocks x Z={bench.block_size}. Paged: max_seqs "
      f"{bench.max_seqs}, max_tokens_per_step "
      f"{max(bench.max_tokens_per_step, 2 * bench.max_seqs)}, steps_per_call "
      f"{bench.steps_per_call}, impl xla, prefix caching off. Contiguous: B="
      f"{bench.contiguous_batch}. transformers {transformers.__version__} (torch "
      f"{torch.__version__}, {result['torch_threads']} threads): batches of B="
      f"{bench.contiguous_batch} (its cache then stays within the budget). Median of "
      f"{bench.rounds} rounds (order rotated), after a warm-up "
      f"run of each; the sweep: median of {bench.sweep_rounds}, max_tokens_per_step = "
      f"max({bench.max_tokens_per_step}, 2 x max_seqs).")
  stats = result["engine_stats"]
  engine_line = (f"Paged engine, last main run: {stats['steps']} steps in "
                 f"{stats['device_calls']} device calls, {stats['preemptions']} preemptions, "
                 f"KV utilisation {100 * stats['kv_utilization']:.1f}%, peak "
                 f"{stats['peak_blocks_in_use']} of {stats['num_blocks']} blocks.")
  text = "\n".join([desc, "", main_table(result["rows"]), "", engine_line, "",
                    "Tokens/s against batch size (same queue; same budget except "
                    "transformers above B):", "",
                    sweep_table(result["sweep"]), ""])
  print(text)
  print(f"{time.perf_counter() - start:.1f} s")
  if not args.quick:
    note = plot(result, bench, PLOT_PATH)
    print(note)
    command = " ".join(["python benchmarks/throughput.py", *(
        argv if argv is not None else sys.argv[1:])]).strip()
    RESULTS_PATH.write_text(
        "## Serving throughput at equal KV budget (`benchmarks/throughput.py`)\n\n"
        f"Command: `{command}`\n\nMachine: {machine()}.\n\n{text}\n{note}.\n")
    print(f"wrote {RESULTS_PATH}")
  return result


if __name__ == "__main__":
  main()
