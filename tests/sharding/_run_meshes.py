"""Runs on 8 CPU devices (``python -m tests.sharding._run_meshes OUT.json``): the engine over
several ("data", "model") meshes against the unsharded engine (on a tiny random checkpoint,
one mesh through ``LLM.from_pretrained(..., mesh=...)``), where ``load_pretrained`` puts
each tensor, the sharded paged forward against the unsharded one, per-device KV bytes, the
mesh validation errors. Writes one JSON file that ``test_sharding.py`` (the parent pytest
process, one device) checks.

XLA_FLAGS must carry ``--xla_force_host_platform_device_count=8`` before JAX starts; the
parent passes it in the environment and this module adds it when missing.
"""

from __future__ import annotations

import os
import sys

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import dataclasses  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from paged_jax.models import ModelConfig, init_random, load_pretrained, steps as model_steps  # noqa: E402,E501
from paged_jax import KVCache, allocator, protocol, sharding  # noqa: E402
from paged_jax.engine import LLM, SamplingParams  # noqa: E402
from tests.models import helpers  # noqa: E402

EOS = 2
VOCAB = 128
MESHES = ((1, 1), (2, 4), (1, 8), (8, 1))
COLLECTIVES_MESH = (2, 4)  # compiled once more to read its collectives
FROM_PRETRAINED_MESH = (2, 4)  # built by LLM.from_pretrained(checkpoint, mesh=...)
ABORT_MESH = (8, 1)  # scrub_on_release, and a stream abandoned mid-way
ENGINE = dict(block_size=4, num_blocks=128, max_seqs=16, max_tokens_per_step=16,
              steps_per_call=8, max_model_len=64)


def config(num_kv_heads=4, num_heads=8, mlp_dim=96):
  return ModelConfig(model_type="llama", vocab_size=VOCAB, embed_dim=64, mlp_dim=mlp_dim,
                     num_layers=2, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=16, max_seq_len=128, eos_token_ids=(EOS,))


def write_checkpoint(path) -> str:
  """A tiny random Hugging Face checkpoint of ``config()``'s shape (no torch)."""
  hf = helpers.hf_config_dict("llama", num_attention_heads=8, num_key_value_heads=4,
                              max_position_embeddings=128)
  cfg = ModelConfig.from_hf_dict(hf)
  helpers.write_numpy_checkpoint(path, hf, helpers.hf_tensors(cfg, seed=0))
  return path


def load_placements(checkpoint):
  """Partition specs of q_EHD and k_EKD as ``load_pretrained`` places them for (2, 4) and
  (1, 8) meshes (K = 4: split over m = 4, kept whole for m = 8), and whether the loaded
  values equal an unsharded load."""
  ref, _ = load_pretrained(checkpoint, dtype="float32", impl="xla")
  out = {}
  for shape in ((2, 4), (1, 8)):
    model, _ = load_pretrained(checkpoint, dtype="float32", impl="xla",
                               sharding=sharding.load_placement(mesh_of(shape)))
    attn, ref_attn = model.layers.attn, ref.layers.attn
    out[f"{shape[0]}x{shape[1]}"] = dict(
        q_EHD=[str(a) for a in attn.q_EHD[...].sharding.spec],
        k_EKD=[str(a) for a in attn.k_EKD[...].sharding.spec],
        down_IE=[str(a) for a in model.layers.mlp.down_IE[...].sharding.spec],
        equal=all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
            jax.tree_util.tree_leaves(nnx.state(model)),
            jax.tree_util.tree_leaves(nnx.state(ref)))))
  return out


def mesh_of(shape):
  d, m = shape
  return Mesh(np.array(jax.devices()[:d * m]).reshape(d, m), (sharding.DATA, sharding.MODEL))


