"""Runs on 4 CPU devices (``python -m tests.sharding._run_own_model OUT.json``): a model of
the user's own (``examples/own_model.py``) served over meshes, against the unsharded
engine. Data parallel (model axis 1) needs nothing of the model; tensor parallel needs its
``with_model_axis`` (here a subclass that ``psum``-s after its two output projections)
and, since flax's layers have no glossary letters in their names,
``param_partition_specs``. Writes one JSON file for ``test_own_model_sharding.py``.
"""

from __future__ import annotations

import os
import sys

_FLAG = "--xla_force_host_platform_device_count=4"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from paged_jax import LLM, SamplingParams, sharding  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples"))
import own_model  # noqa: E402

ENGINE = dict(block_size=4, num_blocks=32, max_seqs=4, max_tokens_per_step=16,
              token_buckets=(16,), steps_per_call=8)


class TPBlock(own_model.Block):
  """The example's block, run on a slice of whole heads and MLP columns: the output
  projections' partial sums are ``psum``-ed over the model axis, their biases added once."""

  def __call__(self, x_TE, attend, model_axis=None):
    if model_axis is None:
      return super().__call__(x_TE, attend)
    qkv_TH3D = self.qkv(self.ln1(x_TE)).reshape(x_TE.shape[0], -1, 3, self.c.head_dim)
    out_THD = attend(qkv_TH3D[:, :, 0], qkv_TH3D[:, :, 1], qkv_TH3D[:, :, 2])
    partial_TE = out_THD.reshape(x_TE.shape[0], -1) @ self.proj.kernel[...]
    x_TE = x_TE + jax.lax.psum(partial_TE, model_axis) + self.proj.bias[...]
    hidden_TI = jax.nn.gelu(self.fc1(self.ln2(x_TE)))
    return x_TE + jax.lax.psum(hidden_TI @ self.fc2.kernel[...], model_axis) + \
        self.fc2.bias[...]


class TPTinyGPT(own_model.TinyGPT):
  """The example's model with the two optional tensor-parallel methods."""

  def __init__(self, c, *, rngs):
    super().__init__(c, rngs=rngs)
    self.blocks = nnx.List([TPBlock(c, rngs) for _ in range(c.num_layers)])
    self.model_axis = None

  def _run(self, tokens_T, positions_T, attend_at):
    x_TE = self.wte(tokens_T) + self.wpe(positions_T)
    for layer, block in enumerate(self.blocks):
      x_TE = block(x_TE, lambda q, k, v, layer=layer: attend_at(layer, q, k, v),
                   model_axis=self.model_axis)
    return x_TE

  def with_model_axis(self, axis):
    graphdef, state = nnx.split(self)
    copy = nnx.merge(graphdef, state)
    copy.model_axis = axis
    return copy

  def param_partition_specs(self, axis):
    split = {("qkv", "kernel"): P(None, axis), ("qkv", "bias"): P(axis),
             ("proj", "kernel"): P(axis, None), ("fc1", "kernel"): P(None, axis),
             ("fc1", "bias"): P(axis), ("fc2", "kernel"): P(axis, None)}

    def spec(path, _):
      names = tuple(k.key for k in path if hasattr(k, "key"))  # dict keys, not .value
      return split.get(names[-2:], P()) if names[0] == "blocks" else P()

    return jax.tree_util.tree_map_with_path(spec, nnx.state(self))


def mesh_of(d, m):
  return Mesh(np.array(jax.devices()[:d * m]).reshape(d, m), (sharding.DATA, sharding.MODEL))


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  config = own_model.TinyGPTConfig()
  plain = own_model.TinyGPT(config, rngs=nnx.Rngs(1))
  tp = TPTinyGPT(config, rngs=nnx.Rngs(1))
  # Same weights in both (the TP model's are drawn in the same order; copied to be sure).
  nnx.update(tp, nnx.state(plain))
  rng = np.random.default_rng(0)
  prompts = [[int(t) for t in rng.integers(3, config.vocab_size, n)]
             for n in (5, 17, 9, 3, 12, 7)]
  params = SamplingParams(max_tokens=6, logprobs=True)

  compiles = []
  jax.monitoring.register_event_duration_secs_listener(
      lambda name, secs, **kw: compiles.append(name)
      if name.endswith("backend_compile_duration") else None)

  def serve(model, mesh=None, precompile=False):
    llm = LLM(model, config, mesh=mesh, **ENGINE)
    if precompile:  # every call compiled ahead: serving compiles nothing more
      result["precompiled"] = sorted(llm.precompile())
      compiles.clear()
    outs = llm.generate(prompts, params)
    if precompile:
      result["compiles_while_serving"] = len(compiles)
    kernel = llm._params["blocks"][0]["qkv"]["kernel"][...]
    return dict(tokens=[list(o.token_ids) for o in outs],
                logprobs=[list(o.logprobs) for o in outs],
                qkv_kernel_per_device=list(kernel.addressable_shards[0].data.shape),
                free_blocks=llm.stats["num_free_blocks"])

  result = dict(num_devices=jax.device_count())
  result["unsharded"] = serve(plain)
  result["data_2x1"] = serve(plain, mesh_of(2, 1))
  result["tp_1x2"] = serve(tp, mesh_of(1, 2))
  result["tp_2x2"] = serve(tp, mesh_of(2, 2), precompile=True)
  try:
    LLM(plain, config, mesh=mesh_of(1, 2), **ENGINE)
    result["no_with_model_axis"] = None
  except ValueError as e:
    result["no_with_model_axis"] = str(e)
  with open(argv[0], "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main()
