"""Flux.1 pipelines, in diffusers' directory layout, in and out of meshtrain workdirs: what `python -m
meshtrain.convert from-diffusers` and `to-diffusers` do (meshtrain/cli/convert.py).

A converted workdir W holds:
  W/config.json        task=t2i with the transformer's model fields (diffusers_flux.model_fields) and
                       model.pipeline = W/pipeline (model.text_encoder "pipeline")
  W/checkpoints/0      the transformer's parameters (meta `params_only`): what sampling reads and fine-tuning
                       (`--config.init_from=W`) starts from
  W/pipeline/          the pipeline's frozen components as diffusers and transformers stored them, copied file by
                       file: model_index.json, vae/, text_encoder/, text_encoder_2/, tokenizer/, tokenizer_2/,
                       scheduler/ (meshtrain reads them with its own readers when it uses them)
Only the transformer, the part that trains, becomes a meshtrain checkpoint; the rest keeps its format, so that
to-diffusers gives back exactly the files it was given with the transformer of a chosen step.

A lone transformer directory (a fine-tuned Flux transformer shared on its own) converts with `--pipeline BASE`, the
Flux.1 pipeline whose other components it works with; they are copied from there.

Everything is checked before anything is written (model_index.json and each component's class, the scheduler's
settings, the transformer's config.json and every tensor's name and shape from the safetensors headers, the free
disk space), and the output is staged beside the target and renamed into place when complete (hf.staged).
"""
import json
import os
import pathlib
import shutil

import ml_dtypes
import numpy as np

from meshtrain import checkpoint, config as config_lib, presets
from meshtrain.errors import UserError
from meshtrain.interop import diffusers_flux, hf, weights
from meshtrain.models.flux import FluxConfig

CLASS_NAME = "FluxPipeline"
# model_index.json's components -> (library, class) as a Flux.1 pipeline names them.
COMPONENTS = {"transformer": ("diffusers", "FluxTransformer2DModel"), "vae": ("diffusers", "AutoencoderKL"),
              "text_encoder": ("transformers", "CLIPTextModel"), "text_encoder_2": ("transformers", "T5EncoderModel"),
              "tokenizer": ("transformers", "CLIPTokenizer"), "tokenizer_2": ("transformers", "T5TokenizerFast"),
              "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler")}
TOKENIZER_CLASSES = {"tokenizer": {"CLIPTokenizer", "CLIPTokenizerFast"},
                     "tokenizer_2": {"T5TokenizerFast", "T5Tokenizer"}}
# FlowMatchEulerDiscreteScheduler settings meshtrain's Euler sampler reproduces: the defaults of everything but the
# (dynamic) shift.
SCHEDULER_DEFAULTS = {"invert_sigmas": False, "shift_terminal": None, "use_karras_sigmas": False,
                      "use_exponential_sigmas": False, "use_beta_sigmas": False, "time_shift_type": "exponential",
                      "stochastic_sampling": False}
FROZEN = ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler")
PIPELINE_DIR = "pipeline"
DEFAULT_IMAGE_SIZE = 1024   # pixels: Flux.1's native size
DEFAULT_TEXT_LEN = 512      # FluxPipeline's max_sequence_length


def read_json(path: pathlib.Path, what: str) -> dict:
  try:
    value = json.loads(path.read_text())
  except FileNotFoundError:
    raise UserError(f"{str(path.parent)!r} has no {path.name}; {what}") from None
  except (OSError, json.JSONDecodeError) as e:
    raise UserError(f"cannot read {str(path)!r} ({type(e).__name__}: {e}); re-save it") from None
  if not isinstance(value, dict):
    raise UserError(f"{str(path)!r} is not a JSON object; re-save it")
  return value


def read_components(root: pathlib.Path, transformer: bool = True) -> dict:
  """model_index.json of the pipeline `root`, checked to be a FluxPipeline whose components meshtrain reads, each
  present as a directory; the transformer's too unless `transformer` is false (a workdir's pipeline/: the
  transformer is its checkpoint)."""
  spec = read_json(root / "model_index.json", "pass a diffusers Flux pipeline directory (as "
                                              "FluxPipeline.save_pretrained writes it)")
  if spec.get("_class_name") != CLASS_NAME:
    raise UserError(f"{str(root / 'model_index.json')!r} describes a {spec.get('_class_name')!r}, not a {CLASS_NAME}; "
                    "meshtrain converts and runs Flux.1 pipelines (dev, schnell)")
  for name, (library, cls) in COMPONENTS.items():
    given, allowed = spec.get(name), TOKENIZER_CLASSES.get(name, {cls})
    if not isinstance(given, list) or len(given) != 2 or given[1] not in allowed:
      raise UserError(f"{str(root / 'model_index.json')!r}: component {name!r} is {given!r}; a Flux.1 pipeline has "
                      f"[{library!r}, {sorted(allowed)[0]!r}] there")
    if not (root / name).is_dir() and (transformer or name != "transformer"):
      raise UserError(f"{str(root)!r} lacks its {name}/ directory, which model_index.json names; copy the whole "
                      "pipeline")
  return spec


