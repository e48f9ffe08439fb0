"""The `dit` task: a class-conditional diffusion transformer (meshtrain/models/dit.py) trained by rectified flow.

Shape letters as in meshtrain/models/dit.py: B batch, N samples, H, W, C image height, width, channels.

Objective: rectified flow (flow matching; Liu et al. 2022, Lipman et al. 2022, the SD3 recipe of Esser et al.
2024). An image x0 in [-1, 1] and Gaussian noise eps are joined by the straight path x_t = (1 - t) x0 + t eps; the
model predicts its velocity v = dx_t/dt = eps - x0 and the loss is the mean squared error per image (the mean over
its pixels; a batch's objective is the sum over its images, the train step divides by the image count).
Why not DDPM noise prediction: the paths are straight, so a few Euler steps from t = 1 to 0 sample well, which
matters when samples are drawn on a CPU during training; and it is one MSE, with no beta schedule, alpha-bar
tables or variance to learn.
The timestep is logit-normal, t = sigmoid(n), n ~ N(0, 1): SD3's best-scoring schedule. It spends the training
mid-path, where the velocity is hardest to predict, and little near the ends, where it is easy: at t = 0, x_t is
the image and the best guess of v is -x_t; at t = 1, x_t is the noise and the best guess is x_t - the mean image.
Measured on digits (experiments/dit_tune.py, 800 steps, one seed each): samples at guidance 1 are labelled as
their class 95-96% of the time, against 88-90% with t ~ U(0, 1).

Randomness comes from the batch: row r's t, eps and label dropout are drawn from jax.random.key(seeds[r]) under
vmap, so a row's loss is a function of its own image, label and seed only, the same on any layout, micro-batching
or process count. Label dropout: with probability model.class_dropout the row's label becomes the null class
(id num_classes), which trains the unconditional velocity that classifier-free guidance needs.

Sampling (`sample`): Euler steps from t = 1 to 0 along v = v_null + g (v_cond - v_null); g = 1 is the
conditional model alone, g = 0 the unconditional one, g > 1 trades diversity for class fidelity.
"""
import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from meshtrain import costs
from meshtrain.errors import UserError
from meshtrain.models.dit import FREQUENCIES, MOD_BLOCK, MOD_FINAL, Block, DiT, DiTConfig
from meshtrain.tasks import dit_config


def noise_and_time(seed, image_HWC, label, class_dropout: float, num_classes: int, drop_labels: bool):
  """One row's randomness, from its own seed only: (t, eps [H, W, C], the label the model sees).

  t ~ logit-normal(0, 1); eps ~ N(0, I); with `drop_labels`, the label becomes the null class (num_classes) with
  probability class_dropout."""
  k_t, k_eps, k_drop = jax.random.split(jax.random.key(seed), 3)
  t = jax.nn.sigmoid(jax.random.normal(k_t, (), jnp.float32))
  eps_HWC = jax.random.normal(k_eps, image_HWC.shape, jnp.float32)
  if drop_labels:
    label = jnp.where(jax.random.bernoulli(k_drop, class_dropout), num_classes, label)
  return t, eps_HWC, label


def loss_per_image(apply_fn, params, images_BHWC, labels_B, seeds_B, class_dropout: float, num_classes: int,
                   drop_labels: bool):
  """Rectified-flow loss of each image [B]: the mean over its pixels of (v_pred - (eps - x0))^2 at
  x_t = (1 - t) x0 + t eps, with t, eps (and the label dropout) from the row's seed."""
  draw = jax.vmap(lambda s, x, y: noise_and_time(s, x, y, class_dropout, num_classes, drop_labels))
  t_B, eps_BHWC, y_B = draw(seeds_B, images_BHWC, labels_B)
  x0_BHWC = images_BHWC.astype(jnp.float32)
  t_B111 = t_B[:, None, None, None]
  x_t_BHWC = (1 - t_B111) * x0_BHWC + t_B111 * eps_BHWC
  v_BHWC = apply_fn({"params": params}, x_t_BHWC, t_B, y_B)
  return jnp.mean(jnp.square(v_BHWC - (eps_BHWC - x0_BHWC)), axis=(1, 2, 3))


