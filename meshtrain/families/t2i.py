"""The `t2i` task: a text-to-image transformer on Flux's architecture (meshtrain/models/flux.py) trained by
rectified flow on captioned images.

Shape letters as in meshtrain/models/flux.py: B batch, N samples, H, W, C image, S caption ids, K fixed times.

Objective: rectified flow, as the DiT's (meshtrain/families/dit.py): x_t = (1 - t) x0 + t eps, the model predicts
v = eps - x0, the loss is the mean squared error per image. t is logit-normal (SD3) and then shifted toward the
noise end by the resolution-dependent shift of SD3 and Flux, t' = s t / (1 + (s - 1) t): more pixels keep more of
the image's coarse structure at a given noise level, so the same t is "less noisy" at higher resolution and the
shift spends more of the training and the sampling near t = 1. s = model.shift, or with model.shift = 0 Flux's rule,
s = exp(mu), mu linear in the image tokens from 0.5 at 256 to 1.15 at 4,096 (its get_lin_function).

Caption dropout: with probability model.caption_dropout a row's caption becomes empty (every id PAD), which trains
the unconditional velocity that classifier-free guidance needs. As for the DiT, a row's t, noise and dropout come
from the row's own seed, so its loss does not depend on the layout, the micro-batching or the process count.

The validation loss is taken at K = 8 fixed times (torchtitan's Flux: equally spaced, here the midpoints
(k + 0.5) / 8), every image at all 8 with its own noise, captions kept: the number does not move with the random t
draws that make the training loss noisy, and eval_loss_t0 .. t7 show where along the path the model is weak.

Sampling (`sample`): Euler steps along the shifted schedule from t = 1 to 0, v = v_empty + g (v_caption - v_empty).
"""
import math

import jax
import jax.numpy as jnp

from meshtrain.errors import UserError
from meshtrain.models.flux import PAD, Flux, FluxConfig, flops_per_image

EVAL_TIMES = 8
# Flux's resolution rule (its get_lin_function): mu at 256 and at 4,096 image tokens, linear between and beyond.
SHIFT_TOKENS = (256, 4096)
SHIFT_MU = (0.5, 1.15)


def time_shift(c: FluxConfig, shift: float) -> float:
  """The shift s of model.shift, or (0) Flux's by-resolution exp(mu) for c's image tokens."""
  if shift > 0:
    return float(shift)
  (x1, x2), (y1, y2) = SHIFT_TOKENS, SHIFT_MU
  return math.exp(y1 + (c.tokens - x1) * (y2 - y1) / (x2 - x1))


def shifted(t, s: float):
  return s * t / (1 + (s - 1) * t)


def noise_and_time(seed, image_HWC, ids_S, s: float, caption_dropout: float, drop: bool):
  """One row's randomness from its own seed: (t, eps [H, W, C], the caption ids the model sees)."""
  k_t, k_eps, k_drop = jax.random.split(jax.random.key(seed), 3)
  t = shifted(jax.nn.sigmoid(jax.random.normal(k_t, (), jnp.float32)), s)
  eps_HWC = jax.random.normal(k_eps, image_HWC.shape, jnp.float32)
  if drop:
    ids_S = jnp.where(jax.random.bernoulli(k_drop, caption_dropout), jnp.full_like(ids_S, PAD), ids_S)
  return t, eps_HWC, ids_S


def velocity_error(apply_fn, params, x0_BHWC, eps_BHWC, t_B, ids_BS):
  """Mean over each image's pixels of (v_pred - (eps - x0))^2 at x_t = (1 - t) x0 + t eps: [B]."""
  t_B111 = t_B[:, None, None, None]
  x_t_BHWC = (1 - t_B111) * x0_BHWC + t_B111 * eps_BHWC
  v_BHWC = apply_fn({"params": params}, x_t_BHWC, t_B, ids_BS)
  return jnp.mean(jnp.square(v_BHWC - (eps_BHWC - x0_BHWC)), axis=(1, 2, 3))


def guided_velocity(model: Flux, params, x_NHWC, t, ids_NS, guidance):
  """v_empty + g (v_caption - v_empty) at time t: both halves in one forward pass of 2N rows. `guidance` is one
  scale or one per row ([N]: a server batch of requests that asked for different ones)."""
  n = x_NHWC.shape[0]
  g = jnp.asarray(guidance, jnp.float32)
  guidance = g.reshape(g.shape + (1, 1, 1)) if g.ndim else g
  ids_2NS = jnp.concatenate([ids_NS.astype(jnp.int32), jnp.full_like(ids_NS, PAD, dtype=jnp.int32)])
  v_2NHWC = model.apply({"params": params}, jnp.concatenate([x_NHWC, x_NHWC]), jnp.full((2 * n,), t, jnp.float32),
                        ids_2NS)
  return v_2NHWC[n:] + guidance * (v_2NHWC[:n] - v_2NHWC[n:])


