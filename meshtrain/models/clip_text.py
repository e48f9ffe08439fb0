"""CLIP's text transformer, transformers' `CLIPTextModel` (models/clip/modeling_clip.py): the encoder whose pooled
output is Flux's conditioning vector (Flux uses CLIP ViT-L/14's text tower for it), in Flax linen.

Shape letters: B batch (prompts), S tokens, K attended tokens (S again), D width, A heads, E head width (D / A),
F MLP width, V vocabulary, P positions (max_position_embeddings), N layers.

The network, as transformers computes it:
  x = token_embedding[ids] + position_embedding[0 .. S)
  per layer (pre-LN): x += o(attention(LN1(x))); x += down(act(up(LN2(x)))); LayerNorms with bias, eps from config,
    q/k/v/o and the MLP with biases, act the config's hidden_act (quick_gelu for CLIP-L);
  last = LN_final(x)                                                                       [B, S, D]
  pooled = last at one position per prompt, chosen exactly as transformers chooses it:     [B, D]
    eos_token_id == 2 (configs written before transformers PR #24773, CLIP-L's among them): the first position of
      the largest id, which is the end-of-text token because it is the tokenizer's largest id;
    any other eos_token_id: its first position (position 0 if a prompt holds none).
Attention is causal (CLIP's text tower was trained so: each token sees itself and those before it), scaled by
1/sqrt(E), with padded keys also masked when a keep mask is passed: transformers combines the causal mask with
attention_mask. Flux's pipeline passes no mask (FluxPipeline._get_clip_prompt_embeds pads to 77 tokens with
padding="max_length" and calls the encoder with the ids alone), so there the padding is attended to, causally, and
`keep_BS=None` reproduces it.

`hidden_layer` also returns transformers' hidden_states[hidden_layer] (0: the embeddings; i: layer i's output,
before the final LayerNorm; negative counts from the end as in Python, -2 the penultimate layer that Stable
Diffusion's "clip skip" reads): one select per layer in the scan's carry, not every layer's output kept.

Layers: one nn.scan over stacked parameters (the leading `layers` axis), flux.py's `stacked`: one compiled block
whatever the depth. Every parameter names its logical axes (meshtrain/sharding.py maps them onto the mesh), as
flux.py and llama.py do: token_embedding (vocab, embed), position_embedding (None, embed), q/k/v
[embed, heads, head_dim], o [heads, head_dim, embed], up [embed, mlp], down [mlp, embed], norms (norm,).
The tree: token_embedding [V, D], position_embedding [P, D], layers/{attn_norm, attn_norm_bias, mlp_norm,
mlp_norm_bias [N, D]; attn/{q, k, v [N, D, A, E], q_bias, k_bias, v_bias [N, A, E], o [N, A, E, D], o_bias [N, D]};
mlp/{up [N, D, F], up_bias [N, F], down [N, F, D], down_bias [N, D]}}, final_norm, final_norm_bias [D].
"""
import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from meshtrain.models.activations import HIDDEN_ACT
from meshtrain.models.flux import heads, stacked, tokens
from meshtrain.models.llama import dense
from meshtrain.models.params import param, zeros

MASKED = -1e30  # a finite "minus infinity": a query that sees no kept key (padding first) stays finite


@dataclasses.dataclass(frozen=True)
class ClipTextConfig:
  vocab_size: int
  d_model: int                   # hidden_size
  num_layers: int                # num_hidden_layers
  num_heads: int                 # num_attention_heads
  mlp_dim: int                   # intermediate_size
  max_positions: int             # max_position_embeddings: the longest prompt (77 for CLIP-L)
  activation: str = "quick_gelu"  # hidden_act, a key of HIDDEN_ACT
  norm_eps: float = 1e-5         # layer_norm_eps
  eos_token_id: int = 2          # picks the pooled position (see the module docstring)
  init_std: float = 0.02
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: str = "none"            # flux.py's `stacked` reads these two
  scan_unroll: int = 0

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


