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
import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from meshtrain import costs
from meshtrain.errors import UserError
from meshtrain.models import flux
from meshtrain.models.flux import PAD, Flux, FluxConfig, flops_per_image
from meshtrain.tasks import t2i_config

EVAL_TIMES = 8
# The guidance a guidance-distilled model (Flux.1-dev) is trained at: its embedding's input for every training image,
# so that fine-tuning keeps the distilled guidance of other scales as it was (as Flux.1-dev fine-tuners do).
TRAIN_GUIDANCE = 1.0
# Flux's resolution rule (its get_lin_function): mu at 256 and at 4,096 image tokens, linear between and beyond.
SHIFT_TOKENS = (256, 4096)
SHIFT_MU = (0.5, 1.15)


def time_shift(c: FluxConfig, shift: float) -> float:
  """The shift s of model.shift, or (0) Flux's by-resolution exp(mu) for c's image tokens."""
  return float(shift) if shift > 0 else resolution_shift(c.tokens)


def resolution_shift(tokens: int, points=(SHIFT_TOKENS, SHIFT_MU)) -> float:
  """exp(mu) for an image of `tokens` tokens, mu linear in the token count through two (tokens, mu) points: Flux's
  rule, and FlowMatchEulerDiscreteScheduler's dynamic shift with its config's (base/max_image_seq_len,
  base/max_shift) as `points`."""
  (x1, x2), (y1, y2) = points
  return math.exp(y1 + (tokens - x1) * (y2 - y1) / (x2 - x1))


def shifted(t, s: float):
  return s * t / (1 + (s - 1) * t)


def noise_and_time(seed, image_HWC, s: float, caption_dropout: float):
  """One row's randomness from its own seed: (t, eps [H, W, C], whether its caption is dropped)."""
  k_t, k_eps, k_drop = jax.random.split(jax.random.key(seed), 3)
  t = shifted(jax.nn.sigmoid(jax.random.normal(k_t, (), jnp.float32)), s)
  eps_HWC = jax.random.normal(k_eps, image_HWC.shape, jnp.float32)
  return t, eps_HWC, jax.random.bernoulli(k_drop, caption_dropout)


# The text condition, as the model takes it (meshtrain/models/flux.py): the own encoder's caption ids, or a frozen
# encoder's features and the mask of their real tokens (meshtrain/data/text_features.py).
def text_keys(c: FluxConfig) -> tuple[str, ...]:
  if c.text_encoder == "own":
    return ("captions",)
  return ("text_features", "text_keep") + (("text_pooled",) if c.pooled_width else ())


def text_of(c: FluxConfig, batch: dict):
  return batch["captions"] if c.text_encoder == "own" else {k: batch[k] for k in text_keys(c)}


def without_caption(c: FluxConfig, text, drop_B):
  """The empty caption where drop_B: every id PAD, or no token kept. Either way no text token is a key of the joint
  attention and the pooled vector is 0, so the image tokens see no caption at all: the unconditional model."""
  if c.text_encoder == "own":
    return jnp.where(drop_B[:, None], jnp.full_like(text, PAD), text)
  return {**text, "text_keep": jnp.logical_and(text["text_keep"], jnp.logical_not(drop_B)[:, None])}


def velocity_error(model: Flux, params, x0_BHWC, eps_BHWC, t_B, text):
  """Mean over each image's pixels of (v_pred - (eps - x0))^2 at x_t = (1 - t) x0 + t eps: [B]. A guidance-distilled
  model (Flux.1-dev) is asked for TRAIN_GUIDANCE."""
  t_B111 = t_B[:, None, None, None]
  x_t_BHWC = (1 - t_B111) * x0_BHWC + t_B111 * eps_BHWC
  g_B = jnp.full(t_B.shape, TRAIN_GUIDANCE, jnp.float32) if model.cfg.guidance_embed else None
  v_BHWC = model.apply({"params": params}, x_t_BHWC, t_B, text, g_B)
  return jnp.mean(jnp.square(v_BHWC - (eps_BHWC - x0_BHWC)), axis=(1, 2, 3))


