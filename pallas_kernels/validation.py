"""Input checks shared by every ragged paged attention implementation.

``static_validate_inputs`` runs at trace time on shapes and dtypes and raises ``ValueError``
naming the argument. ``dynamic_validate_inputs`` is a host function over concrete values
(lengths, block ids) for debug runs and tests; kernels never depend on it having run, and
never clamp a bad block id into a real block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.pallas_kernels import layout


def _is_int32(x) -> bool:
  return jnp.dtype(x.dtype) == jnp.int32


def _list_as_array(x):
  """A list or tuple as a NumPy array; anything else, or a list NumPy cannot take (ragged
  nesting, traced items), as it is, for the checks to name."""
  if not isinstance(x, (list, tuple)):
    return x
  try:
    return np.asarray(x)
  except (ValueError, TypeError):
    return x


def check_int32_range(name: str, x) -> None:
  """``ValueError`` naming ``name`` when a host integer input (a NumPy array, a list, a
  Python int) holds a value outside int32: JAX would wrap it silently. A JAX array (a
  tracer too) passes: its dtype is fixed already and, under ``jit``, its values unknown."""
  if isinstance(x, jax.Array):
    return
  try:
    host = np.asarray(x)
  except (ValueError, TypeError):  # ragged nesting, traced items: named by later checks
    return
  if host.dtype == object:  # Python ints past int64: NumPy keeps them as objects
    values = [int(v) for v in host.ravel()
              if isinstance(v, (int, np.integer)) and not isinstance(v, bool)]
    if not values:
      return
    low, high = min(values), max(values)
  elif host.size and np.issubdtype(host.dtype, np.integer):
    low, high = int(host.min()), int(host.max())
  else:
    return
  info = np.iinfo(np.int32)
  if low < info.min or high > info.max:
    raise ValueError(f"{name} holds {high if high > info.max else low}, which does not fit "
                     f"int32 [{info.min}, {info.max}]")


def host_int32(name: str, x):
  """``x`` as int32 when it is a host array of another integer type (a NumPy array, whose
  integers are int64 by default, or a list / tuple of ints) whose values all fit int32;
  anything else as it is, for the checks to judge (a JAX array must be int32 already:
  under ``jit`` its values are not known). ``ValueError`` naming ``name`` for a value
  outside int32 (``check_int32_range``)."""
  x = _list_as_array(x)
  if not isinstance(x, np.ndarray):
    return x
  check_int32_range(name, x)  # Python ints past int64 (object arrays) included
  if x.dtype == np.int32 or x.dtype == np.bool_ or not np.issubdtype(x.dtype, np.integer):
    return x
  return x.astype(np.int32)


def float32_sinks(sinks):
  """``sinks`` as float32 when it is a floating array of another dtype (bfloat16, a NumPy
  float64) or a list of floats; the softmax takes the sink logits in float32 (widening is
  exact). Anything else as it is, for ``static_validate_variants`` to judge."""
  sinks = _list_as_array(sinks)
  dtype = getattr(sinks, "dtype", None)
  if dtype is None or getattr(sinks, "shape", None) is None:
    return sinks
  if jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype) != jnp.float32:
    return jnp.asarray(sinks, jnp.float32)
  return sinks


def check_is_array(name: str, x, what: str = "an array") -> None:
  """``ValueError`` unless ``x`` is an array (anything with ``ndim`` and ``dtype``): a list
  would fail later as an AttributeError."""
  if not (hasattr(x, "ndim") and hasattr(x, "dtype")):
    raise ValueError(f"{name} is a {type(x).__name__}; must be {what} (jax or numpy)")


def static_validate_inputs(q_THD, k_pages_LKNZD, v_pages_LKNZD, layer, kv_lens_S,
                           block_tables_SP, cu_q_lens, num_seqs, *, kv_dtype=None,
                           k_scales=None, v_scales=None) -> None:
  """Shape and dtype checks; raises ``ValueError`` naming the offending argument.

  ``kv_dtype``: the logical K/V dtype when the pages hold its storage bits; the pages'
  dtype must then be ``layout.storage_dtype(kv_dtype)``. A quantised ``kv_dtype`` (int8,
  float8) needs ``k_scales`` and ``v_scales``, float32 ``[L, K, N, Z]``; others take none.
  """
  check_is_array("q", q_THD, "an array [T, H, D]")
  if kv_dtype is not None:
    try:
      logical = jnp.dtype(kv_dtype)
    except TypeError:
      raise ValueError(f"{kv_dtype=} must be a dtype or None") from None
    if not (jnp.issubdtype(logical, jnp.floating) or layout.is_quantized(logical)):
      raise ValueError(f"kv_dtype={logical} must be a floating dtype, int8 or float8, or None")
    expected = layout.storage_dtype(logical)
    for name, pages in (("k_pages", k_pages_LKNZD), ("v_pages", v_pages_LKNZD)):
      if jnp.dtype(pages.dtype) != expected:
        raise ValueError(f"{name}.dtype={pages.dtype} must be {expected}, the storage dtype "
                         f"of kv_dtype={logical}")
  if q_THD.ndim != 3:
    raise ValueError(f"q.shape={tuple(q_THD.shape)} must be rank 3 [T, H, D]")
  if not jnp.issubdtype(q_THD.dtype, jnp.floating):
    raise ValueError(f"q.dtype={q_THD.dtype} must be a floating dtype")
  for name, pages in (("k_pages", k_pages_LKNZD), ("v_pages", v_pages_LKNZD)):
    if pages.ndim != 5:
      raise ValueError(f"{name}.shape={tuple(pages.shape)} must be rank 5 [L, K, N, Z, D]")
    if kv_dtype is None and not jnp.issubdtype(pages.dtype, jnp.floating):
      raise ValueError(f"{name}.dtype={pages.dtype} must be a floating dtype")
  if k_pages_LKNZD.shape != v_pages_LKNZD.shape:
    raise ValueError(f"v_pages.shape={tuple(v_pages_LKNZD.shape)} must equal "
                     f"k_pages.shape={tuple(k_pages_LKNZD.shape)}")
  if k_pages_LKNZD.dtype != v_pages_LKNZD.dtype:
    raise ValueError(f"v_pages.dtype={v_pages_LKNZD.dtype} must equal "
                     f"k_pages.dtype={k_pages_LKNZD.dtype}")
  dims = layout.unpack_pages_shape(k_pages_LKNZD.shape)
  quantized = layout.is_quantized(kv_dtype)
  expected_scales = layout.scales_shape(dims["L"], dims["K"], dims["N"], dims["Z"])
  for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
    if not quantized:
      if scales is not None:
        raise ValueError(f"{name} must be None for kv_dtype={kv_dtype} (only int8 / float8 "
                         "pools carry scales)")
      continue
    if scales is None:
      raise ValueError(f"{name} is required for a quantised pool (kv_dtype={kv_dtype}): "
                       f"float32 {list(expected_scales)}")
    if tuple(scales.shape) != expected_scales or jnp.dtype(scales.dtype) != jnp.float32:
      raise ValueError(f"{name} is {scales.dtype}{list(scales.shape)}; must be float32 "
                       f"{list(expected_scales)} [L, K, N, Z]")
  _, num_q_heads, head_dim = q_THD.shape
  if head_dim != dims["D"]:
    raise ValueError(f"q.shape[2]={head_dim} (the head dim D) must equal the cache's head "
                     f"dim D={dims['D']}")
  if num_q_heads % dims["K"] != 0:
    raise ValueError(f"q.shape[1]={num_q_heads} (the query heads H) must be a multiple of "
                     f"the cache's KV heads K={dims['K']}")
  for name, x in (("kv_lens", kv_lens_S), ("block_tables", block_tables_SP),
                  ("cu_q_lens", cu_q_lens)):
    check_is_array(name, x, "an int32 array")
  if block_tables_SP.ndim != 2:
    raise ValueError(f"block_tables.shape={tuple(block_tables_SP.shape)} must be rank 2 [S, P]")
  if 0 in block_tables_SP.shape:
    raise ValueError(f"block_tables.shape={tuple(block_tables_SP.shape)} must be [S, P] with "
                     "S >= 1 and P >= 1 (num_seqs=0 marks an empty batch)")
  if isinstance(num_seqs, float) or (hasattr(num_seqs, "dtype")
                                     and not jnp.issubdtype(num_seqs.dtype, jnp.integer)):
    raise ValueError(f"num_seqs={num_seqs!r} must be an int32 scalar")
  num_seq_rows = block_tables_SP.shape[0]
  if kv_lens_S.ndim != 1 or kv_lens_S.shape[0] != num_seq_rows:
    raise ValueError(f"kv_lens.shape={tuple(kv_lens_S.shape)} must be [S]=[{num_seq_rows}], "
                     f"one length per row of block_tables.shape="
                     f"{tuple(block_tables_SP.shape)} [S, P]")
  if cu_q_lens.ndim != 1 or cu_q_lens.shape[0] != num_seq_rows + 1:
    raise ValueError(f"cu_q_lens.shape={tuple(cu_q_lens.shape)} must be [S + 1]="
                     f"[{num_seq_rows + 1}], S from block_tables.shape="
                     f"{tuple(block_tables_SP.shape)} [S, P]")
  if jnp.ndim(num_seqs) != 0:
    extra = (" (JAX's ragged paged attention takes i32[1]: pass num_seqs[0])"
             if jnp.shape(num_seqs) == (1,) else "")
    raise ValueError(f"num_seqs.shape={jnp.shape(num_seqs)} must be () (a scalar i32[]){extra}")
  for name, x in (("kv_lens", kv_lens_S), ("block_tables", block_tables_SP),
                  ("cu_q_lens", cu_q_lens)):
    if not _is_int32(x):
      raise ValueError(f"{name}.dtype={x.dtype} must be int32")
  # A host integer scalar (a Python int, a NumPy np.int64) is a value, not an array: any
  # integer type, checked for range below; a device array must be int32.
  if (hasattr(num_seqs, "dtype") and not isinstance(num_seqs, np.integer)
      and not _is_int32(num_seqs)):
    raise ValueError(f"num_seqs.dtype={num_seqs.dtype} must be int32")
  # A value known now (a host int, or a concrete array outside jit) is checked now; a
  # traced one by validate_* / debug=True (checkify).
  known = (isinstance(num_seqs, (int, np.integer, np.ndarray))
           or isinstance(num_seqs, jax.Array) and not isinstance(num_seqs, jax.core.Tracer))
  if known and not 0 <= int(num_seqs) <= num_seq_rows:
    raise ValueError(f"num_seqs={int(num_seqs)} must be in [0, S={num_seq_rows}]")
  check_layer(layer, dims["L"])


def check_layer(layer, num_layers: int) -> None:
  """``layer``: a Python or numpy int in ``[0, L)``, or an integer scalar array (a traced
  one is range-checked by ``dynamic_validate_inputs`` / checkify). A float or a bool is
  refused, not truncated."""
  if hasattr(layer, "dtype"):
    if not jnp.issubdtype(layer.dtype, jnp.integer):
      raise ValueError(f"layer.dtype={layer.dtype} must be an integer dtype")
  elif isinstance(layer, bool) or not isinstance(layer, int):
    raise ValueError(f"layer={layer!r} must be an int (or an integer scalar array)")
  if jnp.ndim(layer) != 0:
    raise ValueError(f"layer.shape={jnp.shape(layer)} must be () (a scalar)")
  if isinstance(layer, (int, np.integer)) and not 0 <= int(layer) < num_layers:
    raise ValueError(f"layer={int(layer)} must be in [0, L={num_layers})")


MAX_SOFT_CAP = 1e30
"""The largest ``soft_cap``: ``s / c`` stays a normal float32 for any score that matters
(1e37 put the quotients among the subnormals, 0.017 off; past float32's range, NaN)."""


def static_validate_variants(num_q_heads: int, *, sliding_window=None, soft_cap=None,
                             sinks=None) -> None:
  """Checks of the attention variants (static: shapes, dtypes, Python values).

  ``sliding_window`` an int >= 1 or None; ``soft_cap`` a finite real number > 0 or None;
  ``sinks`` None or a float32 array of shape ``[H]`` (traced or concrete). Raises
  ``ValueError`` naming the argument and the expected value. A concrete 0-d JAX array (a
  config value as ``jnp.int32(128)``) counts as its value, as a NumPy scalar does.
  """
  sliding_window, soft_cap = _host_scalar(sliding_window), _host_scalar(soft_cap)
  if sliding_window is not None and (
      isinstance(sliding_window, (bool, np.bool_))
      or not isinstance(sliding_window, (int, np.integer)) or sliding_window < 1):
    raise ValueError(f"{sliding_window=} must be an int >= 1 or None")
  if soft_cap is not None and (not _is_real_number(soft_cap) or not np.isfinite(soft_cap)
                               or soft_cap <= 0 or soft_cap > MAX_SOFT_CAP):
    raise ValueError(f"{soft_cap=} must be a finite float > 0 and <= {MAX_SOFT_CAP:g} or "
                     "None (the kernels divide scores by it in float32; a larger cap changes "
                     "no score: pass None)")
  if sinks is not None:
    shape, dtype = getattr(sinks, "shape", None), getattr(sinks, "dtype", None)
    if shape is None or dtype is None:
      raise ValueError(f"sinks={type(sinks).__name__} must be a float32 array of shape "
                       f"[H]=[{num_q_heads}] or None")
    if tuple(shape) != (num_q_heads,):
      raise ValueError(f"sinks.shape={tuple(shape)} must be [H]=[{num_q_heads}] (one logit "
                       "per query head)")
    if jnp.dtype(dtype) != jnp.float32:
      raise ValueError(f"sinks.dtype={dtype} must be float32")


def _host_scalar(x):
  """A concrete 0-d JAX array as its NumPy scalar; anything else as it is."""
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.ndim == 0:
    return np.asarray(x)[()]
  return x


def _is_real_number(x) -> bool:
  """A Python or numpy real scalar (not a bool)."""
  return (not isinstance(x, (bool, np.bool_))
          and isinstance(x, (int, float, np.integer, np.floating)))


def static_scale(sm_scale) -> float | None:
  """``sm_scale`` as a Python float (None stays None): a finite real number known at trace
  time (a constant of the compiled kernels; a concrete 0-d float array is read), else a
  ``ValueError`` naming it."""
  if sm_scale is None:
    return None
  if isinstance(sm_scale, jax.core.Tracer):
    raise ValueError("sm_scale is a traced value; it must be a static Python float (a "
                     "constant of the compiled kernel): pass it as a static argument")
  if not (_is_real_number(sm_scale)
          or (hasattr(sm_scale, "shape") and jnp.shape(sm_scale) == ()
              and jnp.issubdtype(jnp.result_type(sm_scale), jnp.floating))):
    raise ValueError(f"sm_scale={sm_scale!r} must be a real number (float) or None")
  value = float(sm_scale)
  if not np.isfinite(value) or value <= 0:
    raise ValueError(f"sm_scale={value} must be a finite number > 0 (it multiplies q.k "
                     "before the softmax; None: head_dim ** -0.5)")
  return value


def refuse_float64(q_THD, k_pages_LKNZD, kv_dtype, kernel: str) -> None:
  """``ValueError`` for float64 q or KV (``jax_enable_x64``) on a kernel that computes in
  float32 at most (it failed to trace, or ran at float32's precision in silence)."""
  kv = jnp.dtype(k_pages_LKNZD.dtype if kv_dtype is None else kv_dtype)
  for name, dtype in (("q.dtype", jnp.dtype(q_THD.dtype)), ("the KV dtype", kv)):
    if dtype.itemsize > 4:
      raise ValueError(f"{name}={dtype}: {kernel} computes in float32 at most; float64 "
                       "attention runs on impl='xla' or 'reference'")


def refusal_reason(q_THD, k_pages_LKNZD, check_shapes) -> str | None:
  """Why a kernel refuses these shapes, or None: what its ``unsupported_reason`` (asked by
  an "auto" choice) returns. H must be a multiple of K; then ``check_shapes(group=G,
  block_size=Z, head_dim=D)`` (the kernel's own checks of its default tiling, G = H / K)
  raises ``ValueError`` with the reason, or returns."""
  num_q_heads, head_dim = q_THD.shape[1], q_THD.shape[2]
  dims = layout.unpack_pages_shape(k_pages_LKNZD.shape)
  num_kv_heads = dims["K"]
  if num_kv_heads < 1 or num_q_heads % num_kv_heads:
    return f"q heads H={num_q_heads} must be a multiple of K={num_kv_heads}"
  try:
    check_shapes(group=num_q_heads // num_kv_heads, block_size=dims["Z"], head_dim=head_dim)
  except ValueError as e:
    return str(e)
  return None


def canonical_variants(sliding_window=None, soft_cap=None):
  """``(sliding_window, soft_cap)`` as hashable static Python values (int, float) after
  ``static_validate_variants`` accepted them: a numpy int or an int cap is one jit key."""
  return (None if sliding_window is None else int(sliding_window),
          None if soft_cap is None else float(soft_cap))


def dynamic_validate_inputs(q_THD, k_pages_LKNZD, layer, kv_lens_S, block_tables_SP,
                            cu_q_lens, num_seqs, *, sliding_window: int | None = None) -> None:
  """Host-side value checks (concrete arrays only); raises ``ValueError``.

  Checks that the live rows are consistent: ``cu_q_lens`` starts at 0 and never decreases,
  ends within ``T``; each live sequence has ``0 <= q_len <= kv_len <= P * Z``; and every
  block-table entry a live sequence reads (its first ``ceil(kv_len / Z)``; with
  ``sliding_window``, only those that reach its first query's window, as
  ``checkify_validate_inputs``) lies in ``[0, N)``.
  """
  if isinstance(q_THD, jax.core.Tracer) or isinstance(kv_lens_S, jax.core.Tracer):
    raise ValueError("dynamic_validate_inputs needs concrete arrays; call it outside jit")
  dims = layout.unpack_pages_shape(k_pages_LKNZD.shape)
  num_tokens = q_THD.shape[0]
  kv_lens = np.asarray(kv_lens_S)
  tables = np.asarray(block_tables_SP)
  cu = np.asarray(cu_q_lens)
  n = int(np.asarray(num_seqs))
  layer = int(np.asarray(layer))
  if not 0 <= layer < dims["L"]:
    raise ValueError(f"layer={layer} must be in [0, L={dims['L']})")
  if not 0 <= n <= tables.shape[0]:
    raise ValueError(f"num_seqs={n} must be in [0, S={tables.shape[0]}]")
  if cu[0] != 0:
    raise ValueError(f"cu_q_lens[0]={cu[0]} must be 0")
  live_cu = cu[: n + 1]
  if np.any(np.diff(live_cu) < 0):
    raise ValueError(f"cu_q_lens={live_cu.tolist()} must be non-decreasing over the first "
                     f"num_seqs + 1 entries")
  if live_cu[-1] > num_tokens:
    raise ValueError(f"cu_q_lens[num_seqs]={live_cu[-1]} must be <= T={num_tokens}")
  q_lens = np.diff(live_cu)
  capacity = tables.shape[1] * dims["Z"]
  for i in range(n):
    if not q_lens[i] <= kv_lens[i] <= capacity:
      raise ValueError(f"kv_lens[{i}]={kv_lens[i]} must be in [q_len={q_lens[i]}, "
                       f"P * Z={capacity}]")
    used = tables[i, : -(-int(kv_lens[i]) // dims["Z"])]
    bad = (used < 0) | (used >= dims["N"])
    if sliding_window is not None:  # blocks wholly before the first query's window
      first = int(kv_lens[i]) - int(q_lens[i]) - sliding_window + 1
      bad &= (np.arange(len(used)) + 1) * dims["Z"] > first
    if np.any(bad):
      j = int(np.argmax(bad))
      raise ValueError(f"block_tables[{i}, {j}]={used[j]} must be a block id in "
                       f"[0, N={dims['N']}) (sequence {i} reads it)")


def checkify_validate_inputs(q_THD, k_pages_LKNZD, layer, kv_lens_S, block_tables_SP,
                             cu_q_lens, num_seqs, *, sliding_window: int | None = None) -> None:
  """The checks of ``dynamic_validate_inputs`` as ``jax.experimental.checkify`` checks.

  With ``sliding_window`` W a sequence reads only the blocks that reach its first query's
  window (position ``kv_len - q_len - W + 1`` on): the blocks wholly before it may be
  ``NO_BLOCK`` (a sliding KV group gives them back, ``allocator.slide``).

  Traceable: under ``jit`` they only take effect inside ``checkify.checkify`` (the debug mode
  of ``paged_attention``); the error names the argument and the offending entry. Inputs are
  assumed to have passed ``static_validate_inputs``.
  """
  from jax.experimental import checkify

  dims = layout.unpack_pages_shape(k_pages_LKNZD.shape)
  num_tokens = q_THD.shape[0]
  num_rows, blocks_per_seq = block_tables_SP.shape
  capacity = blocks_per_seq * dims["Z"]
  n = jnp.asarray(num_seqs, jnp.int32)
  layer = jnp.asarray(layer, jnp.int32)
  checkify.check((layer >= 0) & (layer < dims["L"]),
                 f"layer={{}} must be in [0, L={dims['L']})", layer)
  checkify.check((n >= 0) & (n <= num_rows), f"num_seqs={{}} must be in [0, S={num_rows}]", n)
  checkify.check(cu_q_lens[0] == 0, "cu_q_lens[0]={} must be 0", cu_q_lens[0])
  row_S = jnp.arange(num_rows, dtype=jnp.int32)
  live_S = row_S < n
  q_len_S = cu_q_lens[1:] - cu_q_lens[:-1]
  bad_S = live_S & (q_len_S < 0)
  i = jnp.argmax(bad_S)
  checkify.check(~jnp.any(bad_S), "cu_q_lens must be non-decreasing over the first num_seqs "
                 "+ 1 entries: cu_q_lens[{}]={} > cu_q_lens[{} + 1]={}", i, cu_q_lens[i], i,
                 cu_q_lens[i + 1])
  end = cu_q_lens[jnp.clip(n, 0, num_rows)]
  checkify.check(end <= num_tokens, f"cu_q_lens[num_seqs]={{}} must be <= T={num_tokens}", end)
  bad_S = live_S & ((kv_lens_S < q_len_S) | (kv_lens_S > capacity))
  i = jnp.argmax(bad_S)
  checkify.check(~jnp.any(bad_S), f"kv_lens[{{}}]={{}} must be in [q_len={{}}, P * Z={capacity}]",
                 i, kv_lens_S[i], q_len_S[i])
  start_P = jnp.arange(blocks_per_seq, dtype=jnp.int32) * dims["Z"]
  read_SP = live_S[:, None] & (start_P[None, :] < kv_lens_S[:, None])
  if sliding_window is not None:
    first_S = kv_lens_S - q_len_S - sliding_window + 1  # the first position any query sees
    read_SP &= start_P[None, :] + dims["Z"] > first_S[:, None]
  bad_SP = read_SP & ((block_tables_SP < 0) | (block_tables_SP >= dims["N"]))
  flat = jnp.argmax(bad_SP.reshape(-1))
  i, j = flat // blocks_per_seq, flat % blocks_per_seq
  checkify.check(~jnp.any(bad_SP), f"block_tables[{{}}, {{}}]={{}} must be a block id in "
                 f"[0, N={dims['N']}) (sequence {{}} reads it)", i, j, block_tables_SP[i, j], i)