def workload():
  """Ragged prompts (some longer than T = 16: chunked prefill), a fork (n = 2), a stop id,
  penalties, greedy with logprobs (and the fork's top 4); 21 completions for 16 slots (continuous batching)."""
  rng = np.random.default_rng(0)
  lengths = (5, 17, 9, 30, 3, 1, 12, 7, 2, 22, 4, 8, 15, 6, 11, 3, 19, 5, 9, 1)
  prompts = [[int(t) for t in rng.integers(3, VOCAB, n)] for n in lengths]
  params = [SamplingParams(max_tokens=8, logprobs=True, ignore_eos=True)] * len(prompts)
  params[2] = SamplingParams(max_tokens=10, n=2, logprobs=True, top_logprobs=4,
                             ignore_eos=True)
  params[5] = SamplingParams(max_tokens=12, stop_token_ids=(73,), logprobs=True,
                             ignore_eos=True)
  # Penalties and min_tokens read each shard's own token history rows.
  params[7] = SamplingParams(max_tokens=10, repetition_penalty=1.5, presence_penalty=0.3,
                             frequency_penalty=0.5, min_tokens=4, stop_token_ids=(73,),
                             logprobs=True, ignore_eos=True)
  return prompts, params


def prompt_logprobs(llm, prompts):
  """Each prompt's log-probs and top 2 (``SamplingParams.prompt_logprobs``), for the first
  six prompts (one of 30 tokens: chunks over T = 16), with a fork."""
  params = [SamplingParams(max_tokens=2, prompt_logprobs=2, n=1 + (i == 3))
            for i in range(6)]
  outs = llm.generate(prompts[:6], params)
  return [[o.prompt_logprobs, [None if t is None else list(t.items())
                               for t in o.prompt_top_logprobs]] for o in outs]


def summary(outs):
  return dict(tokens=[list(o.token_ids) for o in outs],
              reasons=[(o.finish_reason, o.stop_reason) for o in outs],
              logprobs=[list(o.logprobs) for o in outs],
              top=[[list(t.items()) for t in o.top_logprobs or []] for o in outs])


def collective_sizes(llm) -> list[int]:
  """Element counts of every collective's result in the compiled device call."""
  wanted = jnp.int32(0)
  call = llm._call_for(llm.token_buckets[-1])
  hlo = call.lower(llm._params, llm._state, wanted, jnp.int32(1)).compile().as_text()
  sizes = []
  for line in hlo.splitlines():
    if any(op in line for op in (" all-gather(", " all-to-all(", " all-reduce(",
                                 " collective-permute(", " reduce-scatter(",
                                 " all-gather-start(", " all-reduce-start(")):
      shape = line.split("=", 1)[1].split("{")[0] if "=" in line else ""
      dims = shape[shape.find("[") + 1:shape.find("]")] if "[" in shape else ""
      sizes.append(int(np.prod([int(x) for x in dims.split(",") if x.strip()] or [1])))
  return sizes


def run_engines(model, cfg, checkpoint):
  prompts, params = workload()
  t0 = time.perf_counter()
  base = LLM(model, cfg, **ENGINE)
  result = dict(unsharded=summary(base.generate(prompts, params)))
  result["unsharded_s"] = time.perf_counter() - t0
  result["unsharded"]["prompt_logprobs"] = prompt_logprobs(base, prompts)
  for shape in MESHES:
    t0 = time.perf_counter()
    if shape == FROM_PRETRAINED_MESH:  # the same weights, loaded onto their slices; the
      # mesh as jax.make_mesh makes it, with Explicit axes by default (taken as Auto)
      d, m = shape
      mesh = jax.make_mesh(shape, (sharding.DATA, sharding.MODEL),
                           devices=jax.devices()[:d * m])
      llm = LLM.from_pretrained(checkpoint, mesh=mesh, dtype="float32", impl="xla", **ENGINE)
    else:  # (8, 1) also scrubs released blocks inside the shard_map'd loop
      llm = LLM(model, cfg, mesh=mesh_of(shape), scrub_on_release=shape == ABORT_MESH,
                **ENGINE)
    out = summary(llm.generate(prompts, params))
    stats = llm.stats
    if shape == ABORT_MESH:  # prompt log-probs: rows of 8 shards' steps, merged
      out["prompt_logprobs"] = prompt_logprobs(llm, prompts)
    if shape == ABORT_MESH:  # a stream closed early: every shard's blocks come back
      stream = llm.generate_stream(prompts[:6], params[:6])
      next(stream)
      stream.close()
      out["free_after_abort"] = llm.stats["num_free_blocks"]
    plan = llm._plan
    per_device = sharding.kv_bytes_by_device(llm._state.cache)
    alloc = llm.allocator_state
    for i in range(plan.data_size):
      allocator.validate(jax.tree_util.tree_map(lambda x, i=i: np.asarray(x)[i], alloc))
    llm.reset_stats()
    out.update(
        seconds=time.perf_counter() - t0,
        kv_bytes_per_device=sorted(set(per_device.values())),
        num_devices_holding_kv=len(per_device),
        kv_total_bytes=llm.spec.total_bytes,
        kv_expected_per_device=plan.kv_bytes_per_device(llm.spec.total_bytes),
        replication=plan.replication,
        cache_shape=list(llm._state.cache.k_pages.shape),
        local_cache_shape=list(llm._state.cache.k_pages.addressable_shards[0].data.shape),
        num_free_blocks=stats["num_free_blocks"], num_blocks=stats["num_blocks"],
        generated_tokens=stats["generated_tokens"], steps=stats["steps"],
        stats_after_reset=llm.stats["steps"],
        local_pages_elems=int(np.prod(llm._state.cache.k_pages.addressable_shards[0]
                                      .data.shape)))
    if shape == COLLECTIVES_MESH:
      out["collective_elems"] = sorted(set(collective_sizes(llm)))
    result[f"{shape[0]}x{shape[1]}"] = out
  return result