def guided_velocity(model: DiT, params, x_NHWC, t, labels_N, guidance):
  """v_null + g (v_cond - v_null) at time t: the conditional and null rows in one forward pass of 2N rows."""
  n = x_NHWC.shape[0]
  null_N = jnp.full((n,), model.cfg.num_classes, jnp.int32)
  y_2N = jnp.concatenate([labels_N.astype(jnp.int32), null_N])
  t_2N = jnp.full((2 * n,), t, jnp.float32)
  v_2NHWC = model.apply({"params": params}, jnp.concatenate([x_NHWC, x_NHWC]), t_2N, y_2N)
  v_cond_NHWC, v_null_NHWC = v_2NHWC[:n], v_2NHWC[n:]
  return v_null_NHWC + guidance * (v_cond_NHWC - v_null_NHWC)


def sample(model: DiT, params, labels_N, noise_NHWC, steps: int, guidance):
  """Images [N, H, W, C] in [-1, 1] of the classes labels_N, integrated from noise_NHWC (the t = 1 end).

  `steps` Euler steps of dt = 1/steps from t = 1 down to 0 along the guided velocity, in one lax.fori_loop:
  x_{t - dt} = x_t - dt v(x_t, t). Pure and jittable (`steps` static, `guidance` may be traced); clipped to the
  data range at the end.
  """
  dt = 1.0 / steps

  def euler(i, x_NHWC):
    t = 1.0 - i * dt
    return x_NHWC - dt * guided_velocity(model, params, x_NHWC, t, labels_N, guidance)

  x_NHWC = jax.lax.fori_loop(0, steps, euler, noise_NHWC.astype(jnp.float32))
  return jnp.clip(x_NHWC, -1.0, 1.0)


def flops_per_image(c: DiTConfig) -> float:
  """Model FLOPs of one training image (forward and backward, matmuls and attention): 3 x the forward's.

  Forward, 2 FLOPs per multiply-add, T tokens, X = P*P*C pixels per patch, Q timestep frequencies:
    patch embedding        2 T X D
    timestep MLP           2 (Q D + D D)                  once per image (the condition is per image, not token)
    per block: adaLN       2 D 6D                         once per image
               q, k, v, o  2 T 4 D D
               attention   2 T T D (scores) + 2 T T D (weights x values)
               MLP         2 T 2 D F
    final: adaLN 2 D 2D (per image), linear 2 T D X
  Lookups (class embedding), norms, biases and elementwise work are not counted, as for the language model.
  """
  T, X, D, Q = c.tokens, c.patch_dim, c.d_model, FREQUENCIES
  forward = (2 * T * X * D + 2 * (Q * D + D * D) + c.num_layers * block_flops(c)
             + 2 * D * MOD_FINAL * D + 2 * T * D * X)
  return 3.0 * forward


def block_flops(c: DiTConfig) -> float:
  """Forward FLOPs of one block and image (see flops_per_image): what full remat computes again per block."""
  T, D, F = c.tokens, c.d_model, c.mlp_dim
  return 2 * D * MOD_BLOCK * D + 2 * T * 4 * D * D + 4 * T * T * D + 2 * T * 2 * D * F


def batch_spec(c: DiTConfig, batch_size: int) -> dict:
  """Global shape and dtype of one batch's arrays (the contract's `batch_spec`)."""
  return {"images": jax.ShapeDtypeStruct((batch_size, c.image_size, c.image_size, c.channels), jnp.float32),
          "labels": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
          "seeds": jax.ShapeDtypeStruct((batch_size,), jnp.uint32)}


# Mesh axes a DiT cannot be split over, and why: plan leaves them at 1 and says so, the layout refuses them.
UNSUPPORTED_AXES = {
    "sequence": "a DiT attends over all of an image's patches at once and has no sequence-split attention",
    "stage": "pipeline stages are not supported for DiT: its blocks also take the per-image condition, which the "
             "pipeline does not carry",
}


def check_parallelism(sizes: dict) -> None:
  """Refuses (UserError) a mesh that splits an axis of UNSUPPORTED_AXES; the layout and plan both ask here."""
  for axis, reason in UNSUPPORTED_AXES.items():
    if sizes.get(axis, 1) > 1:
      raise UserError(f"mesh.{axis}={sizes[axis]}: {reason}; set mesh.{axis}=1 and put the devices on mesh.data, "
                      "mesh.fsdp or mesh.tensor")


