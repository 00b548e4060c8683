"""gpt-oss's MoE MLP (models/moe.py) and YaRN RoPE (models/rope.py) against transformers.

The MoE module gets transformers' ``GptOssMLP`` weights (random, O(1) scale, float32),
converted from the checkpoint layout (interleaved gate/up), and must give its output within
1e-5 relative; one batch is small enough that some experts get no token. Negative controls:
the output of a token does not move when an expert it did not choose changes (routing is
truly top-k) but does when a chosen one changes, and a mixture over ALL experts (softmax over
every logit) is far from transformers' output, so the parity test could fail. The experts
run through ``ragged_dot`` (checked in the jaxpr). Tensor parallelism over I is checked by
running two halves of I under ``vmap`` with a named axis (``psum`` over it) against the
whole module. YaRN: inverse frequencies and attention factor equal transformers' rope init
for gpt-oss configs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paged_jax.models import moe, rope

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.gpt_oss import modeling_gpt_oss  # noqa: E402

E, I, O, TOP_K = 32, 24, 8, 3  # width, expert width, experts, experts per token


def _relative_error(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def _hf_config(**overrides):
  kwargs = dict(hidden_size=E, intermediate_size=I, num_local_experts=O,
                num_experts_per_tok=TOP_K, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=64)
  kwargs.update(overrides)
  config = transformers.GptOssConfig(**kwargs)
  config._experts_implementation = "eager"
  return config


@pytest.fixture(scope="module")
def hf_mlp():
  """transformers' GptOssMLP with O(1)-scale random weights (its init is std 0.02, which
  would make every expert's output tiny and the comparison insensitive)."""
  torch.manual_seed(0)
  mlp = modeling_gpt_oss.GptOssMLP(_hf_config()).eval()
  gen = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for name, p in mlp.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      fan_in = {"router.weight": E, "experts.gate_up_proj": E, "experts.down_proj": I}
      p.copy_(noise * fan_in[name] ** -0.5 if name in fan_in else 0.1 * noise)
  return mlp


def _ours(hf) -> moe.MoEMLP:
  """Our module holding ``hf``'s weights (checkpoint layout -> ours)."""
  ours = nnx.eval_shape(lambda: moe.MoEMLP(embed_dim=E, mlp_dim=I, num_experts=O,
                                           experts_per_token=TOP_K, rngs=nnx.Rngs(0)))
  sd = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
  gate, up = moe.from_hf_gate_up(sd["experts.gate_up_proj"])
  gate_bias, up_bias = moe.from_hf_gate_up(sd["experts.gate_up_proj_bias"])
  values = {"router_EO": sd["router.weight"].T, "router_bias_O": sd["router.bias"],
            "gate_OEI": gate, "up_OEI": up, "gate_bias_OI": gate_bias, "up_bias_OI": up_bias,
            "down_OIE": sd["experts.down_proj"], "down_bias_OE": sd["experts.down_proj_bias"]}
  graphdef, state = nnx.split(ours)
  filled = [(path, v.replace(value=jnp.asarray(np.ascontiguousarray(values[path[-1]]))))
            for path, v in nnx.to_flat_state(state)]
  return nnx.merge(graphdef, nnx.from_flat_state(filled))


@jax.jit
def _forward(graphdef, state, x_TE):
  return nnx.merge(graphdef, state)(x_TE)


def _run(module, x_TE):
  graphdef, state = nnx.split(module)
  return np.asarray(_forward(graphdef, state, jnp.asarray(x_TE)))


def _hf_run(hf, x_TE):
  with torch.no_grad():
    return hf(torch.from_numpy(x_TE)[None])[0][0].numpy()


def _hf_routing(hf, x_TE):
  """transformers' (weights ``[Y]``, expert ids ``[Y]``), token-major like ours."""
  with torch.no_grad():
    _, weights, experts = hf.router(torch.from_numpy(x_TE))
  return weights.numpy().reshape(-1), experts.numpy().reshape(-1)


