"""Diffusion transformer (DiT, Peebles & Xie 2023) for class-conditional images.

Shape letters: B batch (images), H, W, C image height, width, channels, P patch side, T tokens (patches,
(H/P) x (W/P)), X pixels per patch (P*P*C), D model width, A attention heads, E head width, F MLP width,
M modulation vectors (6 per block, 2 in the final layer), Q timestep frequencies, Y class ids (num_classes + 1).
Like llama.py, every parameter names its logical axes and the rules in meshtrain/sharding.py decide how they
map onto the mesh: q/k/v [embed, heads, head_dim], out [heads, head_dim, embed], MLP [embed, mlp] / [mlp, embed],
so dp, fsdp, tp and fsdp_tp split DiT exactly as they split the language model.

The network: patchify (a linear map of each P x P x C patch to D), plus a fixed 2-D sin-cos position embedding;
a conditioning vector c = MLP(sinusoidal(t)) + class embedding (one extra row, id num_classes, is the "null"
class that label dropout trains and classifier-free guidance uses); N blocks of attention and MLP under
adaLN-Zero: each half of a block is x + gate * f(LayerNorm(x) * (1 + scale) + shift), with shift, scale and gate
linear in SiLU(c); a final adaLN layer and a linear map back to patches, unpatchified to [B, H, W, C].
The modulation and the final linear map start at zero, so every block starts as the identity and the model's
output is exactly zero at init (adaLN-Zero: the best of the conditioning schemes the paper compares).

The objective (rectified flow) and the sampler live with the task: meshtrain/families/dit.py.
"""
import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from meshtrain.models.llama import dense
from meshtrain.models.params import param, zeros

FREQUENCIES = 256  # Q: sinusoidal features of the timestep, as in DiT (frequency_embedding_size)
TIME_SCALE = 1000.0  # t in [0, 1] is embedded as t x 1000: DiT's timesteps are 0..999, and the frequencies suit them
MAX_AUTO_UNROLL = 4  # deepest stack run unrolled (as llama.unrolled_layers: faster on CPU); deeper: one block looped
MOD_BLOCK = 6  # shift, scale, gate for attention, then for the MLP
MOD_FINAL = 2  # shift, scale of the final layer


