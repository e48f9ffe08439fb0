"""The KL autoencoder (VAE) of latent diffusion, equal to diffusers' `AutoencoderKL`: images to the latents a
diffusion model trains on, and back.

Shape letters: B batch (images), H, W, C image height, width, channels, Y, X height and width at one block's
resolution, K a block's channels, h, w latent height and width (H, W over 2^(blocks - 1)), L latent channels,
T, S positions of the mid block's attention (queries, keys: Y x X).

Both forms in use are one network with two switches: SD / SDXL (4 latent channels, a 1x1 quant_conv after the
encoder and post_quant_conv before the decoder, scaling_factor 0.18215 / 0.13025) and SD3 / Flux (16 channels,
neither 1x1 conv, shift_factor set). As diffusers' Encoder, Decoder and blocks (diffusers/models/autoencoders/
vae.py, unets/unet_2d_blocks.py, resnet.py, downsampling.py, upsampling.py):
  encoder: conv_in; per entry of block_out_channels a down block of layers_per_block ResnetBlock2D and, except
    after the last, a stride-2 conv on the input padded by one row and column at the bottom and right (diffusers'
    Downsample2D with padding 0); the mid block (resnet, one-head self-attention, resnet); GroupNorm, SiLU, conv_out
    to 2L channels (mean and log-variance); quant_conv;
  decoder: post_quant_conv; conv_in; the mid block; per block, deepest first, layers_per_block + 1 resnets and,
    except after the last, nearest x2 upsampling and a conv; GroupNorm, SiLU, conv_out.
  ResnetBlock2D: x + conv2(SiLU(GN(conv1(SiLU(GN(x)))))), x through a 1x1 conv where the channels change; every
  GroupNorm has norm_num_groups groups and eps 1e-6. The attention is one head over all K channels (scale
  1/sqrt(K)) after a GroupNorm, with a residual; its [B, T, S] scores are whole (T = (H/8)^2 at the mid block:
  16,384 for a 1024-pixel image, 1 GiB of float32 scores per image).
Parameters are named as diffusers' state dict with each list index joined to its name (down_blocks.0.resnets.1
-> down_blocks_0/resnets_1): meshtrain/interop/diffusers_vae.py maps the two by that rule. Unlike the trained
models' parameters they name no logical axes: the VAE is frozen and small (84M parameters), run replicated on
every device, so there is nothing to shard.

NHWC throughout (JAX's convolution layout). `dtype` is the compute dtype (params are cast to it); GroupNorm
statistics and the attention's softmax are float32 whatever it is, and what the public functions return is float32.
"""
import dataclasses
import functools
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from meshtrain.errors import UserError

LOGVAR_MIN, LOGVAR_MAX = -30.0, 20.0  # diffusers' DiagonalGaussianDistribution clamps the log-variance so
EPS = 1e-6  # every GroupNorm's, as diffusers' VAE blocks pass resnet_eps=1e-6
DOWN_BLOCK, UP_BLOCK = "DownEncoderBlock2D", "UpDecoderBlock2D"
ACTIVATIONS = ("silu", "swish")  # diffusers' get_activation maps both to SiLU


