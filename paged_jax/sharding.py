"""Serving over a device mesh with JAX's own SPMD: tensor parallel over heads, data parallel
over sequences.

A mesh (``jax.sharding.Mesh``) has exactly the axes ``"data"`` and ``"model"``; call their
sizes d and m. ``LLM(..., mesh=mesh)`` then runs its whole device call (the ``while_loop``
of scheduling steps: allocator, ragged forward, sampling) under ONE ``jax.shard_map`` over
both axes. Nothing is gathered onto one device: each device sees

- its data shard's engine state: every leaf of the engine state carries a leading data
  axis of size d (``P("data")``), so each data shard owns S/d sequence slots, its own
  allocator and its own pool of N/d blocks;
- its model slice of the KV cache: pages ``[d, L, K', N/d, Z, D]`` sharded
  ``P("data", None, "model")``, i.e. its KV heads' pages of every block. The block tables
  are the same on the m devices of a data shard (every device runs the same allocator on
  the same inputs), so no table is ever exchanged;
- its model slice of the weights, Megatron-style: query heads H/m, KV heads, MLP columns
  I/m (``q_EHD``, ``k_EKD``, ``v_EKD``, ``o_HDE``, biases, ``gate_EI``, ``up_EI``,
  ``down_IE``). The decoder (``Decoder.with_model_axis("model")``) ``psum``-s over "model"
  after the attention output projection and after the MLP down projection, so the logits,
  the sampled tokens and the allocator are identical on the m devices of a data shard.
  Embedding, norms and LM head are replicated (V x E twice per device; vocab sharding is
  not done).

Which parameter axis is split is read from its name's glossary letters (``q_EHD``: H):
H, K and I over "model", every other axis (and the stacked L axis) whole.

Any model of the protocol (``paged_jax.protocol``), not only the built-in decoders: the
engine runs ``model.with_model_axis("model")`` (the copy that ``psum``-s), and a model
whose parameter names carry no letters (flax's ``kernel``, ``bias``) says how they split
with ``param_partition_specs("model")``. With m = 1 (data parallel) neither is needed.

KV heads fewer than the model axis (K < m). Each KV head is then stored m/K times: the
pool holds K' = m "head slots", one per device, slot j holding KV head ``j // (m/K)``, and
device j gets the query heads of that KV head (its H/m query heads all belong to it). This
needs m % K == 0 and H % m == 0 (``ValueError`` otherwise). Memory cost: the physical cache
is ``max(1, m / K)`` times the logical one; each device holds
``total_bytes / (d * min(m, K))`` of a pool whose logical size is ``total_bytes`` (K x N
blocks): with K >= m that is ``1 / (d m)`` of it, with K < m ``1 / (d K)``, the same as
with m = K. The k/v projection weights are replicated the same way.

Multi-host (a TPU pod slice, several GPU hosts): every process runs the same program,
calling ``jax.distributed.initialize()`` first, builds the mesh over the global
``jax.devices()`` (put "model" inside a host, where the ``psum``s ride the fast
interconnect, and "data" across hosts), and calls ``generate`` with the same prompts. The
host scheduler is deterministic (requests are balanced over data shards the same way on
every process), inputs go in through ``jax.device_put`` of host arrays with global
shardings, and the one small report of each device call is replicated on every device, so
every process reads it locally.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from paged_jax.pallas_kernels import layout
from paged_jax.kv_cache import KVCache

__all__ = ["DATA", "MODEL", "ShardingPlan", "kv_bytes_by_device", "load_placement",
           "pick_slots"]

DATA, MODEL = "data", "model"
"""The mesh axis names ``LLM(mesh=...)`` requires."""

_MODEL_LETTERS = frozenset("HKI")
"""Parameter axes split over "model": query heads, KV heads, MLP columns."""

_REPORT_MAX = frozenset({"steps"})
"""Report counters combined over data shards by max (they ran side by side); others sum."""

_PAGES_K_AXIS = layout.PAGES_AXES.index("K")


def _shard_map(f, *, mesh, in_specs, out_specs):
  """``jax.shard_map`` (public since JAX 0.7; 0.10 and 0.11 both have it), replication
  checks off: the engine's loops and Pallas calls carry per-device values whose
  replication over "model" holds by construction (the ``psum``s), not by type."""
  return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)


def _axis_letters(name: str) -> str | None:
  """The glossary letters of a parameter name (``"q_EHD"`` -> ``"EHD"``), or None."""
  suffix = name.rsplit("_", 1)[-1]
  return suffix if "_" in name and suffix.isalpha() and suffix.isupper() else None


def _split_spec(name: str, ndim: int,
                can_split: Callable[[int], bool] = lambda axis: True) -> P:
  """Partition spec of an ``ndim``-axis parameter from its name's letters: its H, K and I
  axes over "model" (those for which ``can_split(axis)`` holds), leading axes (the stacked
  L) and names without letters whole."""
  letters = _axis_letters(name)
  if letters is None or len(letters) > ndim:
    return P()
  lead = ndim - len(letters)
  return P(*(None,) * lead, *(MODEL if c in _MODEL_LETTERS and can_split(lead + j) else None
                              for j, c in enumerate(letters)))


def _leaf_name(path) -> str:
  """The last string key of a pytree path (the parameter's name in an ``nnx.State``)."""
  names = [getattr(k, "key", None) for k in path]
  names = [n for n in names if isinstance(n, str)]
  return names[-1] if names else ""


def _check_mesh(mesh) -> Mesh:
  """``mesh`` checked, with every axis of type Auto: the engine places values with
  sharding constraints, which JAX takes only over Auto axes. ``jax.make_mesh`` makes
  Explicit axes by default; the same devices and names serve as Auto axes."""
  if not isinstance(mesh, Mesh):
    raise ValueError(f"mesh={type(mesh).__name__} must be a jax.sharding.Mesh with axes "
                     f"{(DATA, MODEL)}")
  if sorted(mesh.axis_names) != sorted((DATA, MODEL)):
    raise ValueError(f"mesh.axis_names={tuple(mesh.axis_names)} must be "
                     f"{(DATA, MODEL)} (e.g. Mesh(devices.reshape(d, m), {(DATA, MODEL)}))")
  auto = jax.sharding.AxisType.Auto
  if any(t != auto for t in mesh.axis_types):
    mesh = Mesh(mesh.devices, mesh.axis_names, axis_types=(auto,) * len(mesh.axis_names))
  return mesh


def load_placement(mesh) -> Callable[[tuple[str, ...], tuple[int, ...]], NamedSharding]:
  """A ``sharding`` for ``models.load_pretrained``: each checkpoint tensor goes straight to
  its model slice on the mesh (no device ever holds the whole model). An H, K or I axis
  is split over "model" when its size is a multiple of m, else kept whole (K < m: the KV
  heads are replicated later, by ``ShardingPlan.shard_params``)."""
  mesh = _check_mesh(mesh)
  m = int(mesh.shape[MODEL])

  def placement(path: tuple[str, ...], shape: tuple[int, ...]) -> NamedSharding:
    return NamedSharding(mesh, _split_spec(path[-1], len(shape),
                                           can_split=lambda axis: shape[axis] % m == 0))

  return placement


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
  """How one model is laid out over a ("data", "model") mesh; built by ``create``.

  Attributes:
    mesh: the mesh.
    num_heads: H query heads of the model (None: not known from its config).
    num_kv_heads: K KV heads.
    mlp_dim: I, the MLP width (None: not known from its config).
  """

  mesh: Mesh
  num_heads: int | None
  num_kv_heads: int
  mlp_dim: int | None

  @classmethod
  def create(cls, mesh, *, num_kv_heads: int, num_heads: int | None = None,
             mlp_dim: int | None = None) -> "ShardingPlan":
    """Validate ``mesh`` against the model's head counts and MLP width (those a config
    does not have, None, are checked per parameter by ``shard_model``). A mesh with
    Explicit axes (``jax.make_mesh``'s default) is taken as the same mesh of Auto axes."""
    mesh = _check_mesh(mesh)
    m = int(mesh.shape[MODEL])
    k = int(num_kv_heads)
    if num_heads is not None and int(num_heads) % m:
      raise ValueError(f"mesh.shape['model']={m} must divide num_heads={num_heads} (query "
                       "heads are split over the model axis)")
    if k % m and m % k:
      raise ValueError(f"mesh.shape['model']={m} must divide num_kv_heads={k}, or be a "
                       "multiple of it (each KV head is then stored m / K times)")
    if mlp_dim is not None and int(mlp_dim) % m:
      raise ValueError(f"mesh.shape['model']={m} must divide mlp_dim={mlp_dim} (MLP columns "
                       "are split over the model axis)")
    return cls(mesh=mesh, num_heads=None if num_heads is None else int(num_heads),
               num_kv_heads=k, mlp_dim=None if mlp_dim is None else int(mlp_dim))

  # --- sizes ---

  @property
  def data_size(self) -> int:
    """d, data shards."""
    return int(self.mesh.shape[DATA])

  @property
  def model_size(self) -> int:
    """m, devices splitting each data shard's heads."""
    return int(self.mesh.shape[MODEL])

  @property
  def replication(self) -> int:
    """How many times each KV head is stored: ``max(1, m / K)``."""
    return max(1, self.model_size // self.num_kv_heads)

  @property
  def kv_head_slots(self) -> int:
    """K', the head axis of the physical pool: ``K * replication`` (= m when K < m)."""
    return self.num_kv_heads * self.replication

  def kv_bytes_per_device(self, total_bytes: int) -> int:
    """KV bytes each device holds for a pool whose logical size (K heads, every data
    shard's blocks) is ``total_bytes``: ``total_bytes / (d * min(m, K))``."""
    return total_bytes // (self.data_size * min(self.model_size, self.num_kv_heads))

  def _sharding(self, spec: P) -> NamedSharding:
    return NamedSharding(self.mesh, spec)

  # --- weights ---

  def param_spec(self, name: str, ndim: int) -> P:
    """Partition spec of a parameter from its name's letters; leading axes (the stacked
    L) and names without letters stay whole."""
    return _split_spec(name, ndim)

  def param_specs(self, params) -> Any:
    """A pytree of ``PartitionSpec``s matching ``params`` (an ``nnx.State``)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: self.param_spec(_leaf_name(path), jnp.ndim(x)), params)

  def _expand_kv(self, name: str, x, xp):
    """Replicate the K axis of a parameter ``replication`` times (KV head j -> slots
    ``j * r .. j * r + r - 1``)."""
    letters = _axis_letters(name)
    if self.replication == 1 or letters is None or "K" not in letters:
      return x
    axis = x.ndim - len(letters) + letters.index("K")
    return xp.repeat(x, self.replication, axis=axis)

  def shard_params(self, params, specs=None):
    """``params`` (an ``nnx.State`` of the unsharded model) with KV heads replicated as
    needed and every leaf placed with its ``NamedSharding`` over the mesh: ``specs`` (a
    ``PartitionSpec`` pytree like ``params``), default the glossary letters of each name.
    A split axis whose size the model axis does not divide is a ``ValueError``."""
    multihost = jax.process_count() > 1
    m = self.model_size
    if specs is None:
      specs = self.param_specs(params)
      expand = self._expand_kv
    else:
      expand = lambda name, x, xp: x

    def place(path, x, spec):
      name = _leaf_name(path)
      if multihost:  # each process puts its addressable part of the same host array
        x = np.asarray(x)
      x = expand(name, x, np if multihost else jnp)
      for axis, part in enumerate(tuple(spec)[:x.ndim]):
        if part == MODEL and x.shape[axis] % m:
          raise ValueError(f"parameter {jax.tree_util.keystr(path)} of shape {x.shape} is "
                           f"split over 'model' on axis {axis}: its size must be a multiple "
                           f"of mesh.shape['model']={m}")
      return jax.device_put(x, self._sharding(spec))

    return jax.tree_util.tree_map_with_path(place, params, specs)

  def shard_model(self, model):
    """``(graphdef, params, specs)`` of ``model`` laid out over the mesh.

    The model's forward runs inside the engine's ``shard_map`` on each device's slice of
    the weights, so it must combine its partial sums itself: with a "model" axis of size
    m > 1 the model needs ``with_model_axis(axis_name)`` (``paged_jax.protocol``), whose
    copy is what runs; with m = 1 (data parallel only) any model works, its weights
    replicated. Which axes are split: ``model.param_partition_specs(axis_name)`` when the
    model defines it (then K must be a multiple of m), else the glossary letters of each
    parameter's name (H, K, I over "model").
    """
    from flax import nnx  # paged_jax.sharding itself does not need flax
    name = type(model).__name__
    with_axis = getattr(model, "with_model_axis", None)
    if callable(with_axis):
      model = with_axis(MODEL)
    elif self.model_size > 1:
      raise ValueError(
          f"model={name} has no method with_model_axis(axis_name): with "
          f"mesh.shape['model']={self.model_size} > 1 its forward runs on a slice of the "
          "weights and must psum its partial sums over that axis (paged_jax.protocol); "
          "use a mesh with mesh.shape['model'] == 1 (data parallel) otherwise")
    graphdef, params = nnx.split(model)
    custom = getattr(model, "param_partition_specs", None)
    if callable(custom):
      if self.replication > 1:
        raise ValueError(f"model={name}.param_partition_specs: mesh.shape['model']="
                         f"{self.model_size} must divide num_kv_heads={self.num_kv_heads} "
                         "(KV heads are replicated only for glossary-named parameters)")
      specs = custom(MODEL)
      try:
        jax.tree_util.tree_map(lambda x, spec: None, params, specs)
      except (ValueError, TypeError) as e:
        raise ValueError(f"model={name}.param_partition_specs({MODEL!r}) must return a "
                         f"PartitionSpec pytree like nnx.state(model): {e}") from None
      return graphdef, self.shard_params(params, specs), specs
    # By the names' letters, KV heads replicated when K < m.
    return graphdef, self.shard_params(params), self.param_specs(params)

  # --- engine state ---

  def state_specs(self, state) -> Any:
    """Specs of an engine state with a leading data axis on every leaf: ``P("data")``,
    and the KV cache's pages also split over "model" on their head axis. Generic over
    the state's fields (any ``KVCache`` inside is recognised)."""
    def cache_spec(a):  # pages [L, K, N, Z, D] and scales [L, K, N, Z]: K on "model"
      return P(DATA, *[MODEL if i == _PAGES_K_AXIS else None for i in range(a.ndim - 1)])

    def spec(x):
      if isinstance(x, KVCache):
        return jax.tree.map(cache_spec, x)
      return P(DATA)

    return jax.tree_util.tree_map(spec, state, is_leaf=lambda x: isinstance(x, KVCache))

  def state_shardings(self, state) -> Any:
    """``state_specs`` as ``NamedSharding``s on this plan's mesh."""
    return jax.tree_util.tree_map(self._sharding, self.state_specs(state))

  def _constrain(self, state):
    return jax.lax.with_sharding_constraint(state, self.state_shardings(state))

  def _expand_cache(self, state):
    """Every ``KVCache`` in ``state`` with its head axis replicated to ``kv_head_slots``."""
    def expand(x):
      if not isinstance(x, KVCache) or self.replication == 1:
        return x
      # pages and scales alike: K sits at the same axis in both
      return jax.tree.map(lambda a: jnp.repeat(a, self.replication, axis=_PAGES_K_AXIS), x)

    return jax.tree_util.tree_map(expand, state, is_leaf=lambda x: isinstance(x, KVCache))

  def init_state(self, init_shard: Callable[[], Any]):
    """The engine state of d data shards, built directly in place on the mesh.

    ``init_shard()`` builds ONE data shard's state (S/d slots, N/d blocks, the logical K
    heads); it is traced once, its cache's heads replicated to ``kv_head_slots`` and every
    leaf broadcast along a new leading data axis, inside one ``jit`` whose output
    shardings make each device create only its own slice.
    """
    d = self.data_size

    def stacked():
      one = self._expand_cache(init_shard())
      return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (d,) + x.shape), one)

    shapes = jax.eval_shape(stacked)
    return jax.jit(stacked, out_shardings=self.state_shardings(shapes))()

  # --- device calls ---

  def device_call(self, call_shard: Callable, *, param_specs=None):
    """Run ``call_shard(params, state, slots_wanted, step_limit) -> (state, report)`` (one data
    shard's state, no leading axis; a dict report of per-slot ``[S/d, ...]`` arrays and
    scalar counters) on every device under one ``shard_map``.

    ``param_specs``: the parameters' ``PartitionSpec`` pytree (``shard_model``'s; default
    from the names). Returns ``call(params, state, slots_wanted, step_limit) -> (state,
    report)`` to
    ``jit`` (donate the state): the report comes back merged (slot arrays ``[S, ...]``, slot
    ``shard * S/d + s``; counters summed over shards, ``steps`` the max) and replicated.
    """
    d = self.data_size

    def local(params, st, wanted, limit):
      st = jax.tree_util.tree_map(lambda x: x[0], st)
      st, report = call_shard(params, st, wanted[0], limit[0])
      return jax.tree_util.tree_map(lambda x: x[None], (st, report))

    def call(params, st, slots_wanted, step_limit):
      specs = self.state_specs(st)
      wanted, limit = (jnp.broadcast_to(jnp.asarray(x, jnp.int32), (d,))
                       for x in (slots_wanted, step_limit))
      st, report = _shard_map(local, mesh=self.mesh,
                              in_specs=(self.param_specs(params) if param_specs is None
                                        else param_specs, specs, P(DATA), P(DATA)),
                              out_specs=(specs, P(DATA)))(params, st, wanted, limit)
      report = {key: _merge(key, x) for key, x in report.items()}
      return st, jax.lax.with_sharding_constraint(report, self._sharding(P()))

    return call

  def per_shard(self, fn: Callable, **jit_kwargs):
    """``fn(state, *rows)`` of one data shard (``rows``: pytrees of ``[n, ...]`` arrays) as
    ``call(state, *rows)`` over all shards, taking host rows ``[d * n, ...]`` (shard k's in
    rows ``[k * n, (k + 1) * n)``: a mask over slots ``[S]``, or ``admit``'s chunks);
    vmapped, jitted, the state donated and kept in place."""
    d = self.data_size

    def run(st, *rows):
      return self._constrain(jax.vmap(fn)(st, *rows))

    jitted = jax.jit(run, donate_argnums=(0,), **jit_kwargs)

    place = lambda x: jax.device_put(
        np.asarray(x).reshape((d, -1) + np.shape(x)[1:]), self._sharding(P(DATA)))

    def call(st, *rows):
      return jitted(st, *jax.tree_util.tree_map(place, rows))

    call.lower = lambda st, *rows: jitted.lower(st, *jax.tree_util.tree_map(place, rows))
    return call

  def fetch(self, x) -> np.ndarray:
    """``x`` on the host, on every process (replicated first when not addressable)."""
    if x.is_fully_addressable:
      return np.asarray(jax.device_get(x))
    x = jax.jit(lambda y: y, out_shardings=self._sharding(P()))(x)
    return np.asarray(x.addressable_shards[0].data)