def sample(model: Flux, params, ids_NS, noise_NHWC, steps: int, guidance, s: float):
  """Images [N, H, W, C] in [-1, 1] for the captions ids_NS from noise_NHWC (the t = 1 end): `steps` Euler steps
  between the shifted times t_i = shift(1 - i / steps), x <- x + (t_{i+1} - t_i) v(x, t_i). Pure and jittable."""
  t_I = shifted(jnp.linspace(1.0, 0.0, steps + 1), s)

  def euler(i, x_NHWC):
    return x_NHWC + (t_I[i + 1] - t_I[i]) * guided_velocity(model, params, x_NHWC, t_I[i], ids_NS, guidance)

  x_NHWC = jax.lax.fori_loop(0, steps, euler, noise_NHWC.astype(jnp.float32))
  return jnp.clip(x_NHWC, -1.0, 1.0)


def batch_spec(c: FluxConfig, batch_size: int) -> dict:
  return {"images": jax.ShapeDtypeStruct((batch_size, c.image_size, c.image_size, c.channels), jnp.float32),
          "captions": jax.ShapeDtypeStruct((batch_size, c.text_len), jnp.int32),
          "seeds": jax.ShapeDtypeStruct((batch_size,), jnp.uint32)}


UNSUPPORTED_AXES = {
    "sequence": "the text-to-image model has no sequence-split attention yet: its joint attention runs whole",
    "stage": "pipeline stages are not supported for task=t2i: its blocks take the per-image condition, which the "
             "pipeline does not carry",
}


def check_parallelism(sizes: dict) -> None:
  for axis, reason in UNSUPPORTED_AXES.items():
    if sizes.get(axis, 1) > 1:
      raise UserError(f"mesh.{axis}={sizes[axis]}: {reason}; set mesh.{axis}=1 and put the devices on mesh.data, "
                      "mesh.fsdp or mesh.tensor")


class T2iTask:
  """The Task contract (meshtrain/tasks/__init__.py) for text-to-image on captioned pictures."""

  kind = "t2i"
  shape_fields = ("image_size", "channels", "patch_size", "d_model", "num_heads", "mlp_dim", "double_layers",
                  "single_layers", "text_len", "text_width", "text_layers", "text_heads", "text_mlp_dim",
                  "param_dtype")
  throughput_key = "images_per_sec"
  units_per_example = 1

  def __init__(self, cfg, mesh, platform: str | None = None):
    del platform  # one attention implementation (einsums) everywhere
    check_parallelism(dict(mesh.shape))
    self.cfg = cfg
    self.model_cfg = FluxConfig.from_config(cfg.model)
    self.model = Flux(self.model_cfg)
    self.shift = time_shift(self.model_cfg, cfg.model.shift)

  def batch_spec(self, batch_size: int) -> dict:
    return batch_spec(self.model_cfg, batch_size)

  def batch_axes(self) -> dict:
    return {"images": ("act_batch", None, None, None), "captions": ("act_batch", None), "seeds": ("act_batch",)}

  def init_args(self, batch_size: int) -> tuple:
    spec = self.batch_spec(batch_size)
    return (jnp.zeros(spec["images"].shape, jnp.float32), jnp.zeros((batch_size,), jnp.float32),
            jnp.zeros(spec["captions"].shape, jnp.int32))

  def loss(self, params, batch):
    """(sum of the per-image losses, {"loss_sum", "count"}), captions dropped with probability caption_dropout."""
    c = self.model_cfg
    draw = jax.vmap(lambda seed, x, ids: noise_and_time(seed, x, ids, self.shift, c.caption_dropout, True))
    t_B, eps_BHWC, ids_BS = draw(batch["seeds"], batch["images"], batch["captions"])
    losses_B = velocity_error(self.model.apply, params, batch["images"].astype(jnp.float32), eps_BHWC, t_B, ids_BS)
    loss_sum = jnp.sum(losses_B)
    return loss_sum, {"loss_sum": loss_sum, "count": jnp.asarray(losses_B.shape[0], jnp.float32)}

  def eval_extra(self, tokenizer=None):
    del tokenizer
    return None

  def eval_sums(self, params, batch, extra=None):
    """The loss of every image at each of the EVAL_TIMES fixed times (noise from the row's seed), captions kept."""
    del extra
    x0_BHWC = batch["images"].astype(jnp.float32)
    eps_BHWC = jax.vmap(lambda seed: jax.random.normal(jax.random.key(seed), x0_BHWC.shape[1:], jnp.float32))(
        batch["seeds"])
    sums = {}
    for k in range(EVAL_TIMES):
      t_B = jnp.full((x0_BHWC.shape[0],), (k + 0.5) / EVAL_TIMES, jnp.float32)
      sums[f"loss_t{k}"] = jnp.sum(velocity_error(self.model.apply, params, x0_BHWC, eps_BHWC, t_B,
                                                  batch["captions"]))
    return {**sums, "count": jnp.asarray(x0_BHWC.shape[0], jnp.float32)}

  def eval_record(self, sums: dict) -> dict:
    count = max(float(sums["count"]), 1.0)
    per_t = {f"eval_loss_t{k}": float(sums[f"loss_t{k}"]) / count for k in range(EVAL_TIMES)}
    return {"eval_loss": sum(per_t.values()) / EVAL_TIMES, **per_t}

  def flops_per_example(self, table=None) -> float:
    del table  # by formula (flux.flops_per_image)
    return flops_per_image(self.model_cfg)

  def sample(self, params, ids_NS, noise_NHWC, steps: int, guidance):
    return sample(self.model, params, ids_NS, noise_NHWC, steps, guidance, self.shift)
