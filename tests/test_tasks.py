"""The task interface: the language model as a task compiles exactly the program it compiled before tasks existed,
and config validation per task (task=lm, task=dit) says what to fix."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain import config as config_lib, layout as layout_lib, mesh as mesh_lib
from meshtrain.errors import UserError
from meshtrain.models import moe
from meshtrain.runtime import host
from meshtrain.tasks import dit_config as dit_fields


# --- The language model's train step before the task interface (meshtrain/step.py at commit 8aea0d2), verbatim
# but for names: the reference the task-based step must lower to, character for character. ---
def reference_loss_sums(params, batch, *, apply_fn, token_order=None):
  inputs_BL, targets_BL = batch["inputs"], batch["targets"]
  if token_order is not None:
    inputs_BL, targets_BL = inputs_BL[:, token_order], targets_BL[:, token_order]
    logits_BLV, state = apply_fn({"params": params}, inputs_BL, jnp.asarray(token_order), mutable=["moe"])
  else:
    logits_BLV, state = apply_fn({"params": params}, inputs_BL, mutable=["moe"])
  logz_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
  valid_BL = targets_BL >= 0
  safe_targets_BL = jnp.where(valid_BL, targets_BL, 0)
  target_logit_BL = jnp.take_along_axis(logits_BLV, safe_targets_BL[..., None], axis=-1)[..., 0]
  weight_BL = valid_BL.astype(jnp.float32)
  loss_sum, count = jnp.sum((logz_BL - target_logit_BL) * weight_BL), jnp.sum(weight_BL)
  moe_values = moe.collect(state["moe"]) if state.get("moe") else {}
  objective = loss_sum + moe_values.get("aux_loss", 0.0) * count
  return objective, (loss_sum, count, moe_values)


def train_step(state, batch, *, apply_fn, tx, schedule, accum_steps=1, nan_at_step=-1, token_order=None):
  grad_fn = jax.value_and_grad(
      lambda p, b: reference_loss_sums(p, b, apply_fn=apply_fn, token_order=token_order), has_aux=True)
  if accum_steps == 1:
    (_, (loss_sum, count, moe_values)), grads = grad_fn(state.params, batch)
  else:
    def split(x_BL):
      x_ABL = x_BL.reshape(x_BL.shape[0] // accum_steps, accum_steps, *x_BL.shape[1:]).swapaxes(0, 1)
      return nn.with_logical_constraint(x_ABL, (None, "act_batch", "act_len"))

    def accumulate(carry, micro):
      (_, (loss_sum, count, moe_values)), grads = grad_fn(state.params, micro)
      return jax.tree.map(jnp.add, carry, (loss_sum, count, grads)), moe_values

    zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, state.params))
    (loss_sum, count, grads), moe_values = jax.lax.scan(accumulate, zeros, jax.tree.map(split, batch))
    moe_values = jax.tree.map(jnp.mean, moe_values)
  step = state.step + 1
  if nan_at_step >= 0:
    poison = jnp.where(step == nan_at_step, jnp.nan, 1.0)
    loss_sum, grads = loss_sum * poison, jax.tree.map(lambda g: g * poison, grads)
  grads = jax.tree.map(lambda g: (g / count).astype(g.dtype), grads)
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  state = state.replace(step=step, params=keep(params, state.params), opt_state=keep(opt_state, state.opt_state),
                        nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32),
                        last_nonfinite_step=jnp.where(finite, state.last_nonfinite_step, step))
  metrics = {"loss": loss_sum / count, "grad_norm": grad_norm, "learning_rate": schedule(step - 1), "tokens": count,
             "nonfinite_steps": state.nonfinite_steps, "last_nonfinite_step": state.last_nonfinite_step,
             **{f"moe_{k}": v for k, v in moe_values.items()}}
  return state, metrics


def reference_lowered_text(layout) -> str:
  """The pre-task step lowered with the layout's shardings, as layout.lower_train_step lowered it then."""
  fn = functools.partial(train_step, apply_fn=layout.model.apply, tx=layout.tx, schedule=layout.schedule,
                         accum_steps=layout.cfg.optimizer.grad_accum_steps,
                         nan_at_step=layout.cfg.faults.nan_at_step, token_order=layout.task.token_order)
  with layout.context():
    return jax.jit(fn, in_shardings=(layout.state_sharding, layout.batch_sharding),
                   out_shardings=(layout.state_sharding, NamedSharding(layout.mesh, P())), donate_argnums=0,
                   ).trace(layout.state_abstract, layout.batch_abstract(layout.cfg.batch_size)).lower().as_text()


