"""The optimizer: AdamW with linear warmup + cosine decay and global-norm clipping (all Optax)."""
import jax
import optax


def learning_rate_schedule(opt_cfg, steps: int) -> optax.Schedule:
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=opt_cfg.learning_rate, warmup_steps=opt_cfg.warmup_steps,
      decay_steps=max(steps, opt_cfg.warmup_steps + 1), end_value=opt_cfg.learning_rate * opt_cfg.min_lr_ratio)


def decay_mask(params):
  """True for the leaves weight decay applies to: every matrix, never a norm scale.

  Decided by name, not by rank, because under scan the norm scales are stacked into [layers, D] matrices.
  """
  def is_decayed(path, _):
    return not any("norm" in str(getattr(k, "key", k)) for k in path)
  return jax.tree_util.tree_map_with_path(is_decayed, params)


def make_optimizer(opt_cfg, steps: int) -> optax.GradientTransformation:
  parts = [optax.clip_by_global_norm(opt_cfg.grad_clip)] if opt_cfg.grad_clip > 0 else []
  parts.append(optax.adamw(learning_rate_schedule(opt_cfg, steps), b1=opt_cfg.b1, b2=opt_cfg.b2, eps=opt_cfg.eps,
                           weight_decay=opt_cfg.weight_decay, mask=decay_mask))
  return optax.chain(*parts)
