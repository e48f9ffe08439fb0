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
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain.errors import UserError
from meshtrain.families import t2i
from meshtrain.interop import diffusers_flux, diffusers_vae, flux_tokenizers, text_encoders
from meshtrain.models import vae
from meshtrain.models.clip_text import ClipText
from meshtrain.models.flux import Flux
from meshtrain.models.t5 import T5Encoder

CLASS_NAME = "FluxPipeline"
# model_index.json's component -> the (library, class) meshtrain reads it as.
COMPONENTS = {"transformer": ("diffusers", "FluxTransformer2DModel"), "vae": ("diffusers", "AutoencoderKL"),
              "text_encoder": ("transformers", "CLIPTextModel"), "text_encoder_2": ("transformers", "T5EncoderModel"),
              "tokenizer": ("transformers", "CLIPTokenizer"), "tokenizer_2": ("transformers", "T5TokenizerFast"),
              "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler")}
TOKENIZER_CLASSES = {"tokenizer": {"CLIPTokenizer", "CLIPTokenizerFast"},
                     "tokenizer_2": {"T5TokenizerFast", "T5Tokenizer"}}
# FlowMatchEulerDiscreteScheduler settings this sampler reproduces: the defaults of everything else.
SCHEDULER_DEFAULTS = {"invert_sigmas": False, "shift_terminal": None, "use_karras_sigmas": False,
                      "use_exponential_sigmas": False, "use_beta_sigmas": False, "time_shift_type": "exponential",
                      "stochastic_sampling": False}


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


def read_components(root: pathlib.Path) -> dict:
  """model_index.json of the pipeline `root`: checked to be a FluxPipeline whose components meshtrain reads."""
  index = root / "model_index.json"
  if not index.is_file():
    raise UserError(f"{str(root)!r} has no model_index.json; pass a diffusers Flux pipeline directory (as "
                    "FluxPipeline.save_pretrained writes it)")
  try:
    spec = json.loads(index.read_text())
  except json.JSONDecodeError as e:
    raise UserError(f"{str(index)!r} is not JSON ({e}); re-save the pipeline") from None
  if spec.get("_class_name") != CLASS_NAME:
    raise UserError(f"{str(index)!r} describes a {spec.get('_class_name')!r}, not a {CLASS_NAME}; meshtrain runs "
                    "Flux.1 pipelines (dev, schnell)")
  for name, (library, cls) in COMPONENTS.items():
    given = spec.get(name)
    allowed = TOKENIZER_CLASSES.get(name, {cls})
    if not isinstance(given, list) or len(given) != 2 or given[1] not in allowed:
      raise UserError(f"{str(index)!r}: component {name!r} is {given!r}; a Flux.1 pipeline has [{library!r}, "
                      f"{sorted(allowed)[0]!r}] there")
    if not (root / name).is_dir():
      raise UserError(f"{str(root)!r} lacks its {name}/ directory, which model_index.json names; copy the whole "
                      "pipeline")
  return spec


def read_scheduler(path: pathlib.Path) -> dict:
  file = path / "scheduler_config.json"
  try:
    config = json.loads(file.read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise UserError(f"cannot read {str(file)!r} ({type(e).__name__}: {e}); copy the pipeline's scheduler/") from None
  odd = {k: config[k] for k, v in SCHEDULER_DEFAULTS.items() if config.get(k, v) != v}
  if odd:
    raise UserError(f"{str(file)!r} sets {odd}, which meshtrain's Euler sampler does not reproduce; only the "
                    "(dynamic) shift of Flux.1's scheduler is")
  return config


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
  def load(cls, directory) -> "Pipeline":
    root = pathlib.Path(directory).expanduser()
    read_components(root)
    scheduler = read_scheduler(root / "scheduler")
    tokenizers = (flux_tokenizers.clip_tokenizer(root / "tokenizer"),
                  flux_tokenizers.t5_tokenizer(root / "tokenizer_2"))
    # The transformer's image size and prompt length are not its own (it takes any): set per call.
    flux_cfg, flux_params = diffusers_flux.read_transformer(root / "transformer", image_size=2, text_len=1,
                                                            text_encoder="diffusers")
    put = jax.device_put
    vae_cfg, vae_params = diffusers_vae.read(root / "vae")
    clip_cfg, clip_params = text_encoders.read_clip_text(root / "text_encoder")
    t5_cfg, t5_params = text_encoders.read_t5_encoder(root / "text_encoder_2")
    return cls((flux_cfg, put(flux_params)), (vae_cfg, put(vae_params)), (clip_cfg, put(clip_params)),
               (t5_cfg, put(t5_params)), tokenizers, scheduler)

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
               max_sequence_length: int = 512, latents=None, seed: int = 0) -> np.ndarray:
    """Pictures float32 [N, H, W, 3] in [0, 1] for `prompts`, from `latents` (packed, as FluxPipeline's
    `latents=`) or from normal noise drawn from `seed`. `guidance` is the distilled model's guidance embedding
    (dev); schnell has none and guides nothing, as FluxPipeline."""
    flux_cfg, flux_params = self.transformer
    vae_cfg, vae_params = self.vae
    unit = 2 * vae_cfg.downsample  # FluxPipeline's: the VAE's downsampling times the 2x2 packing (16 for Flux.1)
    if height % unit or width % unit or height <= 0 or width <= 0:
      raise UserError(f"--size {width}x{height}: this pipeline takes sides that are positive multiples of {unit} "
                      f"(its VAE's {vae_cfg.downsample}x times the 2x2 patches)")
    h, w = height // vae_cfg.downsample, width // vae_cfg.downsample
    n = len(prompts)
    expected = (n, (h // 2) * (w // 2), flux_cfg.channels * 4)
    if latents is None:
      latents = pack(jax.random.normal(jax.random.key(seed), (n, h, w, flux_cfg.channels), jnp.float32))
    elif tuple(np.shape(latents)) != expected:
      raise UserError(f"--latents has shape {list(np.shape(latents))}; {n} prompt(s) at {width}x{height} take "
                      f"{list(expected)} (packed, as FluxPipeline's latents=)")
    text = self.prompt_features(prompts, max_sequence_length)
    cfg = dataclasses.replace(flux_cfg, image_size=h, text_len=max_sequence_length)
    z_NhwL = _denoise(cfg, flux_params, text, unpack(jnp.asarray(latents, jnp.float32), h, w), steps,
                      guidance if cfg.guidance_embed else None, self.shift(expected[1]))
    pictures = vae.decode(vae_cfg, vae_params, z_NhwL.astype(jnp.float32))
    return np.asarray(jnp.clip(pictures / 2 + 0.5, 0, 1))


@functools.partial(jax.jit, static_argnums=0)
def _clip_pooled(cfg, params, ids_NS):
  return ClipText(cfg).apply({"params": params}, ids_NS)[1]


@functools.partial(jax.jit, static_argnums=0)
def _t5(cfg, params, ids_NS):
  return T5Encoder(cfg).apply({"params": params}, ids_NS)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _denoise(cfg, params, text, noise_NhwL, steps: int, guidance, shift):
  return t2i.denoise(Flux(cfg), params, text, noise_NhwL, steps, guidance, shift)
