"""A text-to-image transformer on Flux's architecture (Black Forest Labs, 2024), with a small text encoder.

Shape letters: B batch (images), H, W, C image height, width, channels, P patch side, T image tokens
((H/P) x (W/P)), X pixels per patch (P*P*C), S text tokens, J joint tokens (S + T), D model width, A attention
heads, E head width, F MLP width, G text width (the encoder's output), V text ids, M modulation vectors, Q timestep
frequencies, R rotary pairs (E/2), N coordinates per position (3: Flux's (0, row, column)).

The network, as Flux's `Flux` module:
  img = img_in(patches); txt = txt_in(text features); vec = time_in(sinusoidal(t)) + vector_in(pooled text)
  double-stream blocks: image and text tokens keep their own weights (modulation, q/k/v, MLP) and meet in one
    joint attention over [text, image] (MMDiT, SD3);
  single-stream blocks: the joint sequence through one set of weights, attention and MLP in parallel (the MLP's
    input projection and q/k/v from one modulated input; the outputs added);
  a final adaLN layer and a linear map back to patches, of the image tokens only.
Every block is adaLN-Zero modulated by vec (shift, scale, gate per half; zero-initialised, so every block starts
as the identity and the output is exactly zero at init, as in meshtrain/models/dit.py). q and k are RMS-normalised
per head (a learned scale), then rotated by a 3-axis RoPE over (0, row, column) positions, Flux's EmbedND with
pairs of adjacent features rotated together; text tokens sit at position (0, 0, 0), so only image tokens carry
positions in the joint attention (the encoder gave the text its order). Padded text tokens are masked as keys.

The text features come from `TextEncoder`, a small bidirectional transformer over UTF-8 bytes trained with the
model (the tiny config's default): its last hidden states, and their mean over the caption's bytes as the pooled
vector. Or (model.text_encoder a language model's workdir) from a frozen language model's hidden states, computed
once per caption outside the model (meshtrain/data/text_features.py), normalised here (`frozen_features`).
Every parameter names its logical axes (meshtrain/sharding.py maps them onto the mesh), as in llama.py:
q/k/v [embed, heads, head_dim], out [heads, head_dim, embed], MLP [embed, mlp] / [mlp, embed].
The objective and the sampler live with the task: meshtrain/families/t2i.py.
"""
import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from meshtrain.models.dit import FREQUENCIES, layer_norm, modulate, patchify, timestep_features, unpatchify
from meshtrain.models.llama import MAX_AUTO_UNROLL, dense
from meshtrain.models.params import param, zeros

PAD = 0  # caption id of padding (and of an empty caption: every id PAD); bytes are ids 1..256
TEXT_VOCAB = 257
ROPE_THETA = 10_000.0  # Flux's
MASKED = -1e30  # a finite "minus infinity": a row whose keys are all masked stays finite (its output is unused)


@dataclasses.dataclass(frozen=True)
class FluxConfig:
  image_size: int
  channels: int
  patch_size: int
  d_model: int
  num_heads: int
  mlp_dim: int
  double_layers: int
  single_layers: int
  axes_dim: tuple[int, int, int]  # RoPE features per coordinate (0, row, column); sums to the head width
  text_len: int                   # S: caption bytes the model reads (longer captions are cut)
  text_width: int                 # G: the text encoder's width
  text_layers: int
  text_heads: int
  text_mlp_dim: int
  text_encoder: str = "own"       # own: TextEncoder below, trained with the model | a frozen language model's features
  # How a frozen encoder's features enter (meshtrain's own models keep the defaults; a converted Flux.1 sets all
  # four): RMS-normalised with a learned scale, padded tokens masked as keys, the pooled vector their mean (0) or
  # one of pooled_width given with them (Flux: CLIP's), and a distilled guidance embedding (Flux.1-dev).
  text_norm: bool = True
  text_mask: bool = True
  pooled_width: int = 0
  guidance_embed: bool = False
  caption_dropout: float = 0.1  # read by the task's loss (caption -> empty), not by the network
  init_std: float = 0.02
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: str = "none"
  scan_unroll: int = 0            # blocks per loop iteration of each stack: 0 = auto (see `unrolled`) | n

  @classmethod
  def from_config(cls, model_cfg) -> "FluxConfig":
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in dict(model_cfg).items() if k in names}
    return cls(**{**values, "axes_dim": tuple(values["axes_dim"])})

  @property
  def tokens(self) -> int:
    return (self.image_size // self.patch_size) ** 2

  @property
  def patch_dim(self) -> int:
    return self.patch_size * self.patch_size * self.channels

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def text_head_dim(self) -> int:
    return self.text_width // self.text_heads


def rms_norm(x, scale):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + 1e-6) * scale).astype(x.dtype)