def read_scheduler(path: pathlib.Path) -> dict:
  """scheduler_config.json, refused where it asks for a schedule meshtrain's Euler sampler does not reproduce."""
  config = read_json(path / "scheduler_config.json", "copy the pipeline's scheduler/")
  odd = {k: config[k] for k, v in SCHEDULER_DEFAULTS.items() if config.get(k, v) != v}
  if odd:
    raise UserError(f"{str(path / 'scheduler_config.json')!r} sets {odd}, which meshtrain's Euler sampler does not "
                    "reproduce; only Flux.1's (dynamic) shift is")
  return config


def vae_downsample(root: pathlib.Path) -> int:
  """The VAE's pixels per latent (2 ** (blocks - 1), diffusers' vae_scale_factor): 8 for Flux.1's."""
  blocks = read_json(root / "vae" / "config.json", "copy the pipeline's vae/").get("block_out_channels", [64])
  return 2 ** (len(blocks) - 1)


def model_config(fields: dict, latent_side: int, text_len: int, param_dtype: str, pipeline: pathlib.Path) -> dict:
  """The meshtrain config a converted workdir records (validated)."""
  cfg = config_lib.base_config()
  cfg.task = "t2i"
  m = presets.t2i_model_config(presets.T2I_PRESETS[0])
  for key, value in fields.items():
    m[key] = list(value) if isinstance(value, tuple) else value
  m.preset = "diffusers"
  m.image_size = latent_side     # the transformer's input: latents, image_size x image_size of them
  m.text_len = text_len          # T5's prompt length (FluxPipeline's max_sequence_length): it changes the picture
  m.text_encoder, m.pipeline = "pipeline", str(pipeline)
  m.caption_dropout = 0.0        # Flux.1 attends over its padded prompt unmasked: no empty caption to drop to
  m.param_dtype, m.dtype = param_dtype, "float32"  # float32 compute: exact on the CPU; bfloat16 by override
  cfg.model = m
  # FluxPipeline's defaults: 28 steps with guidance 3.5 for dev, 4 unguided steps for schnell (no embedding).
  cfg.sample.steps, cfg.sample.guidance = (28, 3.5) if fields["guidance_embed"] else (4, 0.0)
  config_lib.validate(cfg)
  return cfg.to_dict()


def _sources(src: pathlib.Path, base: str | None) -> tuple[pathlib.Path, pathlib.Path]:
  """(the transformer directory, the pipeline whose frozen components travel) of from_diffusers' arguments."""
  if (src / "model_index.json").is_file():
    if base:
      raise UserError(f"{str(src)!r} is a whole pipeline; --pipeline is for a lone transformer directory")
    read_components(src)
    return src / "transformer", src
  cls = read_json(src / "config.json", "pass a Flux pipeline directory (model_index.json) or its transformer/ "
                                       "directory").get("_class_name")
  if cls != diffusers_flux.CLASS_NAME:
    raise UserError(f"{str(src)!r} holds a {cls!r}; from-diffusers converts a FluxPipeline directory or a lone "
                    f"{diffusers_flux.CLASS_NAME} (with --pipeline BASE)")
  if not base:
    raise UserError(f"{str(src)!r} is a lone transformer: give --pipeline DIR, the Flux.1 pipeline whose VAE, text "
                    "encoders, tokenizers and scheduler it works with (they are copied from there)")
  base_dir = pathlib.Path(base).expanduser()
  read_components(base_dir)
  return src, base_dir