def layer_norm(x, scale, bias, eps: float):
  """torch.nn.LayerNorm (biased variance), computed in float32 and returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32) + bias.astype(jnp.float32)
  return y.astype(x.dtype)


def causal_attention(q_BSAE, k_BKAE, v_BKAE, keep_BK):
  """Causal attention, key j visible to query i when j <= i and keep_BK[:, j]; logits and softmax in float32."""
  S, E = q_BSAE.shape[1], q_BSAE.shape[-1]
  logits_BASK = jnp.einsum("BSAE,BKAE->BASK", q_BSAE, k_BKAE).astype(jnp.float32) / math.sqrt(E)
  visible_BSK = jnp.tril(jnp.ones((S, S), bool))[None] & keep_BK[:, None, :]
  logits_BASK = jnp.where(visible_BSK[:, None], logits_BASK, MASKED)
  probs_BASK = jax.nn.softmax(logits_BASK, axis=-1).astype(v_BKAE.dtype)
  return jnp.einsum("BASK,BKAE->BSAE", probs_BASK, v_BKAE)


class Attention(nn.Module):
  """CLIPAttention: q, k, v and o with biases, heads as their own axes: [B, S, D] -> [B, S, D]."""
  cfg: ClipTextConfig

  @nn.compact
  def __call__(self, x_BSD, keep_BS):
    c = self.cfg
    D, A, E, dt = c.d_model, c.num_heads, c.head_dim, c.dtype
    qkv = []
    for name in ("q", "k", "v"):
      w = param(self, name, (D, A, E), ("embed", "heads", "head_dim"), c.init_std, c.param_dtype)
      b = zeros(self, f"{name}_bias", (A, E), ("heads", "head_dim"), c.param_dtype)
      qkv.append(heads(dense(x_BSD, w.astype(dt), "D,DAE->AE") + b.astype(dt)))
    o_BSAE = heads(causal_attention(*qkv, keep_BS))
    w_o = param(self, "o", (A, E, D), ("heads", "head_dim", "embed"), c.init_std, c.param_dtype)
    b_o = zeros(self, "o_bias", (D,), ("embed",), c.param_dtype)
    return dense(o_BSAE, w_o.astype(dt), "AE,AED->D") + b_o.astype(dt)


class MLP(nn.Module):
  """CLIPMLP: fc1 (up), the config's activation, fc2 (down), with biases: [B, S, D] -> [B, S, D]."""
  cfg: ClipTextConfig

  @nn.compact
  def __call__(self, x_BSD):
    c = self.cfg
    D, F, dt = c.d_model, c.mlp_dim, c.dtype
    w_up = param(self, "up", (D, F), ("embed", "mlp"), c.init_std, c.param_dtype)
    b_up = zeros(self, "up_bias", (F,), ("mlp",), c.param_dtype)
    w_down = param(self, "down", (F, D), ("mlp", "embed"), c.init_std, c.param_dtype)
    b_down = zeros(self, "down_bias", (D,), ("embed",), c.param_dtype)
    h_BSF = HIDDEN_ACT[c.activation](dense(x_BSD, w_up.astype(dt), "D,DF->F") + b_up.astype(dt))
    h_BSF = nn.with_logical_constraint(h_BSF, ("act_batch", "act_len", "act_mlp"))
    return dense(h_BSF, w_down.astype(dt), "F,FD->D") + b_down.astype(dt)


