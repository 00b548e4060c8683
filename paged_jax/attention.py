"""``paged_attention``: the one entry point the models call, dispatching on ``impl``."""

from __future__ import annotations

import importlib
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.pallas_kernels import layout
from paged_jax.pallas_kernels import validation
from paged_jax.pallas_kernels.reference import ragged_paged_attention_reference
from paged_jax.pallas_kernels import xla as xla_kernel
from paged_jax.kv_cache import KVCache, check_not_misused

IMPLS = ("auto", "reference", "xla", "pallas_tpu", "pallas_gpu", "pallas_mosaic_gpu")
_PALLAS_MODULES = {"pallas_tpu": "paged_jax.pallas_kernels.tpu",
                   "pallas_gpu": "paged_jax.pallas_kernels.gpu",
                   "pallas_mosaic_gpu": "paged_jax.pallas_kernels.mosaic_gpu"}
# What "auto" tries on each backend, best first; "xla" is always there. On a GPU the Triton
# kernel comes first while JAX has its backend: measured on an H200 (jax 0.11.2, bf16 pools
# as a KVCache holds them, benchmarks/RESULTS.md) it decodes 1.4-1.7x faster than the Mosaic
# GPU kernel at 8k-32k contexts and batch 8-256 (at batch 1 they are even). The Mosaic
# kernel is what keeps a Pallas GPU path, on Hopper, once JAX drops Triton.
_AUTO_BY_BACKEND = {"tpu": ("pallas_tpu",), "gpu": ("pallas_gpu", "pallas_mosaic_gpu"),
                    "cuda": ("pallas_gpu", "pallas_mosaic_gpu")}
# Kernels that run on only some devices of their backend: the Mosaic GPU kernel is written
# with wgmma and TMA, Hopper's (sm_90) instructions, which neither Ampere (sm_80) nor
# Blackwell (sm_100: tcgen05) runs. "auto" takes it only on a CUDA device of major 9.
_MOSAIC_GPU_MAJOR = 9


def _default_device():
  """The first device of the default backend (the one "auto" picks a kernel for)."""
  return jax.devices()[0]


def _compute_capability(device) -> tuple[int, int] | None:
  """``(major, minor)`` of a CUDA device, or None where the device does not say (CPU,
  TPU, ROCm's "gfx..." names, a stand-in device without the attribute)."""
  capability = getattr(device, "compute_capability", None)
  if isinstance(capability, (tuple, list)) and len(capability) >= 2:
    parts = capability[:2]
  elif isinstance(capability, str):
    parts = capability.split(".")[:2]
  else:
    return None
  try:
    major, minor = int(parts[0]), (int(parts[1]) if len(parts) > 1 else 0)
  except (TypeError, ValueError):
    return None
  return major, minor


def _runs_on_device(impl: str) -> bool:
  """Whether ``impl`` runs on the default device ("auto" asks; explicit names are taken
  as asked). Only the Mosaic GPU kernel is restricted: a CUDA device of compute
  capability 9.x (Hopper)."""
  if impl != "pallas_mosaic_gpu":
    return True
  try:
    device = _default_device()
  except RuntimeError:  # no device of the default backend
    return False
  capability = _compute_capability(device)
  return capability is not None and capability[0] == _MOSAIC_GPU_MAJOR


def _pallas_module(impl: str):
  """The Pallas kernel package of ``impl``, or None when the installed JAX lacks its
  backend (JAX is removing Pallas's Triton backend; older JAX lacks Mosaic GPU pieces)."""
  try:
    module = importlib.import_module(_PALLAS_MODULES[impl])
  except ModuleNotFoundError as e:  # our package, or the JAX backend module it needs
    if e.name is None or not (e.name == _PALLAS_MODULES[impl] or e.name.startswith("jax")):
      raise
    return None
  if hasattr(module, "available") and not module.available():
    return None
  return module


def _pallas_impl(impl: str) -> Callable | None:
  """The Pallas kernel's ``ragged_paged_attention``, or None where JAX lacks its backend."""
  module = _pallas_module(impl)
  return None if module is None else module.ragged_paged_attention


