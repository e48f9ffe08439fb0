"""What an image sampling request (task=dit or t2i) may ask, checked before JAX loads: the config a sampler builds
from a run's saved config (`run_config`), whether a request fits this host (`check_request`), a request's prompts.
`python -m meshtrain.sample` and the server's images endpoint use them; the samplers are
meshtrain/inference/dit_sampler.py and t2i_sampler.py.
"""
import pathlib

import ml_collections

from meshtrain import config as config_lib
from meshtrain.errors import UserError
from meshtrain.runtime import host

# What sampling may change of a run's config: where and how it runs, never the model (that comes from the checkpoint).
OVERRIDABLE = ("mesh.", "sharding.", "cpu_devices", "xla_flags", "compilation_cache_dir")


MAX_STEPS = 10_000  # Euler steps: DiTs sample in 25-250; more is a typo that would run for hours without a word


def check_request(cfg, images: int, steps: int) -> None:
  """Refuses, before JAX starts, a sample the host could not hold or would not finish: the activations of one
  Euler step (the grid twice over under guidance: conditional and unconditional rows, each a [tokens, mlp_dim]
  float32 array) against this host's memory, and more than MAX_STEPS steps."""
  if steps > MAX_STEPS:
    raise UserError(f"--steps {steps:,} is more than {MAX_STEPS:,} Euler steps (the DiT samples well in 25-250); pass "
                    "fewer")
  m = cfg.model
  tokens = (m.get("image_size", 1) // m.get("patch_size", 1)) ** 2
  needed = 2 * images * tokens * max(m.get("mlp_dim", 1), 4 * m.get("d_model", 1)) * 4
  if needed > (memory := host.host_memory_bytes()):
    raise UserError(f"{images:,} images ({tokens} tokens each) need about {needed / 1e9:,.1f} GB for one sampling "
                    f"step, more than this host's {memory / 1e9:,.1f} GB; pass fewer classes or a smaller --per-class")


def check_outputs(out: str, npy: str | None) -> None:
  """The grid's path (a PNG) and the samples' (FILE.npz or FILE.npy), neither a directory."""
  if pathlib.Path(out).suffix.lower() != ".png":
    raise UserError(f"--out {out}: the grid is written as a PNG; name it FILE.png")
  if npy is not None and pathlib.Path(npy).suffix not in (".npz", ".npy"):
    raise UserError(f"--npy {npy}: name it FILE.npz (images and labels in one file) or FILE.npy (images; "
                    "labels in FILE.labels.npy)")
  for flag, value in (("--out", out), ("--npy", npy)):
    if value is not None and pathlib.Path(value).is_dir():
      raise UserError(f"{flag} {value} is a directory; give a file name")


def prompts(given: list[str], path: str | None) -> list[str]:
  """The prompts of a text-to-image request: those given, then the lines of the file at `path` (blank lines
  skipped); UserError for an empty prompt or an unreadable file."""
  found = list(given)
  if path is not None:
    try:
      found += [line.strip() for line in pathlib.Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
      raise UserError(f"--prompts {path}: cannot read it ({e})") from e
  if any(not p.strip() for p in found):
    raise UserError("--prompt \"\" is empty; give the text to draw (the unconditional model is --guidance 0)")
  return found


def run_config(saved: dict, overrides: list[str]):
  """The config a sampler of the run whose checkpointed config is `saved` builds its layout from: the run's model,
  data and sample settings, base_config's mesh, sharding and device settings (the training mesh may not exist here;
  one device by default), then `overrides` ("--config.mesh.data=2", ...) of those only."""
  cfg = config_lib.base_config()
  for key in ("task", "seed", "model", "data", "sample"):
    if key in saved:
      value = saved[key]
      cfg[key] = ml_collections.ConfigDict(value) if isinstance(value, dict) else value
  # One device by default on the CPU: simulated devices are threads sharing the same cores. --config.cpu_devices=8
  # with mesh overrides simulates a mesh, as train does.
  cfg.cpu_devices = 1
  for item in overrides:
    key = config_lib.apply_override(cfg, item)
    if not key.startswith(OVERRIDABLE):
      raise UserError(f"--config.{key} cannot be set for sampling (the model comes from the checkpoint); only "
                      "mesh.*, sharding.*, cpu_devices, xla_flags and compilation_cache_dir")
  cfg.optimizer.grad_accum_steps = 1
  return cfg


def add_flux_arguments(parser) -> None:
  """A Flux.1 workdir's sampling flags, as diffusers' FluxPipeline takes them (meshtrain/inference/flux_pipeline.py):
  --size in pixels (default: model.image_size latents, x 8), --max-sequence-length T5's prompt length (default:
  model.text_len; Flux.1 attends over the padded prompt, so it changes the picture), --latents the packed starting
  latents FluxPipeline takes as latents=. --guidance is then dev's guidance embedding (schnell has none), and
  --npy (or --out-npy) FILE.npy holds the pictures as output_type="np" gives them."""
  parser.add_argument("--size", default=None, help="WxH pixels (a Flux.1 workdir; default: the model's)")
  parser.add_argument("--max-sequence-length", type=int, default=None,
                      help="T5's prompt length (a Flux.1 workdir; default: model.text_len)")
  parser.add_argument("--latents", default=None, help="packed starting latents, .npy (a Flux.1 workdir)")


def flux_request(args, model) -> None:
  """--size, --max-sequence-length and --latents: checked and defaulted for a Flux.1 workdir (`model`, the run's
  model group, with model.pipeline), refused for any other run."""
  given = [flag for flag, value in (("--size", args.size), ("--max-sequence-length", args.max_sequence_length),
                                    ("--latents", args.latents)) if value is not None]
  if not model.get("pipeline"):
    if given:
      raise UserError(f"{', '.join(given)}: only a Flux.1 pipeline's workdir (python -m meshtrain.convert "
                      f"from-diffusers) takes {'them' if len(given) > 1 else 'it'}; {args.workdir} samples at its "
                      "trained size")
    return
  side = model.image_size * 8  # its VAE's 8x (the pipeline checks the size against its VAE when it loads)
  try:
    args.size = tuple(int(v) for v in (args.size or f"{side}x{side}").lower().split("x"))
  except ValueError:
    args.size = ()
  if len(args.size) != 2 or min(args.size) <= 0:
    raise UserError(f"--size {args.size!r}: give WIDTHxHEIGHT in pixels, e.g. --size 1024x768")
  args.max_sequence_length = args.max_sequence_length or model.text_len
  if not 0 < args.max_sequence_length <= 512:
    raise UserError(f"--max-sequence-length {args.max_sequence_length} must be in 1 .. 512 (T5's, as FluxPipeline)")
  if args.latents is not None and not pathlib.Path(args.latents).is_file():
    raise UserError(f"--latents {args.latents} is not a file; give a .npy array of packed latents")