@dataclasses.dataclass(frozen=True)
class DiTConfig:
  image_size: int
  channels: int
  patch_size: int
  num_classes: int
  d_model: int
  num_layers: int
  num_heads: int
  mlp_dim: int
  class_dropout: float = 0.1  # read by the task's loss (label -> null class), not by the network
  init_std: float = 0.02
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: str = "none"

  @classmethod
  def from_config(cls, model_cfg) -> "DiTConfig":
    """From the `model` config group (extra informational fields such as `preset` are ignored)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in dict(model_cfg).items() if k in names})

  @property
  def tokens(self) -> int:
    return (self.image_size // self.patch_size) ** 2

  @property
  def patch_dim(self) -> int:
    return self.patch_size * self.patch_size * self.channels

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


def layer_norm(x):
  """LayerNorm without a learned scale or bias (DiT: adaLN supplies both), in float32."""
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
  return ((x32 - mean) * jax.lax.rsqrt(var + 1e-6)).astype(x.dtype)


def modulate(x_BTD, shift_BD, scale_BD):
  return x_BTD * (1 + scale_BD[:, None, :]) + shift_BD[:, None, :]


def sincos_2d(side: int, d: int):
  """Fixed position embedding [side * side, d] of a side x side grid of patches (MAE / DiT): the first half of
  the features encode the row, the second half the column, each as sin and cos of d/4 frequencies."""
  if d % 4:
    raise ValueError(f"a 2-D sin-cos position embedding needs a width divisible by 4, not {d}")
  omega_K = 1.0 / 10_000 ** (jnp.arange(d // 4, dtype=jnp.float32) / (d // 4))
  row_T, col_T = (a.reshape(-1).astype(jnp.float32) for a in jnp.meshgrid(jnp.arange(side), jnp.arange(side),
                                                                            indexing="ij"))
  parts = [f(pos_T[:, None] * omega_K[None, :]) for pos_T in (row_T, col_T) for f in (jnp.sin, jnp.cos)]
  return jnp.concatenate(parts, axis=-1)


def timestep_features(t_B):
  """[B] in [0, 1] -> [B, Q]: cos and sin of t x 1000 at Q/2 geometric frequencies from 1 to 1/10000 (DiT)."""
  half = FREQUENCIES // 2
  freq_Q = jnp.exp(-math.log(10_000) * jnp.arange(half, dtype=jnp.float32) / half)
  angle_BQ = (t_B.astype(jnp.float32) * TIME_SCALE)[:, None] * freq_Q[None, :]
  return jnp.concatenate([jnp.cos(angle_BQ), jnp.sin(angle_BQ)], axis=-1)


def patchify(x_BHWC, p: int):
  """[B, H, W, C] -> [B, T, P*P*C], patches in row-major order, each flattened (row, column, channel)."""
  B, H, W, C = x_BHWC.shape
  x = x_BHWC.reshape(B, H // p, p, W // p, p, C).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(B, (H // p) * (W // p), p * p * C)


def unpatchify(x_BTX, p: int, h: int, w: int, c: int):
  """The inverse of `patchify` for [B, T, P*P*C] -> [B, H, W, C]."""
  B = x_BTX.shape[0]
  x = x_BTX.reshape(B, h // p, w // p, p, p, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(B, h, w, c)


class Modulation(nn.Module):
  """SiLU(c) -> M vectors of width D (shift / scale / gate), zero-initialised: [B, D] -> [B, M, D]."""
  cfg: DiTConfig
  count: int

  @nn.compact
  def __call__(self, c_BD):
    cfg = self.cfg
    # The input width is `embed` (split by fsdp); the outputs act elementwise on the unsplit residual stream,
    # so they stay whole.
    w_DMD = zeros(self, "w", (cfg.d_model, self.count, cfg.d_model), ("embed", None, None), cfg.param_dtype)
    b_MD = zeros(self, "b", (self.count, cfg.d_model), (None, None), cfg.param_dtype)
    m_BMD = jnp.einsum("bi,imo->bmo", nn.silu(c_BD), w_DMD.astype(cfg.dtype)) + b_MD.astype(cfg.dtype)
    return nn.with_logical_constraint(m_BMD, ("act_batch", None, "act_embed"))


class Attention(nn.Module):
  """Bidirectional multi-head self-attention over the patches: [B, T, D] -> [B, T, D]."""
  cfg: DiTConfig

  @nn.compact
  def __call__(self, x_BTD):
    c = self.cfg
    D, A, E = c.d_model, c.num_heads, c.head_dim
    w_q = param(self, "q", (D, A, E), ("embed", "heads", "head_dim"), c.init_std, c.param_dtype)
    w_k = param(self, "k", (D, A, E), ("embed", "heads", "head_dim"), c.init_std, c.param_dtype)
    w_v = param(self, "v", (D, A, E), ("embed", "heads", "head_dim"), c.init_std, c.param_dtype)
    w_o = param(self, "o", (A, E, D), ("heads", "head_dim", "embed"), c.init_std, c.param_dtype)
    heads = lambda a: nn.with_logical_constraint(a, ("act_batch", "act_len", "act_heads", "act_head_dim"))
    q_BTAE = heads(dense(x_BTD, w_q.astype(c.dtype), "D,DAE->AE"))
    k_BTAE = heads(dense(x_BTD, w_k.astype(c.dtype), "D,DAE->AE"))
    v_BTAE = heads(dense(x_BTD, w_v.astype(c.dtype), "D,DAE->AE"))
    # T is tiny (16 patches of an 8x8 image at P=2): the plain [B, A, T, T] form, scores and softmax in float32.
    logits_BATT = jnp.einsum("BTAE,BSAE->BATS", q_BTAE, k_BTAE).astype(jnp.float32) / math.sqrt(E)
    probs_BATT = jax.nn.softmax(logits_BATT, axis=-1).astype(c.dtype)
    o_BTAE = heads(jnp.einsum("BATS,BSAE->BTAE", probs_BATT, v_BTAE))
    return dense(o_BTAE, w_o.astype(c.dtype), "AE,AED->D")


class MLP(nn.Module):
  """GELU MLP (DiT's, tanh approximation): [B, T, D] -> [B, T, D]."""
  cfg: DiTConfig

  @nn.compact
  def __call__(self, x_BTD):
    c = self.cfg
    w_in = param(self, "up", (c.d_model, c.mlp_dim), ("embed", "mlp"), c.init_std, c.param_dtype)
    w_out = param(self, "down", (c.mlp_dim, c.d_model), ("mlp", "embed"), c.init_std, c.param_dtype)
    h_BTF = nn.gelu(dense(x_BTD, w_in.astype(c.dtype), "D,DF->F"), approximate=True)
    h_BTF = nn.with_logical_constraint(h_BTF, ("act_batch", "act_len", "act_mlp"))
    return dense(h_BTF, w_out.astype(c.dtype), "F,FD->D")


class Block(nn.Module):
  """One adaLN-Zero block: (x [B, T, D], c [B, D]) -> (x, None), the scan's carry and output."""
  cfg: DiTConfig

  @nn.compact
  def __call__(self, x_BTD, c_BD):
    residual = lambda x: nn.with_logical_constraint(x, ("act_batch", "act_len", "act_embed"))
    m_BMD = Modulation(self.cfg, MOD_BLOCK, name="modulation")(c_BD)
    shift1, scale1, gate1, shift2, scale2, gate2 = (m_BMD[:, i] for i in range(MOD_BLOCK))
    attn, mlp = Attention(self.cfg, name="attn"), MLP(self.cfg, name="mlp")
    x_BTD = residual(x_BTD + gate1[:, None] * attn(modulate(layer_norm(x_BTD), shift1, scale1)))
    x_BTD = residual(x_BTD + gate2[:, None] * mlp(modulate(layer_norm(x_BTD), shift2, scale2)))
    return x_BTD, None


class DiT(nn.Module):
  """(x_t [B, H, W, C], t [B] in [0, 1], class ids [B] in 0..num_classes) -> velocity [B, H, W, C] float32.

  Class id num_classes is the null class (no condition)."""
  cfg: DiTConfig

  @nn.compact
  def __call__(self, x_BHWC, t_B, y_B):
    c = self.cfg
    D, X = c.d_model, c.patch_dim
    # Patch embedding: a linear map of each flattened patch (the same as DiT's stride-P convolution).
    w_patch = param(self, "patch", (X, D), (None, "embed"), c.init_std, c.param_dtype)
    b_patch = zeros(self, "patch_bias", (D,), ("embed",), c.param_dtype)
    x_BTX = patchify(x_BHWC.astype(c.dtype), c.patch_size)
    x_BTD = dense(x_BTX, w_patch.astype(c.dtype), "X,XD->D") + b_patch.astype(c.dtype)
    x_BTD = x_BTD + sincos_2d(c.image_size // c.patch_size, D).astype(c.dtype)[None]
    x_BTD = nn.with_logical_constraint(x_BTD, ("act_batch", "act_len", "act_embed"))

    # Conditioning: timestep MLP (Q -> D -> D, SiLU between) plus the class embedding (num_classes + 1 rows).
    w_t1 = param(self, "time_in", (FREQUENCIES, D), (None, "embed"), c.init_std, c.param_dtype)
    b_t1 = zeros(self, "time_in_bias", (D,), ("embed",), c.param_dtype)
    w_t2 = param(self, "time_out", (D, D), (None, "embed"), c.init_std, c.param_dtype)
    b_t2 = zeros(self, "time_out_bias", (D,), ("embed",), c.param_dtype)
    # Replicated (a few KB): 11 rows split over `tensor` would not divide evenly, and with its width split over
    # `fsdp` XLA's SPMD partitioner cannot reshard the looked-up rows to the batch split ("involuntary full
    # rematerialization" under fsdp_tp: the whole [B, D] gathered on every device, forward and backward).
    table_YD = param(self, "class_embedding", (c.num_classes + 1, D), (None, None), c.init_std, c.param_dtype)
    h_BD = nn.silu(timestep_features(t_B).astype(c.dtype) @ w_t1.astype(c.dtype) + b_t1.astype(c.dtype))
    c_BD = h_BD @ w_t2.astype(c.dtype) + b_t2.astype(c.dtype) + jnp.take(table_YD, y_B, axis=0).astype(c.dtype)
    c_BD = nn.with_logical_constraint(c_BD, ("act_batch", "act_embed"))

    block = Block
    if c.remat == "full":
      # Under scan, CSE across iterations cannot undo the remat, so its prevention (which costs speed) is off.
      block = nn.remat(Block, prevent_cse=False)
    unroll = c.num_layers if c.num_layers <= MAX_AUTO_UNROLL and c.remat == "none" else 1
    stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=nn.broadcast,
                    length=c.num_layers, unroll=unroll, metadata_params={nn.PARTITION_NAME: "layers"})
    x_BTD, _ = stack(c, name="layers")(x_BTD, c_BD)

    # Final layer: adaLN (shift, scale) then a zero-initialised linear map to patch pixels.
    m_BMD = Modulation(c, MOD_FINAL, name="final_modulation")(c_BD)
    x_BTD = modulate(layer_norm(x_BTD), m_BMD[:, 0], m_BMD[:, 1])
    w_out = zeros(self, "out", (D, X), ("embed", None), c.param_dtype)
    b_out = zeros(self, "out_bias", (X,), (None,), c.param_dtype)
    out_BTX = dense(x_BTD, w_out.astype(c.dtype), "D,DX->X") + b_out.astype(c.dtype)
    out_BHWC = unpatchify(out_BTX.astype(jnp.float32), c.patch_size, c.image_size, c.image_size, c.channels)
    return nn.with_logical_constraint(out_BHWC, ("act_batch", None, None, None))