def _merge(key: str, x):
  """A report leaf ``[d, ...]`` of every data shard as the whole engine's."""
  if x.ndim >= 2:  # per-slot rows [d, S/d, ...] -> [S, ...]
    return x.reshape((-1,) + x.shape[2:])
  return jnp.max(x, axis=0) if key in _REPORT_MAX else jnp.sum(x, axis=0)


def pick_slots(free: Sequence[int], n: int, slots_per_shard: int) -> list[int] | None:
  """Slots for a request of ``n`` completions, all in one data shard (forks stay inside
  one allocator), or None when no shard has ``n`` free.

  ``free``: free global slot ids ascending (slot s is in shard ``s // slots_per_shard``).
  The shard with the most free slots wins (ties: the lowest), which balances requests
  over shards; with one shard this is ``free[:n]``.
  """
  by_shard: dict[int, list[int]] = {}
  for s in free:
    by_shard.setdefault(s // slots_per_shard, []).append(s)
  best = max(by_shard.items(), key=lambda kv: (len(kv[1]), -kv[0]), default=None)
  if best is None or len(best[1]) < n:
    return None
  return best[1][:n]


def kv_bytes_by_device(cache: KVCache) -> dict[Any, int]:
  """Bytes of K and V pages (and a quantised pool's scales) each device holds (its
  addressable shards)."""
  out: dict[Any, int] = {}
  for pages in jax.tree.leaves(cache):
    for shard in pages.addressable_shards:
      out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out