def _first_on_backend(takes: Callable = lambda module: True) -> str:
  """The first kernel "auto" tries on the default backend that runs on its device, that
  the installed JAX has and that ``takes(module)``, else "xla"."""
  for chosen in _AUTO_BY_BACKEND.get(jax.default_backend(), ()):
    if not _runs_on_device(chosen):
      continue
    module = _pallas_module(chosen)
    if module is not None and takes(module):
      return chosen
  return "xla"


def resolve_impl(impl: str) -> str:
  """The concrete implementation ``impl`` names. "auto" picks by the default backend: on
  TPU "pallas_tpu"; on a GPU "pallas_gpu" (Triton: the faster one measured on an H200)
  where the installed JAX still has that backend, else "pallas_mosaic_gpu" when the device
  is Hopper (CUDA compute capability 9.x: the kernel uses wgmma and TMA) and JAX has Mosaic
  GPU; elsewhere, or when none is there, "xla". (Inside ``paged_attention`` "auto" also
  passes over a kernel that refuses the shapes, e.g. pages of 12 tokens on a GPU, or a
  head dim that is not a multiple of 8 on a TPU: every kernel package says why in its
  ``unsupported_reason``.)"""
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r} must be one of {IMPLS}")
  return _first_on_backend() if impl == "auto" else impl


def _auto_impl(q, k_pages, block_tables, kv_dtype, sliding_window) -> str:
  """"auto" for these arguments: the first kernel of the backend that is installed and
  takes their shapes and dtypes (``unsupported_reason``), else "xla"."""

  def takes(module) -> bool:
    refuse = getattr(module, "unsupported_reason", None)
    return refuse is None or refuse(q, k_pages, block_tables, kv_dtype=kv_dtype,
                                    sliding_window=sliding_window) is None

  return _first_on_backend(takes)


def _host_num_seqs(num_seqs, block_tables):
  """A host integer ``num_seqs`` (a Python int, a NumPy scalar of any integer type) in
  range as an int32 scalar, as the kernels take it; anything else as it is (checked by
  ``_static_checks``, which names a value out of range)."""
  if (isinstance(num_seqs, (int, np.integer)) and not isinstance(num_seqs, bool)
      and 0 <= num_seqs <= jnp.shape(block_tables)[0]):
    return jnp.int32(num_seqs)
  return num_seqs


def _host_indices(kv_lens, block_tables, cu_q_lens, num_seqs):
  """The index arguments with host arrays of another integer type (NumPy's default int64,
  lists of ints) as int32 (``validation.host_int32``: values checked to fit). ``ValueError``
  for a ``num_seqs`` that is no number or array at all (a bool, a string, None), named here
  for every entry point: past this point JAX would show it as a tracer or fail to read it."""
  if isinstance(num_seqs, (bool, np.bool_)) or not (
      isinstance(num_seqs, (int, float, np.number)) or hasattr(num_seqs, "dtype")):
    raise ValueError(f"num_seqs={num_seqs!r} must be an int32 scalar (an int or an integer "
                     "scalar array)")
  return tuple(validation.host_int32(name, x) for name, x in (
      ("kv_lens", kv_lens), ("block_tables", block_tables), ("cu_q_lens", cu_q_lens),
      ("num_seqs", num_seqs)))


def _kernel_args(cache: KVCache):
  """``(k_pages, v_pages, kv_dtype)`` as every kernel takes them: the page arrays, and the
  logical K/V dtype when they hold its storage bits (None: they hold K/V as they are).
  The one place that knows how the cache stores its pages."""
  stored = jnp.dtype(cache.k_bits.dtype)
  kv_dtype = None if stored == jnp.dtype(cache.dtype) and not cache.quantized else cache.dtype
  return cache.k_bits, cache.v_bits, kv_dtype


