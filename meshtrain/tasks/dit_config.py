"""The diffusion transformer's config fields (task=dit): their checks, its model group, and the host memory its
batches need. JAX-free, so a bad value is refused before JAX loads; registered with meshtrain.config by
meshtrain/tasks."""
import ml_collections

from meshtrain import config as config_lib, presets
from meshtrain.errors import UserError

REMAT_POLICIES = ("none", "full")
# The same 4 batches in flight as the language model's (meshtrain/tasks/lm_config.py), each row a float32 image
# (counted twice: the uint8 decode is small, the float32 array and its copy into the batch are not) plus its int32
# label and uint32 noise seed.
BATCH_BUFFER_BYTES_PER_PIXEL = 4 * 2 * 4
BATCH_BUFFER_BYTES_PER_IMAGE = 4 * 2 * 4


def model_group(model: ml_collections.ConfigDict):
  """A diffusion transformer's model group, with every field and default, when the config file's group is one (it
  has image_size); else None, and `check` names the mistake."""
  return presets.dit_model_config(presets.DIT_PRESETS[0]) if "image_size" in model else None


def check(cfg) -> None:
  """The diffusion transformer's fields (task=dit: meshtrain/models/dit.py) and the sampling settings."""
  m = cfg.model
  if "image_size" not in m:
    raise UserError("task=dit needs a diffusion-transformer model group (image_size, patch_size, num_classes, ...), "
                    "and this config has a language model's; start from configs/dit_digits.py (c.model = "
                    "presets.dit_model_config('digits'))")
  for key in ("image_size", "channels", "patch_size", "num_classes", "d_model", "num_layers", "num_heads",
              "mlp_dim"):
    if m[key] <= 0:
      raise UserError(f"config key 'model.{key}' must be positive, got {m[key]}")
  if m.init_std <= 0:
    raise UserError(f"config key 'model.init_std' must be positive, got {m.init_std}")
  if m.image_size % m.patch_size:
    raise UserError(f"model.image_size={m.image_size} is not divisible by model.patch_size={m.patch_size}; each "
                    f"{m.patch_size}x{m.patch_size} patch is one token, so use a patch_size that divides the image "
                    "size (e.g. 2 or 4 for 8x8 images)")
  if m.d_model % m.num_heads:
    raise UserError(f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}; each head is "
                    "d_model / num_heads wide")
  if m.d_model % 4:
    raise UserError(f"model.d_model={m.d_model} must be divisible by 4 for DiT's 2-D sin-cos position embedding "
                    f"(half the width per coordinate, sin and cos); e.g. {4 * max(1, m.d_model // 4)}")
  if not 0 <= m.class_dropout < 1:
    raise UserError(f"model.class_dropout={m.class_dropout} must lie in [0, 1): the fraction of training labels "
                    "replaced by the null class (0.1 is usual; 0 trains no unconditional model for guidance)")
  config_lib.check_choice("model.remat", m.remat, REMAT_POLICIES)
  config_lib.check_choice("model.dtype", m.dtype, config_lib.DTYPES)
  config_lib.check_choice("model.param_dtype", m.param_dtype, config_lib.DTYPES)
  s = cfg.sample
  if s.steps <= 0 or s.per_class <= 0:
    raise UserError(f"sample.steps={s.steps} and sample.per_class={s.per_class} must be positive")
  if s.guidance < 0:
    raise UserError(f"sample.guidance={s.guidance} must be >= 0 (classifier-free guidance scale: 0 unconditional, "
                    "1 conditional only, above 1 stronger)")
  if not 0 <= s.seed <= config_lib.MAX_SEED:
    raise UserError(f"sample.seed={s.seed} is out of range; use 0 <= seed <= {config_lib.MAX_SEED}")
  if cfg.init_from:
    raise UserError(f"init_from={cfg.init_from!r}: fine-tuning from another run's parameters is for language models "
                    "(task=lm) only so far; drop init_from to train the diffusion transformer from scratch")
  for key in ("image_key", "label_key"):
    if not cfg.data[key].strip():
      raise UserError(f"data.{key} is empty; name the dataset's image and label features (e.g. image and label)")


def check_batch_memory(cfg, rows: int, per: str, memory: int) -> None:
  m = cfg.model
  pixels = m.image_size * m.image_size * m.channels
  needed = rows * (pixels * BATCH_BUFFER_BYTES_PER_PIXEL + BATCH_BUFFER_BYTES_PER_IMAGE)
  if needed > memory:
    raise UserError(f"batch_size={cfg.batch_size} images of {m.image_size}x{m.image_size}x{m.channels}: for {per} "
                    f"the input pipeline's buffers alone need {needed / 1e9:,.1f} GB (float32 pixels, 4 batches in "
                    f"flight), more than this host's {memory / 1e9:,.1f} GB of memory; lower batch_size")
