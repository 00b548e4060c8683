"""Your own Flax NNX model over paged_jax's KV cache, in a jitted decode loop.

A small GPT-2-style model written with plain ``flax.nnx`` layers (learned positions,
LayerNorm, biases, GELU): nothing in it comes from paged_jax's built-in
decoders. Two things make it servable:

- ``paged_forward(tokens_T, positions_T, cache, metadata, *, logits_indices=None)``: each
  layer writes its K/V with ``cache.write`` and attends with ``paged_attention`` through
  the ``AttentionMetadata`` it is given;
- a config with ``num_layers``, ``num_kv_heads``, ``head_dim``, ``vocab_size``,
  ``max_seq_len`` (and optionally ``eos_token_ids``, and ``layer_windows`` for sliding-window
  layers: each layer then takes its cache layer, slots and block tables from
  ``metadata.for_layer(layer)``, so that the engine may put sliding and full layers in KV
  groups that give blocks back behind the window).

``main()`` prefills three prompts of different lengths in one ragged step, then decodes 8
greedy tokens for each inside ONE jitted ``lax.scan``, and checks them against a greedy
loop over the model's dense forward. Run it: ``python examples/own_model.py``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import paged_jax
from paged_jax import AttentionMetadata, KVCache, KVCacheSpec, allocator, paged_attention


@dataclasses.dataclass(frozen=True)
class TinyGPTConfig:
  vocab_size: int = 96
  embed_dim: int = 32
  num_layers: int = 2
  num_heads: int = 2
  head_dim: int = 16
  mlp_dim: int = 64
  max_seq_len: int = 64
  eos_token_ids: tuple[int, ...] = ()
  # Optional: each layer's sliding window (None: full attention); None: every layer full.
  layer_windows: tuple[int | None, ...] | None = None

  @property
  def num_kv_heads(self) -> int:  # multi-head attention: one KV head per query head
    return self.num_heads

  def window(self, layer: int) -> int | None:
    return None if self.layer_windows is None else self.layer_windows[layer]


class Block(nnx.Module):
  """Pre-LayerNorm attention + GELU MLP, every projection with a bias."""

  def __init__(self, c: TinyGPTConfig, rngs: nnx.Rngs):
    self.c = c
    self.ln1 = nnx.LayerNorm(c.embed_dim, rngs=rngs)
    self.qkv = nnx.Linear(c.embed_dim, 3 * c.num_heads * c.head_dim, rngs=rngs)
    self.proj = nnx.Linear(c.num_heads * c.head_dim, c.embed_dim, rngs=rngs)
    self.ln2 = nnx.LayerNorm(c.embed_dim, rngs=rngs)
    self.fc1 = nnx.Linear(c.embed_dim, c.mlp_dim, rngs=rngs)
    self.fc2 = nnx.Linear(c.mlp_dim, c.embed_dim, rngs=rngs)

  def __call__(self, x_TE, attend):
    """``attend(q_THD, k_TKD, v_TKD) -> out_THD`` is the paged or the dense attention (every
    head has its own K and V here: K = H)."""
    # qkv's columns are (head, q|k|v, D): a slice of whole heads holds their q, k and v.
    qkv_TH3D = self.qkv(self.ln1(x_TE)).reshape(x_TE.shape[0], -1, 3, self.c.head_dim)
    out_THD = attend(qkv_TH3D[:, :, 0], qkv_TH3D[:, :, 1], qkv_TH3D[:, :, 2])
    x_TE = x_TE + self.proj(out_THD.reshape(x_TE.shape[0], -1))
    return x_TE + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x_TE))))


class TinyGPT(nnx.Module):

  def __init__(self, c: TinyGPTConfig, *, rngs: nnx.Rngs):
    self.c = c
    self.wte = nnx.Embed(c.vocab_size, c.embed_dim, rngs=rngs)
    self.wpe = nnx.Embed(c.max_seq_len, c.embed_dim, rngs=rngs)  # learned positions
    self.blocks = nnx.List([Block(c, rngs) for _ in range(c.num_layers)])
    self.ln_f = nnx.LayerNorm(c.embed_dim, rngs=rngs)
    self.head = nnx.Linear(c.embed_dim, c.vocab_size, rngs=rngs)

  def _run(self, tokens_T, positions_T, attend_at):
    x_TE = self.wte(tokens_T) + self.wpe(positions_T)
    for layer, block in enumerate(self.blocks):
      x_TE = block(x_TE, lambda q, k, v, layer=layer: attend_at(layer, q, k, v))
    return x_TE

  def paged_forward(self, tokens_T, positions_T, cache: KVCache, metadata: AttentionMetadata,
                    *, logits_indices=None):
    """The protocol paged_jax serves: logits [T, V] (or one row per logits_indices)."""
    m = metadata

    def attend_at(layer, q_THD, k_TKD, v_TKD):
      nonlocal cache
      # This layer's place in the cache: (layer, m.slots_T, m.block_tables_SP), or its KV
      # group's when the engine groups sliding and full layers (config.layer_windows).
      cache_layer, slots_T, block_tables_SP = m.for_layer(layer)
      cache = cache.write(cache_layer, k_TKD, v_TKD, slots_T)
      return paged_attention(q_THD, cache, cache_layer, m.kv_lens_S, block_tables_SP,
                             m.cu_q_lens, m.num_seqs, sliding_window=self.c.window(layer))

    x_TE = self._run(tokens_T, positions_T, attend_at)
    if logits_indices is not None:
      x_TE = x_TE[logits_indices]
    return self.head(self.ln_f(x_TE)), cache

  def __call__(self, tokens_BT):
    """Dense causal logits [B, T, V], no cache (the oracle)."""
    b, t = tokens_BT.shape

    def attend_at(layer, q_THD, k_TKD, v_TKD):
      q, k, v = (x.reshape(b, t, *x.shape[1:]) for x in (q_THD, k_TKD, v_TKD))
      scores = jnp.einsum("BTHD,BJHD->BHTJ", q, k) * q.shape[-1] ** -0.5
      i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
      window = self.c.window(layer)
      visible = (j <= i) if window is None else (j <= i) & (j > i - window)
      scores = jnp.where(visible, scores, -jnp.inf)
      out = jnp.einsum("BHTJ,BJHD->BTHD", jax.nn.softmax(scores, axis=-1), v)
      return out.reshape(b * t, *out.shape[2:])

    positions_T = jnp.tile(jnp.arange(t), b)
    x_TE = self._run(tokens_BT.reshape(-1), positions_T, attend_at)
    return self.head(self.ln_f(x_TE)).reshape(b, t, -1)


@nnx.jit
def _dense_logits(model, tokens_BT):
  return model(tokens_BT)


def dense_greedy(model, prompt, num_tokens):
  """Greedy tokens from re-running the dense forward on the growing sequence (host loop),
  and the log-probability of each. The model is causal, so right padding to
  ``max_seq_len`` changes nothing before it: one compilation serves every length."""
  seq, logprobs = list(prompt), []
  for _ in range(num_tokens):
    padded = np.zeros((1, model.c.max_seq_len), np.int32)
    padded[0, :len(seq)] = seq
    logits_V = _dense_logits(model, jnp.asarray(padded))[0, len(seq) - 1]
    seq.append(int(jnp.argmax(logits_V)))
    logprobs.append(float(jax.nn.log_softmax(logits_V)[seq[-1]]))
  return seq[len(prompt):], logprobs


@nnx.jit(donate_argnums=(1, 2))
def prefill(model, alloc, cache, tokens_T, num_new_S):
  """One ragged step over every prompt; the next token of each sequence."""
  logits_SV, alloc, cache, ok_S = paged_jax.forward_step(model, alloc, cache, tokens_T,
                                                         num_new_S)
  return jnp.argmax(logits_SV, axis=-1).astype(jnp.int32), alloc, cache, ok_S


@nnx.jit(donate_argnums=(1, 2), static_argnames="num_steps")
def decode(model, alloc, cache, tokens_S, active_S, *, num_steps):
  """``num_steps`` greedy decode steps in one ``lax.scan``: ``[S, num_steps]`` tokens (-1
  where a sequence made none), and each sequence's next input token."""

  def body(carry, _):
    alloc, cache, tokens_S = carry
    logits_SV, alloc, cache, ok_S = paged_jax.decode_step(model, alloc, cache, tokens_S,
                                                          active_S)
    decoded_S = ok_S & active_S  # False: inactive, or dropped (no block was free)
    next_S = jnp.argmax(logits_SV, axis=-1).astype(jnp.int32)
    # A dropped sequence keeps its pending token for a later step; -1 marks no token.
    tokens_S = jnp.where(decoded_S, next_S, tokens_S)
    return (alloc, cache, tokens_S), jnp.where(decoded_S, next_S, -1)

  (alloc, cache, tokens_S), per_step = jax.lax.scan(body, (alloc, cache, tokens_S),
                                                    length=num_steps)
  return per_step.T, tokens_S, alloc, cache