def _static_checks(q, cache, layer, kv_lens, block_tables, cu_q_lens, num_seqs):
  """The shape / dtype checks of ``paged_attention``'s arguments (``ValueError``s naming
  them), shared by its checked and host-side variants; returns ``_kernel_args(cache)``."""
  if not isinstance(cache, KVCache):
    raise ValueError(f"cache={type(cache).__name__} must be a paged_jax.KVCache")
  k_pages, v_pages, kv_dtype = _kernel_args(cache)
  validation.static_validate_inputs(q, k_pages, v_pages, layer, kv_lens, block_tables,
                                    cu_q_lens, num_seqs, kv_dtype=kv_dtype,
                                    **_scale_kwargs(cache))
  return k_pages, v_pages, kv_dtype


def _scale_kwargs(cache: KVCache) -> dict:
  """``k_scales`` / ``v_scales`` ([L, K, N, Z] float32) for a quantised pool, else none."""
  if not cache.quantized:
    return {}
  return dict(k_scales=cache.k_scales, v_scales=cache.v_scales)


def _variant_kwargs(sliding_window, soft_cap, sinks, kv_dtype) -> dict:
  """The keywords a kernel gets for the variants: only those set, so a kernel's defaults
  (None: no window, no cap, no sinks, pages as they are) stay its own."""
  kwargs = dict(sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
                kv_dtype=kv_dtype)
  return {name: value for name, value in kwargs.items() if value is not None}


