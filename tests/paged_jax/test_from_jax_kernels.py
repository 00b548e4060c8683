"""README's "Coming from JAX's own paged attention": its lines, run as written, turn pages in
JAX's layouts into a ``KVCache`` whose attention equals JAX's on the same inputs (JAX's GPU
kernel in interpret mode; the reference of JAX's TPU ragged kernel, which does not run in
TPU interpret mode with jax 0.10.2)."""

from __future__ import annotations

import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import KVCache, paged_attention

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _snippet() -> tuple[str, str]:
  """README's lines for JAX's GPU layout, and those for its TPU layout."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    code = re.search(r"<!-- from-jax -->\n```python\n(.+?)\n```", f.read(), re.S).group(1)
  gpu, tpu = code.split("# JAX's TPU")
  return gpu, "# JAX's TPU" + tpu


def _pages(rng, kv_lens, num_pages, page_size, fill):
  """Shuffled tables [S, P] and, per sequence, which page holds each token."""
  order = rng.permutation(num_pages)
  max_pages = max(-(-n // page_size) for n in kv_lens)
  tables = np.full((len(kv_lens), max_pages), order[-1], np.int32)  # unused: some page
  used = 0
  for s, n in enumerate(kv_lens):
    pages = order[used:used + -(-n // page_size)]
    tables[s, :len(pages)] = pages
    for t in range(n):
      fill(pages[t // page_size], t % page_size)
    used += len(pages)
  return tables


def test_gpu_pages_as_readme_ports_them():
  gpu_pallas = pytest.importorskip("jax.experimental.pallas.ops.gpu.paged_attention")
  rng = np.random.default_rng(0)
  num_kv_heads, group, head_dim, page_size, num_pages = 2, 2, 32, 8, 12
  lengths = [19, 1, 30]
  k_pages = np.full((num_kv_heads, num_pages, page_size, head_dim), np.nan, np.float32)
  v_pages = k_pages.copy()

  def fill(page, offset):
    k_pages[:, page, offset] = rng.normal(size=(num_kv_heads, head_dim))
    v_pages[:, page, offset] = rng.normal(size=(num_kv_heads, head_dim))

  tables = _pages(rng, lengths, num_pages, page_size, fill)
  q = rng.normal(size=(len(lengths), num_kv_heads * group, head_dim)).astype(np.float32)
  # JAX's kernel reads whole compute blocks: NaN in a sequence's unread tail reaches its
  # output, so it gets finite noise there; our pool keeps the NaN.
  finite = lambda x: jnp.asarray(np.where(np.isnan(x), 0.5, x))
  want = gpu_pallas.paged_attention(jnp.asarray(q), finite(k_pages), finite(v_pages),
                                    jnp.asarray(tables), jnp.asarray(lengths, jnp.int32),
                                    attn_logits_soft_cap=3.0, pages_per_compute_block=2,
                                    k_splits=2, interpret=True)
  scope = {"KVCache": KVCache, "jnp": jnp, "k_pages": jnp.asarray(k_pages),
           "v_pages": jnp.asarray(v_pages)}
  exec(compile(_snippet()[0], "README.md", "exec"), scope)  # noqa: S102
  cache = scope["cache"]
  assert cache.k_bits.shape == (1, num_kv_heads, num_pages, page_size, head_dim)
  cu_q_lens = np.arange(len(lengths) + 1, dtype=np.int32)  # one query row per sequence
  for impl in ("reference", "xla"):
    out = paged_attention(jnp.asarray(q), cache, 0, np.asarray(lengths, np.int32), tables,
                          cu_q_lens, len(lengths), sm_scale=1.0, soft_cap=3.0, impl=impl)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=0, atol=2e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float8_e4m3fn, jnp.int8],
                         ids=lambda d: jnp.dtype(d).name)
def test_tpu_ragged_pages_as_readme_ports_them(dtype):
  from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as tpu_ragged
  rng = np.random.default_rng(1)
  num_kv_heads, group, head_dim, page_size, num_pages = 2, 2, 128, 8, 14
  q_lens, kv_lens = [1, 5, 0, 8], [19, 21, 7, 8]  # decode, chunk, no query, prefill
  kv_pages = np.full((num_pages, page_size, 2 * num_kv_heads, head_dim), np.nan, np.float32)

  def fill(page, offset):
    values = rng.normal(size=(2 * num_kv_heads, head_dim))
    kv_pages[page, offset] = values if dtype == jnp.float32 else np.round(values * 4)

  tables = _pages(rng, kv_lens, num_pages, page_size, fill)
  num_seqs, num_tokens = len(q_lens), 20
  cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = rng.normal(size=(num_tokens, num_kv_heads * group, head_dim)).astype(np.float32)
  scales = {} if dtype == jnp.float32 else {"k_scale": 0.25, "v_scale": 0.5}
  # JAX's reference gathers only each sequence's tokens, so NaN pages may stay.
  pages = jnp.asarray(kv_pages).astype(dtype) if dtype != jnp.int8 else jnp.asarray(
      np.nan_to_num(kv_pages), jnp.int8)
  statics = dict(sm_scale=0.2, sliding_window=6, soft_cap=5.0)
  want = tpu_ragged.ref_ragged_paged_attention(
      jnp.asarray(q), pages, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables),
      jnp.asarray(cu_q_lens), jnp.array([num_seqs], jnp.int32), **statics, **scales)
  scope = {"KVCache": KVCache, "jnp": jnp, "kv_pages": pages,
           "k_scale": scales.get("k_scale"), "v_scale": scales.get("v_scale")}
  exec(compile(_snippet()[1], "README.md", "exec"), scope)  # noqa: S102
  cache = scope["cache"]
  assert cache.dtype == jnp.dtype(dtype) and cache.quantized == (dtype != jnp.float32)
  rows = int(cu_q_lens[-1])
  # Float32 rounding, in another order than JAX's: the quantised V values reach 7 (scaled
  # integers) where float32's stay near 1, so their sums' rounding is larger (2.5e-6 seen
  # on an AVX2 CPU; within 2e-6 on others).
  atol = 2e-6 if dtype == jnp.float32 else 1e-5
  for impl in ("reference", "xla"):
    out = paged_attention(jnp.asarray(q), cache, 0, np.asarray(kv_lens, np.int32), tables,
                          cu_q_lens, num_seqs, impl=impl, **statics)
    assert out.shape == q.shape and not np.asarray(out[rows:]).any()  # padding rows: zeros
    np.testing.assert_allclose(np.asarray(out[:rows]), np.asarray(want), rtol=2e-6, atol=atol)