def guided_velocity(model: Flux, params, x_NHWC, t, text, guidance):
  """v_empty + g (v_caption - v_empty) at time t: both halves in one forward pass of 2N rows. `guidance` is one
  scale or one per row ([N]: a server batch of requests that asked for different ones)."""
  n = x_NHWC.shape[0]
  g = jnp.asarray(guidance, jnp.float32)
  guidance = g.reshape(g.shape + (1, 1, 1)) if g.ndim else g
  empty = without_caption(model.cfg, text, jnp.ones((n,), bool))
  text_2N = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), text, empty)
  v_2NHWC = model.apply({"params": params}, jnp.concatenate([x_NHWC, x_NHWC]), jnp.full((2 * n,), t, jnp.float32),
                        text_2N)
  return v_2NHWC[n:] + guidance * (v_2NHWC[:n] - v_2NHWC[n:])


def denoise(model: Flux, params, text, noise_NHWC, steps: int, guidance, s: float):
  """x at t = 0 [N, H, W, C] for the captions `text` (as the model takes it) from noise_NHWC (the t = 1 end):
  `steps` Euler steps between the shifted times t_i = shift(1 - i / steps), x <- x + (t_{i+1} - t_i) v(x, t_i),
  FlowMatchEulerDiscreteScheduler's steps. v is classifier-free guided by `guidance`; for a guidance-distilled
  model (Flux.1-dev) one pass with `guidance` given to its guidance embedding, as FluxPipeline's guidance_scale;
  None: one unguided pass (Flux.1-schnell). Pure and jittable."""
  t_I = shifted(jnp.linspace(1.0, 0.0, steps + 1), s)
  n = noise_NHWC.shape[0]

  def velocity(x_NHWC, t):
    if guidance is not None and not model.cfg.guidance_embed:
      return guided_velocity(model, params, x_NHWC, t, text, guidance)
    g_N = None if guidance is None else jnp.broadcast_to(jnp.asarray(guidance, jnp.float32), (n,))
    return model.apply({"params": params}, x_NHWC, jnp.full((n,), t, jnp.float32), text, g_N)

  def euler(i, x_NHWC):
    return x_NHWC + (t_I[i + 1] - t_I[i]) * velocity(x_NHWC, t_I[i])

  return jax.lax.fori_loop(0, steps, euler, noise_NHWC.astype(jnp.float32))


def sample(model: Flux, params, text, noise_NHWC, steps: int, guidance, s: float):
  """Images [N, H, W, C] in [-1, 1]: `denoise`'s, clipped."""
  return jnp.clip(denoise(model, params, text, noise_NHWC, steps, guidance, s), -1.0, 1.0)


def batch_spec(c: FluxConfig, batch_size: int) -> dict:
  if c.text_encoder == "own":
    text = {"captions": jax.ShapeDtypeStruct((batch_size, c.text_len), jnp.int32)}
  else:
    text = {"text_features": jax.ShapeDtypeStruct((batch_size, c.text_len, c.text_width), jnp.float32),
            "text_keep": jax.ShapeDtypeStruct((batch_size, c.text_len), jnp.bool_)}
    if c.pooled_width:
      text["text_pooled"] = jax.ShapeDtypeStruct((batch_size, c.pooled_width), jnp.float32)
  return {"images": jax.ShapeDtypeStruct((batch_size, c.image_size, c.image_size, c.channels), jnp.float32),
          **text, "seeds": jax.ShapeDtypeStruct((batch_size,), jnp.uint32)}


def model_inputs(c: FluxConfig, batch_size: int) -> tuple:
  """The arguments after the PRNG key that `Flux(c).init` takes, as zeros of a batch_size batch."""
  spec = batch_spec(c, batch_size)
  return (jnp.zeros(spec["images"].shape, jnp.float32), jnp.zeros((batch_size,), jnp.float32),
          text_of(c, {k: jnp.zeros(v.shape, v.dtype) for k, v in spec.items()}),
          jnp.ones((batch_size,), jnp.float32) if c.guidance_embed else None)


UNSUPPORTED_AXES = {
    "stage": "pipeline stages are not supported for task=t2i: its blocks take the per-image condition, which the "
             "pipeline does not carry",
}


