"""Ragged paged attention on this machine: reference vs XLA path vs dense contiguous.

For each workload, one run times every implementation side by side (best of repeats,
after a warm-up compile) and reads XLA's compiled temporary memory, so the table is of
ratios measured together. The dense baseline is plain attention over a contiguous
[S, ctx, K, D] cache holding the same live tokens, with the queries padded per sequence
to [S, max q_len] as a static batch would: for decode-only and single-sequence workloads
it does exactly the paged work, so xla / dense is the price of paging there.

The second table is causal prefill of one sequence against torch's fused
``scaled_dot_product_attention(is_causal=True)`` on the same tensors (contiguous, float32,
``torch.set_num_threads(2)``; torch is a benchmark peer only, skipped when not installed),
at 2k and 4k tokens and two head shapes. Both tables also time the XLA path with its
prefill tiles switched off (``XlaTiling.prefill=None``: the unit path alone, what every
call ran before the tiles), so before / after come from one run; timings are interleaved
round by round so that other load on the machine hits every column alike.

    python benchmarks/attention_cpu.py            # both tables
    python benchmarks/attention_cpu.py --quick    # seconds; used by the test suite
    python benchmarks/attention_cpu.py --no-prefill-table --no-chunk-table --repeats 20

A third table times a long prompt's chunks as the engine runs them (the last 256 or 512 rows
of one sequence at context 4,000, 9/3 heads), xla against units-only.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.pallas_kernels.reference import ragged_paged_attention_reference
from paged_jax.pallas_kernels.xla import ragged as xla_ragged
from paged_jax.pallas_kernels.xla import ragged_paged_attention as xla_paged_attention


@dataclasses.dataclass(frozen=True)
class Workload:
  name: str
  q_lens: tuple[int, ...]
  kv_lens: tuple[int, ...]
  num_q_heads: int = 8
  num_kv_heads: int = 2
  head_dim: int = 64
  block_size: int = 16

  @property
  def num_tokens(self) -> int:
    return sum(self.q_lens)


FULL = (
    Workload("decode 16 x 1024", (1,) * 16, (1024,) * 16),
    Workload("decode 4 x 8192", (1,) * 4, (8192,) * 4),
    Workload("prefill 1 x 512", (512,), (512,)),
    Workload("mixed: 1 prefill 256 + 15 decodes 1024", (256,) + (1,) * 15,
             (256,) + (1024,) * 15),
)
QUICK = (
    Workload("decode 4 x 128", (1,) * 4, (128,) * 4),
    Workload("mixed: prefill 32 + 3 decodes", (32, 1, 1, 1), (32, 100, 60, 7)),
)


def build(w: Workload, seed: int = 0):
  rng = np.random.default_rng(seed)
  z = w.block_size
  num_seqs = len(w.q_lens)
  blocks = [-(-k // z) for k in w.kv_lens]
  num_blocks, width = sum(blocks), max(blocks)
  k_pages = rng.normal(size=(1, w.num_kv_heads, num_blocks, z, w.head_dim)).astype(np.float32)
  v_pages = rng.normal(size=k_pages.shape).astype(np.float32)
  perm = rng.permutation(num_blocks)
  tables = np.zeros((num_seqs, width), np.int32)
  used = 0
  for i, b in enumerate(blocks):
    tables[i, :b] = perm[used:used + b]
    used += b
  cu = np.concatenate([[0], np.cumsum(w.q_lens)]).astype(np.int32)
  q = rng.normal(size=(int(cu[-1]), w.num_q_heads, w.head_dim)).astype(np.float32)
  # The same tokens, contiguous: [S, ctx, K, D].
  ctx = width * z
  k_dense = k_pages[0][:, tables].transpose(1, 2, 3, 0, 4).reshape(num_seqs, ctx,
                                                                    w.num_kv_heads, w.head_dim)
  v_dense = v_pages[0][:, tables].transpose(1, 2, 3, 0, 4).reshape(num_seqs, ctx,
                                                                    w.num_kv_heads, w.head_dim)
  paged = (jnp.asarray(q), jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.int32(0),
           jnp.asarray(w.kv_lens, jnp.int32), jnp.asarray(tables), jnp.asarray(cu),
           jnp.int32(num_seqs))
  max_q = max(w.q_lens)
  q_padded = np.zeros((num_seqs, max_q, w.num_q_heads, w.head_dim), np.float32)
  for i, q_len in enumerate(w.q_lens):
    q_padded[i, :q_len] = q[cu[i]:cu[i + 1]]
  dense = (jnp.asarray(q_padded), jnp.asarray(k_dense), jnp.asarray(v_dense),
           jnp.asarray(w.kv_lens, jnp.int32), jnp.asarray(w.q_lens, jnp.int32))
  return paged, dense


@jax.jit
def dense_attention(q_SQHD, k_SCKD, v_SCKD, kv_lens_S, q_lens_S):
  """Causal attention over a contiguous cache, queries padded per sequence to [S, Q]."""
  num_seqs, max_q, num_q_heads, head_dim = q_SQHD.shape
  num_kv_heads = k_SCKD.shape[2]
  q_SQKGD = q_SQHD.reshape(num_seqs, max_q, num_kv_heads, -1, head_dim)
  scores = jnp.einsum("sqkgd,sckd->skgqc", q_SQKGD, k_SCKD) * head_dim ** -0.5
  qpos_SQ = kv_lens_S[:, None] - q_lens_S[:, None] + jnp.arange(max_q)[None, :]
  visible = jnp.arange(k_SCKD.shape[1])[None, None, :] <= qpos_SQ[:, :, None]
  scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("skgqc,sckd->sqkgd", probs, v_SCKD)
  return out.reshape(num_seqs, max_q, num_q_heads, head_dim)


def compile_fn(fn, args):
  compiled = jax.jit(fn).lower(*args).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  out = jax.block_until_ready(compiled(*args))
  return (lambda: jax.block_until_ready(compiled(*args))), temp, out


def interleaved(fns: dict, repeats: int) -> dict:
  """Best (least disturbed) seconds of each zero-argument fn over ``repeats`` rounds of one
  call each, the order rotating every round, so that load from other jobs and the cache
  left by the previous call fall on every column alike."""
  names = list(fns)
  best = {name: float("inf") for name in names}
  for r in range(repeats):
    for name in names[r % len(names):] + names[:r % len(names)]:
      start = time.perf_counter()
      fns[name]()
      best[name] = min(best[name], time.perf_counter() - start)
  return best


def units_only(w_or_args, sm_scale):
  """The XLA path with its prefill tiles off (the unit path alone): the 'before' column."""
  q, _, _, _, _, tables, _, _ = w_or_args
  tiling = xla_ragged.default_tiling(q.shape[0], tables.shape[0], w_or_args[1].shape[3],
                                     tables.shape[1])
  tiling = dataclasses.replace(tiling, prefill=None)
  return lambda *a: xla_paged_attention(*a, sm_scale=sm_scale, tiling=tiling)


def main_table(workloads, repeats: int) -> list[dict]:
  rows = []
  print("| workload | reference ms | xla ms | xla units-only ms | dense ms | xla / dense "
        "| xla / units-only | reference temp MiB | xla temp MiB | dense temp MiB "
        "| max abs(xla - ref) |")
  print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
  for w in workloads:
    paged, dense = build(w)
    sm_scale = w.head_dim ** -0.5
    ref_fn, ref_mem, ref_out = compile_fn(
        lambda *a: ragged_paged_attention_reference(*a, sm_scale=sm_scale), paged)
    xla_fn, xla_mem, xla_out = compile_fn(
        lambda *a: xla_paged_attention(*a, sm_scale=sm_scale), paged)
    tiling = xla_ragged.default_tiling(w.num_tokens, len(w.q_lens), w.block_size,
                                       paged[5].shape[1])
    if xla_ragged.active_prefill_tiling(tiling, w.num_tokens) is None:
      old_fn = xla_fn  # no prefill tiles at this T: the same program
    else:
      old_fn, _, _ = compile_fn(units_only(paged, sm_scale), paged)
    dense_fn, dense_mem, _ = compile_fn(dense_attention, dense)
    # The two XLA programs against each other, then the baselines: reference and dense
    # leave hundreds of MiB of temporaries behind, which would land on whichever call
    # follows them.
    t = interleaved(dict(xla=xla_fn, old=old_fn), repeats)
    t |= interleaved(dict(ref=ref_fn, dense=dense_fn), repeats)
    max_err = float(jnp.max(jnp.abs(xla_out - ref_out)))
    row = dict(workload=w.name, reference_ms=1e3 * t["ref"], xla_ms=1e3 * t["xla"],
               units_only_ms=1e3 * t["old"], dense_ms=1e3 * t["dense"],
               xla_over_dense=t["xla"] / t["dense"], xla_over_units_only=t["xla"] / t["old"],
               reference_temp_mib=ref_mem / 2**20, xla_temp_mib=xla_mem / 2**20,
               dense_temp_mib=dense_mem / 2**20, xla_max_abs_err=max_err)
    rows.append(row)
    print(f"| {w.name} | {row['reference_ms']:.2f} | {row['xla_ms']:.2f} | "
          f"{row['units_only_ms']:.2f} | {row['dense_ms']:.2f} | {row['xla_over_dense']:.2f} | "
          f"{row['xla_over_units_only']:.2f} | {row['reference_temp_mib']:.1f} | "
          f"{row['xla_temp_mib']:.1f} | {row['dense_temp_mib']:.1f} | {max_err:.1e} |",
          flush=True)
  print(f"\njax {jax.__version__}, backend {jax.default_backend()}, "
        f"{jax.device_count()} device(s), float32, H=8 K=2 D=64 Z=16; best of {repeats}; "
        "units-only is the same program as xla below 256 query rows")
  return rows


PREFILL = (  # (tokens, H, K, D)
    (2048, 9, 3, 64),
    (4000, 9, 3, 64),
    (2048, 32, 8, 128),
    (4000, 32, 8, 128),
)
PREFILL_QUICK = ((300, 9, 3, 64),)


def prefill_table(shapes, repeats: int, block_size: int = 16,
                  units_only_column: bool = True) -> list[dict]:
  """Causal prefill of one sequence: xla (default tiling), xla units-only (unless
  ``units_only_column`` is False: one compilation less, for the quick mode), torch SDPA."""
  try:
    import torch
  except ImportError:
    print("\n(prefill table skipped: torch is not installed; it is the benchmark's peer "
          "only: pip install torch)")
    return []
  torch.set_num_threads(2)
  sdpa = torch.nn.functional.scaled_dot_product_attention
  rows = []
  print("\n| prefill tokens | H/K | D | xla ms | xla units-only ms | torch sdpa ms "
        "| xla / torch | units-only / torch | Q x J (prefill tiles) | max abs(xla - torch) |")
  print("|---:|---|---:|---:|---:|---:|---:|---:|---|---:|")
  for num_tokens, num_q_heads, num_kv_heads, head_dim in shapes:
    w = Workload(f"prefill {num_tokens}", (num_tokens,), (num_tokens,), num_q_heads,
                 num_kv_heads, head_dim, block_size)
    paged, dense = build(w)
    sm_scale = head_dim ** -0.5
    xla_fn, _, xla_out = compile_fn(lambda *a: xla_paged_attention(*a, sm_scale=sm_scale),
                                    paged)
    old_fn = (compile_fn(units_only(paged, sm_scale), paged)[0] if units_only_column
              else lambda: None)
    # The same tokens for torch: [1, H, T, D] queries, [1, K, T, D] keys and values.
    q_t = torch.from_numpy(np.asarray(dense[0])[0].transpose(1, 0, 2).copy())[None]
    k_t = torch.from_numpy(np.asarray(dense[1])[0, :num_tokens].transpose(1, 0, 2).copy())[None]
    v_t = torch.from_numpy(np.asarray(dense[2])[0, :num_tokens].transpose(1, 0, 2).copy())[None]

    def torch_fn():
      with torch.no_grad():
        return sdpa(q_t, k_t, v_t, is_causal=True, enable_gqa=True)

    torch_out = torch_fn()[0].numpy().transpose(1, 0, 2)
    t = interleaved(dict(xla=xla_fn, old=old_fn, torch=torch_fn), repeats)
    if not units_only_column:
      t["old"] = float("nan")
    tiling = xla_ragged.default_tiling(num_tokens, 1, block_size, paged[5].shape[1],
                                       num_kv_heads=num_kv_heads,
                                       group=num_q_heads // num_kv_heads).prefill
    tiles = f"{tiling.q_tile} x {tiling.pages_per_chunk * block_size}" if tiling else "-"
    max_err = float(np.max(np.abs(np.asarray(xla_out) - torch_out)))
    row = dict(tokens=num_tokens, heads=f"{num_q_heads}/{num_kv_heads}", head_dim=head_dim,
               xla_ms=1e3 * t["xla"], units_only_ms=1e3 * t["old"], torch_ms=1e3 * t["torch"],
               xla_over_torch=t["xla"] / t["torch"],
               units_only_over_torch=t["old"] / t["torch"], tiles=tiles,
               xla_max_abs_err=max_err)
    rows.append(row)
    print(f"| {num_tokens} | {row['heads']} | {head_dim} | {row['xla_ms']:.1f} | "
          f"{row['units_only_ms']:.1f} | {row['torch_ms']:.1f} | {row['xla_over_torch']:.2f} | "
          f"{row['units_only_over_torch']:.2f} | {tiles} | {max_err:.1e} |", flush=True)
  print(f"\nfloat32, Z={block_size}, torch {torch.__version__} with "
        f"{torch.get_num_threads()} threads, jax on the same cores; best of {repeats}")
  return rows


CHUNKS = (  # (T rows of one sequence, its context): a long prompt's chunks in the engine
    (256, 4000),
    (512, 4000),
)


def chunk_table(chunks, repeats: int, num_q_heads: int = 9, num_kv_heads: int = 3,
                head_dim: int = 64, block_size: int = 16) -> list[dict]:
  """A prompt's chunk as the engine runs it: one sequence's last T rows at a long context,
  in a batch of 4 sequence rows (3 idle): xla against units-only."""
  rows = []
  print(f"\n| chunk rows T | context | xla ms | xla units-only ms | xla / units-only |")
  print("|---:|---:|---:|---:|---:|")
  for num_tokens, context in chunks:
    w = Workload(f"chunk {num_tokens} at {context}", (num_tokens, 0, 0, 0), (context, 0, 0, 0),
                 num_q_heads, num_kv_heads, head_dim, block_size)
    paged, _ = build(w)
    sm_scale = head_dim ** -0.5
    xla_fn, _, xla_out = compile_fn(lambda *a: xla_paged_attention(*a, sm_scale=sm_scale),
                                    paged)
    old_fn, _, old_out = compile_fn(units_only(paged, sm_scale), paged)
    t = interleaved(dict(xla=xla_fn, old=old_fn), repeats)
    row = dict(chunk=num_tokens, context=context, xla_ms=1e3 * t["xla"],
               units_only_ms=1e3 * t["old"], xla_over_units_only=t["xla"] / t["old"],
               xla_max_abs_diff=float(jnp.max(jnp.abs(xla_out - old_out))))
    rows.append(row)
    print(f"| {num_tokens} | {context} | {row['xla_ms']:.1f} | {row['units_only_ms']:.1f} | "
          f"{row['xla_over_units_only']:.2f} |", flush=True)
  print(f"\nfloat32, H/K={num_q_heads}/{num_kv_heads}, D={head_dim}, Z={block_size}; "
        f"best of {repeats}")
  return rows


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="tiny workloads, a few seconds")
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--no-prefill-table", action="store_true",
                      help="skip the prefill table against torch")
  parser.add_argument("--no-chunk-table", action="store_true",
                      help="skip the table of a long prompt's chunks")
  args = parser.parse_args(argv)
  repeats = args.repeats or (3 if args.quick else 10)
  rows = main_table(QUICK if args.quick else FULL, repeats)
  if not args.no_prefill_table:
    rows += prefill_table(PREFILL_QUICK if args.quick else PREFILL,
                          args.repeats or (2 if args.quick else 3),
                          units_only_column=not args.quick)
  if not args.quick and not args.no_chunk_table:
    rows += chunk_table(CHUNKS, args.repeats or 8)
  return rows


if __name__ == "__main__":
  main()
