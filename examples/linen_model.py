"""A Flax Linen model served by paged_jax's engine.

``LLM`` serves ``flax.nnx.Module``s; a Linen model joins through a small NNX module that
holds its variables (parameters as ``nnx.Param``s, any other collection as
``nnx.Variable``s) and calls ``module.apply`` with them:

- the Linen model has a method ``paged_forward(tokens_T, positions_T, cache, metadata, *,
  logits_indices=None)`` returning ``(logits, cache)``; its layers write K/V with
  ``cache.write`` and attend with ``paged_attention``, exactly as an NNX model's do (the
  cache and metadata are pytrees, passed through ``apply`` like any array argument);
- ``FromLinen(module, variables)`` is the model ``LLM`` serves.

``main()`` initialises a small GPT-style Linen model (``init`` on its dense ``__call__``:
both methods share the same submodules, so one set of parameters serves both), serves
three prompts through ``LLM`` and checks every greedy token against a loop over the dense
forward. Run it: ``python examples/linen_model.py``.
"""

from __future__ import annotations

import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from paged_jax import LLM, SamplingParams, paged_attention

CONFIG = types.SimpleNamespace(vocab_size=96, embed_dim=32, num_layers=2, num_heads=2,
                               head_dim=16, max_seq_len=64, num_kv_heads=2)


class Block(nn.Module):
  """Pre-LayerNorm attention + GELU MLP; ``attend(q, k, v)`` is the paged or dense one."""
  c: types.SimpleNamespace

  def setup(self):
    self.ln1, self.ln2 = nn.LayerNorm(), nn.LayerNorm()
    self.qkv = nn.Dense(3 * self.c.num_heads * self.c.head_dim)
    self.proj = nn.Dense(self.c.embed_dim)
    self.fc1, self.fc2 = nn.Dense(4 * self.c.embed_dim), nn.Dense(self.c.embed_dim)

  def __call__(self, x_TE, attend):
    qkv_TH3D = self.qkv(self.ln1(x_TE)).reshape(x_TE.shape[0], -1, 3, self.c.head_dim)
    out_THD = attend(qkv_TH3D[:, :, 0], qkv_TH3D[:, :, 1], qkv_TH3D[:, :, 2])
    x_TE = x_TE + self.proj(out_THD.reshape(x_TE.shape[0], -1))
    return x_TE + self.fc2(nn.gelu(self.fc1(self.ln2(x_TE))))


class LinenGPT(nn.Module):
  c: types.SimpleNamespace

  def setup(self):
    self.wte = nn.Embed(self.c.vocab_size, self.c.embed_dim)
    self.wpe = nn.Embed(self.c.max_seq_len, self.c.embed_dim)
    self.blocks = [Block(self.c) for _ in range(self.c.num_layers)]
    self.ln_f = nn.LayerNorm()

  def _run(self, tokens_T, positions_T, attend_at):
    x_TE = self.wte(tokens_T) + self.wpe(positions_T)
    for layer, block in enumerate(self.blocks):
      x_TE = block(x_TE, lambda q, k, v, layer=layer: attend_at(layer, q, k, v))
    return self.wte.attend(self.ln_f(x_TE))  # tied embeddings

  def paged_forward(self, tokens_T, positions_T, cache, metadata, *, logits_indices=None):
    """The protocol paged_jax serves, written in Linen."""
    m = metadata

    def attend_at(layer, q_THD, k_TKD, v_TKD):
      nonlocal cache
      cache_layer, slots_T, block_tables_SP = m.for_layer(layer)
      cache = cache.write(cache_layer, k_TKD, v_TKD, slots_T)
      return paged_attention(q_THD, cache, cache_layer, m.kv_lens_S, block_tables_SP,
                             m.cu_q_lens, m.num_seqs)

    logits_TV = self._run(tokens_T, positions_T, attend_at)
    return (logits_TV if logits_indices is None else logits_TV[logits_indices]), cache

  def __call__(self, tokens_BT):
    """Dense causal logits [B, T, V], no cache (the oracle, and what ``init`` runs)."""
    b, t = tokens_BT.shape

    def attend_at(layer, q_THD, k_TKD, v_TKD):
      q, k, v = (x.reshape(b, t, *x.shape[1:]) for x in (q_THD, k_TKD, v_TKD))
      scores = jnp.einsum("BTHD,BJHD->BHTJ", q, k) * q.shape[-1] ** -0.5
      scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -jnp.inf)
      out = jnp.einsum("BHTJ,BJHD->BTHD", jax.nn.softmax(scores, axis=-1), v)
      return out.reshape(b * t, *out.shape[2:])

    logits_TV = self._run(tokens_BT.reshape(-1), jnp.tile(jnp.arange(t), b), attend_at)
    return logits_TV.reshape(b, t, -1)


class FromLinen(nnx.Module):
  """An NNX model ``LLM`` serves: a Linen module and its ``variables`` (``init``'s, or a
  checkpoint's: a dict or ``FrozenDict`` of collections), "params" held as ``nnx.Param``s
  and any other collection (batch_stats, ...) as ``nnx.Variable``s, all read-only."""

  def __init__(self, module: nn.Module, variables):
    self.module = module
    self.variables = nnx.data({name: jax.tree.map(nnx.Param if name == "params" else
                                                  nnx.Variable, tree)
                               for name, tree in variables.items()})

  def _values(self):
    return jax.tree.map(lambda v: v[...], self.variables,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))

  def paged_forward(self, tokens_T, positions_T, cache, metadata, *, logits_indices=None):
    return self.module.apply(self._values(), tokens_T, positions_T, cache, metadata,
                             logits_indices=logits_indices, method="paged_forward")

  def __call__(self, tokens_BT):  # the dense forward, for paged_jax.testing
    return self.module.apply(self._values(), tokens_BT)


@jax.jit
def _dense_logits(variables, tokens_BT):
  return LinenGPT(CONFIG).apply(variables, tokens_BT)


def dense_greedy(variables, prompt, num_tokens):
  """Greedy tokens from re-running the dense forward on the growing sequence."""
  seq = list(prompt)
  for _ in range(num_tokens):
    padded = np.zeros((1, CONFIG.max_seq_len), np.int32)  # causal: padding after is unseen
    padded[0, :len(seq)] = seq
    seq.append(int(jnp.argmax(_dense_logits(variables, jnp.asarray(padded))[0, len(seq) - 1])))
  return seq[len(prompt):]


def main(num_tokens: int = 8) -> list[list[int]]:
  module = LinenGPT(CONFIG)
  variables = module.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  llm = LLM(FromLinen(module, variables), CONFIG, block_size=4, num_blocks=32,
            max_seqs=4, max_tokens_per_step=32)
  prompts = [[5, 17, 33, 2, 64], [7, 7, 80, 1, 0, 45, 2, 90, 33, 12, 8], [11, 12, 13]]
  outs = llm.generate(prompts, SamplingParams(max_tokens=num_tokens))
  got = [list(o.token_ids) for o in outs]
  for prompt, tokens in zip(prompts, got):
    want = dense_greedy(variables, prompt, num_tokens)
    assert tokens == want, (prompt, tokens, want)
    print(f"prompt {prompt} -> {tokens} (equal to the dense forward's greedy tokens)")
  return got


if __name__ == "__main__":
  main()