def image_positions(rows: int, columns: int):
  """int32[rows * columns, 3]: (0, row, column) of each patch in row-major order, Flux's img_ids."""
  row_T, col_T = (a.reshape(-1) for a in jnp.meshgrid(jnp.arange(rows), jnp.arange(columns), indexing="ij"))
  return jnp.stack([jnp.zeros_like(row_T), row_T, col_T], axis=-1).astype(jnp.int32)


def rope_angles(pos_JN, axes_dim: tuple[int, ...]):
  """float32[J, E/2]: per coordinate n, pos_n x theta^(-2i/d_n) for i < d_n/2, concatenated (Flux's EmbedND)."""
  parts = []
  for n, d in enumerate(axes_dim):
    omega_R = 1.0 / ROPE_THETA ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    parts.append(pos_JN[:, n].astype(jnp.float32)[:, None] * omega_R[None, :])
  return jnp.concatenate(parts, axis=-1)


def rotate(x_BJAE, angle_JR):
  """Rotates each pair (x[2i], x[2i+1]) by angle i (Flux's apply_rope), in float32."""
  B, J, A, E = x_BJAE.shape
  x = x_BJAE.astype(jnp.float32).reshape(B, J, A, E // 2, 2)
  cos, sin = jnp.cos(angle_JR)[None, :, None, :], jnp.sin(angle_JR)[None, :, None, :]
  out = jnp.stack([cos * x[..., 0] - sin * x[..., 1], sin * x[..., 0] + cos * x[..., 1]], axis=-1)
  return out.reshape(B, J, A, E).astype(x_BJAE.dtype)


def attention(q_BJAE, k_BJAE, v_BJAE, keep_BJ):
  """Bidirectional attention with masked keys (keep_BJ false), scores and softmax in float32."""
  E = q_BJAE.shape[-1]
  logits_BAJK = jnp.einsum("BJAE,BKAE->BAJK", q_BJAE, k_BJAE).astype(jnp.float32) / math.sqrt(E)
  logits_BAJK = jnp.where(keep_BJ[:, None, None, :], logits_BAJK, MASKED)
  probs_BAJK = jax.nn.softmax(logits_BAJK, axis=-1).astype(v_BJAE.dtype)
  return jnp.einsum("BAJK,BKAE->BJAE", probs_BAJK, v_BJAE)


def heads(x):
  return nn.with_logical_constraint(x, ("act_batch", "act_len", "act_heads", "act_head_dim"))


def tokens(x):
  return nn.with_logical_constraint(x, ("act_batch", "act_len", "act_embed"))


class Modulation(nn.Module):
  """SiLU(vec) -> `count` vectors of width `width` (shift / scale / gate), zero-initialised: [B, D] -> [B, M, D]."""
  width: int
  count: int
  dtype: str
  param_dtype: str

  @nn.compact
  def __call__(self, vec_BD):
    w = zeros(self, "w", (vec_BD.shape[-1], self.count, self.width), ("embed", None, None), self.param_dtype)
    b = zeros(self, "b", (self.count, self.width), (None, None), self.param_dtype)
    m_BMD = jnp.einsum("bi,imo->bmo", nn.silu(vec_BD), w.astype(self.dtype)) + b.astype(self.dtype)
    return nn.with_logical_constraint(m_BMD, ("act_batch", None, "act_embed"))


class QKV(nn.Module):
  """q, k, v [B, L, A, E] of one stream, q and k RMS-normalised per head (Flux's QKNorm). The head width is given:
  width / num_heads in the model, the full one for a device's share of the heads (the cost model's trace)."""
  width: int
  num_heads: int
  head_dim: int
  init_std: float
  dtype: str
  param_dtype: str

  @nn.compact
  def __call__(self, x_BLD):
    D, A, E = self.width, self.num_heads, self.head_dim
    out = []
    for name in ("q", "k", "v"):
      w = param(self, name, (D, A, E), ("embed", "heads", "head_dim"), self.init_std, self.param_dtype)
      b = zeros(self, f"{name}_bias", (A, E), ("heads", "head_dim"), self.param_dtype)
      out.append(heads(dense(x_BLD, w.astype(self.dtype), "D,DAE->AE") + b.astype(self.dtype)))
    q, k, v = out
    q_scale = param(self, "q_norm", (E,), ("head_dim",), None, self.param_dtype)
    k_scale = param(self, "k_norm", (E,), ("head_dim",), None, self.param_dtype)
    return rms_norm(q, q_scale), rms_norm(k, k_scale), v


def out_proj(module: nn.Module, name: str, o_BLAE, width: int, init_std: float, dtype: str, param_dtype: str):
  A, E = o_BLAE.shape[-2:]
  w = param(module, name, (A, E, width), ("heads", "head_dim", "embed"), init_std, param_dtype)
  b = zeros(module, f"{name}_bias", (width,), ("embed",), param_dtype)
  return dense(o_BLAE, w.astype(dtype), "AE,AED->D") + b.astype(dtype)


class MLP(nn.Module):
  """GELU (tanh) MLP with biases, Flux's: [B, L, D] -> [B, L, D]."""
  width: int
  hidden: int
  init_std: float
  dtype: str
  param_dtype: str

  @nn.compact
  def __call__(self, x_BLD):
    w_in = param(self, "up", (self.width, self.hidden), ("embed", "mlp"), self.init_std, self.param_dtype)
    b_in = zeros(self, "up_bias", (self.hidden,), ("mlp",), self.param_dtype)
    w_out = param(self, "down", (self.hidden, self.width), ("mlp", "embed"), self.init_std, self.param_dtype)
    b_out = zeros(self, "down_bias", (self.width,), ("embed",), self.param_dtype)
    h_BLF = nn.gelu(dense(x_BLD, w_in.astype(self.dtype), "D,DF->F") + b_in.astype(self.dtype), approximate=True)
    h_BLF = nn.with_logical_constraint(h_BLF, ("act_batch", "act_len", "act_mlp"))
    return dense(h_BLF, w_out.astype(self.dtype), "F,FD->D") + b_out.astype(self.dtype)


def _parts(c: FluxConfig):
  return dict(init_std=c.init_std, dtype=c.dtype, param_dtype=c.param_dtype)


class DoubleBlock(nn.Module):
  """One double-stream block: ((img [B, T, D], txt [B, S, D]), (vec, angles, keep)) -> ((img, txt), None)."""
  cfg: FluxConfig

  @nn.compact
  def __call__(self, streams, context):
    c = self.cfg
    img_BTD, txt_BSD = streams
    vec_BD, angle_JR, keep_BJ = context
    S = txt_BSD.shape[1]
    mods = {s: Modulation(c.d_model, 6, c.dtype, c.param_dtype, name=f"{s}_mod")(vec_BD) for s in ("img", "txt")}
    qkv = {s: QKV(c.d_model, c.num_heads, c.head_dim, **_parts(c), name=f"{s}_qkv")(
        modulate(layer_norm(x), mods[s][:, 0], mods[s][:, 1])) for s, x in (("img", img_BTD), ("txt", txt_BSD))}
    # Joint attention over [text, image], Flux's order.
    q, k, v = (jnp.concatenate([qkv["txt"][i], qkv["img"][i]], axis=1) for i in range(3))
    o_BJAE = heads(attention(rotate(q, angle_JR), rotate(k, angle_JR), v, keep_BJ))
    out = {"txt": o_BJAE[:, :S], "img": o_BJAE[:, S:]}
    new = {}
    for s, x in (("img", img_BTD), ("txt", txt_BSD)):
      m = mods[s]
      x = tokens(x + m[:, 2][:, None] * out_proj(self, f"{s}_proj", out[s], c.d_model, **_parts(c)))
      h = MLP(c.d_model, c.mlp_dim, **_parts(c), name=f"{s}_mlp")(modulate(layer_norm(x), m[:, 3], m[:, 4]))
      new[s] = tokens(x + m[:, 5][:, None] * h)
    return (new["img"], new["txt"]), None


class SingleBlock(nn.Module):
  """One single-stream block on the joint sequence: (x [B, J, D], (vec, angles, keep)) -> (x, None)."""
  cfg: FluxConfig

  @nn.compact
  def __call__(self, x_BJD, context):
    c = self.cfg
    vec_BD, angle_JR, keep_BJ = context
    m = Modulation(c.d_model, 3, c.dtype, c.param_dtype, name="mod")(vec_BD)
    h_BJD = modulate(layer_norm(x_BJD), m[:, 0], m[:, 1])
    q, k, v = QKV(c.d_model, c.num_heads, c.head_dim, **_parts(c), name="qkv")(h_BJD)
    o_BJAE = heads(attention(rotate(q, angle_JR), rotate(k, angle_JR), v, keep_BJ))
    # Flux's linear1 / linear2 hold q/k/v with the MLP's input, and the attention output with its output; split
    # here into named parts so that each takes its own logical axes (heads and mlp split over `tensor`).
    w_up = param(self, "mlp_up", (c.d_model, c.mlp_dim), ("embed", "mlp"), c.init_std, c.param_dtype)
    b_up = zeros(self, "mlp_up_bias", (c.mlp_dim,), ("mlp",), c.param_dtype)
    g_BJF = nn.gelu(dense(h_BJD, w_up.astype(c.dtype), "D,DF->F") + b_up.astype(c.dtype), approximate=True)
    g_BJF = nn.with_logical_constraint(g_BJF, ("act_batch", "act_len", "act_mlp"))
    w_down = param(self, "mlp_down", (c.mlp_dim, c.d_model), ("mlp", "embed"), c.init_std, c.param_dtype)
    y_BJD = out_proj(self, "proj", o_BJAE, c.d_model, **_parts(c)) + dense(g_BJF, w_down.astype(c.dtype), "F,FD->D")
    return tokens(x_BJD + m[:, 2][:, None] * y_BJD), None


class EncoderBlock(nn.Module):
  """A pre-norm bidirectional block of the text encoder: (x [B, S, G], (angles, keep)) -> (x, None)."""
  cfg: FluxConfig

  @nn.compact
  def __call__(self, x_BSG, context):
    c = self.cfg
    angle_SR, keep_BS = context
    norm = lambda name: param(self, name, (c.text_width,), ("norm",), None, c.param_dtype)
    q, k, v = QKV(c.text_width, c.text_heads, c.text_head_dim, **_parts(c), name="qkv")(
        rms_norm(x_BSG, norm("attn_norm")))
    o_BSAE = heads(attention(rotate(q, angle_SR), rotate(k, angle_SR), v, keep_BS))
    x_BSG = tokens(x_BSG + out_proj(self, "proj", o_BSAE, c.text_width, **_parts(c)))
    h_BSG = MLP(c.text_width, c.text_mlp_dim, **_parts(c), name="mlp")(rms_norm(x_BSG, norm("mlp_norm")))
    return tokens(x_BSG + h_BSG), None


def unrolled(c: FluxConfig, length: int) -> int:
  """Blocks per loop iteration of a stack of `length`: model.scan_unroll, or when 0 (auto) the whole stack (no loop)
  for at most MAX_AUTO_UNROLL blocks without remat, else 1, as the language model's (meshtrain/models/llama.py
  `unrolled_layers`): a loop keeps its residuals in stacked buffers written and read with dynamic slices, and its
  small per-block programs fuse worse; configs/t2i_tiny.py trains 1.25x faster unrolled (python -m meshtrain.bench,
  benchmarks/)."""
  if c.scan_unroll:
    return min(c.scan_unroll, length)
  return length if length <= MAX_AUTO_UNROLL and c.remat == "none" else 1


def stacked(block, c: FluxConfig, length: int, name: str):
  """`length` blocks as one nn.scan over stacked parameters (axis `layers`), remat-wrapped under remat=full."""
  if c.remat == "full":
    block = nn.remat(block, prevent_cse=False)
  return nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=nn.broadcast,
                 length=length, unroll=max(unrolled(c, length), 1),
                 metadata_params={nn.PARTITION_NAME: "layers"})(c, name=name)