# 2 tokens x 3 choices are 6 assignments over 8 experts: at least 2 experts get no row (a
# group of size 0). 40 tokens give every expert several rows (checked below).
@pytest.mark.parametrize("num_tokens,seed", [(2, 3), (40, 1)])
def test_moe_matches_transformers(hf_mlp, num_tokens, seed):
  x_TE = np.random.default_rng(seed).standard_normal((num_tokens, E)).astype(np.float32)
  want_weights_Y, want_experts_Y = _hf_routing(hf_mlp, x_TE)
  counts_O = np.bincount(want_experts_Y, minlength=O)
  if num_tokens == 2:
    assert (counts_O == 0).any(), counts_O  # some expert receives no token
  else:
    assert (counts_O >= 2).all(), counts_O
  ours = _ours(hf_mlp)
  weights_Y, experts_Y = ours.router(jnp.asarray(x_TE))
  np.testing.assert_array_equal(np.asarray(experts_Y), want_experts_Y)
  np.testing.assert_allclose(np.asarray(weights_Y), want_weights_Y, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(weights_Y).reshape(-1, TOP_K).sum(-1), 1.0, rtol=1e-6)
  want = _hf_run(hf_mlp, x_TE)
  got = _run(ours, x_TE)
  assert _relative_error(got, want) < 1e-5


def test_routing_is_top_k(hf_mlp):
  """A token's output ignores the experts it did not choose; a dense mixture does not."""
  x_TE = np.random.default_rng(5).standard_normal((6, E)).astype(np.float32)
  ours = _ours(hf_mlp)
  base = _run(ours, x_TE)
  choices = _hf_routing(hf_mlp, x_TE)[1].reshape(-1, TOP_K)  # [T, k]
  unchosen = sorted(set(range(O)) - set(choices[0].tolist()))
  chosen = int(choices[0, -1])  # the lowest-weighted of token 0's choices
  for expert, moves in ((unchosen[0], False), (chosen, True)):
    changed = _ours(hf_mlp)
    changed.down_OIE[...] = changed.down_OIE[...].at[expert].multiply(3.0)
    changed.down_bias_OE[...] = changed.down_bias_OE[...].at[expert].add(1.0)
    out = _run(changed, x_TE)
    assert (_relative_error(out[0], base[0]) > 1e-3) == moves, (expert, moves)
    users = (choices == expert).any(-1)  # the tokens routed to this expert
    np.testing.assert_array_equal(out[~users], base[~users])
  # Negative control: softmax over all O logits, every expert for every token.
  x = jnp.asarray(x_TE)
  logits_TO = x @ ours.router_EO[...] + ours.router_bias_O[...]
  gate = jnp.minimum(jnp.einsum("TE,OEI->TOI", x, ours.gate_OEI[...]) + ours.gate_bias_OI[...],
                     7.0)
  up = jnp.clip(jnp.einsum("TE,OEI->TOI", x, ours.up_OEI[...]) + ours.up_bias_OI[...], -7, 7)
  down_TOE = jnp.einsum("TOI,OIE->TOE", (up + 1) * gate * jax.nn.sigmoid(1.702 * gate),
                        ours.down_OIE[...]) + ours.down_bias_OE[...]
  dense = jnp.einsum("TO,TOE->TE", jax.nn.softmax(logits_TO, -1), down_TOE)
  assert _relative_error(dense, _hf_run(hf_mlp, x_TE)) > 1e-2


def test_experts_run_as_one_grouped_matmul():
  module = nnx.eval_shape(lambda: moe.MoEMLP(embed_dim=E, mlp_dim=I, num_experts=O,
                                              experts_per_token=TOP_K, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(module)  # abstract: tracing needs no weights
  jaxpr = jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(
      state, jnp.zeros((5, E), jnp.float32)).jaxpr
  names = [eqn.primitive.name for eqn in jaxpr.eqns]
  assert names.count("ragged_dot_general") == 3  # gate, up, down
  # No intermediate as large as every expert for every token ([T, O, I] or [T, O, E]).
  sizes = [int(np.prod(v.aval.shape)) for eqn in jaxpr.eqns for v in eqn.outvars]
  assert max(sizes) < 5 * O * min(I, E), max(sizes)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_accelerator_lowering_keeps_the_grouped_matmul(platform):
  """On TPU and GPU the grouped matmul lowers to XLA's ``ragged_dot`` (a grouped GEMM): no
  [O, Y, E] operand (every expert's copy of every row) appears. JAX 0.10.2 on CPU, by
  contrast, lowers ``ragged_dot`` to exactly that masked dense form (checked by hand: the
  [8, 15, 32] operand below), so CPU runs cost O times the routed FLOPs."""
  module = nnx.eval_shape(lambda: moe.MoEMLP(embed_dim=E, mlp_dim=I, num_experts=O,
                                              experts_per_token=TOP_K, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(module)
  exported = jax.export.export(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)),
                               platforms=[platform])(
      state, jax.ShapeDtypeStruct((5, E), jnp.float32))
  text = exported.mlir_module()
  assert text.count('stablehlo.composite "chlo.ragged_dot"') == 3  # gate, up, down
  assert f"{O}x{5 * TOP_K}x{E}x" not in text  # the dense emulation's expanded rows


def test_model_axis_splits_expert_columns(hf_mlp):
  """Two halves of every expert's I columns under a named vmap axis, ``psum``-ed, equal the
  whole module (the split ``paged_jax.sharding`` makes from the names' I letters)."""
  x_TE = np.random.default_rng(2).standard_normal((7, E)).astype(np.float32)
  ours = _ours(hf_mlp)
  graphdef, state = nnx.split(ours)
  halves = []
  for part in range(2):
    flat = []
    for path, v in nnx.to_flat_state(state):
      value, name = v.get_value(), path[-1]
      letters = name.rsplit("_", 1)[-1]
      if "I" in letters:
        axis = letters.index("I")
        value = jnp.split(value, 2, axis=axis)[part]
      flat.append((path, v.replace(value=value)))
    halves.append(nnx.from_flat_state(flat))
  stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), halves[0], halves[1])
  split_out = jax.jit(jax.vmap(lambda s, x: nnx.merge(graphdef, s)(x, model_axis="model"),
                               in_axes=(0, None), axis_name="model"))(stacked, jnp.asarray(x_TE))
  whole = _run(ours, x_TE)
  for part in range(2):
    assert _relative_error(split_out[part], whole) < 1e-5