class DitTask:
  """The Task contract (meshtrain/tasks/__init__.py) for a DiT on class-labelled images."""

  kind = "dit"
  shape_fields = ("image_size", "channels", "patch_size", "num_classes", "d_model", "num_layers", "num_heads",
                  "mlp_dim", "param_dtype")
  throughput_key = "images_per_sec"
  units_per_example = 1

  def __init__(self, cfg, mesh, platform: str | None = None):
    del platform  # one attention implementation (plain einsums over T ~ 16 tokens) on every platform
    check_parallelism(dict(mesh.shape))
    self.cfg = cfg
    self.model_cfg = DiTConfig.from_config(cfg.model)
    self.model = DiT(self.model_cfg)

  def batch_spec(self, batch_size: int) -> dict:
    return batch_spec(self.model_cfg, batch_size)

  def batch_axes(self) -> dict:
    return {"images": ("act_batch", None, None, None), "labels": ("act_batch",), "seeds": ("act_batch",)}

  def init_args(self, batch_size: int) -> tuple:
    spec = self.batch_spec(batch_size)
    return (jnp.zeros(spec["images"].shape, jnp.float32), jnp.zeros((batch_size,), jnp.float32),
            jnp.zeros((batch_size,), jnp.int32))

  def _losses(self, params, batch, drop_labels: bool):
    c = self.model_cfg
    return loss_per_image(self.model.apply, params, batch["images"], batch["labels"], batch["seeds"],
                          c.class_dropout, c.num_classes, drop_labels)

  def loss(self, params, batch):
    """(sum of the per-image losses, {"loss_sum", "count"}), labels dropped with probability class_dropout."""
    loss_sum = jnp.sum(self._losses(params, batch, drop_labels=True))
    count = jnp.asarray(batch["labels"].shape[0], jnp.float32)
    return loss_sum, {"loss_sum": loss_sum, "count": count}

  def eval_extra(self, tokenizer=None):
    del tokenizer
    return None

  def eval_sums(self, params, batch, extra=None):
    """The loss with every label kept (t and eps still from the batch's seeds: a fixed function of the batch)."""
    del extra
    losses_B = self._losses(params, batch, drop_labels=False)
    return {"loss_sum": jnp.sum(losses_B), "count": jnp.asarray(losses_B.shape[0], jnp.float32)}

  def eval_record(self, sums: dict) -> dict:
    return {"eval_loss": float(sums["loss_sum"]) / max(float(sums["count"]), 1.0)}

  def flops_per_example(self, table=None) -> float:
    del table  # by formula from the config (see flops_per_image); the table's matmul count would miss attention
    return flops_per_image(self.model_cfg)

  def sample(self, params, labels_N, noise_NHWC, steps: int, guidance):
    """`sample` with this task's model."""
    return sample(self.model, params, labels_N, noise_NHWC, steps, guidance)


@dataclasses.dataclass(frozen=True)
class _LocalConfig(DiTConfig):
  """A DiTConfig whose head width is given, not d_model / num_heads: one device of a tensor split holds
  num_heads / tensor heads of the full width (and mlp_dim / tensor of the MLP)."""
  local_head_dim: int = 0

  @property
  def head_dim(self) -> int:
    return self.local_head_dim