def check_parallelism(sizes: dict, c: FluxConfig | None = None) -> None:
  """The task's layout refusals. `sequence` splits the caption's and the image's tokens (every act_len activation:
  the streams, q/k/v, the MLP's hidden layer) where both lengths divide by it; the joint attention gathers the keys
  and values of the split sequence (XLA's partitioner, from the sharding annotations alone)."""
  for axis, reason in UNSUPPORTED_AXES.items():
    if sizes.get(axis, 1) > 1:
      raise UserError(f"mesh.{axis}={sizes[axis]}: {reason}; set mesh.{axis}=1 and put the devices on mesh.data, "
                      "mesh.fsdp or mesh.tensor")
  n = sizes.get("sequence", 1)
  if c is not None and n > 1 and (c.tokens % n or c.text_len % n):
    raise UserError(f"mesh.sequence={n} must divide the image's {c.tokens} tokens and the caption's "
                    f"model.text_len={c.text_len}; pick a sequence split that divides both (or change text_len)")


class T2iTask:
  """The Task contract (meshtrain/tasks/__init__.py) for text-to-image on captioned pictures."""

  kind = "t2i"
  shape_fields = ("image_size", "channels", "patch_size", "d_model", "num_heads", "mlp_dim", "double_layers",
                  "single_layers", "text_len", "text_width", "text_layers", "text_heads", "text_mlp_dim",
                  "text_encoder", "text_norm", "pooled_width", "guidance_embed", "param_dtype")
  throughput_key = "images_per_sec"
  units_per_example = 1

  def __init__(self, cfg, mesh, platform: str | None = None):
    del platform  # one attention implementation (einsums) everywhere
    self.cfg = cfg
    self.model_cfg = FluxConfig.from_config(cfg.model)
    check_parallelism(dict(mesh.shape), self.model_cfg)
    self.model = Flux(self.model_cfg)
    self.shift = time_shift(self.model_cfg, cfg.model.shift)

  def batch_spec(self, batch_size: int) -> dict:
    return batch_spec(self.model_cfg, batch_size)

  def batch_axes(self) -> dict:
    text = {"captions": ("act_batch", None), "text_features": ("act_batch", None, None),
            "text_keep": ("act_batch", None), "text_pooled": ("act_batch", None)}
    return {"images": ("act_batch", None, None, None), **{k: text[k] for k in text_keys(self.model_cfg)},
            "seeds": ("act_batch",)}

  def init_args(self, batch_size: int) -> tuple:
    return model_inputs(self.model_cfg, batch_size)

  def loss(self, params, batch):
    """(sum of the per-image losses, {"loss_sum", "count"}), captions dropped with probability caption_dropout."""
    c = self.model_cfg
    draw = jax.vmap(lambda seed, x: noise_and_time(seed, x, self.shift, c.caption_dropout))
    t_B, eps_BHWC, drop_B = draw(batch["seeds"], batch["images"])
    text = without_caption(c, text_of(c, batch), drop_B)
    losses_B = velocity_error(self.model, params, batch["images"].astype(jnp.float32), eps_BHWC, t_B, text)
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
      sums[f"loss_t{k}"] = jnp.sum(velocity_error(self.model, params, x0_BHWC, eps_BHWC, t_B,
                                                  text_of(self.model_cfg, batch)))
    return {**sums, "count": jnp.asarray(x0_BHWC.shape[0], jnp.float32)}

  def eval_record(self, sums: dict) -> dict:
    count = max(float(sums["count"]), 1.0)
    per_t = {f"eval_loss_t{k}": float(sums[f"loss_t{k}"]) / count for k in range(EVAL_TIMES)}
    return {"eval_loss": sum(per_t.values()) / EVAL_TIMES, **per_t}

  def flops_per_example(self, table=None) -> float:
    del table  # by formula (flux.flops_per_image)
    return flops_per_image(self.model_cfg)

  def sample(self, params, texts: dict, noise_NHWC, steps: int, guidance):
    """Pictures of `texts` (batch arrays, as meshtrain/data/images.py `Captions` gives them) from
    noise_NHWC: the module's `sample`."""
    return sample(self.model, params, text_of(self.model_cfg, texts), noise_NHWC, steps, guidance, self.shift)