def paged_attention(q, cache: KVCache, layer, kv_lens, block_tables, cu_q_lens, num_seqs, *,
                    sm_scale: float | None = None, sliding_window: int | None = None,
                    soft_cap: float | None = None, sinks=None, impl: str = "auto",
                    interpret: bool = False, debug: bool = False):
  """Causal attention of a ragged batch of queries over the paged KV cache.

  One call serves prefill, chunked prefill and decode together.

  Args:
    q: [T, H, D] queries. Sequence i owns rows ``cu_q_lens[i]:cu_q_lens[i + 1]``: its last
      ``q_len`` tokens, so row j of it sits at position ``kv_lens[i] - q_len + j`` and sees
      positions ``<=`` its own. H is a multiple of the cache's K: query head h reads KV
      head ``h // (H // K)`` (consecutive query heads share one).
    cache: the ``KVCache`` holding K/V (already written for the new tokens).
    layer: which layer's pages to read (int or traced int scalar).
    kv_lens: i32[S] tokens in each sequence's cache, the new ones included.
    block_tables: i32[S, P] physical block of each logical block.
    cu_q_lens: i32[S + 1] cumulative query lengths, starting at 0. (These three and
      ``num_seqs`` may also be host arrays of another integer type, NumPy's default int64
      or lists: their values must fit int32. A JAX array must be int32.)
    num_seqs: i32[] live sequences; rows past it are padding.
    sm_scale: softmax scale, default ``D ** -0.5``.
    sliding_window: W (static int >= 1) or None: the query at position p sees keys at
      positions k with ``p - W < k <= p`` (W positions, itself included). Pages wholly
      before a query tile's window are never read.
    soft_cap: c (static float > 0) or None: scores ``s = sm_scale * q.k`` become
      ``c * tanh(s / c)`` before the mask and softmax.
    sinks: f32[H] (may be traced; another floating dtype is taken as float32) or None: one
      extra logit per query head in the softmax denominator, with no value:
      ``p_j = exp(s_j) / (exp(sinks[h]) + sum_k exp(s_k))``.
    impl: "auto", "reference", "xla", "pallas_tpu", "pallas_gpu" (Triton backend) or
      "pallas_mosaic_gpu" (Mosaic GPU, Hopper). "auto": on TPU the Pallas TPU kernel; on a
      GPU the Triton one while JAX has that backend (faster, measured on an H200), else
      the Mosaic GPU kernel on a Hopper device (compute capability 9.x) where JAX has it
      and it takes these shapes (``mosaic_gpu.unsupported_reason``); otherwise XLA.
    interpret: run a Pallas impl in its interpret mode (on CPU).
    debug: also check the values (block ids a live sequence reads in ``[0, N)``, lengths
      consistent) with ``jax.experimental.checkify`` checks. Called eagerly, a failed check
      is a ``ValueError`` naming the argument (as ``checked_paged_attention``); under
      ``jit`` wrap the caller in ``checkify.checkify`` and ``throw`` the error;
      without ``debug`` nothing is checked at run time and a bad block id reads as an empty
      block (zeros), never as a clamped real block. These are user checks (checkify's
      default ``errors``): its ``index_checks`` (and ``all_checks``) also flag the
      deliberate out-of-range reads that make a bad id read zeros, on any input.

  Returns:
    [T, H, D] in q's dtype; padding rows (past ``cu_q_lens[num_seqs]``) are zero.
  """
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r} must be one of {IMPLS}")
  check_not_misused("layer", layer)  # in a forward over KV groups
  check_not_misused("block_tables", block_tables)
  kv_lens, block_tables, cu_q_lens, num_seqs = _host_indices(kv_lens, block_tables, cu_q_lens,
                                                             num_seqs)
  sinks = validation.float32_sinks(sinks)
  num_seqs = _host_num_seqs(num_seqs, block_tables)
  k_pages, v_pages, kv_dtype = _static_checks(q, cache, layer, kv_lens, block_tables,
                                              cu_q_lens, num_seqs)
  validation.static_validate_variants(q.shape[1], sliding_window=sliding_window,
                                      soft_cap=soft_cap, sinks=sinks)
  sliding_window, soft_cap = validation.canonical_variants(sliding_window, soft_cap)
  if not isinstance(debug, bool):
    raise ValueError(f"{debug=} must be a bool")
  if not isinstance(interpret, bool):
    raise ValueError(f"{interpret=} must be a bool")
  sm_scale = validation.static_scale(sm_scale)
  if debug and not _traced(q, cache, layer, kv_lens, block_tables, cu_q_lens, num_seqs):
    # Called eagerly: a failed check would surface as checkify's JaxRuntimeError; the
    # checked wrapper raises the ValueError naming the argument instead.
    return checked_paged_attention(q, cache, layer, kv_lens, block_tables, cu_q_lens,
                                   num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
                                   soft_cap=soft_cap, sinks=sinks, impl=impl,
                                   interpret=interpret)
  if debug:
    validation.checkify_validate_inputs(q, k_pages, layer, kv_lens, block_tables, cu_q_lens,
                                        num_seqs, sliding_window=sliding_window)
  if sm_scale is None:
    sm_scale = float(q.shape[-1]) ** -0.5
  if not isinstance(layer, (int, np.integer)):
    # A traced layer outside [0, L) (invalid: ``debug`` names it) reads nothing, every row
    # then padding (zeros): the kernels would read a wrapped layer, or past the pool.
    layer = jnp.asarray(layer, jnp.int32)
    layer_ok = (layer >= 0) & (layer < layout.unpack_pages_shape(k_pages.shape)["L"])
    layer, num_seqs = jnp.where(layer_ok, layer, 0), jnp.where(layer_ok, num_seqs, 0)
  args = (q, k_pages, v_pages, layer, kv_lens, block_tables, cu_q_lens, num_seqs)
  variants = _variant_kwargs(sliding_window, soft_cap, sinks, kv_dtype) | _scale_kwargs(cache)
  chosen = (_auto_impl(q, k_pages, block_tables, kv_dtype, sliding_window) if impl == "auto"
            else impl)
  if q.shape[0] == 0:  # no query rows (T = 0): nothing to attend (the reference divides by T)
    return jnp.zeros_like(q)
  if chosen == "reference":
    return ragged_paged_attention_reference(*args, sm_scale=sm_scale, **variants)
  if chosen == "xla":
    return xla_kernel.ragged_paged_attention(*args, sm_scale=sm_scale, **variants)
  kernel = _pallas_impl(chosen)
  if kernel is None:
    raise NotImplementedError(
        f"impl={chosen!r} needs a Pallas backend that jax {jax.__version__} lacks "
        "(impl='auto' picks one that is there)")
  return kernel(*args, sm_scale=sm_scale, interpret=interpret, **variants)