@dataclasses.dataclass(frozen=True)
class LayerStack(costs.BlockStack):
  """DiT's block stack as one device runs it (`CostModel.stack`): what estimate._layer_residuals traces. Hashable,
  so traces are cached per local shape."""
  model: DiTConfig
  # The residual stream is named act_len, not act_res_len: sharding.sequence_parallel does not split it.
  sequence_parallel: bool = False
  # Its per-layer batch-independent residuals are the q/k/v/o weights as `dense` reshapes them: under FSDP XLA
  # gathers them again for the backward pass instead of keeping them (buffer assignment of fsdp=8).
  fixed_are_weights: bool = True

  @property
  def dims(self) -> tuple[int, ...]:
    """Every other dimension of the block's values (the trace's batch must divide none of them)."""
    m = self.model
    return (m.num_heads, m.head_dim, m.mlp_dim, MOD_BLOCK)

  def backward_peak(self, length: int, act: int) -> int:
    """Bytes per image one block's backward holds at its peak beyond the residuals it reads: none beyond the
    generic working set (one layer's residuals again, its weights, the carried gradient). Measured on the
    5-block digits model (a loop): compiled / predicted 0.97 (fsdp=8) to 1.05 (data=8, where the unmodelled AdamW
    moment copies are largest); any per-image constant here would push the FSDP layouts further below."""
    del length, act
    return 0

  def gradient_jaxpr(self, batch: int, length: int, shards: int):
    """The gradient of a two-layer `nn.scan` of the (remat-wrapped) block on x [batch, T, D] and the per-image
    condition c [batch, D], broadcast to every layer as the model's scan does."""
    del shards  # check_parallelism refuses a split sequence
    c = self.model
    block = Block if c.remat == "none" else nn.remat(Block, prevent_cse=False)
    stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=nn.broadcast,
                    length=2, metadata_params={nn.PARTITION_NAME: "layers"})(c)
    dtype = jnp.dtype(c.dtype)
    x, cond = jnp.zeros((1, length, c.d_model), dtype), jnp.zeros((1, c.d_model), dtype)
    params = jax.eval_shape(lambda: nn.meta.unbox(stack.init(jax.random.key(0), x, cond)["params"]))
    loss = lambda p, x, cond: stack.apply({"params": p}, x, cond)[0].astype(jnp.float32).sum()
    return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(
        params, jax.ShapeDtypeStruct((batch, length, c.d_model), dtype),
        jax.ShapeDtypeStruct((batch, c.d_model), dtype))


