"""Pure step functions: loss, train step (with gradient accumulation), eval step.

No I/O, no config objects, no Python-side state: everything a step needs is an argument, so `train.py` can
jit them with explicit shardings and donate the state.
"""
from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from meshtrain.models import moe

# A target id below zero is not a token: the loss and evaluation skip it. The data pipeline gives padding this
# target, and a fine-tuning source gives it to the prompt tokens whose prediction is not trained. The inputs at
# such positions are real ids (the tokenizer's pad id), since the model embeds every input.
IGNORE_ID = -1


class TrainState(flax.struct.PyTreeNode):
  step: jax.Array  # int32 scalar: steps taken so far (the data position), skipped updates included
  params: Any
  opt_state: Any
  nonfinite_steps: jax.Array  # int32: steps whose loss or gradients were not finite (their update was dropped)
  last_nonfinite_step: jax.Array  # int32: the latest such step, 0 if none

  @classmethod
  def create(cls, params, opt_state) -> "TrainState":
    zero = jnp.zeros((), jnp.int32)
    return cls(step=zero, params=params, opt_state=opt_state, nonfinite_steps=zero, last_nonfinite_step=zero)


def loss_sums(params, batch, *, apply_fn: Callable, token_order=None):
  """Summed next-token cross-entropy over the targets >= 0, the number of those targets, and MoE values.

  Returns (objective, (loss_sum, count, moe)): the objective adds the MoE auxiliary loss (a mean, so weighted by
  the token count) to the cross-entropy sum; `moe` holds the router statistics ({} for a dense model).
  `token_order` (a permutation of the columns, or None) feeds the model its tokens in that order with those
  positions, and permutes the targets alike: the summed loss is unchanged, only the layout of work differs.
  """
  inputs_BL, targets_BL = batch["inputs"], batch["targets"]
  if token_order is not None:
    inputs_BL, targets_BL = inputs_BL[:, token_order], targets_BL[:, token_order]
    logits_BLV, state = apply_fn({"params": params}, inputs_BL, jnp.asarray(token_order), mutable=["moe"])
  else:
    logits_BLV, state = apply_fn({"params": params}, inputs_BL, mutable=["moe"])
  logz_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
  valid_BL = targets_BL >= 0
  # Ignored targets read id 0's logit (an in-range index) and are then weighted by zero.
  safe_targets_BL = jnp.where(valid_BL, targets_BL, 0)
  target_logit_BL = jnp.take_along_axis(logits_BLV, safe_targets_BL[..., None], axis=-1)[..., 0]
  weight_BL = valid_BL.astype(jnp.float32)
  loss_sum, count = jnp.sum((logz_BL - target_logit_BL) * weight_BL), jnp.sum(weight_BL)
  moe_values = moe.collect(state["moe"]) if state.get("moe") else {}
  objective = loss_sum + moe_values.get("aux_loss", 0.0) * count
  return objective, (loss_sum, count, moe_values)


def train_step(state: TrainState, batch, *, apply_fn, tx: optax.GradientTransformation, schedule: optax.Schedule,
               accum_steps: int = 1, nan_at_step: int = -1, token_order=None):
  """One optimizer update on a global batch; returns the new state and scalar metrics (left on device).

  A step whose loss or gradients are not finite leaves parameters and optimizer state unchanged (so a NaN state
  can never be saved) and is counted in the state; the host decides whether to stop or carry on.
  `nan_at_step` poisons that step's gradients: fault injection for testing exactly this path.
  """
  grad_fn = jax.value_and_grad(
      lambda p, b: loss_sums(p, b, apply_fn=apply_fn, token_order=token_order), has_aux=True)
  if accum_steps == 1:
    (_, (loss_sum, count, moe_values)), grads = grad_fn(state.params, batch)
  else:
    # Micro-batch a takes rows a, a+A, a+2A, ...: each device keeps its own rows, so splitting needs no traffic.
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
  # Mean over every target token of the global batch, however it was split into micro-batches. Divided in
  # float32 (a bfloat16 count is inexact above 256 tokens) and cast back: a float32 gradient of a bfloat16
  # parameter would make Adam's moments float32, so the returned state would no longer match the compiled
  # input (the second step fails) and every moment would take twice the memory.
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


def eval_step(params, batch, token_bytes_V, *, apply_fn, token_order=None):
  """Sums for validation: cross-entropy (nats), target tokens, and the UTF-8 bytes those targets stand for.

  `token_bytes_V` (int32[model vocab]) holds the bytes of each id's text (0 for specials), from
  `Tokenizer.token_bytes()`: loss_sum / bytes / ln 2 is bits per byte, which compares across tokenizers where
  the loss per token does not.
  """
  _, (loss_sum, count, _) = loss_sums(params, batch, apply_fn=apply_fn, token_order=token_order)
  targets_BL = batch["targets"]
  valid_BL = targets_BL >= 0
  bytes_BL = jnp.where(valid_BL, token_bytes_V[jnp.where(valid_BL, targets_BL, 0)], 0)
  # float32 sums are exact up to 2^24 bytes per eval step; that is 16 MB of text in one micro-batch.
  return {"loss_sum": loss_sum, "tokens": count, "bytes": jnp.sum(bytes_BL.astype(jnp.float32))}
