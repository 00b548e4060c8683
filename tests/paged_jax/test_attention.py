"""paged_attention (reference and XLA impls) against an independent float64 oracle."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import types
import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax import (KVCache, allocator, checked_paged_attention, paged_attention,
                       resolve_impl, validate_attention_inputs)
from paged_jax.pallas_kernels.xla import XlaTiling, ragged_paged_attention as xla_attention
from tests import attention_cases as cases

IMPLS = ("reference", "xla")


def run(case: cases.Case, impl: str, **kwargs):
  q, k_pages, v_pages, layer, kv_lens, tables, cu, num_seqs = case.jax_args()
  cache = KVCache(k_pages=k_pages, v_pages=v_pages)
  return paged_attention(q, cache, layer, kv_lens, tables, cu, num_seqs, impl=impl, **kwargs)


def check(case: cases.Case, out, dtype) -> None:
  out = np.asarray(out.astype(jnp.float32))
  assert np.all(np.isfinite(out)), "output must be finite (NaN pages were read)"
  expected = cases.oracle(case)
  live = int(case.cu_q_lens[case.num_seqs])
  np.testing.assert_allclose(out[:live], expected[:live], **cases.tolerance(dtype))
  np.testing.assert_array_equal(out[live:], 0.0)  # padding rows are zero


GRID = list(itertools.product([jnp.float32, jnp.bfloat16], [8, 16, 32], [1, 4, 8], [64, 128]))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,block_size,group,head_dim", GRID)
def test_grid_against_float64_oracle(impl, dtype, block_size, group, head_dim):
  q_lens, kv_lens = cases.mixed_lengths(block_size)
  seed = zlib.crc32(f"{impl}-{jnp.dtype(dtype)}-{block_size}-{group}-{head_dim}".encode())
  case = cases.make_case(seed, q_lens=q_lens, kv_lens=kv_lens, num_kv_heads=2 if group < 8
                         else 1, group=group, head_dim=head_dim, block_size=block_size,
                         dtype=dtype)
  check(case, run(case, impl), dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_computed_case(impl):
  # One sequence, K = H = D = 1, block size 2, sm_scale 1. Keys at positions 0, 1, 2 are
  # 0, ln 2, ln 3 and values 3, 6, 9; the two queries (q_len 2 of kv_len 3) are 1.
  # Query 0 sits at position 1: weights e^0 : e^ln2 = 1 : 2, so 3/3 + 6*2/3 = 5.
  # Query 1 sits at position 2: weights 1 : 2 : 3 over 6, so (3 + 12 + 27) / 6 = 7.
  # Logical block 0 is physical block 3, logical block 1 is physical block 1; everything
  # else (blocks 0 and 2, and offset 1 of block 1) is NaN and must never be read.
  k_pages, v_pages = cases.hand_case_pages()
  cache = KVCache(k_pages=jnp.asarray(k_pages), v_pages=jnp.asarray(v_pages))
  q = jnp.ones((3, 1, 1), jnp.float32)  # row 2 is padding
  out = paged_attention(q, cache, 0, jnp.array([3], jnp.int32), jnp.array([[3, 1]], jnp.int32),
                        jnp.array([0, 2], jnp.int32), jnp.int32(1), sm_scale=1.0, impl=impl)
  np.testing.assert_allclose(np.asarray(out)[:, 0, 0], [5.0, 7.0, 0.0], rtol=1e-6)


class VariantsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_variants_match_oracle(self):
    for impl, dtype in itertools.product(IMPLS, [jnp.float32, jnp.bfloat16]):
      q_lens, kv_lens = cases.mixed_lengths(8)
      case = cases.make_case(7, q_lens=q_lens, kv_lens=kv_lens, group=4, head_dim=64,
                             dtype=dtype)
      q, k_pages, v_pages, layer, kv_lens_S, tables, cu, num_seqs = case.jax_args()

      @self.variant
      def attend(q, k_pages, v_pages, layer, kv_lens_S, tables, cu, num_seqs):
        cache = KVCache(k_pages=k_pages, v_pages=v_pages)
        return paged_attention(q, cache, layer, kv_lens_S, tables, cu, num_seqs, impl=impl)

      check(case, attend(q, k_pages, v_pages, jnp.int32(layer), kv_lens_S, tables, cu,
                         num_seqs), dtype)


@pytest.mark.parametrize("q_tile,pages_per_chunk", [(1, 1), (2, 3), (4, 1), (8, 2), (64, 8)])
def test_xla_tilings_agree(q_tile, pages_per_chunk):
  q_lens, kv_lens = cases.mixed_lengths(8)
  case = cases.make_case(3, q_lens=q_lens, kv_lens=kv_lens, group=2, head_dim=64)
  out = xla_attention(*case.jax_args(), sm_scale=64 ** -0.5,
                      tiling=XlaTiling(q_tile=q_tile, pages_per_chunk=pages_per_chunk))
  check(case, out, jnp.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_long_context_and_single_sequence(impl):
  # One long prefill, then one long decode: many chunks in the XLA loop.
  for q_lens, kv_lens in (([40], [300]), ([1], [513])):
    case = cases.make_case(11, q_lens=q_lens, kv_lens=kv_lens, block_size=16, group=2,
                           padding_seqs=0, padding_tokens=0)
    check(case, run(case, impl), jnp.float32)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_padding_and_empty_batches(impl):
  case = cases.make_case(5, q_lens=[0, 0], kv_lens=[4, 0], padding_tokens=3)
  out = run(case, impl)
  np.testing.assert_array_equal(np.asarray(out), 0.0)
  case = cases.make_case(5, q_lens=[2], kv_lens=[4])
  case.num_seqs = 0  # every row is padding
  np.testing.assert_array_equal(np.asarray(run(case, impl)), 0.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_sm_scale_is_applied(impl):
  q_lens, kv_lens = cases.mixed_lengths(8)
  case = cases.make_case(2, q_lens=q_lens, kv_lens=kv_lens)
  out = np.asarray(run(case, impl, sm_scale=0.3))
  np.testing.assert_allclose(out[: sum(q_lens)], cases.oracle(case, 0.3)[: sum(q_lens)],
                             rtol=1e-5, atol=1e-5)


def test_traced_layer_selects_pages():
  q_lens, kv_lens = cases.mixed_lengths(8)
  case = cases.make_case(4, q_lens=q_lens, kv_lens=kv_lens, layer=0)
  q, k_pages, v_pages, _, kv_lens_S, tables, cu, num_seqs = case.jax_args()
  cache = KVCache(k_pages=k_pages, v_pages=v_pages)
  fn = jax.jit(lambda layer: paged_attention(q, cache, layer, kv_lens_S, tables, cu, num_seqs,
                                             impl="xla"))
  check(case, fn(jnp.int32(0)), jnp.float32)
  case.layer = 1
  check(case, fn(jnp.int32(1)), jnp.float32)


def test_auto_resolves_to_xla_on_cpu():
  assert resolve_impl("auto") == "xla"
  assert resolve_impl("reference") == "reference"


@pytest.fixture
def without_triton(monkeypatch):
  """This process as under a JAX without Pallas's Triton backend (being removed)."""
  import sys
  from jax.experimental import pallas
  monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)
  monkeypatch.delattr(pallas, "triton", raising=False)  # else `from pallas import triton` finds it
  for name in list(sys.modules):
    if name.startswith("paged_jax.pallas_kernels.gpu"):
      monkeypatch.delitem(sys.modules, name)
  return monkeypatch


