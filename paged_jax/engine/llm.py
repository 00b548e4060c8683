"""``LLM``: the serving engine's API over any model of the protocol (``paged_jax.protocol``).

Continuous batching inside ``jit``, chunked prefill, preemption by recompute, prefix
caching, forks (``n > 1``), streaming, stats and sharding over a mesh, for any
``flax.nnx.Module`` with ``paged_forward``. The parts:

- ``paged_jax.engine.state``: the device-side state (one pytree) and its small edits;
- ``paged_jax.engine.device``: one scheduling step; ``paged_jax.engine.loop``: the device
  call looping over it; ``paged_jax.engine.scoring``: prompt log-probs;
- ``paged_jax.engine.calls``: the jitted device calls, compiled by ``LLM.precompile``;
- ``paged_jax.engine.scheduler``: host scheduling (requests, slots, token buckets, reports);
- ``paged_jax.engine.options``: the checks of this class's options;
- ``paged_jax.engine.session``: serving as requests come and go (``session``), under
  ``generate_stream`` too;
- ``paged_jax.engine.stats``: ``stats``;
- this module: construction and validation, ``generate`` / ``generate_stream``.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax import allocator
from paged_jax import compile_cache
from paged_jax import protocol
from paged_jax import sharding as mesh_sharding
from paged_jax.engine import chat as chat_lib
from paged_jax.engine import options
from paged_jax.engine import state as state_lib
from paged_jax.engine.calls import DeviceCalls
from paged_jax.engine.salts import engine_live_salts
from paged_jax.kv_groups import KVGroups, layer_windows_of
from paged_jax.engine import session as session_lib
from paged_jax.engine.scheduler import Output, Scheduler, StreamEvent, default_token_buckets
from paged_jax.engine.session import Session
from paged_jax.engine.stats import engine_stats
from paged_jax.engine.stream import Stream

__all__ = ["LLM"]


class LLM:
  """The serving engine over any model of the protocol.

  Args:
    model: a ``flax.nnx.Module`` with ``paged_forward(tokens_T, positions_T, cache,
      metadata, *, logits_indices=None) -> (logits, cache)`` (``paged_jax.protocol``), e.g.
      a built-in ``paged_jax.models.Decoder`` or your own.
    config: any object with the ints ``num_layers``, ``num_kv_heads``, ``head_dim``,
      ``vocab_size``, ``max_seq_len`` and optionally ``eos_token_ids`` (``ModelConfig`` is
      one).
    kv_cache_dtype: what the KV pool stores (default: the model's dtype,
      ``protocol.model_dtype``): a float dtype, or ``jnp.int8`` / ``jnp.float8_e4m3fn`` /
      ``jnp.float8_e5m2`` for a quantised pool of one byte per value plus one float32 scale
      per token and KV head (``paged_jax.KVCache``), about twice the sequences of a bfloat16
      pool in the same memory. ``stats["kv_cache_dtype"]`` names it.
    dtype: the same as ``kv_cache_dtype`` (its older name; give at most one).
    block_size: Z, tokens per KV block.
    num_blocks: N, blocks in the pool. Default: from ``kv_budget_bytes`` when given, else
      enough for ``max_seqs`` sequences of ``min(config.max_seq_len, 2048)`` tokens.
    kv_budget_bytes: size the pool by memory (``KVCacheSpec.from_budget``; the token rows,
      8 bytes x S x ``max_model_len``, are apart); exclusive with ``num_blocks``.
    max_seqs: S, sequences running at once (slots; a request with ``n`` completions uses n).
    max_tokens_per_step: T, the token budget of one step (prefill chunks + decode rows).
    token_buckets: increasing step budgets ending at T, one compiled device call each;
      the host runs each call at the smallest that holds the tokens its sequences want, and
      a call ends early when they would fit a smaller one or need a larger one, so decode
      steps cost about S rows, not T. Default ``default_token_buckets(T, max_seqs)``;
      ``(T,)`` compiles one.
    max_model_len: longest sequence (prompt + generated); default
      ``min(config.max_seq_len, N * Z)`` so that any admitted sequence fits the pool alone.
    steps_per_call: most scheduling steps per device call.
    enable_prefix_caching: share the K/V of full blocks whose token prefix matches
      (``paged_jax.engine.device``, "Prefix cache"): a request whose prompt starts with
      cached blocks skips their prefill; ``stats["prefix_hit_rate"]`` counts the prompt
      tokens found cached. ``generate(..., cache_salt=...)`` keeps tenants apart. With
      sliding-window groups that give blocks back (``free_outside_window``) a hit also
      needs, in each sliding group, the cached blocks its window reads at the hit's end;
      off when every layer slides (no full-attention group to anchor a prefix);
      ``stats["prefix_caching"]`` says whether it is on.
    prefix_hash_fn: the block hash of the prefix cache (default
      ``allocator.chain_hashes``); any function of that signature, e.g. a degenerate one in a
      test: a hit is confirmed by the stored tokens, so a bad hash costs hits, not outputs.
    mesh: None (one device), or a ``jax.sharding.Mesh`` with axes ("data", "model")
      (``paged_jax.sharding``): weights and KV heads split over "model", sequences over
      "data", each data shard with its own slots and block pool; ``max_seqs`` and
      ``num_blocks`` are totals over the data shards and must be multiples of their
      number (a ``kv_budget_bytes`` pool is rounded down to one), ``n`` at most the slots
      of one shard, and ``allocator_state`` carries a leading data axis. A "model" axis
      of size > 1 needs the model's ``with_model_axis`` (``paged_jax.protocol``).
    tokenizer: optional ``tokenizers.Tokenizer`` (``from_pretrained`` loads tokenizer.json)
      or a transformers tokenizer: whatever turns a string prompt into ids and back.
    seed: seeds the engine's draw of seeds for requests whose ``SamplingParams.seed`` is None.
    max_traces: when set, the jitted device call is wrapped in ``chex.assert_max_traces``
      with this many traces (tests).
    scrub_on_release: zero every KV block inside the step that frees it (finish, preemption,
      abandoned stream), so no freed page keeps another request's K/V. Reads never depend on
      it (attention masks every position a sequence does not own); it is defence in depth,
      at the cost of one masked pass over the pool in each step that frees a block.
    compilation_cache: JAX's persistent compilation cache (``paged_jax.compile_cache``):
      True (default) uses ``$PAGED_JAX_COMPILATION_CACHE`` or ``~/.cache/paged_jax/jax``,
      so a second start of the same engine loads its device calls instead of compiling
      them; a directory path puts it there; False leaves JAX's setting alone. A cache
      directory already set through ``jax.config`` is kept.
    free_outside_window: True: layers are grouped by attention kind (``paged_jax.kv_groups``)
      and a sliding group gives back the blocks behind its window, so ``kv_budget_bytes``
      buys more sequences; each block then holds one group's layers, and prefix caching
      is off only when every layer slides (above). False: every layer keeps every block.
      Default (None): True when ``kv_budget_bytes`` sizes the pool, else False.
  """

  def __init__(self, model, config, *, dtype=None, block_size: int = 16,
               num_blocks: int | None = None, kv_budget_bytes: int | None = None,
               max_seqs: int = 16, max_tokens_per_step: int = 256,
               max_model_len: int | None = None, steps_per_call: int = 16,
               enable_prefix_caching: bool = True, mesh=None, tokenizer=None, seed: int = 0,
               max_traces: int | None = None, scrub_on_release: bool = False,
               prefix_hash_fn=None, token_buckets: Sequence[int] | None = None,
               kv_cache_dtype=None, compilation_cache: bool | str | os.PathLike = True,
               free_outside_window: bool | None = None):
    protocol.check_model(model, serving=True)
    dtype = options.pool_dtype(dtype, kv_cache_dtype)
    protocol.check_config(config)
    protocol.check_model_config(model, config)
    self._plan = None if mesh is None else mesh_sharding.ShardingPlan.create(
        mesh, num_kv_heads=config.num_kv_heads, num_heads=getattr(config, "num_heads", None),
        mlp_dim=getattr(config, "mlp_dim", None))
    shards = 1 if self._plan is None else self._plan.data_size
    if free_outside_window is None:
      free_outside_window = kv_budget_bytes is not None
    options.check_plain(block_size=block_size, max_seqs=max_seqs,
                        max_tokens_per_step=max_tokens_per_step, steps_per_call=steps_per_call,
                        num_blocks=num_blocks, kv_budget_bytes=kv_budget_bytes, seed=seed,
                        tokenizer=tokenizer, max_traces=max_traces,
                        enable_prefix_caching=enable_prefix_caching,
                        scrub_on_release=scrub_on_release,
                        free_outside_window=free_outside_window, prefix_hash_fn=prefix_hash_fn)
    self.model, self.config, self.tokenizer = model, config, tokenizer
    self.chat_template = None  # a ChatTemplate (from_pretrained reads the checkpoint's)
    # KV groups (paged_jax.kv_groups): sliding layers give back blocks behind their window.
    self.kv_groups = KVGroups.from_layer_windows(
        layer_windows_of(config), free_outside_window=bool(free_outside_window))
    self.enable_prefix_caching = (bool(enable_prefix_caching)
                                  and allocator.supports_prefix_caching(self.kv_groups.windows))
    self.scrub_on_release = bool(scrub_on_release)
    self.spec = options.pool_spec(
        config, protocol.model_dtype(model) if dtype is None else jnp.dtype(dtype),
        self.kv_groups.layers_per_group, block_size=block_size, num_blocks=num_blocks,
        kv_budget_bytes=kv_budget_bytes, max_seqs=max_seqs, shards=shards)
    pool_tokens = self.kv_groups.max_len_in_pool(  # N * Z without sliding groups
        self.spec.num_blocks // shards, self.spec.block_size, max_tokens_per_step,
        max(int(config.max_seq_len), 2))
    limit = options.limit_note(config.max_seq_len, self.spec, self.kv_groups, pool_tokens,
                               shards)
    self.max_model_len, limit = options.check_max_model_len(
        max_model_len, int(config.max_seq_len), pool_tokens, limit)
    self.max_seqs = int(max_seqs)
    self.max_tokens_per_step = int(max_tokens_per_step)
    self.steps_per_call = int(steps_per_call)
    if token_buckets is None:
      token_buckets = default_token_buckets(self.max_tokens_per_step, self.max_seqs)
    self.token_buckets = options.check_token_buckets(token_buckets, self.max_tokens_per_step)
    self._slots_per_shard = self.max_seqs // shards

    if self._plan is None:
      self._graphdef, self._params = nnx.split(model)
      param_specs = None
    else:
      self._graphdef, self._params, param_specs = self._plan.shard_model(model)
    # Arguments checked: now (and only now) point JAX at the persistent cache.
    self.compilation_cache_dir = compile_cache.enable(compilation_cache)
    self._device = DeviceCalls(
        static=dict(graphdef=protocol.static_graphdef(self._graphdef),
                    steps_per_call=self.steps_per_call,
                    scrub_on_release=self.scrub_on_release,
                    prefix_caching=self.enable_prefix_caching,
                    hash_fn=prefix_hash_fn or allocator.chain_hashes,
                    kv_groups=None if self.kv_groups.plain else self.kv_groups,
                    vocab_size=int(config.vocab_size)),
        token_buckets=self.token_buckets, plan=self._plan, param_specs=param_specs,
        max_traces=max_traces)
    self._bucket = self.token_buckets[-1]  # the step budget of the next device call
    self._scoring = False  # and whether it is the prompt log-probs variant
    self._scheduler = Scheduler(
        max_seqs=self.max_seqs, slots_per_shard=self._slots_per_shard,
        max_model_len=self.max_model_len, token_buckets=self.token_buckets,
        vocab_size=int(config.vocab_size), eos=protocol.served_eos_token_ids(config),
        limit_note=limit, live_salts=engine_live_salts(self),
        tokenizer=tokenizer, seed=seed)
    self._state = self._init_state()
    # One thread at a time reads or replaces the device state: a session's step, or stats
    # read from a server's other thread (which waits for the device call under way).
    self._state_lock = threading.RLock()

  @classmethod
  def from_pretrained(cls, path, *, dtype=None, impl: str = "auto", **kwargs) -> "LLM":
    """An engine over a Hugging Face checkpoint directory (``load_pretrained``);
    ``tokenizer.json`` is loaded when present and the ``tokenizers`` package is installed.
    ``dtype`` is the model's (and the KV cache's) dtype; other options as ``LLM``."""
    options.check_pretrained_keywords(cls, kwargs)  # before the checkpoint is read
    # The one place the engine imports a model: the built-in checkpoint loader.
    from paged_jax.models.loader import checkpoint_dir, load_pretrained
    mesh = kwargs.get("mesh")  # with a mesh each tensor is loaded onto its model slice
    model, config = load_pretrained(path, dtype=dtype, impl=impl, sharding=None if mesh is None
                                    else mesh_sharding.load_placement(mesh))
    tokenizer = kwargs.pop("tokenizer", None)
    tok_path = os.path.join(checkpoint_dir(path), "tokenizer.json")  # beside the weights
    if tokenizer is None and os.path.isfile(tok_path):  # tokenizers is optional
      tokenizer = options.load_tokenizer(tok_path)
    llm = cls(model, config, tokenizer=tokenizer, **kwargs)
    llm.chat_template = chat_lib.load_chat_template(checkpoint_dir(path))
    return llm

  # --- state and compilation ---

  def _init_state(self) -> state_lib.EngineState:
    init = lambda spec, slots: state_lib.init_state(spec, slots, self.max_model_len,
                                                    windows=self.kv_groups.windows)
    if self._plan is None:
      return init(self.spec, self.max_seqs)
    blocks = self.spec.num_blocks // self._plan.data_size  # a data shard's: S/d slots, N/d blocks
    return self._plan.init_state(
        lambda: init(dataclasses.replace(self.spec, num_blocks=blocks), self._slots_per_shard))

  def precompile(self, progress: Callable[[int, int, str], Any] | None = None, *,
                 prompt_logprobs: bool = False) -> dict[str, float]:
    """Compile every device call serving will make (the step loop at each of
    ``token_buckets``, then the admit and abort merges) now, so that no request waits for
    a compilation; ``prompt_logprobs``: also the step loops of requests asking for them
    ("step T=32 scoring"). ``progress(i, n, what)`` is called before each of the n
    compilations (``what`` e.g. "step T=32"). Returns the seconds each took, also kept in
    ``compile_seconds`` (and their sum in ``stats["compile_s"]``). Calls compiled before
    (by serving, or by another engine of the same model structure and sizes) take ~0 s."""
    options.check_bools(prompt_logprobs=prompt_logprobs)
    with self._state_lock:
      return self._device.precompile(self._params, self._state, progress,
                                     scoring=prompt_logprobs)

  @property
  def compile_seconds(self) -> dict[str, float]:
    """Seconds each device call took to compile, by name ("step T=32", "step T=32 scoring",
    "admit", "abort"): by ``precompile``, or when serving first used it."""
    return dict(self._device.compile_seconds)

  @property
  def _calls(self) -> dict:
    """The step loops built so far, by token bucket."""
    return self._device.steps

  def _call_for(self, bucket: int, scoring: bool = False):
    """The jitted step loop at ``bucket`` (``DeviceCalls.step``; ``scoring``: its variant)."""
    return self._device.step(bucket, scoring)

  def _call(self, params, st, slots_wanted, step_limit):
    """One device call at the step budget ``self._bucket`` (set before each call)."""
    return self._call_for(self._bucket, self._scoring)(params, st, slots_wanted, step_limit)

  def reset_stats(self) -> None:
    """Zero ``stats``' counters (``compile_s`` and the pool's figures stay), e.g. after a
    warm-up call; host totals, no device call. Between generates (in a stream they mix)."""
    self._scheduler.reset_counters()
    self._device.serve_compile_s = 0.0

  @property
  def allocator_state(self) -> allocator.AllocatorState:
    """The allocator state now (for ``allocator.validate``); with a mesh, every leaf has
    a leading data-shard axis (validate ``tree_map(lambda x: x[i], ...)`` per shard)."""
    with self._state_lock:
      self._abort(np.zeros(self._scheduler.max_seqs, np.bool_))  # rebuilds a lost state
      return self._state.alloc

  # --- serving ---

  def _run(self, bucket: int, slots_wanted: int, max_steps: int | None = None,
           scoring: bool = False) -> dict:
    limit = self.steps_per_call if max_steps is None else min(max_steps, self.steps_per_call)
    with self._state_lock:
      self._device.ensure_compiled(f"step T={bucket}{' scoring' * scoring}", self._params,
                                   self._state)
      self._bucket, self._scoring = bucket, scoring
      # Explicit host -> device puts: a caller's jax.transfer_guard("disallow") holds.
      wanted, limit = jax.device_put((np.int32(slots_wanted), np.int32(limit)))
      self._state, report = self._call(self._params, self._state, wanted, limit)
      return jax.device_get(report)  # the one device -> host transfer of this call

  def _admit(self, entries: list) -> None:
    with self._state_lock:
      self._device.ensure_compiled("admit", self._params, self._state)
      for chunk in self._device.admit_chunks(self._state, entries):
        self._state = self._device.admit(self._state, *self._to_device(*chunk))

  def _abort(self, mask_S: np.ndarray) -> None:
    """Drop ``mask_S``'s sequences (every serve ends here). A state lost to an interrupt
    (a call took the donated state; its result never came back) is rebuilt empty: the
    sequences go anyway, the prefix cache with them; the interrupt propagates as it was."""
    with self._state_lock:
      if state_lib.lost(self._state):
        self._state = self._init_state()
      elif mask_S.any():
        self._device.ensure_compiled("abort", self._params, self._state)
        self._state = self._device.abort(self._state, *self._to_device(mask_S))

  def _to_device(self, *host):
    # A mesh's calls place host rows on their shards themselves.
    return host if self._plan is not None else jax.device_put(host)

  def _serve(self, prompts, params, cache_salt, text_per_token=True) -> tuple[list, Stream]:
    self._scheduler.check_idle()  # at the call, and again at the first event
    scheduler = self._scheduler
    requests = scheduler.requests(prompts, params, cache_salt, text_per_token=text_per_token)
    return requests, Stream(scheduler.check_idle, lambda: session_lib.serve(
        scheduler, requests, run=self._run, admit=self._admit, abort=self._abort))

  def session(self) -> Session:
    """A ``Session`` (``paged_jax.engine.session``): requests added (``add``) and aborted
    (``abort``) while the engine serves, one device call per ``step()``, for a server whose
    requests arrive over time. It holds the engine until ``close()`` (``with llm.session()
    as session:``); a ``RuntimeError`` while another stream or session is open."""
    return Session(self._scheduler, run=self._run, admit=self._admit, abort=self._abort)

  def generate_stream(self, prompts, params=None, *,
                      cache_salt=None) -> Iterator[StreamEvent]:
    """Serve ``prompts`` and yield ``StreamEvent``s as tokens are decided (after each device
    call): one per generated token, then one with ``finish_reason`` per completion. All
    requests are validated (``ValueError`` naming the request) before this returns; seeds of
    unseeded requests are drawn when it starts. Closing the generator early drops the
    unfinished requests (their blocks are released). One ``generate`` / ``generate_stream``
    / ``session`` at a time per engine: a stream iterated but neither exhausted nor closed holds the
    engine's slots, and starting another is a ``RuntimeError`` until it is (``break`` out of
    ``for ev in llm.generate_stream(...)`` closes it; a stream kept in a variable needs
    ``.close()``); a stream so refused at its first event can be iterated again later.
    ``cache_salt`` as for ``generate``."""
    return self._serve(prompts, params, cache_salt)[1]

  def check_requests(self, prompts, params=None, *, cache_salt=None) -> None:
    """The ``ValueError`` ``generate`` would raise for these arguments (an empty prompt, one
    too long for ``max_model_len``, a bad id, ...), without compiling or serving anything;
    None when they would be served. Draws no seeds: sampling is as if it had not run."""
    self._scheduler.check(prompts, params, cache_salt)

  def generate(self, prompts, params=None, *, cache_salt=None) -> list[Output]:
    """Serve ``prompts`` (token-id lists or 1-D arrays, a [B, T] array of B unpadded prompts, or
    strings with a tokenizer) with ``params`` (one ``SamplingParams`` or one per prompt).
    Returns one ``Output`` per completion in prompt order, n consecutive ones for n > 1.

    ``cache_salt``: None, one str for every prompt, or one str (or None) per prompt. Prefix
    cache entries are shared only between requests with the same salt (none counts as one
    salt), so tenants that must not share pass different salts."""
    requests, stream = self._serve(prompts, params, cache_salt, text_per_token=False)
    return session_lib.outputs(requests, stream, with_text=self.tokenizer is not None)

  def chat(self, messages, params=None, *, chat_template=None, add_generation_prompt=True,
           continue_final_message=False, chat_template_kwargs=None, cache_salt=None
           ) -> list[Output]:
    """``generate`` for conversations (vLLM's ``LLM.chat``): ``messages`` is one
    conversation (a list of ``{"role": ..., "content": ...}`` dicts) or a list of them
    (``prompt_index``: its position), each laid out by ``chat_template`` (a Jinja template
    str, given the checkpoint's special-token texts, or a ``ChatTemplate``; default
    ``self.chat_template``, the checkpoint's) in a Jinja sandbox set up as transformers'
    ``apply_chat_template`` sets its own (``paged_jax.engine.chat``), the model's turn
    opened when ``add_generation_prompt``, or its last message continued (a reply begun:
    ``continue_final_message``, with ``add_generation_prompt=False``);
    ``chat_template_kwargs``: more template variables (``tools``, ...)."""
    template = self.chat_template if chat_template is None else chat_template
    if isinstance(template, str) and self.chat_template is not None:  # its BOS text etc.
      template = dataclasses.replace(self.chat_template, source=template)
    prompts = chat_lib.chat_prompts(self.tokenizer, template, messages,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    variables=chat_template_kwargs)
    return self.generate(prompts, params, cache_salt=cache_salt)

  @property
  def stats(self) -> dict[str, Any]:
    """Counters since the engine was built or ``reset_stats``. ``wall_s``: the time spent
    inside generate / generate_stream / ``Session.step``, less the compilations they waited
    for (a device call used for the first time without ``precompile`` is compiled then,
    timed apart) and less the time a stream's consumer held its events; tokens_per_s and
    requests_per_s divide by it. ``requests``: those whose every completion finished (not
    aborted ones, nor a closed stream's unfinished ones); ``generated_tokens``: the tokens
    read (none past a stop string).
    ``kv_utilization``: tokens stored / token slots of the blocks in use, mean over the
    steps that ran a batch (0.0 before any). No reset changes ``compile_s`` (the seconds all
    compilations took, by ``precompile`` or on first use: ``compile_seconds``' sum), nor
    ``num_free_blocks`` and ``cached_blocks`` (free blocks still holding a cached prefix,
    counted among the free), which describe the pool now."""
    return engine_stats(self)


LLM.from_pretrained.__func__.__signature__ = options.pretrained_signature(LLM)
