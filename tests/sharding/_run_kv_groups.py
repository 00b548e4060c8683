"""Runs on 4 CPU devices (``python -m tests.sharding._run_kv_groups OUT.json``): KV groups
(sliding layers give back the blocks behind their window, ``free_outside_window=True``)
under a ("data", "model") mesh. For an all-sliding Mistral-like model (one sliding group)
and a Gemma-3-like hybrid (one sliding, one full layer: two groups), the same prompts are
served unsharded and over (2 x 1) and (2 x 2) meshes in a pool too small to hold the
sequences unless the sliding group gives blocks back; released blocks are scrubbed, so a
block given back too early would change the tokens. Writes one JSON file that
``test_kv_groups_sharding.py`` (the parent pytest process, one device) checks.

XLA_FLAGS must carry ``--xla_force_host_platform_device_count=4`` before JAX starts; the
parent passes it in the environment and this module adds it when missing.
"""

from __future__ import annotations

import os
import sys

_FLAG = "--xla_force_host_platform_device_count=4"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from paged_jax import allocator, models, sharding  # noqa: E402
from paged_jax.engine import LLM, SamplingParams  # noqa: E402
from paged_jax.kv_groups import layer_windows_of  # noqa: E402
from tests.models import helpers  # noqa: E402

WINDOW, Z, T = 16, 4, 16
NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS = 4, 20, 40
MESHES = ((2, 1), (2, 2))
# Pools (totals over the data shards; each of d = 2 shards owns half, and 2 of the 4
# sequences). A sequence reaches 20 + 40 = 60 tokens: 15 blocks per group.
# - all sliding (one group): at most sliding_blocks(16, 4, 16) = 9 blocks each, 36 for
#   four; 40 blocks hold them only when the group gives blocks back (60 without).
# - hybrid (a block holds one layer): 15 (full) + 9 (sliding) = 24 each, 96 for four;
#   104 blocks hold them only with windowed freeing (4 * 30 = 120 without).
MODELS = {
    "mistral": dict(config=dict(model_type="mistral", sliding_window=WINDOW), num_blocks=40),
    "gemma3": dict(config=dict(model_type="gemma3_text", sliding_window=WINDOW,
                               sliding_window_pattern=2), num_blocks=104),
}
ENGINE = dict(block_size=Z, max_seqs=NUM_PROMPTS, max_tokens_per_step=T, token_buckets=(T,),
              steps_per_call=16, free_outside_window=True, scrub_on_release=True,
              compilation_cache=False)


def mesh_of(shape):
  d, m = shape
  return Mesh(np.array(jax.devices()[:d * m]).reshape(d, m), (sharding.DATA, sharding.MODEL))


def given_back(llm, mesh) -> list[int]:
  """Per KV group, the table entries that are NO_BLOCK below a block the sequence still
  holds (blocks given back behind the window), summed over every slot (and data shard)."""
  tables = np.asarray(llm.allocator_state.block_tables)
  if mesh is None:
    tables = tables[None]  # [d = 1, (g,) S, P]
  if tables.ndim == 3:  # one group: the table has no group axis
    tables = tables[:, None]
  held = tables >= 0  # [d, g, S, P]
  last = np.where(held.any(-1), held.shape[-1] - 1 - np.argmax(held[..., ::-1], -1), 0)
  below = np.arange(held.shape[-1]) < last[..., None]
  return [int(n) for n in (below & ~held).sum((0, 2, 3))]


def serve(model, config, num_blocks, mesh):
  t0 = time.perf_counter()
  llm = LLM(model, config, num_blocks=num_blocks, mesh=mesh, **ENGINE)
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(3, helpers.VOCAB, PROMPT_LEN)]
             for _ in range(NUM_PROMPTS)]
  params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=True)
  tokens, logprobs, holes = {}, {}, None
  for ev in llm.generate_stream(prompts, params):
    if ev.token_id is None:
      continue
    tokens.setdefault(ev.prompt_index, []).append(ev.token_id)
    logprobs.setdefault(ev.prompt_index, []).append(ev.logprob)
    if holes is None and len(tokens[ev.prompt_index]) >= MAX_TOKENS // 2:
      holes = given_back(llm, mesh)  # mid-run: the sequences are 40+ tokens long
  stats = llm.stats
  alloc = llm.allocator_state
  shards = 1 if mesh is None else mesh.shape[sharding.DATA]
  for i in range(shards):  # each data shard's allocator keeps the invariants of its groups
    allocator.validate(alloc if mesh is None else
                       jax.tree_util.tree_map(lambda x, i=i: np.asarray(x)[i], alloc))
  return dict(
      tokens=[tokens[i] for i in range(NUM_PROMPTS)],
      logprobs=[logprobs[i] for i in range(NUM_PROMPTS)],
      given_back_mid_run=holes,
      windows=list(llm.kv_groups.windows),
      block_tables_shape=list(np.shape(alloc.block_tables)),
      **{k: stats[k] for k in ("preemptions", "peak_blocks_in_use", "num_blocks",
                               "num_free_blocks", "generated_tokens", "steps")},
      seconds=time.perf_counter() - t0)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  result = dict(num_devices=jax.device_count())
  for name, spec in MODELS.items():
    overrides = dict(spec["config"])
    config = helpers.tiny_config(overrides.pop("model_type"), **overrides)
    model = models.init_random(config, seed=0, impl="xla")
    runs = dict(layer_windows=list(layer_windows_of(config)))
    runs["unsharded"] = serve(model, config, spec["num_blocks"], None)
    for shape in MESHES:
      runs[f"{shape[0]}x{shape[1]}"] = serve(model, config, spec["num_blocks"],
                                             mesh_of(shape))
    result[name] = runs
  with open(argv[0], "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main()
