"""A Flux.1 pipeline directory, as diffusers' `FluxPipeline.save_pretrained` writes it, run by meshtrain: prompts in,
pictures out, equal to `FluxPipeline` given the same starting latents (tests/test_flux_pipeline.py).

The parts are meshtrain's own, each checked against its library on its own:
  prompts -> ids       CLIP's and T5's tokenizers (meshtrain/interop/flux_tokenizers.py), padded and cut as
                       FluxPipeline pads and cuts them: CLIP to 77 tokens, T5 to max_sequence_length
  ids -> features      CLIPTextModel's pooled output and T5EncoderModel's last hidden states
                       (meshtrain/models/clip_text.py, t5.py), neither given a mask, as FluxPipeline gives none
  features -> latents  the transformer (meshtrain/models/flux.py) in FlowMatchEulerDiscreteScheduler's Euler steps
                       (meshtrain/families/t2i.py `denoise`): the shift from scheduler_config.json, dynamic by
                       the image's token count where it says so
  latents -> pictures  the VAE's decoder (meshtrain/models/vae.py) after undoing its scaling and shift, mapped from
                       [-1, 1] to [0, 1] and clipped, as FluxPipeline's output_type="np"

Latents travel as FluxPipeline takes them (`latents=`): packed 2x2 patches, channel first, [N, h/2 * w/2, 4 L]
(`pack`, `unpack`). Everything runs on one device, in the dtype the weights are stored in.

Shape letters: N pictures, H, W pixels, h, w latent rows and columns (H/8, W/8 for Flux.1's VAE), L latent
channels, S prompt tokens (77 for CLIP, max_sequence_length for T5), G T5's width, P CLIP's width.
"""
import dataclasses
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain import checkpoint
from meshtrain.errors import UserError
from meshtrain.families import t2i
from meshtrain.interop import (diffusers_flux, diffusers_pipeline, diffusers_vae, flux_tokenizers,
                               text_encoders)
from meshtrain.models import vae
from meshtrain.models.clip_text import ClipText
from meshtrain.models.flux import Flux, FluxConfig
from meshtrain.models.t5 import T5Encoder