def test_moe_rejects_bad_arguments():
  with pytest.raises(ValueError, match="experts_per_token=9"):
    moe.MoEMLP(embed_dim=E, mlp_dim=I, num_experts=8, experts_per_token=9, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_experts=0"):
    moe.MoEMLP(embed_dim=E, mlp_dim=I, num_experts=0, experts_per_token=1, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("overrides", [
    {},  # gpt-oss-20b's own config: yarn, factor 32, beta 32 / 1, truncate False, D 64
    {"head_dim": 16, "rope_parameters": {"rope_type": "yarn", "factor": 8.0,
                                         "beta_fast": 16.0, "beta_slow": 2.0,
                                         "original_max_position_embeddings": 256,
                                         "rope_theta": 10000.0}},  # truncate absent: True
])
def test_yarn_matches_transformers(overrides):
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  config = transformers.GptOssConfig(**overrides)
  want_inv_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
  p = config.rope_parameters
  inv_freq, factor = rope.yarn_inv_frequencies(
      head_dim=config.head_dim, theta=p["rope_theta"], factor=p["factor"],
      original_max_position_embeddings=p["original_max_position_embeddings"],
      beta_fast=p["beta_fast"], beta_slow=p["beta_slow"], truncate=p.get("truncate", True))
  scaling = rope.YarnScaling.from_hf(p)  # the same, read from the dict with its defaults
  assert scaling.truncate == p.get("truncate", True)
  from_dict = scaling.inv_frequencies(config.head_dim, p["rope_theta"])
  np.testing.assert_array_equal(from_dict[0], inv_freq)
  assert from_dict[1] == factor
  assert inv_freq.dtype == np.float32 and inv_freq.shape == (config.head_dim // 2,)
  # numpy's and torch's float32 pow may round theta ** x an ulp apart.
  np.testing.assert_allclose(inv_freq, want_inv_freq.numpy(), rtol=4e-7, atol=0)
  assert factor == want_factor
  plain = np.float32(p["rope_theta"]) ** -(np.arange(0, config.head_dim, 2, dtype=np.float32)
                                           / config.head_dim)
  assert not np.allclose(inv_freq, plain)  # the scheme does change the frequencies
  if not overrides:
    assert factor == pytest.approx(0.1 * np.log(32.0) + 1)


def test_yarn_rejects_bad_arguments():
  with pytest.raises(ValueError, match="head_dim=7"):
    rope.yarn_inv_frequencies(head_dim=7, theta=1e4, factor=2.0,
                              original_max_position_embeddings=64)
  with pytest.raises(ValueError, match="factor=0"):
    rope.yarn_inv_frequencies(head_dim=8, theta=1e4, factor=0,
                              original_max_position_embeddings=64)
  with pytest.raises(ValueError, match="original_max_position_embeddings"):
    rope.YarnScaling.from_hf({"rope_type": "yarn", "factor": 4.0})
  with pytest.raises(ValueError, match="truncate='no'"):
    rope.YarnScaling(factor=4.0, original_max_position_embeddings=64, truncate="no")
