"""T5's encoder, transformers' `T5EncoderModel` (models/t5/modeling_t5.py): Flux's text-token encoder (T5 v1.1 XXL),
in Flax linen.

Shape letters: B batch (prompts), S tokens, K attended tokens (S again), D width (d_model), A heads, E head width
(d_kv; A x E need not be D), F MLP width (d_ff), V vocabulary, U relative-position buckets, N layers.

The network, as transformers computes it:
  x = embedding[ids]                                     (the `shared` table; no scaling, no position embedding)
  per layer: x += o(attention(RMS1(x))); x += MLP(RMS2(x))
  last = RMS_final(x)                                                                      [B, S, D]
  RMS: T5LayerNorm, x / sqrt(mean(x^2) + eps) x scale: no mean subtracted, no bias, computed in float32.
  attention: softmax(q k^T + bias + mask) v with NO 1/sqrt(E) scaling (T5 folds it into the query's init); bias
    [A, S, K] looked up from a learned [U, A] table by bucketed relative position k - q (bidirectional: half the
    buckets for keys after the query; exact distances below U/4, log-spaced up to max_distance, the last bucket
    beyond), computed once and added in every layer: transformers computes it in layer 0, which alone holds the
    table, and hands it on. Padded keys (keep false) are masked; Flux's pipeline passes no mask (keep_BS=None):
    it pads to max_sequence_length and lets every token see the padding.
  MLP: relu (T5DenseActDense: wi = up, wo = down) or gated (T5DenseGatedActDense, feed_forward_proj "gated-gelu"
    of T5 v1.1 / XXL: act(wi_0 = gate) x (wi_1 = up), then wo = down), act transformers' dense_act_fn ("gated-gelu"
    means gelu_new, the tanh approximation).

Layers: one nn.scan over stacked parameters (the leading `layers` axis), flux.py's `stacked`. The shared position
bias does not make the scan awkward: its table is a parameter of the encoder itself (relative_attention_bias),
not of layer 0 as in transformers, so every layer has the same parameters and the bias reaches the scanned blocks
as broadcast context. meshtrain/interop/text_encoders.py maps transformers' layer-0 tensor onto it.
Every parameter names its logical axes (meshtrain/sharding.py maps them onto the mesh; T5-XXL does not fit one
device unsharded): embedding (vocab, embed), relative_attention_bias (None, heads), q/k/v [embed, heads, head_dim],
o [heads, head_dim, embed], gate/up [embed, mlp], down [mlp, embed], norms (norm,).
The tree: embedding [V, D], relative_attention_bias [U, A], layers/{attn_norm, mlp_norm [N, D]; attn/{q, k, v
[N, D, A, E], o [N, A, E, D]}; mlp/{gate (gated only), up [N, D, F], down [N, F, D]}}, final_norm [D].
"""
import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.models.activations import HIDDEN_ACT
from meshtrain.models.flux import heads, stacked, tokens
from meshtrain.models.llama import dense
from meshtrain.models.params import param

MASKED = -1e30  # a finite "minus infinity": a prompt of padding only stays finite (its output is unused)


@dataclasses.dataclass(frozen=True)
class T5EncoderConfig:
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  head_dim: int                  # d_kv
  mlp_dim: int                   # d_ff
  num_buckets: int = 32          # relative_attention_num_buckets
  max_distance: int = 128        # relative_attention_max_distance
  activation: str = "relu"       # dense_act_fn, a key of HIDDEN_ACT
  gated: bool = False            # is_gated_act: feed_forward_proj "gated-..."
  norm_eps: float = 1e-6         # layer_norm_epsilon
  init_std: float = 0.02
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: str = "none"            # flux.py's `stacked` reads these two
  scan_unroll: int = 0