def pack(z_NhwL):
  """FluxPipeline._pack_latents: [N, h, w, L] -> [N, h/2 * w/2, 4 L], each patch (channel, row, column)."""
  N, h, w, L = z_NhwL.shape
  z = z_NhwL.reshape(N, h // 2, 2, w // 2, 2, L).transpose(0, 1, 3, 5, 2, 4)
  return z.reshape(N, (h // 2) * (w // 2), L * 4)


def unpack(z_NTX, h: int, w: int):
  """The inverse of `pack` for an h x w latent."""
  N, _, X = z_NTX.shape
  L = X // 4
  return z_NTX.reshape(N, h // 2, w // 2, L, 2, 2).transpose(0, 1, 4, 2, 5, 3).reshape(N, h, w, L)


@dataclasses.dataclass
class Pipeline:
  """A loaded Flux.1 pipeline: each component's config and parameters (on the default device), its tokenizers and
  its scheduler config. `Pipeline.load(directory)`, then `pipeline(prompts, ...)`."""
  transformer: tuple
  vae: tuple
  clip: tuple
  t5: tuple
  tokenizers: tuple
  scheduler: dict

  @classmethod
  def load(cls, directory, transformer: tuple | None = None) -> "Pipeline":
    """The pipeline in `directory`, with its own transformer/ or `transformer` = (FluxConfig, parameters): a
    meshtrain workdir's (`from_workdir`)."""
    root = pathlib.Path(directory).expanduser()
    diffusers_pipeline.read_components(root, transformer=transformer is None)
    scheduler = diffusers_pipeline.read_scheduler(root / "scheduler")
    tokenizers = (flux_tokenizers.clip_tokenizer(root / "tokenizer"),
                  flux_tokenizers.t5_tokenizer(root / "tokenizer_2"))
    # The transformer's image size and prompt length are not its own (it takes any): set per call.
    transformer = transformer or diffusers_flux.read_transformer(root / "transformer", image_size=2, text_len=1,
                                                                 text_encoder="pipeline")
    put = jax.device_put
    vae_cfg, vae_params = diffusers_vae.read(root / "vae")
    clip_cfg, clip_params = text_encoders.read_clip_text(root / "text_encoder")
    t5_cfg, t5_params = text_encoders.read_t5_encoder(root / "text_encoder_2")
    return cls((transformer[0], put(transformer[1])), (vae_cfg, put(vae_params)), (clip_cfg, put(clip_params)),
               (t5_cfg, put(t5_params)), tokenizers, scheduler)

  @classmethod
  def from_workdir(cls, workdir, step: int | None = None) -> tuple["Pipeline", int]:
    """(the pipeline of a converted or fine-tuned Flux.1 workdir at `step` (default: the newest), the step read):
    its transformer from the checkpoint, the rest from model.pipeline."""
    params, meta, step = checkpoint.read_params(workdir, step, step is not None)
    model = meta["config"]["model"]
    if checkpoint.task_of(meta) != "t2i" or not model.get("pipeline"):
      raise UserError(f"{workdir} is not a Flux.1 pipeline's workdir (task=t2i with model.pipeline, as "
                      "python -m meshtrain.convert from-diffusers writes it)")
    return cls.load(model["pipeline"], (FluxConfig.from_config(model), params)), step

  def prompt_features(self, prompts: list[str], max_sequence_length: int) -> dict:
    """The transformer's text condition for `prompts`: T5's features [N, S, G], CLIP's pooled vector [N, P]."""
    clip_ids_NS, t5_ids_NS = flux_tokenizers.flux_ids(*self.tokenizers, prompts, max_sequence_length)
    (clip_cfg, clip_params), (t5_cfg, t5_params) = self.clip, self.t5
    pooled_NP = _clip_pooled(clip_cfg, clip_params, jnp.asarray(clip_ids_NS))
    features_NSG = _t5(t5_cfg, t5_params, jnp.asarray(t5_ids_NS))
    return {"text_features": features_NSG, "text_keep": jnp.ones(t5_ids_NS.shape, bool), "text_pooled": pooled_NP}

  def shift(self, tokens: int) -> float:
    """The scheduler's shift for an image of `tokens` packed tokens: dynamic (Flux.1-dev) or fixed (schnell: 1)."""
    s = self.scheduler
    if s.get("use_dynamic_shifting", False):
      return t2i.resolution_shift(tokens, ((s.get("base_image_seq_len", 256), s.get("max_image_seq_len", 4096)),
                                           (s.get("base_shift", 0.5), s.get("max_shift", 1.15))))
    return float(s.get("shift", 1.0))

  def __call__(self, prompts: list[str], height: int, width: int, steps: int, guidance: float,
               max_sequence_length: int = 512, latents=None, seed: int = 0, index=None) -> np.ndarray:
    """Pictures float32 [N, H, W, 3] in [0, 1] for `prompts`, from `latents` (packed, as FluxPipeline's
    `latents=`) or from normal noise: picture i's of (seed, index[i]) (default index i), the same whatever else is
    drawn beside it. `guidance` is the distilled model's guidance embedding (dev); schnell has none and guides
    nothing, as FluxPipeline."""
    h, w = self.latent_size(height, width)
    n = len(prompts)
    expected = (n, (h // 2) * (w // 2), self.transformer[0].channels * 4)
    if latents is None:
      z_NhwL = self.noise(np.full(n, seed, np.uint32), np.arange(n) if index is None else np.asarray(index), h, w)
    elif tuple(np.shape(latents)) != expected:
      raise UserError(f"--latents has shape {list(np.shape(latents))}; {n} prompt(s) at {width}x{height} take "
                      f"{list(expected)} (packed, as FluxPipeline's latents=)")
    else:
      z_NhwL = unpack(jnp.asarray(latents, jnp.float32), h, w)
    return self.draw(self.transformer[1], self.prompt_features(prompts, max_sequence_length), z_NhwL, steps, guidance)

  def latent_size(self, height: int, width: int) -> tuple[int, int]:
    """(h, w) of a height x width picture, which must be a whole number of the VAE's pixels times 2x2 patches."""
    down = self.vae[0].downsample
    if height % (2 * down) or width % (2 * down) or height <= 0 or width <= 0:
      raise UserError(f"--size {width}x{height}: this pipeline takes sides that are positive multiples of {2 * down} "
                      f"(its VAE's {down}x times the 2x2 patches)")
    return height // down, width // down

  def noise(self, seeds_N, index_N, h: int, w: int):
    """Starting latents [N, h, w, L]: row i's from (seeds[i], index[i]), whatever else is drawn beside it."""
    shape = (h, w, self.transformer[0].channels)
    return jax.vmap(lambda s, i: jax.random.normal(jax.random.fold_in(jax.random.key(s), i), shape, jnp.float32))(
        jnp.asarray(seeds_N, jnp.uint32), jnp.asarray(index_N))

  def draw(self, params, text: dict, z_NhwL, steps: int, guidance) -> np.ndarray:
    """Pictures [N, H, W, 3] in [0, 1] from starting latents: the transformer (`params`) in `steps` Euler steps,
    then the VAE's decoder. `guidance`: one scale or one per picture (dev's embedding; schnell ignores it)."""
    flux_cfg, _ = self.transformer
    _, h, w, _ = z_NhwL.shape
    cfg = dataclasses.replace(flux_cfg, image_size=h, text_len=text["text_features"].shape[1])
    z_NhwL = _denoise(cfg, params, text, z_NhwL, steps, guidance if cfg.guidance_embed else None,
                      self.shift((h // 2) * (w // 2)))
    pictures = vae.decode(self.vae[0], self.vae[1], z_NhwL.astype(jnp.float32))
    return np.asarray(jnp.clip(pictures / 2 + 0.5, 0, 1))


class PromptFeatures:
  """The text condition of prompts for the server's PromptEngine (images_lib.Captions' interface): T5's features at
  the run's prompt length, their mask (all kept: Flux attends over padding) and CLIP's pooled vector."""

  def __init__(self, pipeline: Pipeline, text_len: int):
    self.pipeline, self.text_len = pipeline, text_len

  def __call__(self, prompts: list[str]) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in self.pipeline.prompt_features(prompts, self.text_len).items()}

  def blank(self, n: int) -> dict[str, np.ndarray]:
    """Zeros of the same shapes for n rows: a batch's padding, and what programs are warmed with."""
    (clip_cfg, _), (t5_cfg, _) = self.pipeline.clip, self.pipeline.t5
    return {"text_features": np.zeros((n, self.text_len, t5_cfg.d_model), np.float32),
            "text_keep": np.ones((n, self.text_len), bool), "text_pooled": np.zeros((n, clip_cfg.d_model), np.float32)}


class Sampler:
  """The server's sampler of pictures at one step count (t2i_sampler.Sampler's interface): (params, texts, seeds,
  index, guidance per picture) -> pictures [N, side, side, 3] in [0, 1]."""

  def __init__(self, pipeline: Pipeline, steps: int, side: int):
    self.pipeline, self.steps = pipeline, steps
    self.h, self.w = pipeline.latent_size(side, side)

  def __call__(self, params, texts: dict, seeds_N, index_N, guidance_N) -> np.ndarray:
    z_NhwL = self.pipeline.noise(seeds_N, index_N, self.h, self.w)
    return self.pipeline.draw(params, texts, z_NhwL, self.steps, jnp.asarray(guidance_N, jnp.float32))


@functools.partial(jax.jit, static_argnums=0)
def _clip_pooled(cfg, params, ids_NS):
  return ClipText(cfg).apply({"params": params}, ids_NS)[1]


@functools.partial(jax.jit, static_argnums=0)
def _t5(cfg, params, ids_NS):
  return T5Encoder(cfg).apply({"params": params}, ids_NS)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _denoise(cfg, params, text, noise_NhwL, steps: int, guidance, shift):
  return t2i.denoise(Flux(cfg), params, text, noise_NhwL, steps, guidance, shift)


def sample_workdir(workdir, step: int | None, prompts: list[str], per_prompt: int, size: tuple[int, int], steps: int,
                   guidance: float, seed: int, max_sequence_length: int, latents_file: str | None):
  """(pictures float32 [N, H, W, 3] in [0, 1], the step read): `per_prompt` pictures of each prompt, in order, from
  the Flux.1 workdir at `step`; picture k of a prompt from the noise of (seed, k), or all from the packed latents
  in `latents_file` (.npy, as FluxPipeline's latents=)."""
  latents = None
  if latents_file is not None:
    try:
      latents = np.load(latents_file)
    except (OSError, ValueError) as e:
      raise UserError(f"--latents {latents_file}: cannot read it as a .npy array ({e})") from None
  pipeline, step = Pipeline.from_workdir(workdir, step)
  width, height = size
  index = np.tile(np.arange(per_prompt), len(prompts))
  pictures = pipeline([p for p in prompts for _ in range(per_prompt)], height, width, steps, guidance,
                      max_sequence_length, latents, seed, index)
  return pictures, step