def _on_gpu(monkeypatch, compute_capability="9.0"):
  """This process as on a CUDA device of ``compute_capability`` (None: a device that does
  not say, as a CPU-faked or ROCm one)."""
  from paged_jax import attention
  device = types.SimpleNamespace(platform="gpu", device_kind="fake")
  if compute_capability is not None:
    device.compute_capability = compute_capability
  monkeypatch.setattr(attention.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(attention, "_default_device", lambda: device)


def _auto_for(args) -> str:
  from paged_jax import attention
  k_bits, _, kv_dtype = attention._kernel_args(args["cache"])
  return attention._auto_impl(args["q"], k_bits, args["block_tables"], kv_dtype, None)


def test_auto_on_a_gpu_without_triton_takes_mosaic_never_a_missing_backend(without_triton):
  from paged_jax import attention
  from paged_jax.pallas_kernels import mosaic_gpu
  monkeypatch = without_triton
  _on_gpu(monkeypatch, "9.0")
  assert attention._pallas_impl("pallas_gpu") is None  # import failed: not there
  assert resolve_impl("auto") == "pallas_mosaic_gpu"
  args = _good_args()
  k_bits, _, kv_dtype = attention._kernel_args(args["cache"])
  assert _auto_for(args) == "pallas_mosaic_gpu", mosaic_gpu.unsupported_reason(
      args["q"], k_bits, args["block_tables"], kv_dtype=kv_dtype)
  # Shapes Mosaic GPU refuses (H not a multiple of K) and no Triton: XLA, never a
  # kernel that is not there.
  monkeypatch.setattr(mosaic_gpu, "unsupported_reason", lambda *a, **k: "refused")
  assert _auto_for(args) == "xla"
  # JAX without the Mosaic GPU pieces either: "auto" is XLA, explicit names say why.
  monkeypatch.setattr(mosaic_gpu, "available", lambda: False)
  assert resolve_impl("auto") == "xla"
  with pytest.raises(NotImplementedError, match="pallas_gpu.*lacks"):
    _call(impl="pallas_gpu")
  with pytest.raises(NotImplementedError, match="pallas_mosaic_gpu.*lacks"):
    _call(impl="pallas_mosaic_gpu")


@pytest.mark.parametrize("compute_capability", ["9.0", "8.0", "8.9", "10.0", "12.0", None,
                                                "gfx90a"])
def test_auto_on_a_gpu_takes_triton_while_jax_has_it(monkeypatch, compute_capability):
  # Measured on an H200 (benchmarks/RESULTS.md), the Triton kernel decodes 1.4-1.7x faster
  # than the Mosaic GPU one over KVCache pools: while JAX ships Triton, "auto" takes it on
  # every GPU, Hopper included, and with Mosaic GPU there too.
  from paged_jax import attention
  from paged_jax.pallas_kernels import mosaic_gpu
  _on_gpu(monkeypatch, compute_capability)
  assert mosaic_gpu.available()
  assert resolve_impl("auto") == "pallas_gpu"
  assert _auto_for(_good_args()) == "pallas_gpu"
  monkeypatch.setattr(mosaic_gpu, "available", lambda: False)
  assert resolve_impl("auto") == "pallas_gpu"
  monkeypatch.setattr(attention.jax, "default_backend", lambda: "tpu")
  assert resolve_impl("auto") == "pallas_tpu"


def test_triton_refuses_a_one_byte_pool_its_32_bit_offsets_cannot_address(monkeypatch):
  # JAX's Triton lowering addresses a ref with 32-bit element offsets up to 2**32 bytes: an
  # int8 / float8 pool (Llama-3.2-1B at 20000 blocks: 2.6e9 elements) would read its high
  # blocks at negative offsets. The kernel refuses it, so "auto" takes Mosaic GPU or XLA;
  # a bfloat16 pool of as many elements (64-bit offsets) and a smaller one are taken.
  from paged_jax import attention
  from paged_jax.pallas_kernels import gpu, mosaic_gpu
  _on_gpu(monkeypatch, "9.0")
  q = jax.ShapeDtypeStruct((8, 32, 64), jnp.bfloat16)
  tables = jax.ShapeDtypeStruct((8, 256), jnp.int32)
  big = (16, 8, 20000, 16, 64)  # 2.6e9 elements
  for dtype, kv_dtype, refused in ((jnp.int8, jnp.int8, True),
                                   (jnp.uint8, jnp.float8_e4m3fn, True),
                                   (jnp.uint16, jnp.bfloat16, False)):
    pages = jax.ShapeDtypeStruct(big, dtype)
    reason = gpu.unsupported_reason(q, pages, tables, kv_dtype=kv_dtype)
    assert (reason is not None) == refused, reason
    if refused:
      assert "32-bit offsets" in reason and f"k_pages.shape={big}" in reason
      assert attention._auto_impl(q, pages, tables, kv_dtype, None) == "pallas_mosaic_gpu"
      monkeypatch.setattr(mosaic_gpu, "available", lambda: False)
      assert attention._auto_impl(q, pages, tables, kv_dtype, None) == "xla"
      monkeypatch.undo()
      _on_gpu(monkeypatch, "9.0")
  small = jax.ShapeDtypeStruct((16, 8, 16384, 16, 64), jnp.int8)  # 2**31 elements: fits
  assert gpu.unsupported_reason(q, small, tables, kv_dtype=jnp.int8) is None


@pytest.mark.parametrize("compute_capability", ["8.0", "8.9", "10.0", "12.0", None, "gfx90a"])
def test_auto_without_triton_takes_mosaic_only_on_hopper(without_triton, compute_capability):
  # The Mosaic GPU kernel is wgmma + TMA (sm_90 only): on Ampere, Ada, Blackwell and a
  # device that does not say, a JAX without Triton leaves XLA, though it has Mosaic GPU.
  from paged_jax.pallas_kernels import mosaic_gpu
  _on_gpu(without_triton, compute_capability)
  args = _good_args()
  assert mosaic_gpu.available()
  assert resolve_impl("auto") == "xla"
  assert _auto_for(args) == "xla"
  _on_gpu(without_triton, "9.0")  # the same process on an H100 / H200: Mosaic
  assert resolve_impl("auto") == "pallas_mosaic_gpu"
  assert _auto_for(args) == "pallas_mosaic_gpu"


def test_auto_on_hopper_without_triton_passes_over_mosaic_only_where_it_refuses(
    without_triton):
  # Mosaic GPU refuses a head dim that is not a multiple of 16 (D = 72): XLA there, with
  # no Triton. Phi-3's D = 96 and float32 at D = 256 (chunks of J = 16) fit: Mosaic.
  from paged_jax.pallas_kernels import mosaic_gpu
  _on_gpu(without_triton, "9.0")
  q_lens, kv_lens = cases.mixed_lengths(8)

  def args_for(head_dim, dtype):
    case = cases.make_case(0, q_lens=q_lens, kv_lens=kv_lens, head_dim=head_dim,
                           dtype=jnp.float32)
    q, k_pages, v_pages, _, _, tables, _, _ = case.jax_args()
    return dict(q=q.astype(dtype), cache=KVCache(k_pages=k_pages.astype(dtype),
                                                 v_pages=v_pages.astype(dtype)),
                block_tables=tables)

  d72 = args_for(72, jnp.bfloat16)
  assert "head_dim D=72" in mosaic_gpu.unsupported_reason(
      d72["q"], d72["cache"].k_pages, d72["block_tables"])
  assert _auto_for(d72) == "xla"
  assert _auto_for(args_for(96, jnp.bfloat16)) == "pallas_mosaic_gpu"
  for dtype in (jnp.float32, jnp.bfloat16):
    assert _auto_for(args_for(256, dtype)) == "pallas_mosaic_gpu"


def _args_of_shape(head_dim, block_size, dtype=jnp.float32):
  q_lens, kv_lens = cases.mixed_lengths(block_size)
  case = cases.make_case(0, q_lens=q_lens, kv_lens=kv_lens, head_dim=head_dim,
                         block_size=block_size, dtype=jnp.float32)
  q, k_pages, v_pages, _, _, tables, _, _ = case.jax_args()
  return dict(q=q.astype(dtype), cache=KVCache(k_pages=k_pages.astype(dtype),
                                               v_pages=v_pages.astype(dtype)),
              block_tables=tables)


def test_auto_passes_over_triton_and_tpu_kernels_that_refuse_the_shapes(monkeypatch):
  # "auto" never picks a kernel that would raise on the shapes: pages of 12 tokens are no
  # power of two (Triton) nor a multiple of 8 (Mosaic GPU, TPU), D = 100 no multiple of 8
  # (TPU): the XLA path there; pages of 16 and D = 96 take the kernels.
  from paged_jax import attention
  from paged_jax.pallas_kernels import gpu, tpu
  _on_gpu(monkeypatch, "9.0")
  z12 = _args_of_shape(64, 12)
  assert "block_size Z=12" in gpu.unsupported_reason(z12["q"], z12["cache"].k_pages,
                                                     z12["block_tables"])
  assert _auto_for(z12) == "xla"
  assert _auto_for(_args_of_shape(96, 16)) == "pallas_gpu"
  monkeypatch.setattr(attention.jax, "default_backend", lambda: "tpu")
  d100 = _args_of_shape(100, 16)
  assert "head_dim=100" in tpu.unsupported_reason(d100["q"], d100["cache"].k_pages,
                                                  d100["block_tables"])
  assert _auto_for(d100) == "xla" and _auto_for(z12) == "xla"
  assert _auto_for(_args_of_shape(96, 16, jnp.bfloat16)) == "pallas_tpu"


def test_compute_capability_is_read_defensively():
  from paged_jax import attention
  cc = attention._compute_capability
  assert cc(types.SimpleNamespace(compute_capability="9.0")) == (9, 0)
  assert cc(types.SimpleNamespace(compute_capability=(8, 6))) == (8, 6)
  assert cc(types.SimpleNamespace(compute_capability="10")) == (10, 0)
  assert cc(types.SimpleNamespace(compute_capability="gfx90a")) is None
  assert cc(types.SimpleNamespace()) is None
  assert cc(jax.devices("cpu")[0]) is None


# --- bad input: each a ValueError naming the argument --------------------------------------


def _good_args():
  q_lens, kv_lens = cases.mixed_lengths(8)
  case = cases.make_case(0, q_lens=q_lens, kv_lens=kv_lens, group=2)
  q, k_pages, v_pages, layer, kv_lens_S, tables, cu, num_seqs = case.jax_args()
  return dict(q=q, cache=KVCache(k_pages=k_pages, v_pages=v_pages), layer=layer,
              kv_lens=kv_lens_S, block_tables=tables, cu_q_lens=cu, num_seqs=num_seqs)


def _call(**overrides):
  args = _good_args()
  impl = overrides.pop("impl", "xla")
  args.update(overrides)
  return paged_attention(**args, impl=impl)


@pytest.mark.parametrize("name,make,match", [
    ("q rank", lambda a: dict(q=a["q"][0]), r"q\.shape"),
    ("q integer", lambda a: dict(q=a["q"].astype(jnp.int32)), r"q\.dtype"),
    ("H not multiple of K", lambda a: dict(q=a["q"][:, :3]),
     r"q\.shape\[1\]=3 \(the query heads H\) must be a multiple of the cache's KV heads K="),
    ("head dim", lambda a: dict(q=a["q"][..., :32]),
     r"q\.shape\[2\]=32 \(the head dim D\) must equal the cache's head dim D="),
    ("tables rank", lambda a: dict(block_tables=a["block_tables"][0]), r"block_tables\.shape"),
    ("tables dtype", lambda a: dict(block_tables=a["block_tables"].astype(jnp.int64)
                                    if jax.config.jax_enable_x64 else
                                    a["block_tables"].astype(jnp.float32)),
     r"block_tables\.dtype"),
    ("kv_lens dtype", lambda a: dict(kv_lens=a["kv_lens"].astype(jnp.uint32)), r"kv_lens\.dtype"),
    ("kv_lens length", lambda a: dict(kv_lens=a["kv_lens"][:-1]), r"kv_lens\.shape"),
    ("cu_q_lens length", lambda a: dict(cu_q_lens=a["cu_q_lens"][:-1]), r"cu_q_lens\.shape"),
    ("cu_q_lens dtype", lambda a: dict(cu_q_lens=a["cu_q_lens"].astype(jnp.float32)),
     r"cu_q_lens\.dtype"),
    ("num_seqs shape", lambda a: dict(num_seqs=jnp.zeros(2, jnp.int32)),
     r"num_seqs\.shape=\(2,\) must be \(\) \(a scalar i32\[\]\)$"),
    ("num_seqs as JAX's ragged kernel takes it", lambda a: dict(num_seqs=jnp.ones(1, jnp.int32)),
     r"num_seqs\.shape=\(1,\) must be \(\) .*i32\[1\]: pass num_seqs\[0\]"),
    ("layer shape", lambda a: dict(layer=jnp.zeros(1, jnp.int32)),
     r"layer\.shape=\(1,\) must be \(\) \(a scalar\)"),
    ("num_seqs range", lambda a: dict(num_seqs=99), r"num_seqs=99"),
    ("num_seqs range, a concrete array", lambda a: dict(num_seqs=jnp.int32(99)),
     r"num_seqs=99 must be in \[0, S="),
    ("layer range", lambda a: dict(layer=2), r"layer=2"),
    ("layer negative", lambda a: dict(layer=-1), r"layer=-1"),
    ("layer float", lambda a: dict(layer=jnp.float32(0)), r"layer\.dtype"),
    ("layer a Python float", lambda a: dict(layer=1.7), r"layer=1\.7 must be an int"),
    ("layer a bool", lambda a: dict(layer=True), r"layer=True must be an int"),
    ("kv_lens a list of floats", lambda a: dict(kv_lens=np.asarray(a["kv_lens"], float).tolist()),
     r"kv_lens\.dtype=float64 must be int32"),
    ("cache type", lambda a: dict(cache=a["cache"].k_pages), r"cache="),
    ("impl", lambda a: dict(impl="cuda_magic"), r"impl='cuda_magic'"),
    ("tables rows", lambda a: dict(block_tables=a["block_tables"][:-1]),
     r"kv_lens\.shape=.* one length per row of block_tables\.shape"),
    ("sm_scale string", lambda a: dict(sm_scale="a"), r"sm_scale='a' must be a real number"),
    ("sm_scale nan", lambda a: dict(sm_scale=float("nan")), r"sm_scale=nan must be a finite"),
    ("sm_scale inf", lambda a: dict(sm_scale=np.inf), r"sm_scale=inf must be a finite"),
    ("sm_scale 0", lambda a: dict(sm_scale=0.0), r"sm_scale=0\.0 must be a finite number > 0"),
    ("sm_scale < 0", lambda a: dict(sm_scale=-0.125), r"sm_scale=-0\.125 must be a finite "),
    ("interpret", lambda a: dict(interpret="yes"), r"interpret='yes' must be a bool"),
    # Empty tables: a gather's TypeError or an IndexError before, each impl its own.
    ("no sequence rows", lambda a: dict(block_tables=a["block_tables"][:0],
                                        kv_lens=a["kv_lens"][:0], cu_q_lens=a["cu_q_lens"][:1],
                                        num_seqs=0),
     r"block_tables\.shape=\(0, \d+\) must be \[S, P\] with S >= 1 and P >= 1"),
    ("no pages", lambda a: dict(block_tables=a["block_tables"][:, :0]),
     r"block_tables\.shape=\(\d+, 0\) must be \[S, P\]"),
    ("num_seqs a float", lambda a: dict(num_seqs=1.0), r"num_seqs=1\.0 must be an int32"),
    # A bool showed as "num_seqs=JitTracer(bool[])"; a string or None failed inside JAX.
    ("num_seqs a bool", lambda a: dict(num_seqs=True), r"num_seqs=True must be an int32 "
     r"scalar \(an int or an integer scalar array\)"),
    ("num_seqs a string", lambda a: dict(num_seqs="1"), r"num_seqs='1' must be an int32"),
    ("num_seqs None", lambda a: dict(num_seqs=None), r"num_seqs=None must be an int32"),
    ("q a list", lambda a: dict(q=np.asarray(a["q"]).tolist()), r"q is a list; must be an "
     r"array \[T, H, D\]"),
])
def test_bad_input_raises_value_error(name, make, match):
  with pytest.raises(ValueError, match=match):
    _call(**make(_good_args()))


def test_num_seqs_of_no_number_type_is_refused_by_every_entry_point():
  # validate_attention_inputs took True and "1" without a word (and None as a TypeError)
  # where paged_attention refused them.
  args = _good_args()
  attend = functools.partial(paged_attention, impl="xla")
  for entry in (attend, checked_paged_attention, validate_attention_inputs):
    for bad in (True, np.bool_(True), "1", None):
      with pytest.raises(ValueError, match=rf"num_seqs={re.escape(repr(bad))} must be an "
                         r"int32 scalar \(an int or an integer scalar array\)"):
        entry(**{**args, "num_seqs": bad})


def test_traced_sm_scale_is_refused_by_name():
  # sm_scale is a constant of the compiled kernels: under jit it must stay static.
  args = _good_args()
  with pytest.raises(ValueError, match="sm_scale is a traced value"):
    jax.jit(lambda scale: paged_attention(**args, sm_scale=scale, impl="xla"))(0.5)
  static = jax.jit(lambda: paged_attention(**args, sm_scale=np.float32(0.5), impl="xla"))()
  np.testing.assert_allclose(static, paged_attention(**args, sm_scale=0.5, impl="xla"))


def test_validate_attention_inputs_checks_values():
  args = _good_args()
  validate_attention_inputs(**args)  # the good case passes
  bad_table = np.asarray(args["block_tables"]).copy()
  bad_table[0, 0] = args["cache"].num_blocks  # out of range, read by sequence 0
  with pytest.raises(ValueError, match=r"block_tables\[0, 0\]"):
    validate_attention_inputs(**{**args, "block_tables": jnp.asarray(bad_table)})
  bad_table[0, 0] = -1
  with pytest.raises(ValueError, match=r"block_tables\[0, 0\]"):
    validate_attention_inputs(**{**args, "block_tables": jnp.asarray(bad_table)})
  kv_lens = np.asarray(args["kv_lens"]).copy()
  kv_lens[2] = 1  # shorter than its q_len of 5
  with pytest.raises(ValueError, match=r"kv_lens\[2\]"):
    validate_attention_inputs(**{**args, "kv_lens": jnp.asarray(kv_lens)})
  cu = np.asarray(args["cu_q_lens"]).copy()
  cu[2], cu[3] = cu[3], cu[2]
  with pytest.raises(ValueError, match=r"non-decreasing"):
    validate_attention_inputs(**{**args, "cu_q_lens": jnp.asarray(cu)})
  cu = np.asarray(args["cu_q_lens"]).copy()
  cu[args["num_seqs"]:] = args["q"].shape[0] + 1
  with pytest.raises(ValueError, match=r"cu_q_lens\[num_seqs\]"):
    validate_attention_inputs(**{**args, "cu_q_lens": jnp.asarray(cu)})


def test_host_index_arrays_of_any_integer_type_are_taken_when_they_fit_int32():
  # np.array([5, 3]) is int64: it was refused ("kv_lens.dtype=int64 must be int32"), and
  # lists were refused as not arrays. Host arrays and lists of ints whose values fit int32
  # are now taken as int32, by paged_attention, checked_paged_attention (whose jit would
  # have converted them before any check) and validate_attention_inputs alike; a value
  # past int32 is refused naming the argument, never wrapped. JAX arrays stay int32 only.
  args = _good_args()
  want = paged_attention(**args, impl="xla")
  host = {**args, "kv_lens": np.asarray(args["kv_lens"]).astype(np.int64),
          "block_tables": np.asarray(args["block_tables"]).astype(np.int64).tolist(),
          "cu_q_lens": np.asarray(args["cu_q_lens"]).astype(np.uint16),
          "num_seqs": np.asarray(args["num_seqs"], np.int64)}
  for attend in (paged_attention, checked_paged_attention):
    np.testing.assert_array_equal(np.asarray(attend(**host, impl="xla")), np.asarray(want))
  validate_attention_inputs(**host)
  huge = np.asarray(args["kv_lens"]).astype(np.int64)
  huge[0] += 2**40  # as an int32 it would wrap to the original length
  for attend in (paged_attention, checked_paged_attention, validate_attention_inputs):
    with pytest.raises(ValueError, match=r"kv_lens holds 1099511627\d+, which does not "
                                         r"fit int32"):
      attend(**{**args, "kv_lens": huge})
    # A Python int past int64 (a NumPy object array): named too, not an OverflowError.
    with pytest.raises(ValueError, match=r"kv_lens holds 2361183241434822606848, which does "):
      attend(**{**args, "kv_lens": [2**71] + np.asarray(args["kv_lens"])[1:].tolist()})
  with pytest.raises(ValueError, match=r"kv_lens\.dtype=float64 must be int32"):
    paged_attention(**{**args, "kv_lens": np.asarray(args["kv_lens"], np.float64)})
  # Under jit a list argument is a list of tracers: refused by name, not a TypeError.
  traced = jax.jit(lambda lens: paged_attention(**{**args, "kv_lens": lens}, impl="xla"))
  with pytest.raises(ValueError, match=r"kv_lens is a list; must be an int32 array"):
    traced([jnp.int32(n) for n in np.asarray(args["kv_lens"])])


def test_validate_attention_inputs_takes_the_window_as_checked_attention_does():
  # A sliding KV group gives back the blocks wholly behind a sequence's window and marks
  # them NO_BLOCK (allocator.slide); the host check refused such a table, which the
  # checkify checks of checked_paged_attention(..., sliding_window=W) accept.
  args = _good_args()
  n = int(args["num_seqs"])
  block_size = args["cache"].block_size
  cu = np.asarray(args["cu_q_lens"])
  before_S = np.asarray(args["kv_lens"])[:n] - np.diff(cu[:n + 1])  # positions before q
  i = int(np.argmax(before_S))
  assert before_S[i] >= block_size  # block 0 lies wholly before a window of W = 1
  table = np.asarray(args["block_tables"]).copy()
  table[i, 0] = allocator.NO_BLOCK
  args["block_tables"] = jnp.asarray(table)
  validate_attention_inputs(**args, sliding_window=1)
  checked_paged_attention(**args, sliding_window=1, impl="xla")
  wide = int(before_S[i]) + 1  # the first query's window reaches position 0: block 0 read
  for window in (None, wide):
    with pytest.raises(ValueError, match=rf"block_tables\[{i}, 0\]=-\d+ must be a block id"):
      validate_attention_inputs(**args, sliding_window=window)
    with pytest.raises(ValueError, match=rf"block_tables\[{i}, 0\]"):
      checked_paged_attention(**args, sliding_window=window, impl="xla")
  with pytest.raises(ValueError, match="sliding_window=0"):
    validate_attention_inputs(**args, sliding_window=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_table_entry_is_never_clamped(impl):
  # A corrupt entry must not silently read a real block (as a clamping gather would): the
  # block is treated as empty (zeros), so the output differs from reading block N - 1.
  case = cases.make_case(9, q_lens=[1], kv_lens=[8], padding_seqs=0, padding_tokens=0,
                         extra_blocks=0)
  case.block_tables_SP[0, 0] = case.k_pages_LKNZD.shape[2]  # == N, out of range
  out = np.asarray(run(case, impl))
  assert np.all(np.isfinite(out))
  np.testing.assert_allclose(out, 0.0, atol=1e-6)  # zero keys, zero values -> zero output


def test_mosaic_gpu_through_the_entry_point_matches_the_reference():
  # impl="pallas_mosaic_gpu" reaches the Mosaic GPU kernel (interpret mode on CPU) with the
  # cache's storage bits and dtype; bfloat16 pages, unused pages NaN.
  q_lens, kv_lens = (1, 3, 1), (9, 20, 33)
  case = cases.make_case(3, q_lens=q_lens, kv_lens=kv_lens, group=2, head_dim=64,
                         block_size=16, dtype=jnp.bfloat16)
  q, k_pages, v_pages, layer, kv_lens_S, tables, cu, num_seqs = case.jax_args()
  cache = KVCache(k_pages=k_pages, v_pages=v_pages)
  args = (q, cache, layer, kv_lens_S, tables, cu, num_seqs)
  out = paged_attention(*args, impl="pallas_mosaic_gpu", interpret=True, sliding_window=12)
  ref = paged_attention(*args, impl="reference", sliding_window=12)
  assert not jnp.isnan(out).any()
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_a_traced_negative_num_seqs_reads_nothing(impl):
  # Invalid (debug names it), but not silently wrong: cu_q_lens[-1] made every row live
  # and the reference read sequence 0's K/V for every row; now no row is live (zeros), as
  # in the kernels.
  args = _good_args()
  attend = jax.jit(lambda n: paged_attention(**{**args, "num_seqs": n}, impl=impl))
  np.testing.assert_array_equal(np.asarray(attend(jnp.int32(-1))), 0.0)


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_mosaic_gpu", "pallas_tpu", "xla"])
def test_kernels_trace_under_x64(impl):
  # With jax_enable_x64 on, the Pallas kernels failed to trace ("lax.div requires arguments
  # to have the same dtypes, got int32, int64"): a Python int divisor became int64 beside
  # the int32 lengths (the GPU kernels until stop 39, the TPU kernel until stop 44). "auto"
  # picks them on their devices. A long decode takes split-K on a GPU.
  from paged_jax.pallas_kernels import mosaic_gpu
  if impl == "pallas_mosaic_gpu" and not mosaic_gpu.interpret_available():
    pytest.skip("this jax has no Mosaic GPU interpret mode")
  case = cases.make_case(30, q_lens=[1, 5], kv_lens=[300, 20], group=2, block_size=16)
  q, k_pages, v_pages, layer, kv_lens, tables, cu, num_seqs = case.jax_args()
  args = (q, KVCache(k_pages=k_pages, v_pages=v_pages), layer, kv_lens, tables, cu, num_seqs)
  variant = dict(sliding_window=200, soft_cap=20.0, sinks=jnp.linspace(-1.0, 1.0, 4))
  want = paged_attention(*args, impl="reference", **variant)
  with jax.enable_x64(True):
    got = paged_attention(*args, impl=impl, interpret=impl != "xla", **variant)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_gpu_kernels_refuse_float64_by_name_and_auto_passes_them_by():
  # Under x64 a float64 q and pool failed inside the Triton kernel's loop (carry float32
  # vs float64), which "auto" would pick on a GPU, and the Mosaic GPU kernel ran them at
  # float32's precision in silence (3.6e-7 off); the reference and XLA compute float64.
  from paged_jax.pallas_kernels import gpu, mosaic_gpu
  case = cases.make_case(31, q_lens=[1, 5], kv_lens=[40, 20], group=2, block_size=16)
  with jax.enable_x64(True):
    q, k_pages, v_pages, layer, kv_lens, tables, cu, num_seqs = case.jax_args()
    q, k_pages, v_pages = (x.astype(jnp.float64) for x in (q, k_pages, v_pages))
    args = (q, KVCache(k_pages=k_pages, v_pages=v_pages), layer, kv_lens, tables, cu,
            num_seqs)
    for kernel, impl in ((gpu, "pallas_gpu"), (mosaic_gpu, "pallas_mosaic_gpu")):
      reason = kernel.unsupported_reason(q, k_pages, tables)
      if impl == "pallas_mosaic_gpu" and not mosaic_gpu.compat.available():
        continue
      assert reason is not None and "float64" in reason, (impl, reason)
      with pytest.raises(ValueError, match=r"q.dtype=float64: the .* kernel computes in "
                                           r"float32 at most"):
        paged_attention(*args, impl=impl, interpret=True)
    got = paged_attention(*args, impl="xla")
    assert got.dtype == jnp.float64
    want = paged_attention(*args, impl="reference")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", ["pallas_gpu", "pallas_mosaic_gpu", "xla"])
def test_a_row_whose_every_score_is_below_minus_1e30_is_attended(impl):
  # The GPU kernels' running max started at -1e30: with sm_scale = 1e30 (any finite
  # positive one is allowed) and every q.k < 0, each exp(s - max) was 0 and the row came
  # out zero. The float64 oracle attends to the nearest key.
  from paged_jax.pallas_kernels import mosaic_gpu
  if impl == "pallas_mosaic_gpu" and not mosaic_gpu.interpret_available():
    pytest.skip("this jax has no Mosaic GPU interpret mode")
  case = cases.make_case(32, q_lens=[1, 2], kv_lens=[3, 20], group=2, block_size=16)
  # Every key positive, every query negative: every q.k < 0.
  case = dataclasses.replace(case, q_THD=-np.abs(case.q_THD),
                             k_pages_LKNZD=np.abs(case.k_pages_LKNZD))
  q, k_pages, v_pages, layer, kv_lens, tables, cu, num_seqs = case.jax_args()
  args = (q, KVCache(k_pages=k_pages, v_pages=v_pages), layer, kv_lens, tables, cu, num_seqs)
  want = paged_attention(*args, impl="reference", sm_scale=1e30)
  got = paged_attention(*args, impl=impl, sm_scale=1e30,
                        **({} if impl == "xla" else {"interpret": True}))
  assert np.abs(np.asarray(want)[:3]).max() > 0.1
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_num_seqs_may_be_any_host_integer_scalar():
  # A NumPy integer (np.int64, as indexing or len of an array gives) was refused with
  # "num_seqs.dtype=int64 must be int32" where the Python int of the same value passed;
  # a device array must still be int32.
  args = _good_args()
  want = paged_attention(**args, impl="xla")
  n = int(args["num_seqs"])
  for host in (n, np.int64(n), np.int32(n), np.uint8(n)):
    got = paged_attention(**{**args, "num_seqs": host}, impl="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    validate_attention_inputs(**{**args, "num_seqs": host})
    np.testing.assert_array_equal(np.asarray(checked_paged_attention(
        **{**args, "num_seqs": host}, impl="xla")), np.asarray(want))
  rows = args["block_tables"].shape[0]
  with pytest.raises(ValueError, match=rf"num_seqs={rows + 1} must be in \[0, S={rows}\]"):
    paged_attention(**{**args, "num_seqs": np.int64(rows + 1)}, impl="xla")
  with pytest.raises(ValueError, match=r"num_seqs\.dtype=int16 must be int32"):
    paged_attention(**{**args, "num_seqs": jnp.asarray(n, jnp.int16)}, impl="xla")