def rms_norm(x, scale, eps: float):
  """T5LayerNorm: the root mean square in float32, no mean subtracted, no bias; returned in x's dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  return y.astype(x.dtype) * scale.astype(x.dtype)


def relative_buckets(query_len: int, key_len: int, num_buckets: int, max_distance: int) -> np.ndarray:
  """int32[S, K]: T5Attention._relative_position_bucket of k - q, bidirectional, in numpy at trace time (the
  lengths are static). Step by step in float32 as torch computes it, so that the truncation to an integer lands on
  the same bucket at the boundaries of the log-spaced range."""
  relative_SK = np.arange(key_len)[None, :] - np.arange(query_len)[:, None]
  half = num_buckets // 2
  bucket_SK = (relative_SK > 0).astype(np.int64) * half
  distance_SK = np.abs(relative_SK)
  exact = half // 2
  with np.errstate(divide="ignore"):  # log(0) at distance 0, which takes the exact branch below
    log_ratio = np.log(distance_SK.astype(np.float32) / np.float32(exact))
    scaled = log_ratio / np.float32(math.log(max_distance / exact)) * np.float32(half - exact)
  large_SK = exact + np.where(distance_SK < exact, 0, scaled).astype(np.int64)
  large_SK = np.minimum(large_SK, half - 1)
  return (bucket_SK + np.where(distance_SK < exact, distance_SK, large_SK)).astype(np.int32)


def attention(q_BSAE, k_BKAE, v_BKAE, bias_ASK, keep_BK):
  """Unscaled attention with an additive position bias and masked keys; logits and softmax in float32."""
  logits_BASK = jnp.einsum("BSAE,BKAE->BASK", q_BSAE, k_BKAE).astype(jnp.float32) + bias_ASK[None]
  logits_BASK = jnp.where(keep_BK[:, None, None, :], logits_BASK, MASKED)
  probs_BASK = jax.nn.softmax(logits_BASK, axis=-1).astype(v_BKAE.dtype)
  return jnp.einsum("BASK,BKAE->BSAE", probs_BASK, v_BKAE)


class MLP(nn.Module):
  """T5DenseActDense (up, act, down) or T5DenseGatedActDense (act(gate) x up, down), no biases."""
  cfg: T5EncoderConfig

  @nn.compact
  def __call__(self, x_BSD):
    c = self.cfg
    D, F, dt = c.d_model, c.mlp_dim, c.dtype
    matrix = lambda name, shape, logical: param(self, name, shape, logical, c.init_std, c.param_dtype).astype(dt)
    act = HIDDEN_ACT[c.activation]
    if c.gated:
      h_BSF = act(dense(x_BSD, matrix("gate", (D, F), ("embed", "mlp")), "D,DF->F")) * dense(
          x_BSD, matrix("up", (D, F), ("embed", "mlp")), "D,DF->F")
    else:
      h_BSF = act(dense(x_BSD, matrix("up", (D, F), ("embed", "mlp")), "D,DF->F"))
    h_BSF = nn.with_logical_constraint(h_BSF, ("act_batch", "act_len", "act_mlp"))
    return dense(h_BSF, matrix("down", (F, D), ("mlp", "embed")), "F,FD->D")


class Attention(nn.Module):
  """T5Attention of the encoder: q, k, v and o without biases, heads as their own axes: [B, S, D] -> [B, S, D]."""
  cfg: T5EncoderConfig

  @nn.compact
  def __call__(self, x_BSD, bias_ASK, keep_BS):
    c = self.cfg
    D, A, E, dt = c.d_model, c.num_heads, c.head_dim, c.dtype
    qkv = [heads(dense(x_BSD, param(self, name, (D, A, E), ("embed", "heads", "head_dim"), c.init_std,
                                    c.param_dtype).astype(dt), "D,DAE->AE")) for name in ("q", "k", "v")]
    o_BSAE = heads(attention(*qkv, bias_ASK, keep_BS))
    w_o = param(self, "o", (A, E, D), ("heads", "head_dim", "embed"), c.init_std, c.param_dtype)
    return dense(o_BSAE, w_o.astype(dt), "AE,AED->D")


class Block(nn.Module):
  """One T5Block of the encoder: (x [B, S, D], (bias [A, S, K], keep [B, K])) -> (x, None)."""
  cfg: T5EncoderConfig

  @nn.compact
  def __call__(self, x_BSD, context):
    c = self.cfg
    bias_ASK, keep_BS = context
    norm = lambda name: param(self, name, (c.d_model,), ("norm",), None, c.param_dtype)
    h_BSD = Attention(c, name="attn")(rms_norm(x_BSD, norm("attn_norm"), c.norm_eps), bias_ASK, keep_BS)
    x_BSD = tokens(x_BSD + h_BSD)
    x_BSD = tokens(x_BSD + MLP(c, name="mlp")(rms_norm(x_BSD, norm("mlp_norm"), c.norm_eps)))
    return x_BSD, None


class T5Encoder(nn.Module):
  """ids int32[B, S], keep bool[B, S] or None (no padding mask: Flux's call) -> last hidden state [B, S, D]."""
  cfg: T5EncoderConfig

  @nn.compact
  def __call__(self, ids_BS, keep_BS=None):
    c = self.cfg
    B, S = ids_BS.shape
    if c.activation not in HIDDEN_ACT:
      raise ValueError(f"activation {c.activation!r} is not one of {', '.join(HIDDEN_ACT)}")
    table_VD = param(self, "embedding", (c.vocab_size, c.d_model), ("vocab", "embed"), c.init_std, c.param_dtype)
    x_BSD = tokens(jnp.take(table_VD, ids_BS, axis=0).astype(c.dtype))
    table_UA = param(self, "relative_attention_bias", (c.num_buckets, c.num_heads), (None, "heads"), c.init_std,
                     c.param_dtype)
    bucket_SK = relative_buckets(S, S, c.num_buckets, c.max_distance)
    bias_ASK = jnp.transpose(jnp.take(table_UA.astype(jnp.float32), bucket_SK, axis=0), (2, 0, 1))
    bias_ASK = nn.with_logical_constraint(bias_ASK, ("act_heads", None, None))
    keep_BS = jnp.ones((B, S), bool) if keep_BS is None else keep_BS.astype(bool)
    x_BSD, _ = stacked(Block, c, c.num_layers, "layers")(x_BSD, (bias_ASK, keep_BS))
    scale = param(self, "final_norm", (c.d_model,), ("norm",), None, c.param_dtype)
    return tokens(rms_norm(x_BSD, scale, c.norm_eps))
