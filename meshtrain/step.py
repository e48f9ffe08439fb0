"""The pure train step (with gradient accumulation and non-finite protection) and the train state.

No I/O, no config objects, no Python-side state: everything a step needs is an argument (the loss is the task's,
meshtrain/tasks), so `layout.py` can jit it with explicit shardings and donate the state.
"""
from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

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
  # With optimizer.ema_decay > 0: the exponential moving average of the parameters after each update, in float32
  # (a bfloat16 average could not take steps of (1 - decay) x the difference); None without.
  ema_params: Any = None

  @classmethod
  def create(cls, params, opt_state, ema: bool = False) -> "TrainState":
    zero = jnp.zeros((), jnp.int32)
    ema_params = jax.tree.map(lambda p: p.astype(jnp.float32), params) if ema else None
    return cls(step=zero, params=params, opt_state=opt_state, nonfinite_steps=zero, last_nonfinite_step=zero,
               ema_params=ema_params)


def ema_decay_at(decay: float, step):
  """The EMA's decay after update `step` (1, 2, ...): min(decay, (1 + step) / (10 + step)), the warm-up of
  diffusers' EMAModel, so the average follows the fast-moving early parameters instead of holding the init."""
  return jnp.minimum(decay, (1.0 + step) / (10.0 + step))


def _split_aux(aux: dict):
  """A task loss's aux as (loss_sum, count, the other metrics)."""
  extra = {k: v for k, v in aux.items() if k not in ("loss_sum", "count")}
  return aux["loss_sum"], aux["count"], extra


def train_step(state: TrainState, batch, *, loss_fn: Callable, batch_axes: dict, tx: optax.GradientTransformation,
               schedule: optax.Schedule, accum_steps: int = 1, nan_at_step: int = -1, count_name: str = "count",
               ema_decay: float = 0.0):
  """One optimizer update on a global batch; returns the new state and scalar metrics (left on device).

  `loss_fn(params, batch) -> (objective, aux)` is the task's (meshtrain/tasks): the objective is a sum over the
  batch, aux holds its "loss_sum" and "count" and any other scalar metrics. The gradients are divided by the
  step's total count, so gradient accumulation equals one big batch. `batch_axes` (the task's logical axes per
  batch key) keeps each micro-batch on the devices that hold its rows; `count_name` names the count in the
  metrics (the task's unit: "tokens", "images").
  A step whose loss or gradients are not finite leaves parameters and optimizer state unchanged (so a NaN state
  can never be saved) and is counted in the state; the host decides whether to stop or carry on.
  `nan_at_step` poisons that step's gradients: fault injection for testing exactly this path.
  A state with `ema_params` moves them toward the new parameters: ema <- d ema + (1 - d) params, d =
  ema_decay_at(ema_decay, step).
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if accum_steps == 1:
    (_, aux), grads = grad_fn(state.params, batch)
    loss_sum, count, extra = _split_aux(aux)
  else:
    # Micro-batch a takes rows a, a+A, a+2A, ...: each device keeps its own rows, so splitting needs no traffic.
    def split(x_B, axes):
      x_AB = x_B.reshape(x_B.shape[0] // accum_steps, accum_steps, *x_B.shape[1:]).swapaxes(0, 1)
      return nn.with_logical_constraint(x_AB, (None, *axes))

    def accumulate(carry, micro):
      (_, aux), grads = grad_fn(state.params, micro)
      loss_sum, count, extra = _split_aux(aux)
      return jax.tree.map(jnp.add, carry, (loss_sum, count, grads)), extra

    zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, state.params))
    micro_batches = {k: split(x, batch_axes[k]) for k, x in batch.items()}
    (loss_sum, count, grads), extra = jax.lax.scan(accumulate, zeros, micro_batches)
    extra = jax.tree.map(jnp.mean, extra)
  step = state.step + 1
  if nan_at_step >= 0:
    poison = jnp.where(step == nan_at_step, jnp.nan, 1.0)
    loss_sum, grads = loss_sum * poison, jax.tree.map(lambda g: g * poison, grads)
  # Mean over every counted unit (target token, image) of the global batch, however it was split into
  # micro-batches. Divided in float32 (a bfloat16 count is inexact above 256 tokens) and cast back: a float32
  # gradient of a bfloat16 parameter would make Adam's moments float32, so the returned state would no longer
  # match the compiled input (the second step fails) and every moment would take twice the memory.
  grads = jax.tree.map(lambda g: (g / count).astype(g.dtype), grads)
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
  ema_params = state.ema_params
  if ema_params is not None:
    d = ema_decay_at(ema_decay, step)
    ema_params = keep(jax.tree.map(lambda e, p: d * e + (1 - d) * p.astype(jnp.float32), ema_params, params),
                      ema_params)
  state = state.replace(step=step, params=keep(params, state.params), opt_state=keep(opt_state, state.opt_state),
                        ema_params=ema_params,
                        nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32),
                        last_nonfinite_step=jnp.where(finite, state.last_nonfinite_step, step))
  metrics = {"loss": loss_sum / count, "grad_norm": grad_norm, "learning_rate": schedule(step - 1),
             count_name: count, "nonfinite_steps": state.nonfinite_steps,
             "last_nonfinite_step": state.last_nonfinite_step, **extra}
  return state, metrics

