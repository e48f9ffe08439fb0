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
import jax
import jax.numpy as jnp

from meshtrain.errors import UserError
from meshtrain.models.dit import FREQUENCIES, MOD_BLOCK, MOD_FINAL, DiT, DiTConfig


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
  T, X, D, F, Q = c.tokens, c.patch_dim, c.d_model, c.mlp_dim, FREQUENCIES
  block = 2 * D * MOD_BLOCK * D + 2 * T * 4 * D * D + 4 * T * T * D + 2 * T * 2 * D * F
  forward = (2 * T * X * D + 2 * (Q * D + D * D) + c.num_layers * block
             + 2 * D * MOD_FINAL * D + 2 * T * D * X)
  return 3.0 * forward


class DitTask:
  """The Task contract (meshtrain/tasks/__init__.py) for a DiT on class-labelled images."""

  kind = "dit"
  shape_fields = ("image_size", "channels", "patch_size", "num_classes", "d_model", "num_layers", "num_heads",
                  "mlp_dim", "param_dtype")
  throughput_key = "images_per_sec"
  units_per_example = 1

  def __init__(self, cfg, mesh, platform: str | None = None):
    del platform  # one attention implementation (plain einsums over T ~ 16 tokens) on every platform
    shape = dict(mesh.shape)
    if shape.get("sequence", 1) > 1:
      raise UserError(f"mesh.sequence={shape['sequence']} splits the token sequence over devices, but a DiT "
                      f"attends over an image's {self._tokens(cfg)} patches at once and has no sequence-split "
                      "attention; set mesh.sequence=1 and put the devices on mesh.data or mesh.fsdp")
    if shape.get("stage", 1) > 1:
      raise UserError(f"mesh.stage={shape['stage']}: pipeline stages are not supported for DiT (its blocks also "
                      "take the per-image condition, which the pipeline does not carry); set mesh.stage=1 and use "
                      "mesh.data, mesh.fsdp or mesh.tensor")
    self.cfg = cfg
    self.model_cfg = DiTConfig.from_config(cfg.model)
    self.model = DiT(self.model_cfg)

  @staticmethod
  def _tokens(cfg) -> int:
    return (cfg.model.image_size // cfg.model.patch_size) ** 2

  def batch_spec(self, batch_size: int) -> dict:
    c = self.model_cfg
    return {"images": jax.ShapeDtypeStruct((batch_size, c.image_size, c.image_size, c.channels), jnp.float32),
            "labels": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
            "seeds": jax.ShapeDtypeStruct((batch_size,), jnp.uint32)}

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

  def hooks(self, run) -> list:
    """At eval_every: a sample grid (WORKDIR/samples, TensorBoard) and its quality (meshtrain/sample.py); none
    when eval_every=0, which turns evaluation off."""
    del run
    from meshtrain import sample as sample_cli  # pylint: disable=g-import-not-at-top  # it imports this module
    return [sample_cli.SampleHook(self.cfg)] if self.cfg.eval_every else []

  def sample(self, params, labels_N, noise_NHWC, steps: int, guidance):
    """`sample` with this task's model."""
    return sample(self.model, params, labels_N, noise_NHWC, steps, guidance)