def forward_equality(model, cfg, model_sizes, block_size=4):
  """One ragged prefill step (two sequences, 7 and 13 tokens) through the model unsharded
  and under ``shard_map`` over a (1, m) mesh for each m: max |logits diff| / max |logits|
  and the same for the cache (each KV head compared with its first replica)."""
  spec = model.kv_cache_spec(block_size=block_size, num_blocks=16)
  alloc = allocator.init(16, block_size, 4, 8)
  rng = np.random.default_rng(1)
  tokens_T = jnp.asarray(rng.integers(3, VOCAB, 24), jnp.int32)
  num_new_S = jnp.asarray([7, 13, 0, 0], jnp.int32)
  step = jax.jit(lambda mdl, a, c: model_steps.prefill_step(mdl, a, c, tokens_T, num_new_S))
  logits_ref, _, cache_ref, _ = step(model, alloc, KVCache.create(spec))
  return {str(m): _sharded_forward(model, cfg, m, spec, alloc, tokens_T, num_new_S,
                                   logits_ref, cache_ref) for m in model_sizes}


def _sharded_forward(model, cfg, m, spec, alloc, tokens_T, num_new_S, logits_ref, cache_ref):
  plan = sharding.ShardingPlan.create(mesh_of((1, m)), num_heads=cfg.num_heads,
                                      num_kv_heads=cfg.num_kv_heads, mlp_dim=cfg.mlp_dim)

  graphdef, params, _ = plan.shard_model(model)
  pages = [None] * 5
  pages[1] = sharding.MODEL
  cache = KVCache.create(dataclasses.replace(spec, num_kv_heads=plan.kv_head_slots),
                         sharding=NamedSharding(plan.mesh, P(*pages)))
  cache_spec = jax.tree.map(lambda a: P(*pages[:a.ndim]), cache)  # pages (and any scales)

  def local(params, a, c):
    logits, a, c, ok = model_steps.prefill_step(nnx.merge(graphdef, params), a, c, tokens_T,
                                                num_new_S)
    return logits, c

  fn = jax.jit(jax.shard_map(local, mesh=plan.mesh,
                             in_specs=(plan.param_specs(params), P(), cache_spec),
                             out_specs=(P(), cache_spec), check_vma=False))
  logits, cache = fn(params, alloc, cache)
  logits, logits_ref = np.asarray(logits), np.asarray(logits_ref)
  k, k_ref = np.asarray(cache.k_pages), np.asarray(cache_ref.k_pages)
  v, v_ref = np.asarray(cache.v_pages), np.asarray(cache_ref.v_pages)
  r = plan.replication
  rel = lambda a, b: float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
  replicas_equal = all(np.array_equal(k[:, j * r + i], k[:, j * r])
                       for j in range(cfg.num_kv_heads) for i in range(r))
  return dict(logits_rel=rel(logits, logits_ref), k_rel=rel(k[:, ::r], k_ref),
              v_rel=rel(v[:, ::r], v_ref), replicas_equal=replicas_equal,
              local_heads=int(cache.k_pages.addressable_shards[0].data.shape[1]))