class Block(nn.Module):
  """One CLIPEncoderLayer: ((x, picked, i), (keep, wanted)) -> ((x, picked, i + 1), None). `picked` is x after
  layer `wanted` (transformers' hidden_states[wanted]); i counts the layers done."""
  cfg: ClipTextConfig

  @nn.compact
  def __call__(self, carry, context):
    c = self.cfg
    x_BSD, picked_BSD, i = carry
    keep_BS, wanted = context
    norm = lambda name: (param(self, name, (c.d_model,), ("norm",), None, c.param_dtype),
                         zeros(self, f"{name}_bias", (c.d_model,), ("norm",), c.param_dtype))
    x_BSD = tokens(x_BSD + Attention(c, name="attn")(layer_norm(x_BSD, *norm("attn_norm"), c.norm_eps), keep_BS))
    x_BSD = tokens(x_BSD + MLP(c, name="mlp")(layer_norm(x_BSD, *norm("mlp_norm"), c.norm_eps)))
    return (x_BSD, jnp.where(i + 1 == wanted, x_BSD, picked_BSD), i + 1), None


def pooled_positions(ids_BS, eos_token_id: int):
  """int32[B]: the position transformers' CLIPTextModel pools at (see the module docstring); argmax returns the first
  maximum, as torch's does."""
  ids_BS = ids_BS.astype(jnp.int32)
  if eos_token_id == 2:
    return jnp.argmax(ids_BS, axis=-1)
  return jnp.argmax((ids_BS == eos_token_id).astype(jnp.int32), axis=-1)


class ClipText(nn.Module):
  """ids int32[B, S] (S <= max_positions), keep bool[B, S] or None (no padding mask: Flux's call) ->
  (last hidden state [B, S, D], pooled [B, D]), and hidden_states[hidden_layer] [B, S, D] third when asked."""
  cfg: ClipTextConfig

  @nn.compact
  def __call__(self, ids_BS, keep_BS=None, hidden_layer: int | None = None):
    c = self.cfg
    B, S = ids_BS.shape
    if S > c.max_positions:
      raise ValueError(f"{S} tokens; this CLIP text encoder reads at most max_positions={c.max_positions}")
    if c.activation not in HIDDEN_ACT:
      raise ValueError(f"activation {c.activation!r} is not one of {', '.join(HIDDEN_ACT)}")
    table_VD = param(self, "token_embedding", (c.vocab_size, c.d_model), ("vocab", "embed"), c.init_std,
                     c.param_dtype)
    pos_PD = param(self, "position_embedding", (c.max_positions, c.d_model), (None, "embed"), c.init_std,
                   c.param_dtype)
    x_BSD = tokens(jnp.take(table_VD, ids_BS, axis=0).astype(c.dtype) + pos_PD[:S].astype(c.dtype)[None])
    keep_BS = jnp.ones((B, S), bool) if keep_BS is None else keep_BS.astype(bool)
    wanted = 0 if hidden_layer is None else hidden_layer_index(hidden_layer, c.num_layers)
    (x_BSD, picked_BSD, _), _ = stacked(Block, c, c.num_layers, "layers")(
        (x_BSD, x_BSD, jnp.int32(0)), (keep_BS, jnp.int32(wanted)))
    scale = param(self, "final_norm", (c.d_model,), ("norm",), None, c.param_dtype)
    bias = zeros(self, "final_norm_bias", (c.d_model,), ("norm",), c.param_dtype)
    last_BSD = tokens(layer_norm(x_BSD, scale, bias, c.norm_eps))
    pos_B = pooled_positions(ids_BS, c.eos_token_id)
    pooled_BD = jnp.take_along_axis(last_BSD, pos_B[:, None, None], axis=1)[:, 0]
    pooled_BD = nn.with_logical_constraint(pooled_BD, ("act_batch", "act_embed"))
    return (last_BSD, pooled_BD) if hidden_layer is None else (last_BSD, pooled_BD, picked_BSD)


def hidden_layer_index(hidden_layer: int, num_layers: int) -> int:
  """hidden_states' index (0 .. num_layers) of `hidden_layer`, negative ones counted from the end."""
  if not -(num_layers + 1) <= hidden_layer <= num_layers:
    raise ValueError(f"hidden_layer={hidden_layer}: there are {num_layers + 1} hidden states (the embeddings and "
                     f"{num_layers} layers), so it must lie in [{-(num_layers + 1)}, {num_layers}]")
  return hidden_layer % (num_layers + 1)