class CostModel:
  """What meshtrain/analysis/estimate.py needs of the DiT, from the config alone (no mesh, no devices): the contract's
  `cost_model` (meshtrain/tasks/__init__.py)."""
  throughput_key = DitTask.throughput_key
  units_per_example = DitTask.units_per_example
  unsupported_axes = UNSUPPORTED_AXES
  num_experts = 0
  remat_policies = dit_config.REMAT_POLICIES

  def __init__(self, cfg):
    self.cfg = cfg
    self.model_cfg = DiTConfig.from_config(cfg.model)
    self.length = self.model_cfg.tokens    # an image's patches are its sequence

  def check_parallelism(self, sizes: dict, microbatches: int | None = None) -> None:
    del microbatches  # no pipeline
    check_parallelism(sizes)

  def attention_on(self, platform: str, capability: str | None) -> str:
    """One implementation everywhere: plain einsums, which keep the [T, T] scores (T is small)."""
    del platform, capability
    return "einsum"

  def abstract_params(self):
    c = self.model_cfg
    x = jax.ShapeDtypeStruct((1, c.image_size, c.image_size, c.channels), jnp.float32)
    t, y = jax.ShapeDtypeStruct((1,), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.int32)
    return jax.eval_shape(DiT(c).init, jax.random.key(0), x, t, y)["params"]

  def flops_per_example(self, table) -> float:
    del table
    return flops_per_image(self.model_cfg)

  def recomputed_flops_per_example(self, table) -> float:
    """Full remat wraps the blocks alone: their forward runs again in the backward pass."""
    del table
    c = self.model_cfg
    return float(c.num_layers * block_flops(c)) if c.remat == "full" else 0.0

  def batch_bytes_per_example(self, length: int) -> int:
    del length  # an image is never split
    return sum(math.prod(a.shape[1:]) * a.dtype.itemsize for a in batch_spec(self.model_cfg, 1).values())

  def stack(self, sizes: dict) -> LayerStack:
    """The blocks as one device of the tensor split computes them: its share of the heads and of the MLP."""
    c, tensor = self.model_cfg, sizes["tensor"]
    fields = {f.name: getattr(c, f.name) for f in dataclasses.fields(DiTConfig)}
    return LayerStack(_LocalConfig(**{**fields, "num_heads": c.num_heads // tensor, "mlp_dim": c.mlp_dim // tensor},
                                   local_head_dim=c.head_dim))

  def stacks(self, sizes: dict) -> list[costs.Stacked]:
    """One stack: the blocks, over an image's patches."""
    return [costs.Stacked(self.stack(sizes), self.model_cfg.num_layers, "layers/", self.length)]

  def loss_bytes(self, b: int, l: int, sizes: dict, act: int) -> int:
    """The final layer and the loss: the final adaLN's normalised and modulated tokens ([b, l, D] each), and in
    float32 the predicted velocity, its target and their difference ([b, H, W, C] each). Always below one block's
    backward (whose residuals alone are ~39 [l, D] arrays per image), so it never sets the peak; kept for the rule."""
    c = self.model_cfg
    return b * (2 * l * c.d_model * act + 3 * c.image_size * c.image_size * c.channels * 4)

  def collectives(self, sizes, table, gathered, b: int, l: int, act: int) -> list:
    """Collectives per device per step, derived from what each split forces in DiT's blocks.

    One micro-step (x grad_accum_steps) of N blocks, b images of l tokens per device, [b, l, D] = bld bytes:
      data: each block's gradients reduced as the backward loop produces them (N), the rest in one reduction
        after the loop (patch embedding, time MLP, class table, final layer, loss sums);
      fsdp: every split block weight (adaLN modulation, q, k, v, o, MLP up and down) all-gathered for its forward
        and again for its backward use (2 per weight per block); outside the blocks every split weight once,
        except the time MLP's first layer: XLA runs that layer column-split over the fsdp group's whole batch,
        gathering the timestep features [b x fsdp, Q] and the hidden layer [b x fsdp, D] instead; so the time
        MLP's output weight's gradient is whole on each device and needs no reduction. Gradients: one reduction
        per block, one per other split gradient (XLA does not combine them) and one for the unsplit ones; five
        all-to-alls of the per-image condition [b, D] between the time MLP's column split and the batch split
        (forward and gradients);
      tensor: the adaLN modulation is not split (its outputs act on the whole residual stream), so per block one
        all-reduce of [b, l, D] after the attention output and after the MLP down projection (again under full
        remat's recompute), and in the backward pass one of the combined Q/K/V input gradients (3 x [b, l, D])
        and one of the MLP-up input gradient; one more for the global-norm partial sums.
    Bytes are the buffer per device per execution (full gathered size for all-gathers), summed over executions.
    """
    c, accum = self.model_cfg, self.cfg.optimizer.grad_accum_steps
    layers, tensor, fsdp = c.num_layers, sizes["tensor"], sizes["fsdp"]
    bld = b * l * c.d_model * act
    out = costs.CollectiveList(sizes)
    add = out.add
    split = {r.path for r in table if "fsdp" in str(r.spec)}
    time_in = {"time_in", "time_in_bias"}  # never gathered: the time MLP's first layer runs column-split
    if sizes["data"] > 1 or fsdp > 1:
      layer_grads = sum(r.bytes_per_device for r in costs.layer_rows(gathered))
      other = [r for r in gathered if not r.path.startswith("layers/") and not (fsdp > 1 and r.path == "time_out")]
      reductions = 1 + (len([r for r in other if r.path in split]) if fsdp > 1 else 0)
      add("all-reduce", ("data", "fsdp"), accum * (layers + reductions),
          accum * (layer_grads + sum(r.bytes_per_device for r in other)))
    if fsdp > 1:
      in_layers = [g for g in costs.layer_rows(gathered) if g.path in split]
      outside = [g for g in gathered if not g.path.startswith("layers/") and g.path in split and g.path not in time_in]
      add("all-gather", ("fsdp",), accum * (2 * len(in_layers) * layers + len(outside) + 2),
          accum * (2 * sum(g.bytes_per_device for g in in_layers) + sum(g.bytes_per_device for g in outside)
                   + b * fsdp * (FREQUENCIES + c.d_model) * act))
      add("all-to-all", ("fsdp",), accum * 5, accum * 5 * b * c.d_model * act)
    if tensor > 1:
      forward = 2 * layers * (2 if c.remat == "full" else 1)
      add("all-reduce", ("tensor",), accum * (forward + 2 * layers + 1), accum * (forward + 4 * layers) * bld)
    return out