@dataclasses.dataclass(frozen=True)
class VAEConfig:
  """The fields of diffusers' AutoencoderKL config.json (its defaults where a field is absent, as diffusers), and
  the compute dtype."""
  in_channels: int = 3
  out_channels: int = 3
  block_out_channels: tuple[int, ...] = (64,)
  layers_per_block: int = 1
  latent_channels: int = 4
  norm_num_groups: int = 32
  scaling_factor: float = 0.18215
  shift_factor: float = 0.0  # diffusers' None (no shift) is 0
  use_quant_conv: bool = True
  use_post_quant_conv: bool = True
  mid_block_add_attention: bool = True
  # Read by pipelines, not by the network: carried so that a written config.json says what the read one said.
  sample_size: int | tuple[int, ...] = 32
  force_upcast: bool = True
  latents_mean: tuple[float, ...] | None = None
  latents_std: tuple[float, ...] | None = None
  dtype: str = "float32"

  @classmethod
  def from_diffusers(cls, config: dict, where: str = "config.json", dtype: str = "float32") -> "VAEConfig":
    """From the fields of diffusers' config.json (`where` names it in errors); a UserError for what this network
    is not (another block type or activation, inconsistent sizes)."""
    fields = {f.name for f in dataclasses.fields(cls)} - {"dtype"}
    values = {k: v for k, v in config.items() if k in fields}
    for key in ("block_out_channels", "latents_mean", "latents_std", "sample_size"):
      if isinstance(values.get(key), list):
        values[key] = tuple(values[key])
    if values.get("shift_factor") is None:
      values["shift_factor"] = 0.0
    cfg = cls(**values, dtype=dtype)
    check_config(cfg, config, where)
    return cfg

  def to_diffusers(self) -> dict:
    """The config.json fields diffusers' AutoencoderKL reads."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "dtype"}
    n = len(self.block_out_channels)
    return {**out, "shift_factor": self.shift_factor or None, "act_fn": "silu",
            "down_block_types": [DOWN_BLOCK] * n, "up_block_types": [UP_BLOCK] * n}

  @property
  def downsample(self) -> int:
    """Image side over latent side: 2 per down block but the last."""
    return 2 ** (len(self.block_out_channels) - 1)


def check_config(cfg: VAEConfig, config: dict, where: str) -> None:
  """The config describes a VAE this module builds (its fields' types, then what they must agree on)."""
  def bad(what: str):
    raise UserError(f"{where}: {what}; meshtrain builds diffusers' AutoencoderKL of DownEncoderBlock2D / "
                    "UpDecoderBlock2D blocks with SiLU, as the SD, SDXL, SD3 and Flux VAEs are")

  ints = ("in_channels", "out_channels", "layers_per_block", "latent_channels", "norm_num_groups")
  for key in ints:
    value = getattr(cfg, key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      bad(f"{key} is {value!r}, not a positive integer")
  channels = cfg.block_out_channels
  if (not isinstance(channels, tuple) or not channels
      or not all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in channels)):
    bad(f"block_out_channels is {config.get('block_out_channels')!r}, not a list of positive integers")
  for key in ("scaling_factor", "shift_factor"):
    value = getattr(cfg, key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
      bad(f"{key} is {value!r}, not a number")
  if cfg.scaling_factor == 0:
    bad("scaling_factor is 0: latents would all be zero")
  for key in ("use_quant_conv", "use_post_quant_conv", "mid_block_add_attention"):
    if not isinstance(getattr(cfg, key), bool):
      bad(f"{key} is {getattr(cfg, key)!r}, not true or false")
  act = config.get("act_fn", "silu")
  if act not in ACTIVATIONS:
    bad(f"act_fn is {act!r}, not silu")
  for key, kind in (("down_block_types", DOWN_BLOCK), ("up_block_types", UP_BLOCK)):
    types = config.get(key, [kind])
    if not isinstance(types, list | tuple) or len(types) != len(channels):
      bad(f"{key} is {types!r}: one block per entry of block_out_channels {list(channels)} is needed")
    others = sorted({str(t) for t in types} - {kind})
    if others:
      bad(f"{key} has {', '.join(others)}, a block type other than {kind}")
  uneven = [k for k in channels if k % cfg.norm_num_groups]
  if uneven:
    bad(f"norm_num_groups {cfg.norm_num_groups} does not divide block_out_channels {list(channels)}")


# ------------------------------------------------------------------------------------------------------------------
# The network, diffusers' modules one for one.

def conv(features: int, name: str, dtype: str, kernel: int = 3, stride: int = 1, padding=1):
  return nn.Conv(features, (kernel, kernel), strides=stride, padding=padding, dtype=dtype, name=name)


def group_norm(groups: int, name: str, dtype: str):
  # Two-pass variance, as torch's GroupNorm: E[x^2] - E[x]^2 loses digits where the mean is large.
  return nn.GroupNorm(num_groups=groups, epsilon=EPS, dtype=dtype, use_fast_variance=False, name=name)


class ResnetBlock(nn.Module):
  """diffusers' ResnetBlock2D without a time embedding: [B, Y, X, K_in] -> [B, Y, X, K]."""
  features: int
  groups: int
  dtype: str

  @nn.compact
  def __call__(self, x_BYXK):
    K, G, dt = self.features, self.groups, self.dtype
    h_BYXK = conv(K, "conv1", dt)(nn.silu(group_norm(G, "norm1", dt)(x_BYXK)))
    h_BYXK = conv(K, "conv2", dt)(nn.silu(group_norm(G, "norm2", dt)(h_BYXK)))
    if x_BYXK.shape[-1] != K:
      x_BYXK = conv(K, "conv_shortcut", dt, kernel=1, padding=0)(x_BYXK)
    return x_BYXK + h_BYXK


class Attention(nn.Module):
  """The mid block's one-head self-attention with a residual (diffusers' Attention with group_norm and
  residual_connection, its to_q / to_k / to_v / to_out.0): [B, Y, X, K] -> [B, Y, X, K]."""
  groups: int
  dtype: str

  @nn.compact
  def __call__(self, x_BYXK):
    B, Y, X, K = x_BYXK.shape
    h_BTK = group_norm(self.groups, "group_norm", self.dtype)(x_BYXK).reshape(B, Y * X, K)
    q_BTK, k_BSK, v_BSK = (nn.Dense(K, dtype=self.dtype, name=f"to_{n}")(h_BTK) for n in "qkv")
    logits_BTS = jnp.einsum("BTK,BSK->BTS", q_BTK, k_BSK).astype(jnp.float32) / math.sqrt(K)
    probs_BTS = jax.nn.softmax(logits_BTS, axis=-1).astype(v_BSK.dtype)
    o_BTK = nn.Dense(K, dtype=self.dtype, name="to_out_0")(jnp.einsum("BTS,BSK->BTK", probs_BTS, v_BSK))
    return x_BYXK + o_BTK.reshape(B, Y, X, K)


class MidBlock(nn.Module):
  """diffusers' UNetMidBlock2D of the VAE: resnet, attention (unless mid_block_add_attention is false), resnet."""
  cfg: VAEConfig

  @nn.compact
  def __call__(self, x_BYXK):
    c, K = self.cfg, x_BYXK.shape[-1]
    x_BYXK = ResnetBlock(K, c.norm_num_groups, c.dtype, name="resnets_0")(x_BYXK)
    if c.mid_block_add_attention:
      x_BYXK = Attention(c.norm_num_groups, c.dtype, name="attentions_0")(x_BYXK)
    return ResnetBlock(K, c.norm_num_groups, c.dtype, name="resnets_1")(x_BYXK)


class DownBlock(nn.Module):
  """diffusers' DownEncoderBlock2D: resnets, then (but in the last block) Downsample2D: the input padded by one
  row at the bottom and one column at the right, a 3x3 conv of stride 2."""
  cfg: VAEConfig
  features: int
  downsample: bool

  @nn.compact
  def __call__(self, x_BYXK):
    c = self.cfg
    for j in range(c.layers_per_block):
      x_BYXK = ResnetBlock(self.features, c.norm_num_groups, c.dtype, name=f"resnets_{j}")(x_BYXK)
    if self.downsample:
      x_BYXK = Downsample(self.features, c.dtype, name="downsamplers_0")(x_BYXK)
    return x_BYXK


class Downsample(nn.Module):
  features: int
  dtype: str

  @nn.compact
  def __call__(self, x_BYXK):
    return conv(self.features, "conv", self.dtype, stride=2, padding=((0, 1), (0, 1)))(x_BYXK)


class UpBlock(nn.Module):
  """diffusers' UpDecoderBlock2D: layers_per_block + 1 resnets, then (but in the last block) Upsample2D: nearest
  x2 (each pixel repeated), a 3x3 conv."""
  cfg: VAEConfig
  features: int
  upsample: bool

  @nn.compact
  def __call__(self, x_BYXK):
    c = self.cfg
    for j in range(c.layers_per_block + 1):
      x_BYXK = ResnetBlock(self.features, c.norm_num_groups, c.dtype, name=f"resnets_{j}")(x_BYXK)
    if self.upsample:
      x_BYXK = Upsample(self.features, c.dtype, name="upsamplers_0")(x_BYXK)
    return x_BYXK


class Upsample(nn.Module):
  features: int
  dtype: str

  @nn.compact
  def __call__(self, x_BYXK):
    x_BYXK = jnp.repeat(jnp.repeat(x_BYXK, 2, axis=1), 2, axis=2)
    return conv(self.features, "conv", self.dtype)(x_BYXK)


class Encoder(nn.Module):
  """Images [B, H, W, C] -> [B, h, w, 2L]: mean and log-variance, before quant_conv."""
  cfg: VAEConfig

  @nn.compact
  def __call__(self, x_BHWC):
    c = self.cfg
    channels = c.block_out_channels
    x_BYXK = conv(channels[0], "conv_in", c.dtype)(x_BHWC.astype(c.dtype))
    for i, K in enumerate(channels):
      x_BYXK = DownBlock(c, K, i < len(channels) - 1, name=f"down_blocks_{i}")(x_BYXK)
    x_BhwK = MidBlock(c, name="mid_block")(x_BYXK)
    x_BhwK = nn.silu(group_norm(c.norm_num_groups, "conv_norm_out", c.dtype)(x_BhwK))
    return conv(2 * c.latent_channels, "conv_out", c.dtype)(x_BhwK)


class Decoder(nn.Module):
  """Latents [B, h, w, L], after post_quant_conv -> images [B, H, W, C]."""
  cfg: VAEConfig

  @nn.compact
  def __call__(self, z_BhwL):
    c = self.cfg
    channels = c.block_out_channels[::-1]  # deepest first
    x_BYXK = conv(channels[0], "conv_in", c.dtype)(z_BhwL.astype(c.dtype))
    x_BYXK = MidBlock(c, name="mid_block")(x_BYXK)
    for i, K in enumerate(channels):
      x_BYXK = UpBlock(c, K, i < len(channels) - 1, name=f"up_blocks_{i}")(x_BYXK)
    x_BHWK = nn.silu(group_norm(c.norm_num_groups, "conv_norm_out", c.dtype)(x_BYXK))
    return conv(c.out_channels, "conv_out", c.dtype)(x_BHWK)


class AutoencoderKL(nn.Module):
  """diffusers' AutoencoderKL: `encode` (images -> [B, h, w, 2L] of mean and log-variance), `decode` (unscaled
  latents -> images); calling it runs both (the posterior's mean decoded), which `init` uses to create every
  parameter."""
  cfg: VAEConfig

  def setup(self):
    c = self.cfg
    self.encoder, self.decoder = Encoder(c), Decoder(c)
    if c.use_quant_conv:
      self.quant_conv = conv(2 * c.latent_channels, "quant_conv", c.dtype, kernel=1, padding=0)
    if c.use_post_quant_conv:
      self.post_quant_conv = conv(c.latent_channels, "post_quant_conv", c.dtype, kernel=1, padding=0)

  def encode(self, x_BHWC):
    moments_Bhw2L = self.encoder(x_BHWC)
    return self.quant_conv(moments_Bhw2L) if self.cfg.use_quant_conv else moments_Bhw2L

  def decode(self, z_BhwL):
    return self.decoder(self.post_quant_conv(z_BhwL) if self.cfg.use_post_quant_conv else z_BhwL)

  def __call__(self, x_BHWC):
    return self.decode(self.encode(x_BHWC)[..., :self.cfg.latent_channels])


# ------------------------------------------------------------------------------------------------------------------
# The public functions: params are the tree under "params" (what interop/diffusers_vae.read returns).

class Posterior(NamedTuple):
  """The encoder's diagonal Gaussian over unscaled latents (diffusers' DiagonalGaussianDistribution), float32."""
  mean: jax.Array    # [B, h, w, L]
  logvar: jax.Array  # [B, h, w, L], clipped to [LOGVAR_MIN, LOGVAR_MAX]

  def mode(self):
    return self.mean

  def sample(self, key):
    """mean + std * standard normal noise drawn from `key`."""
    return self.mean + jnp.exp(0.5 * self.logvar) * jax.random.normal(key, self.mean.shape, self.mean.dtype)


def param_shapes(cfg: VAEConfig) -> dict:
  """The parameter tree's shapes and dtypes (jax.ShapeDtypeStruct leaves), without computing anything."""
  side = cfg.downsample  # the smallest image every block can take; parameters do not depend on it
  x = jax.ShapeDtypeStruct((1, side, side, cfg.in_channels), jnp.float32)
  return jax.eval_shape(lambda x: AutoencoderKL(cfg).init(jax.random.key(0), x), x)["params"]


@functools.partial(jax.jit, static_argnums=0)
def encode(cfg: VAEConfig, params: dict, x_BHWC) -> Posterior:
  """Images in [-1, 1] -> the posterior over unscaled latents (diffusers' `vae.encode(x).latent_dist`)."""
  moments_Bhw2L = AutoencoderKL(cfg).apply({"params": params}, x_BHWC, method="encode").astype(jnp.float32)
  mean_BhwL, logvar_BhwL = jnp.split(moments_Bhw2L, 2, axis=-1)
  return Posterior(mean_BhwL, jnp.clip(logvar_BhwL, LOGVAR_MIN, LOGVAR_MAX))


def scale(cfg: VAEConfig, z_BhwL):
  """Unscaled latents -> the diffusion model's: (z - shift_factor) * scaling_factor, about unit variance."""
  return (z_BhwL - cfg.shift_factor) * cfg.scaling_factor


def unscale(cfg: VAEConfig, z_BhwL):
  """The inverse of `scale`, what diffusers' pipelines apply before vae.decode."""
  return z_BhwL / cfg.scaling_factor + cfg.shift_factor


@functools.partial(jax.jit, static_argnums=0)
def latents(cfg: VAEConfig, params: dict, x_BHWC, key=None):
  """Images in [-1, 1] -> scaled latents [B, h, w, L], the form a diffusion model trains on: the posterior's mean,
  or a sample of it drawn from `key`."""
  posterior = encode(cfg, params, x_BHWC)
  return scale(cfg, posterior.mode() if key is None else posterior.sample(key))


@functools.partial(jax.jit, static_argnums=0, static_argnames="scaled")
def decode(cfg: VAEConfig, params: dict, z_BhwL, scaled: bool = True):
  """Latents -> images [B, H, W, C] in about [-1, 1] (not clipped, as diffusers'). `scaled`: the latents are the
  diffusion model's (`latents`' output); false: unscaled, as diffusers' `vae.decode(z)` takes them."""
  z_BhwL = unscale(cfg, z_BhwL) if scaled else z_BhwL
  return AutoencoderKL(cfg).apply({"params": params}, z_BhwL, method="decode").astype(jnp.float32)
