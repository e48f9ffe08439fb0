"""The text-to-image transformer's config fields (task=t2i): their checks, its model group, and the host memory its
batches need. JAX-free, so a bad value is refused before JAX loads; registered with meshtrain.config by
meshtrain/tasks."""
import ml_collections

from meshtrain import config as config_lib, presets
from meshtrain.errors import UserError

REMAT_POLICIES = ("none", "full")
# As DiT's (meshtrain/tasks/dit_config.py): 4 batches in flight, float32 pixels counted twice, plus the caption ids.
BATCH_BUFFER_BYTES_PER_PIXEL = 4 * 2 * 4
BATCH_BUFFER_BYTES_PER_TEXT_ID = 4 * 4


def model_group(model: ml_collections.ConfigDict):
  """The text-to-image model group with every field and default when the config's group is one (it has
  double_layers); else None, and `check` names the mistake."""
  return presets.t2i_model_config(presets.T2I_PRESETS[0]) if "double_layers" in model else None


def check(cfg) -> None:
  m = cfg.model
  if "double_layers" not in m:
    raise UserError("task=t2i needs a text-to-image model group (double_layers, single_layers, text_len, ...); start "
                    "from configs/t2i_tiny.py (c.model = presets.t2i_model_config('tiny'))")
  own = m.text_encoder == "own"  # the text_layers / heads / mlp_dim of the encoder trained with the model
  for key in ("image_size", "channels", "patch_size", "d_model", "num_heads", "mlp_dim", "text_len", "text_width",
              *(("text_layers", "text_heads", "text_mlp_dim") if own else ())):
    if m[key] <= 0:
      raise UserError(f"config key 'model.{key}' must be positive, got {m[key]}")
  for key in ("double_layers", "single_layers"):
    if m[key] < 0:
      raise UserError(f"config key 'model.{key}' must be >= 0, got {m[key]}")
  if m.double_layers + m.single_layers == 0:
    raise UserError("model.double_layers + model.single_layers is 0: the model needs at least one block")
  if m.image_size % m.patch_size:
    raise UserError(f"model.image_size={m.image_size} is not divisible by model.patch_size={m.patch_size}; use a "
                    "patch size that divides it (e.g. 2 or 4 for 32x32 images)")
  for width, count, what in ((m.d_model, m.num_heads, "model.d_model / model.num_heads"),
                             *([(m.text_width, m.text_heads, "model.text_width / model.text_heads")] if own else [])):
    if width % count or (width // count) % 2:
      raise UserError(f"{what} = {width} / {count} must be a whole, even head width (RoPE rotates pairs)")
  head = m.d_model // m.num_heads
  if len(m.axes_dim) != 3 or sum(m.axes_dim) != head or any(d <= 0 or d % 2 for d in m.axes_dim):
    first = max(2, 2 * round(head / 16))
    second = (head - first) // 4 * 2
    raise UserError(f"model.axes_dim={tuple(m.axes_dim)} must be 3 positive even numbers (RoPE features of the "
                    f"coordinates 0, row, column) summing to the head width {head}; e.g. "
                    f"({first}, {second}, {head - first - second})")
  if m.scan_unroll < 0:
    raise UserError(f"model.scan_unroll={m.scan_unroll} must be >= 0 (0: auto; n: blocks per loop iteration)")
  if not 0 <= m.caption_dropout < 1:
    raise UserError(f"model.caption_dropout={m.caption_dropout} must lie in [0, 1): the fraction of training "
                    "captions replaced by the empty one (0.1 is usual; 0 trains no unconditional model for guidance)")
  if m.shift < 0:
    raise UserError(f"model.shift={m.shift} must be >= 0 (0: by resolution; 1: no shift; 3: SD3 at 1024 px)")
  config_lib.check_choice("model.remat", m.remat, REMAT_POLICIES)
  config_lib.check_choice("model.dtype", m.dtype, config_lib.DTYPES)
  config_lib.check_choice("model.param_dtype", m.param_dtype, config_lib.DTYPES)
  if (m.text_encoder == "pipeline") != bool(m.pipeline):
    raise UserError(f"model.text_encoder={m.text_encoder!r} with model.pipeline={m.pipeline!r}: a Flux.1 pipeline's "
                    "model takes its prompts through that pipeline's encoders (text_encoder 'pipeline', pipeline the "
                    "directory), every other model through its own or a language model's")
  if m.channels != 3 and not m.pipeline:
    raise UserError(f"model.channels={m.channels}: task=t2i reads RGB pictures; set model.channels=3")
  if m.pooled_width < 0:
    raise UserError(f"model.pooled_width={m.pooled_width} must be >= 0 (0: the mean of the text features)")
  s = cfg.sample
  if s.steps <= 0 or s.per_prompt <= 0:
    raise UserError(f"sample.steps={s.steps} and sample.per_prompt={s.per_prompt} must be positive")
  if s.guidance < 0:
    raise UserError(f"sample.guidance={s.guidance} must be >= 0 (0 unconditional, 1 conditional only, above 1 "
                    "stronger)")
  if not 0 <= s.seed <= config_lib.MAX_SEED:
    raise UserError(f"sample.seed={s.seed} is out of range; use 0 <= seed <= {config_lib.MAX_SEED}")
  if cfg.init_from:
    raise UserError(f"init_from={cfg.init_from!r}: fine-tuning from another run is for language models (task=lm) so "
                    "far; drop init_from")
  for key in ("image_key", "caption_key"):
    if not cfg.data[key].strip():
      raise UserError(f"data.{key} is empty; name the column (or feature) holding the {key.split('_')[0]}")


def check_batch_memory(cfg, rows: int, per: str, memory: int) -> None:
  m = cfg.model
  needed = rows * (m.image_size ** 2 * m.channels * BATCH_BUFFER_BYTES_PER_PIXEL
                   + m.text_len * BATCH_BUFFER_BYTES_PER_TEXT_ID)
  if needed > memory:
    raise UserError(f"batch_size={cfg.batch_size} captioned {m.image_size}x{m.image_size} images: for {per} the input "
                    f"pipeline's buffers alone need {needed / 1e9:,.1f} GB, more than this host's {memory / 1e9:,.1f} "
                    "GB of memory; lower batch_size")