def pooled(x_BSG, keep_BS):
  """The mean of the kept tokens' features, in float32, returned in x's dtype: [B, G]; 0 for a caption with none
  (the empty one)."""
  count_B = jnp.maximum(jnp.sum(keep_BS, axis=1, keepdims=True), 1).astype(jnp.float32)
  sum_BG = jnp.sum(jnp.where(keep_BS[..., None], x_BSG.astype(jnp.float32), 0), axis=1)
  return (sum_BG / count_B).astype(x_BSG.dtype)


class TextEncoder(nn.Module):
  """Caption ids int32[B, S] (PAD = 0, bytes 1..256) -> (features [B, S, G], pooled [B, G], keep bool[B, S])."""
  cfg: FluxConfig

  @nn.compact
  def __call__(self, ids_BS):
    c = self.cfg
    table_VG = param(self, "embedding", (TEXT_VOCAB, c.text_width), (None, "embed"), c.init_std, c.param_dtype)
    x_BSG = tokens(jnp.take(table_VG, ids_BS, axis=0).astype(c.dtype))
    keep_BS = ids_BS != PAD
    pos_S = jnp.arange(ids_BS.shape[1])
    angle_SR = rope_angles(pos_S[:, None], (c.text_width // c.text_heads,))
    x_BSG, _ = stacked(EncoderBlock, c, c.text_layers, "layers")(x_BSG, (angle_SR, keep_BS))
    scale = param(self, "final_norm", (c.text_width,), ("norm",), None, c.param_dtype)
    x_BSG = rms_norm(x_BSG, scale)
    return x_BSG, pooled(x_BSG, keep_BS), keep_BS


def embedder(module: nn.Module, name: str, x_BI, c: FluxConfig):
  """Flux's MLPEmbedder: Linear(I, D), SiLU, Linear(D, D), with biases."""
  D = c.d_model
  w1 = param(module, f"{name}_in", (x_BI.shape[-1], D), (None, "embed"), c.init_std, c.param_dtype)
  b1 = zeros(module, f"{name}_in_bias", (D,), ("embed",), c.param_dtype)
  w2 = param(module, f"{name}_out", (D, D), (None, "embed"), c.init_std, c.param_dtype)
  b2 = zeros(module, f"{name}_out_bias", (D,), ("embed",), c.param_dtype)
  h_BD = nn.silu(x_BI.astype(c.dtype) @ w1.astype(c.dtype) + b1.astype(c.dtype))
  return h_BD @ w2.astype(c.dtype) + b2.astype(c.dtype)


def frozen_features(module: nn.Module, text: dict, c: FluxConfig):
  """A frozen encoder's features (meshtrain/data/text_features.py) as the model reads them: (features [B, S, G],
  pooled [B, G or pooled_width], keep bool[B, S]).

  With text_norm, RMS-normalised with a learned scale: a language model's hidden states before its final norm reach
  magnitudes in the hundreds, which Lumina-Image 2.0 and Z-Image tame the same way; Flux.1's T5 features enter as
  they are. Without text_mask every token is a key, padding too: Flux.1 attends over the T5 prompt padded to
  max_sequence_length without a mask, so that length changes its pictures. The pooled vector is the mean of the
  kept tokens' features, or text["text_pooled"] where pooled_width is set (Flux.1: CLIP's pooled output)."""
  x_BSG = text["text_features"].astype(c.dtype)
  if c.text_norm:
    x_BSG = rms_norm(x_BSG, param(module, "text_norm", (c.text_width,), ("norm",), None, c.param_dtype))
  x_BSG = tokens(x_BSG)
  keep_BS = text["text_keep"].astype(bool) if c.text_mask else jnp.ones(x_BSG.shape[:2], bool)
  pooled_BG = text["text_pooled"].astype(c.dtype) if c.pooled_width else pooled(x_BSG, keep_BS)
  return x_BSG, pooled_BG, keep_BS


class Flux(nn.Module):
  """(x_t [B, H, W, C], t [B] in [0, 1], text, guidance [B]) -> velocity [B, H, W, C] float32. `text`: caption ids
  int32[B, S] with the own encoder (text_encoder "own"), else a frozen encoder's {"text_features": [B, S, G],
  "text_keep": bool[B, S]} (plus "text_pooled" [B, pooled_width] where pooled_width is set). `guidance`: the scale
  a guidance-distilled model (guidance_embed) is asked for, None otherwise. H and W are any multiples of the patch
  side: the positions follow the input, as Flux samples at sizes it was not trained at."""
  cfg: FluxConfig

  @nn.compact
  def __call__(self, x_BHWC, t_B, text, guidance_B=None):
    c = self.cfg
    D, X = c.d_model, c.patch_dim
    _, H, W, _ = x_BHWC.shape
    if c.guidance_embed != (guidance_B is not None):
      raise ValueError(f"guidance_embed={c.guidance_embed} but guidance {'not ' if guidance_B is None else ''}given")
    if c.text_encoder == "own":
      txt_BSG, pooled_BG, keep_BS = TextEncoder(c, name="text")(text)
    else:
      txt_BSG, pooled_BG, keep_BS = frozen_features(self, text, c)
    w_img = param(self, "img_in", (X, D), (None, "embed"), c.init_std, c.param_dtype)
    b_img = zeros(self, "img_in_bias", (D,), ("embed",), c.param_dtype)
    img_BTD = tokens(dense(patchify(x_BHWC.astype(c.dtype), c.patch_size), w_img.astype(c.dtype), "X,XD->D")
                     + b_img.astype(c.dtype))
    w_txt = param(self, "txt_in", (c.text_width, D), (None, "embed"), c.init_std, c.param_dtype)
    b_txt = zeros(self, "txt_in_bias", (D,), ("embed",), c.param_dtype)
    txt_BSD = tokens(dense(txt_BSG, w_txt.astype(c.dtype), "G,GD->D") + b_txt.astype(c.dtype))
    vec_BD = embedder(self, "time", timestep_features(t_B), c)
    if c.guidance_embed:  # Flux.1-dev: the scale as a second timestep, t's features of g (t x 1000 <- g x 1000)
      vec_BD = vec_BD + embedder(self, "guidance", timestep_features(guidance_B), c)
    vec_BD = vec_BD + embedder(self, "vector", pooled_BG, c)
    vec_BD = nn.with_logical_constraint(vec_BD, ("act_batch", "act_embed"))

    S = keep_BS.shape[1]
    pos_JN = jnp.concatenate([jnp.zeros((S, 3), jnp.int32), image_positions(H // c.patch_size, W // c.patch_size)])
    angle_JR = rope_angles(pos_JN, c.axes_dim)
    keep_BJ = jnp.concatenate([keep_BS, jnp.ones(img_BTD.shape[:2], bool)], axis=1)
    context = (vec_BD, angle_JR, keep_BJ)
    (img_BTD, txt_BSD), _ = stacked(DoubleBlock, c, c.double_layers, "double")((img_BTD, txt_BSD), context)
    x_BJD, _ = stacked(SingleBlock, c, c.single_layers, "single")(
        tokens(jnp.concatenate([txt_BSD, img_BTD], axis=1)), context)

    m = Modulation(D, 2, c.dtype, c.param_dtype, name="final_mod")(vec_BD)
    x_BTD = modulate(layer_norm(x_BJD[:, S:]), m[:, 0], m[:, 1])
    w_out = zeros(self, "out", (D, X), ("embed", None), c.param_dtype)
    b_out = zeros(self, "out_bias", (X,), (None,), c.param_dtype)
    out_BTX = dense(x_BTD, w_out.astype(c.dtype), "D,DX->X") + b_out.astype(c.dtype)
    out_BHWC = unpatchify(out_BTX.astype(jnp.float32), c.patch_size, H, W, c.channels)
    return nn.with_logical_constraint(out_BHWC, ("act_batch", None, None, None))


def flops_per_image(c: FluxConfig) -> float:
  """Model FLOPs of one training image (forward and backward, matmuls and attention): 3 x the forward's.

  Forward, 2 FLOPs per multiply-add, T image and S text tokens, J = S + T:
    text encoder per layer   2 S 4 G G (q, k, v, out) + 4 S S G (attention) + 2 S 2 G F_t (MLP); the own one only
    embeddings               2 T X D (patches) + 2 S G D (txt_in) + 2 (Q D + D D) + 2 (U D + D D) (time, vector:
                             U the pooled vector's width, pooled_width or G) [+ 2 (Q D + D D): guidance_embed's]
    double block             2 D 12 D (modulation) + 2 J 4 D D + 4 J J D + 2 J 2 D F
    single block             2 D 3 D + 2 J 4 D D + 4 J J D + 2 J 2 D F
    final                    2 D 2 D + 2 T D X
  Lookups, norms, biases, RoPE and elementwise work are not counted, as for the other families.
  """
  T, S, D, X, G, Q = c.tokens, c.text_len, c.d_model, c.patch_dim, c.text_width, FREQUENCIES
  J = S + T
  # A frozen encoder's features are computed once per caption, not per training step.
  encoder = 0 if c.text_encoder != "own" else c.text_layers * (
      2 * S * 4 * G * G + 4 * S * S * G + 2 * S * 2 * G * c.text_mlp_dim)
  U = c.pooled_width or G
  timestep = 2 * (Q * D + D * D)  # a timestep MLP: the time's, and the guidance scale's of a distilled model
  embed = 2 * T * X * D + 2 * S * G * D + timestep * (2 if c.guidance_embed else 1) + 2 * (U * D + D * D)
  joint = 2 * J * 4 * D * D + 4 * J * J * D + 2 * J * 2 * D * c.mlp_dim
  blocks = c.double_layers * (2 * D * 12 * D + joint) + c.single_layers * (2 * D * 3 * D + joint)
  return 3.0 * (encoder + embed + blocks + 2 * D * 2 * D + 2 * T * D * X)