def validate_attention_inputs(q, cache: KVCache, layer, kv_lens, block_tables, cu_q_lens,
                              num_seqs, *, sliding_window: int | None = None) -> None:
  """Host-side check of shapes and values (block ids, lengths); raises ``ValueError``.
  With ``sliding_window``, table entries wholly before a sequence's window may be
  ``NO_BLOCK`` (a sliding KV group gives them back), as in ``checked_paged_attention``."""
  kv_lens, block_tables, cu_q_lens, num_seqs = _host_indices(kv_lens, block_tables, cu_q_lens,
                                                             num_seqs)
  k_pages, _, _ = _static_checks(q, cache, layer, kv_lens, block_tables, cu_q_lens, num_seqs)
  validation.static_validate_variants(q.shape[1], sliding_window=sliding_window)
  validation.dynamic_validate_inputs(q, k_pages, layer, kv_lens, block_tables, cu_q_lens,
                                     num_seqs, sliding_window=sliding_window)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "impl",
                                             "interpret"))
def _checked(q, cache, layer, kv_lens, block_tables, cu_q_lens, num_seqs, sinks, *, sm_scale,
             sliding_window, soft_cap, impl, interpret):
  from jax.experimental import checkify

  def attend(*args):
    return paged_attention(*args, sm_scale=sm_scale, sliding_window=sliding_window,
                           soft_cap=soft_cap, sinks=sinks, impl=impl, interpret=interpret,
                           debug=True)

  return checkify.checkify(attend)(q, cache, layer, kv_lens, block_tables, cu_q_lens,
                                   num_seqs)


def _traced(*args) -> bool:
  """Whether any array in ``args`` (pytrees too) is a tracer: a call under a transform."""
  return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(args))


def checked_paged_attention(q, cache: KVCache, layer, kv_lens, block_tables, cu_q_lens,
                            num_seqs, *, sm_scale: float | None = None,
                            sliding_window: int | None = None, soft_cap: float | None = None,
                            sinks=None, impl: str = "auto", interpret: bool = False):
  """``paged_attention`` in debug mode, jitted, its value checks run on the device.

  Same arguments and result; raises ``ValueError`` naming the argument (an out-of-range
  block id a live sequence reads, inconsistent ``kv_lens`` / ``cu_q_lens``, ``num_seqs`` or
  ``layer`` out of range) after the call, instead of returning a silently masked result.
  """
  if _traced(q, cache, layer, kv_lens, block_tables, cu_q_lens, num_seqs, sinks):
    raise ValueError("checked_paged_attention raises after its call, so it cannot run "
                     "inside jit (or another transformation): there, call paged_attention("
                     "..., debug=True) inside jax.experimental.checkify.checkify and throw "
                     "the error it returns")
  sm_scale = validation.static_scale(sm_scale)
  # paged_attention's static checks, before jit converts the arguments (it would turn a
  # NumPy int64 kv_lens holding 2**40 into int32 without a word).
  kv_lens, block_tables, cu_q_lens, num_seqs = _host_indices(kv_lens, block_tables, cu_q_lens,
                                                             num_seqs)
  sinks = validation.float32_sinks(sinks)
  _static_checks(q, cache, layer, kv_lens, block_tables, cu_q_lens, num_seqs)
  num_seqs = _host_num_seqs(num_seqs, block_tables)
  validation.static_validate_variants(q.shape[1], sliding_window=sliding_window,
                                      soft_cap=soft_cap, sinks=sinks)
  sliding_window, soft_cap = validation.canonical_variants(sliding_window, soft_cap)
  err, out = _checked(q, cache, layer, kv_lens, block_tables, cu_q_lens, num_seqs, sinks,
                      sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                      impl=impl, interpret=interpret)
  message = err.get()
  if message is not None:
    raise ValueError(message.split(" (`check` failed)")[0])
  return out