def errors(model, cfg):
  """Messages of the ValueErrors a bad mesh or bad sizes raise."""
  out = {}

  def catch(name, fn):
    try:
      fn()
      out[name] = None
    except ValueError as e:
      out[name] = str(e)

  devices = np.array(jax.devices()[:8])
  catch("axis_names", lambda: LLM(model, cfg, mesh=Mesh(devices.reshape(2, 4), ("x", "y")),
                                  **ENGINE))
  catch("heads", lambda: LLM(model, cfg, mesh=Mesh(devices[:3].reshape(1, 3),
                                                   ("data", "model")), **ENGINE))
  catch("kv_heads", lambda: sharding.ShardingPlan.create(
      mesh_of((1, 4)), num_heads=12, num_kv_heads=6, mlp_dim=96))
  catch("mlp", lambda: sharding.ShardingPlan.create(
      mesh_of((1, 4)), num_heads=8, num_kv_heads=4, mlp_dim=90))
  catch("not_a_mesh", lambda: LLM(model, cfg, mesh="8 devices", **ENGINE))
  catch("max_seqs", lambda: LLM(model, cfg, mesh=mesh_of((2, 4)),
                                **{**ENGINE, "max_seqs": 15}))
  catch("num_blocks", lambda: LLM(model, cfg, mesh=mesh_of((8, 1)),
                                  **{**ENGINE, "num_blocks": 100}))
  block = protocol.kv_cache_spec(cfg, block_size=4, num_blocks=1, dtype="float32").block_bytes
  budget = {k: v for k, v in ENGINE.items() if k not in ("num_blocks", "max_model_len")}
  catch("budget", lambda: LLM(model, cfg, mesh=mesh_of((8, 1)), kv_budget_bytes=3 * block,
                              free_outside_window=False, **budget))
  llm = LLM(model, cfg, mesh=mesh_of((8, 1)), **ENGINE)
  catch("n", lambda: llm.generate([[5, 6]], SamplingParams(n=3)))
  return out


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  with tempfile.TemporaryDirectory() as tmp:
    checkpoint = write_checkpoint(os.path.join(tmp, "tiny"))
    result = run(checkpoint)
  with open(argv[0], "w") as f:
    json.dump(result, f)


def run(checkpoint):
  model, cfg = load_pretrained(checkpoint, dtype="float32", impl="xla")
  assert cfg.num_heads == 8 and cfg.num_kv_heads == 4 and cfg.max_seq_len == 128
  result = dict(num_devices=jax.device_count())
  t0 = time.perf_counter()
  result["load_placements"] = load_placements(checkpoint)
  result["engines"] = run_engines(model, cfg, checkpoint)
  result["engines_s"] = time.perf_counter() - t0
  result["forward"] = forward_equality(model, cfg, (4, 8))
  cfg1 = config(num_kv_heads=1)  # MQA: one KV head stored 8 times on a model axis of 8
  mqa = forward_equality(init_random(cfg1, seed=1, impl="xla"), cfg1, (8,))
  result["forward"]["8_mqa"] = mqa["8"]
  # The Pallas kernels (interpret mode) inside the same shard_map, one KV head per device;
  # the TPU kernel needs D >= 64 and Z a multiple of 8.
  for impl, cfg_k, z in (("pallas_gpu", cfg, 4),
                         ("pallas_tpu", dataclasses.replace(cfg, head_dim=64), 8)):
    kernel_model = init_random(cfg_k, seed=2, impl=impl, interpret=True)
    result["forward"][f"4_{impl}"] = forward_equality(kernel_model, cfg_k, (4,),
                                                      block_size=z)["4"]
  result["forward_s"] = time.perf_counter() - t0 - result["engines_s"]
  result["errors"] = errors(model, cfg)
  result["seconds"] = time.perf_counter() - t0
  return result


if __name__ == "__main__":
  main()