LAYOUTS = {  # every branch of the LM's step: accumulation, fsdp x tensor, zigzag context parallelism, stages, MoE
    "dp": [],
    "accum2": ["--config.optimizer.grad_accum_steps=2"],
    "fsdp_tp": ["--config.mesh.data=1", "--config.mesh.fsdp=4", "--config.mesh.tensor=2"],
    "sequence2": ["--config.mesh.data=4", "--config.mesh.sequence=2"],
    "stage2_circular": ["--config.mesh.data=4", "--config.mesh.stage=2", "--config.pipeline.microbatches=2",
                        "--config.pipeline.schedule=circular", "--config.pipeline.repeats=2",
                        "--config.model.num_layers=4"],
    "moe_expert2": ["--config.model.num_experts=4", "--config.model.experts_per_token=2", "--config.mesh.data=4",
                    "--config.mesh.expert=2", "--config.faults.nan_at_step=3"],
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_lm_task_lowers_to_the_pre_task_program(name):
  cfg = config_lib.load("configs/tiny.py", ["--config.model.num_layers=2", *LAYOUTS[name]])
  layout = layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh))
  assert layout.lower_train_step().as_text() == reference_lowered_text(layout)


def test_layout_batch_shardings_come_from_the_task_axes():
  cfg = config_lib.load("configs/tiny.py", ["--config.mesh.data=4", "--config.mesh.sequence=2"])
  layout = layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh))
  assert set(layout.batch_shardings) == {"inputs", "targets"}
  # act_batch over data, act_len over sequence: one sharding for both keys, which data.Batches takes as it is.
  assert layout.batch_sharding.spec == P("data", "sequence") and layout.task.units_per_example == cfg.seq_len
  assert {k: a.shape for k, a in layout.batch_abstract(8).items()} == {"inputs": (8, 128), "targets": (8, 128)}


# --- Config validation per task ---
def dit_config(**model):
  """base_config() with a DiT model group of the contract's fields (meshtrain/models/presets.dit_model_config)."""
  cfg = config_lib.base_config()
  cfg.task = "dit"
  cfg.model = ml_collections.ConfigDict(dict(
      preset="digits", image_size=8, channels=1, patch_size=2, num_classes=10, num_layers=2, d_model=64,
      num_heads=4, mlp_dim=256, class_dropout=0.1, init_std=0.02, dtype="float32", param_dtype="float32",
      remat="none") | model)
  return cfg


def test_a_valid_dit_config_passes_and_lm_only_fields_are_not_checked():
  cfg = dit_config()
  cfg.seq_len = 0  # a language model's field: meaningless for images, so not refused
  config_lib.validate(cfg)


@pytest.mark.parametrize("change,message", [
    ({"image_size": 9}, "model.image_size=9 is not divisible by model.patch_size=2"),
    ({"d_model": 66}, "model.d_model=66 is not divisible by model.num_heads=4"),
    ({"class_dropout": 1.0}, r"model.class_dropout=1.0 must lie in \[0, 1\)"),
    ({"num_classes": 0}, "'model.num_classes' must be positive, got 0"),
    ({"remat": "save_dots"}, "'model.remat' is 'save_dots'; choose one of none, full"),
])
def test_dit_model_fields_are_checked(change, message):
  with pytest.raises(UserError, match=message):
    config_lib.validate(dit_config(**change))


def test_dit_sampling_and_init_from_are_checked():
  cfg = dit_config()
  cfg.sample.guidance = -1.0
  with pytest.raises(UserError, match="sample.guidance=-1.0 must be >= 0"):
    config_lib.validate(cfg)
  cfg = dit_config()
  cfg.init_from = "runs/x"
  with pytest.raises(UserError, match="task=lm"):
    config_lib.validate(cfg)


def test_task_is_one_of_the_kinds_and_needs_its_model_group():
  cfg = config_lib.base_config()
  cfg.task = "gan"
  with pytest.raises(UserError, match="'task' is 'gan'; choose one of lm, dit"):
    config_lib.validate(cfg)
  cfg.task = "dit"  # with the language model's model group
  with pytest.raises(UserError, match="task=dit needs a diffusion-transformer model group"):
    config_lib.validate(cfg)


def test_batch_memory_check_counts_images_for_dit():
  cfg = dit_config()
  cfg.batch_size = 1024
  row = 8 * 8 * 1 * dit_fields.BATCH_BUFFER_BYTES_PER_PIXEL + dit_fields.BATCH_BUFFER_BYTES_PER_IMAGE
  host.check_batch_memory(cfg, processes=1, memory=1024 * row)  # exactly fits
  with pytest.raises(UserError, match="batch_size=1024 images of 8x8x1"):
    host.check_batch_memory(cfg, processes=1, memory=1024 * row - 1)
  cfg.seq_len = 10**9  # the LM's formula would refuse this; images do not have a length
  host.check_batch_memory(cfg, processes=1, memory=1024 * row)