def from_diffusers(src: str, workdir: str, base: str | None = None, image_size: int = DEFAULT_IMAGE_SIZE,
                   text_len: int = DEFAULT_TEXT_LEN) -> pathlib.Path:
  """Converts the Flux.1 pipeline `src` (or a lone transformer with the pipeline `base`) into the workdir `workdir`
  (see the module docstring); image_size in pixels, text_len T5's prompt length. Returns the workdir's path."""
  source, target = pathlib.Path(src).expanduser(), pathlib.Path(workdir).expanduser()
  if not source.is_dir():
    raise UserError(f"SRC {src!r} is not a directory; pass a diffusers Flux pipeline directory")
  if not 0 < text_len <= DEFAULT_TEXT_LEN:
    raise UserError(f"--max-sequence-length {text_len} must be in 1 .. {DEFAULT_TEXT_LEN} (T5's, as FluxPipeline)")
  hf.check_output(target, "--workdir")
  transformer_dir, pipeline = _sources(source, base)
  read_scheduler(pipeline / "scheduler")
  down = vae_downsample(pipeline)
  if image_size <= 0 or image_size % (2 * down):
    raise UserError(f"--image-size {image_size} must be a positive multiple of {2 * down} pixels (the VAE's "
                    f"{down}x times the 2x2 patches)")
  frozen_bytes = sum(f.stat().st_size for part in FROZEN for f in (pipeline / part).rglob("*") if f.is_file())
  transformer_bytes = sum(f.stat().st_size for f in transformer_dir.glob("*.safetensors"))
  hf.check_space(target, frozen_bytes + 2 * transformer_bytes + (1 << 20), f"converting {str(source)!r}")

  with hf.staged(target) as tmp:
    staging = tmp / ".params"
    staging.mkdir()

    def allocate(path, shape, dtype):  # memory-mapped: page cache the kernel writes back, not process memory
      return np.memmap(staging / ".".join(path), dtype, mode="w+", shape=shape)

    c, params = diffusers_flux.read_transformer(transformer_dir, image_size // down, text_len, "pipeline", allocate)
    fields = diffusers_flux.model_fields(read_json(transformer_dir / "config.json", ""), str(transformer_dir))
    cfg = model_config(fields, image_size // down, text_len, c.param_dtype, target.absolute() / PIPELINE_DIR)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    meta = {"config": cfg, "params_only": True, "tokenizer": None, "layer_order": "sequential",
            "source": {"format": "diffusers", "architecture": diffusers_flux.CLASS_NAME,
                       "path": str(transformer_dir.absolute()), "dtype": c.param_dtype}}
    weights.save_params(tmp, params, meta)
    del params  # unmaps the staged arrays, so that removing their files frees the disk space
    shutil.rmtree(staging)
    (tmp / PIPELINE_DIR).mkdir()
    shutil.copyfile(pipeline / "model_index.json", tmp / PIPELINE_DIR / "model_index.json")
    for part in FROZEN:
      hf.Interrupts.check()
      shutil.copytree(pipeline / part, tmp / PIPELINE_DIR / part)
  return target


def to_diffusers(workdir: str, step: int | None, out: str) -> pathlib.Path:
  """Writes the Flux.1 pipeline of `workdir` at `step` (default: the newest) into `out`: its pipeline/ files and a
  transformer/ of that step's parameters, which FluxPipeline.from_pretrained loads."""
  src, target = pathlib.Path(workdir).expanduser(), pathlib.Path(out).expanduser()
  if not (src / "checkpoints").is_dir():
    raise UserError(f"--workdir {workdir!r} holds no checkpoints; pass the workdir of from-diffusers or of a run "
                    "fine-tuned from one")
  hf.check_output(target, "--out")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  return checkpoint.retrying(lambda at_step: _export(src, at_step, target), step)


def _export(src: pathlib.Path, step: int | None, target: pathlib.Path) -> pathlib.Path:
  meta, stored, read = checkpoint.param_reader(src, step=step)
  model = meta["config"]["model"]
  if checkpoint.task_of(meta) != "t2i" or not model.get("pipeline"):
    raise UserError(f"{str(src)!r} is not a Flux.1 pipeline's workdir (task=t2i with model.pipeline, as "
                    "from-diffusers writes it); to-diffusers exports those")
  pipeline = pathlib.Path(model["pipeline"])
  read_components(pipeline, transformer=False)
  c = FluxConfig.from_config(model)
  diffusers_flux.diffusers_config(c)  # a model diffusers cannot hold is refused before anything is written
  leaves = lambda tree: [x for v in tree.values() for x in (leaves(v) if isinstance(v, dict) else [v])]
  dtype = np.dtype(ml_dtypes.bfloat16) if c.param_dtype == "bfloat16" else np.dtype(np.float32)
  frozen_bytes = sum(f.stat().st_size for f in pipeline.rglob("*") if f.is_file())
  hf.check_space(target, sum(int(np.prod(x.shape)) * dtype.itemsize for x in leaves(stored)) + frozen_bytes,
                 f"exporting {str(src)!r}")
  cache = {}

  def leaf(path):  # the two stacked leaves a single block's proj_out needs, each read from the checkpoint once
    if path not in cache:
      if len(cache) == 2:
        cache.pop(next(iter(cache)))
      cache[path] = read(path)
    return cache[path]

  with hf.staged(target) as tmp:
    shutil.copyfile(pipeline / "model_index.json", tmp / "model_index.json")
    for part in FROZEN:
      hf.Interrupts.check()
      shutil.copytree(pipeline / part, tmp / part)
    (tmp / "transformer").mkdir()
    diffusers_flux.write_files(tmp / "transformer", c, leaf)
  return target