# The cost model of plan and inspect (meshtrain/analysis/estimate.py): the three block stacks as one device runs them.

BLOCKS = {"text": flux.EncoderBlock, "double": flux.DoubleBlock, "single": flux.SingleBlock}


@dataclasses.dataclass(frozen=True)
class _LocalConfig(FluxConfig):
  """A FluxConfig whose head widths are given, not width / heads: one device of a tensor split holds num_heads /
  tensor heads of the full width (and mlp_dim / tensor of the MLP), as meshtrain/families/dit.py's."""
  local_head_dim: int = 0
  local_text_head_dim: int = 0

  @property
  def head_dim(self) -> int:
    return self.local_head_dim

  @property
  def text_head_dim(self) -> int:
    return self.local_text_head_dim


@dataclasses.dataclass(frozen=True)
class LayerStack(costs.BlockStack):
  """One of Flux's three block stacks as one device runs it (`CostModel.stacks`): what estimate._layer_residuals
  traces. `model` holds the device's share of the heads and MLP widths, at the full head widths."""
  model: FluxConfig
  kind: str = "double"        # "text" (the encoder's blocks), "double" or "single" (BLOCKS)
  # The residual stream is named act_len, not act_res_len: sharding.sequence_parallel does not split it.
  sequence_parallel: bool = False
  # Its per-layer batch-independent residuals are mostly the q/k/v/o and MLP weights as `dense` reshapes them:
  # under FSDP they are gathered again for the backward pass, not kept (as for the DiT).
  fixed_are_weights: bool = True

  @property
  def width(self) -> int:
    return self.model.text_width if self.kind == "text" else self.model.d_model

  @property
  def head_dim(self) -> int:
    return self.model.text_head_dim if self.kind == "text" else self.model.head_dim

  @property
  def dims(self) -> tuple[int, ...]:
    """Every other dimension of the block's values (the trace's batch must divide none of them)."""
    c = self.model
    heads, mlp = (c.text_heads, c.text_mlp_dim) if self.kind == "text" else (c.num_heads, c.mlp_dim)
    return (c.tokens, c.text_len, c.tokens + c.text_len, heads, self.head_dim, self.head_dim // 2, mlp, 6, 3)

  def backward_peak(self, length: int, act: int) -> int:
    """Bytes per image one block's backward holds at its peak beyond the residuals it reads: none beyond the
    generic working set, as for the DiT. Measured on configs/t2i_tiny.py (tests/test_t2i_inspect.py): compiled /
    predicted 0.96-1.00 without remat; with full remat 0.89 (fsdp=8) to 0.97, so any constant here would push the
    FSDP layouts further above what XLA allocates."""
    del length, act
    return 0

  def gradient_jaxpr(self, batch: int, length: int, shards: int):
    """The gradient of a two-layer stack (flux.stacked: nn.scan, remat-wrapped under remat=full) of the block, on
    its streams and with its context as the model passes them: the encoder's [batch, S, G] with the text rotary
    angles and key mask; the double blocks' image [batch, T, D] and text [batch, S, D] streams, the single blocks'
    joint [batch, J, D] one, each with the condition [batch, D], the joint angles and key mask."""
    del length, shards  # each stack's tokens are the config's (CostModel.stacks); check_parallelism refuses a split
    c, E = self.model, self.head_dim
    S, T = c.text_len, c.tokens
    dtype = jnp.dtype(c.dtype)
    stack = flux.stacked(BLOCKS[self.kind], c, 2, self.kind)
    if self.kind == "text":
      angle = flux.rope_angles(jnp.arange(S)[:, None], (E,))
      streams = jax.ShapeDtypeStruct((batch, S, c.text_width), dtype)
      extra = (jax.ShapeDtypeStruct((batch, S), jnp.bool_),)  # the key mask
      context = lambda keep: (angle, keep)
    else:
      side = c.image_size // c.patch_size
      positions = jnp.concatenate([jnp.zeros((S, 3), jnp.int32), flux.image_positions(side, side)])
      angle = flux.rope_angles(positions, c.axes_dim)
      lengths = (T, S) if self.kind == "double" else (S + T,)
      streams = tuple(jax.ShapeDtypeStruct((batch, n, c.d_model), dtype) for n in lengths)
      streams = streams if self.kind == "double" else streams[0]
      extra = (jax.ShapeDtypeStruct((batch, c.d_model), dtype), jax.ShapeDtypeStruct((batch, S + T), jnp.bool_))
      context = lambda vec, keep: (vec, angle, keep)

    def one(a):
      return jnp.zeros((1, *a.shape[1:]), a.dtype)

    def loss(p, x, *ctx):
      out = stack.apply({"params": p}, x, context(*ctx))[0]
      return sum(o.astype(jnp.float32).sum() for o in jax.tree.leaves(out))

    params = jax.eval_shape(lambda: nn.meta.unbox(stack.init(
        jax.random.key(0), jax.tree.map(one, streams), context(*map(one, extra)))["params"]))
    grad = jax.grad(loss, argnums=(0, 1) if self.kind == "text" else (0, 1, 2))
    return jax.make_jaxpr(grad)(params, streams, *extra)


class CostModel:
  """What meshtrain/analysis/estimate.py needs of the text-to-image model, from the config alone (no mesh, no
  devices): the contract's `cost_model` (meshtrain/tasks/__init__.py)."""
  throughput_key = T2iTask.throughput_key
  units_per_example = T2iTask.units_per_example
  # The sequence split trains (T2iTask) but is not modelled here: its residuals and K/V gathers would need the
  # stacks traced at split lengths, so plan leaves it at 1.
  unsupported_axes = {**UNSUPPORTED_AXES, "sequence": "plan and inspect do not model t2i's sequence split yet"}
  num_experts = 0
  remat_policies = t2i_config.REMAT_POLICIES

  def __init__(self, cfg):
    self.cfg = cfg
    self.model_cfg = FluxConfig.from_config(cfg.model)
    self.length = self.model_cfg.tokens    # an image's patches, as the DiT's; the text is part of the example too

  def check_parallelism(self, sizes: dict, microbatches: int | None = None) -> None:
    del microbatches  # no pipeline
    for axis, reason in self.unsupported_axes.items():
      if sizes.get(axis, 1) > 1:
        raise UserError(f"mesh.{axis}={sizes[axis]}: {reason}; set mesh.{axis}=1 for plan and inspect")

  def attention_on(self, platform: str, capability: str | None) -> str:
    """One implementation everywhere: einsums, which keep the [J, J] scores."""
    del platform, capability
    return "einsum"

  def abstract_params(self):
    c = self.model_cfg
    return jax.eval_shape(Flux(c).init, jax.random.key(0), *model_inputs(c, 1))["params"]

  def flops_per_example(self, table) -> float:
    del table
    return flops_per_image(self.model_cfg)

  def recomputed_flops_per_example(self, table) -> float:
    """Full remat wraps every block of the three stacks: their forward (a third of their training FLOPs) runs again
    in the backward pass. The blocks' share, from flops_per_image itself: the model's less the model's without
    blocks."""
    del table
    c = self.model_cfg
    if c.remat != "full":
      return 0.0
    blockless = dataclasses.replace(c, text_layers=0, double_layers=0, single_layers=0)
    return (flops_per_image(c) - flops_per_image(blockless)) / 3

  def batch_bytes_per_example(self, length: int) -> int:
    del length  # an image is never split
    return sum(math.prod(a.shape[1:]) * a.dtype.itemsize for a in batch_spec(self.model_cfg, 1).values())

  def stacks(self, sizes: dict) -> list[costs.Stacked]:
    """The text encoder's blocks (the own encoder's; a frozen encoder runs outside training), then the double- and
    single-stream blocks, as one device of the tensor split computes them: its share of the heads and MLP widths."""
    c, tensor = self.model_cfg, sizes["tensor"]
    fields = {f.name: getattr(c, f.name) for f in dataclasses.fields(FluxConfig)}
    local = _LocalConfig(**{**fields, "num_heads": c.num_heads // tensor, "mlp_dim": c.mlp_dim // tensor,
                            "text_heads": c.text_heads // tensor, "text_mlp_dim": c.text_mlp_dim // tensor},
                         local_head_dim=c.head_dim, local_text_head_dim=c.text_head_dim)
    S, T = c.text_len, c.tokens
    runs = [("text", c.text_layers if c.text_encoder == "own" else 0, "text/layers/", S),
            ("double", c.double_layers, "double/", S + T), ("single", c.single_layers, "single/", S + T)]
    return [costs.Stacked(LayerStack(local, kind), layers, prefix, length)
            for kind, layers, prefix, length in runs if layers]

  def loss_bytes(self, b: int, l: int, sizes: dict, act: int) -> int:
    """The final layer and the loss, as the DiT's: the final adaLN's normalised and modulated image tokens ([b, l, D]
    each), and in float32 the predicted velocity, its target and their difference ([b, H, W, C] each)."""
    c = self.model_cfg
    return b * (2 * l * c.d_model * act + 3 * c.image_size * c.image_size * c.channels * 4)

  def collectives(self, sizes, table, gathered, b: int, l: int, act: int) -> list:
    """Collectives per device per step, derived from what each split forces in Flux's blocks; where XLA's
    partitioner decides (the embedders, the combiner's choices) as it compiled configs/t2i_tiny.py's layouts
    (tests/test_t2i_inspect.py).

    One micro-step (x grad_accum_steps), N blocks over the three stacks, b images of T image and S text tokens
    (J = S + T) per device, text width G, head width E:
      data: each block's gradients reduced as the backward loop produces them (N), the rest in one reduction
        after the loops;
      fsdp: every split block weight gathered for its forward use, and again for its backward use but for the
        biases (a bias's gradient is its output's, summed: the backward pass does not read it, unless full remat
        recomputes the forward there). Outside the blocks
        every split weight once, but these: the time and vector embedders' first layers run column-split over the
        fsdp group's whole batch (as the DiT's time MLP), gathering their inputs, the timestep features [b x fsdp,
        Q] and the pooled text [b x fsdp, U] (U: pooled_width, else G), in the forward pass and their hidden layers
        [b x fsdp, D] in the backward one; a distilled model's guidance embedder (guidance_embed, Flux.1-dev) the
        same way, but its input is the constant training guidance (no gather), so only its hidden layer is
        gathered; and the own encoder's byte embedding is looked up slice by slice with the caption ids
        gathered [b x fsdp, S], as the LM's; txt_in is gathered again for the backward pass (the gradient goes on
        into the text). Gradients: one reduction per block, one per other split gradient (XLA does not combine
        them) but the embedders' output weights (whole on each device after the column-split first layers) and
        the byte embedding's, and one for the rest. All-to-alls: nine of the condition [b, D] between the
        embedders' column split and the batch split (forward and gradients), four more with the guidance
        embedder (13; compiled for a Flux.1-dev-shaped tiny config, tests/test_t2i_inspect.py), and the own
        encoder's looked-up bytes [b, S, G] re-split by batch and back (two, in the parameter dtype);
      tensor: the modulation is not split (it acts on the whole residual stream), so per block the outputs of
        the attention and the MLP are all-reduced ([b, l, width] each) and, in the backward pass, the input
        gradients of Q/K/V (3 x [b, l, width], with the q/k norm scales' partial gradients) and of the MLP's
        input projection: the encoder block 2 forward and 2 backward; the double block both streams' four
        outputs in 3 (XLA combines the image MLP's with the text attention's) and 2 backward (the streams
        combined); the single block, whose attention and MLP read one input, 1 forward (both outputs combined)
        and 1 backward. Full remat's recompute all-reduces the forward's outputs again, in as many more
        all-reduces as XLA's combiner leaves: the encoder block's attention output alone (1; its MLP output is
        not read back), the double block's four in 2, the single block's two within its backward one (0).
        One more all-reduce for the global-norm partial sums.
    Bytes are the buffer per device per execution (full gathered size for all-gathers), summed over executions.
    Counted for grad_accum_steps=1 and multiplied by it: with accumulation XLA moves a few of the fsdp gathers out
    of the micro-step loop and combines the reductions after the blocks (same bytes, fewer collectives).
    """
    c, accum = self.model_cfg, self.cfg.optimizer.grad_accum_steps
    tensor, fsdp = sizes["tensor"], sizes["fsdp"]
    S, J, D, G, E = c.text_len, c.text_len + c.tokens, c.d_model, c.text_width, c.head_dim
    U = c.pooled_width or G  # the pooled vector's width: a given one's (Flux.1: CLIP's), else the features' mean
    own, guided = c.text_encoder == "own", int(c.guidance_embed)
    stacks = self.stacks(sizes)
    layers = sum(s.layers for s in stacks)
    in_stacks = lambda row: any(row.path.startswith(s.prefix) for s in stacks)
    split = {r.path for r in table if "fsdp" in str(r.spec)}
    out = costs.CollectiveList(sizes)
    add = out.add
    if sizes["data"] > 1 or fsdp > 1:
      unreduced = {"time_out", "vector_out", "guidance_out", "text/embedding"} if fsdp > 1 else set()
      reduced = [r for r in gathered if r.path not in unreduced]
      others = len([r for r in reduced if not in_stacks(r) and r.path in split]) if fsdp > 1 else 0
      add("all-reduce", ("data", "fsdp"), accum * (layers + 1 + others),
          accum * sum(r.bytes_per_device for r in reduced))
    if fsdp > 1:
      blocks = [g for g in gathered if in_stacks(g) and g.path in split]
      # The backward pass reads the [layers, ...] matrices again, not the [layers, D] biases, unless it recomputes
      # the forward (full remat).
      again = [g for g in blocks if len(g.shape) > 2 or c.remat == "full"]
      column_split = {"time_in", "time_in_bias", "vector_in", "vector_in_bias", "guidance_in", "guidance_in_bias",
                      "text/embedding"}
      outside = [g for g in gathered if not in_stacks(g) and g.path in split and g.path not in column_split]
      outside += [g for g in gathered if g.path == "txt_in"]
      # Batch rows gathered [b x fsdp, ...]: timestep features, pooled text, two hidden layers (and the guidance
      # embedder's hidden layer); the caption ids.
      features, ids = flux.FREQUENCIES + U + (3 if guided else 2) * D, (S if own else 0)
      add("all-gather", ("fsdp",),
          accum * (sum(g.shape[0] for g in blocks + again) + len(outside) + 4 + guided + own),
          accum * (sum(g.bytes_per_device for g in blocks + again + outside) + b * fsdp * (features * act + ids * 4)))
      lookups, moves = (2 if own else 0), (13 if guided else 9)
      add("all-to-all", ("fsdp",), accum * (moves + lookups),
          accum * (moves * b * D * act + lookups * b * S * G * jnp.dtype(c.param_dtype).itemsize))
    if tensor > 1:
      # Per block: (forward all-reduces, their [b, ...] bytes; backward all-reduces, their bytes), q/k norm
      # scales' partial gradients (float32) with the Q/K/V input gradients.
      # Per block: forward all-reduces and their bytes per image; backward ones; what full remat adds to the
      # backward pass; the q/k norm scales' float32 partial gradients (with the Q/K/V input gradients).
      per_block = {"text": (2, 2 * S * G, 2, 4 * S * G, 1, S * G, 2 * (G // c.text_heads)),
                   "double": (3, 2 * J * D, 2, 4 * J * D, 2, 2 * J * D, 4 * E),
                   "single": (1, 2 * J * D, 1, 4 * J * D, 0, 2 * J * D, 2 * E)}
      count = nbytes = 0
      for s in stacks:
        forward, forward_bytes, backward, backward_bytes, remat, remat_bytes, norms = per_block[s.stack.kind]
        if c.remat != "full":
          remat = remat_bytes = 0
        count += s.layers * (forward + backward + remat)
        nbytes += s.layers * (b * act * (forward_bytes + backward_bytes + remat_bytes) + norms * 4)
      add("all-reduce", ("tensor",), accum * count + 1, accum * nbytes)  # the global norm once per step
    return out
