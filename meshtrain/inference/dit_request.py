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