def main(num_steps: int = 8) -> list[list[int]]:
  config = TinyGPTConfig()
  model = TinyGPT(config, rngs=nnx.Rngs(1))
  prompts = [[5, 17, 33, 2, 64], [7, 7, 80, 1, 0, 45, 2, 90, 33, 12, 8], [11, 12, 13]]
  num_seqs, block_size = len(prompts), 4
  alloc = allocator.init(num_blocks=32, block_size=block_size, max_seqs=num_seqs,
                         max_blocks_per_seq=config.max_seq_len // block_size)
  cache = KVCache.create(KVCacheSpec(
      num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
      head_dim=config.head_dim, block_size=block_size, num_blocks=32, dtype=jnp.float32))

  # Prefill: every prompt's tokens packed one after another (slot order), then padding.
  flat = [t for p in prompts for t in p]
  tokens_T = jnp.asarray(flat + [0] * (32 - len(flat)), jnp.int32)
  first_S, alloc, cache, ok_S = prefill(model, alloc, cache, tokens_T,
                                        jnp.asarray([len(p) for p in prompts], jnp.int32))
  assert bool(ok_S.all())
  rest, _, alloc, cache = decode(model, alloc, cache, first_S, jnp.ones(num_seqs, bool),
                                 num_steps=num_steps - 1)
  allocator.validate(alloc)
  got = np.concatenate([np.asarray(first_S)[:, None], np.asarray(rest)], axis=1).tolist()
  for prompt, tokens in zip(prompts, got):
    want, _ = dense_greedy(model, prompt, num_steps)
    assert tokens == want, (prompt, tokens, want)
    print(f"prompt {prompt} -> {tokens} (= the dense forward's greedy tokens)")
  return got


if __name__ == "__main__":
  main()
