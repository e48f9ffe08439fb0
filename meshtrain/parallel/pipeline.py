"""Pipeline parallelism over the `stage` mesh axis for a stack of identical blocks (Flax Linen).

Shape letters: S stages, R passes (circular schedule), M microbatches, B batch, b = B / M microbatch rows,
L length, D model width, N layers, P = N / (S*R) layers per stage and pass, T = R*M + S - 1 loop iterations.

Shift-register form (as in praxis/MaxText): every iteration each stage runs its layers on its slot of an
activation buffer [S, b, L, D]; the buffer then rolls by one stage (XLA makes the roll a collective-permute
when the stage dimension is sharded), stage 0 takes the next microbatch, and the last stage's result leaves
the pipe. Gradients come from autodiff through the loop, so the schedule is GPipe: all forwards, then all
backwards; each stage keeps the residuals of every microbatch it ran (M microbatches' activations of its
layers; remat the block to keep only each block's input).

Circular (interleaved) schedule: R passes through the stages, stage s running layers (r*S + s)*P .. in pass r,
so an iteration does 1/R of a GPipe iteration's work and the bubble shrinks R-fold. A microbatch leaving the
last stage re-enters stage 0 M iterations after it first did, which needs M >= S.

Parameters: exactly the tree of llama's `nn.scan` stack, leaves [N, ...] with logical axis "layers" first;
the rules map "layers" (and the activation buffer's "act_stage") to the stage axis, so each device holds its
stage's consecutive layers, and the reshape to [S, N/S, ...] inside is free. For GPipe the storage order is the
layer order: checkpoints move between pipelined and unpipelined models as they are. The circular schedule
stores its layers stage-major (stage s's P*R layers together); `to_pipeline_params` / `from_pipeline_params`
convert. The module never names a mesh axis.
"""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from meshtrain import sharding
from meshtrain.errors import UserError

SCHEDULES = ("gpipe", "circular")


def pipeline_repeats(cfg, stages: int) -> int:
  """Passes through the stages: pipeline.repeats under the circular schedule with stages, else one (config.validate
  refuses repeats > 1 without circular; with one stage there is no pipeline)."""
  return cfg.pipeline.repeats if stages > 1 and cfg.pipeline.schedule == "circular" else 1


def bubble_fraction(num_stages: int, num_microbatches: int, num_repeats: int = 1) -> float:
  """Idle fraction of each stage: (S-1) / (R*M + S-1). R = 1 is GPipe; the circular schedule divides the
  per-iteration work by R, so the same S-1 fill/drain iterations cost R times less."""
  S, M, R = num_stages, num_microbatches, num_repeats
  return (S - 1) / (R * M + S - 1)


def _circular_order(x_N, num_stages: int, num_repeats: int, inverse: bool = False):
  """Layer order -> stage-major storage order (circular schedule) along the leading axis, or back."""
  N, S, R = x_N.shape[0], num_stages, num_repeats
  src = (R, S) if not inverse else (S, R)
  return x_N.reshape(src + (N // (S * R),) + x_N.shape[1:]).swapaxes(0, 1).reshape(x_N.shape)


def to_pipeline_params(stack_params, num_stages: int, num_repeats: int = 1):
  """Unboxed scanned-stack parameters [N, ...] -> the pipeline's storage order (the same for GPipe)."""
  return jax.tree.map(lambda a: _circular_order(a, num_stages, num_repeats), stack_params)


def from_pipeline_params(pipe_params, num_stages: int, num_repeats: int = 1):
  """Unboxed pipeline parameters (or their gradients) -> the scanned-stack layer order."""
  return jax.tree.map(lambda a: _circular_order(a, num_stages, num_repeats, inverse=True), pipe_params)


class Pipeline(nn.Module):
  """x [B, L, D] (and `extra`, given unchanged to every block, e.g. positions) -> [B, L, D] through
  cfg.num_layers blocks, pipelined over stages.

  `block` is a Linen module class built as `block(cfg)` with `__call__(x_BLD, extra) -> (x_BLD, None)` (llama's
  `Block`, possibly `nn.remat`-wrapped). Microbatch m holds rows m, m+M, m+2M, ...: a batch sharded in
  contiguous row blocks then keeps its sharding in every microbatch, as long as B/M is divisible by the number
  of batch shards. Stages and microbatches default to cfg.pipeline_stages / cfg.pipeline_microbatches.
  Collections a block sows (the MoE "moe" statistics) are not collected through the pipeline.
  """
  block: Any
  cfg: Any
  num_stages: int | None = None
  num_microbatches: int | None = None
  schedule: str = "gpipe"
  num_repeats: int = 1  # passes through the stages; circular schedule only

  @property
  def stages(self) -> int:
    return self.num_stages or self.cfg.pipeline_stages

  @property
  def microbatches(self) -> int:
    return self.num_microbatches or self.cfg.pipeline_microbatches

  @property
  def layers_per_stage(self) -> int:
    """Layers each stage runs per pass."""
    return self.cfg.num_layers // (self.stages * self.num_repeats)

  def _layers(self, length):
    # "moe": 0 as in llama's stack, so a block that sows its router statistics can be initialised.
    return nn.scan(self.block, variable_axes={"params": 0, "moe": 0}, split_rngs={"params": True},
                   in_axes=nn.broadcast, length=length, metadata_params={nn.PARTITION_NAME: "layers"})

  def setup(self):
    # The parameters are created by the same scan as the unpipelined stack, in this module's own scope, so the
    # two trees are identical.
    self.stack = self._layers(self.cfg.num_layers)(self.cfg)
    nn.share_scope(self, self.stack)

  def _check(self, batch):
    S, M, R, N = self.stages, self.microbatches, self.num_repeats, self.cfg.num_layers
    if self.schedule not in SCHEDULES:
      raise UserError(f"pipeline schedule {self.schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    if self.schedule == "gpipe" and R != 1:
      raise UserError(f"num_repeats={R} needs schedule='circular'; GPipe makes one pass (num_repeats=1)")
    if N % (S * R):
      raise UserError(f"num_layers={N} is not divisible by stages x passes = {S} x {R}; choose stages and "
                      f"passes whose product divides the layer count")
    if batch % M:
      raise UserError(f"batch {batch} is not divisible by pipeline microbatches={M}; use a batch that is a "
                      f"multiple of {M} or fewer microbatches")
    if R > 1 and M < S:
      raise UserError(f"the circular schedule needs microbatches >= stages (got M={M}, S={S}): a microbatch "
                      f"re-enters stage 0 M iterations after it left it, and the pipe is S deep")

  def __call__(self, x_BLD, extra=None):
    c, S, M, R, P = self.cfg, self.stages, self.microbatches, self.num_repeats, self.layers_per_stage
    B, L, D = x_BLD.shape
    self._check(B)
    if self.is_initializing():  # creates the parameters with far less to compile (init's output is dropped)
      return self.stack(x_BLD, extra)[0]
    b = B // M
    # Row r of the batch is row r // M of microbatch r % M (see the class docstring).
    x_MbLD = x_BLD.reshape(b, M, L, D).transpose(1, 0, 2, 3)
    # [N, ...] -> [S, R, P, ...]: consecutive storage blocks are stages, so this is local to each device.
    w = jax.tree.map(lambda a: a.reshape((S, R, P) + a.shape[1:]), nn.meta.unbox(self.variables["params"]))
    if R == 1:
      w = jax.tree.map(lambda a: a[:, 0], w)

    layers = self._layers(P)
    run_layers = lambda w_, x_bLD: layers(c, parent=None).apply({"params": w_}, x_bLD, extra)[0]
    # spmd_axis_name keeps the stage dimension of the constraints inside the block on its mesh axes (without
    # it vmap leaves that dimension unconstrained for the partitioner to guess).
    run_stages = jax.vmap(run_layers, spmd_axis_name=sharding.active_mesh_axes("act_stage") or None)
    buffer_names = ("act_stage", "act_batch", "act_res_len", "act_embed")
    stage_S = jnp.arange(S)
    # Per-stage copies of the microbatch store: stage 0 reads its inputs there and the pipe's outputs are written
    # back there, so neither needs a transfer between stages inside the loop. Only stage 0's row is used.
    store_SMbLD = jnp.broadcast_to(x_MbLD, (S, M, b, L, D))
    store_SMbLD = nn.with_logical_constraint(store_SMbLD, ("act_stage", None) + buffer_names[1:])
    out_SbLD = nn.with_logical_constraint(jnp.zeros((S, b, L, D), x_BLD.dtype), buffer_names)

    def tick(carry, t):
      out_SbLD, store_SMbLD = carry
      in_SbLD = nn.with_logical_constraint(jnp.roll(out_SbLD, 1, axis=0), buffer_names)
      # What reached stage 0 is the last stage's output for microbatch t-S: keep it for its next pass (or as
      # the result). Before iteration S it is fill garbage, and its slot still holds an unread input.
      slot = (t - S) % M
      old_SbLD = jax.lax.dynamic_index_in_dim(store_SMbLD, slot, axis=1, keepdims=False)
      store_SMbLD = jax.lax.dynamic_update_index_in_dim(
          store_SMbLD, jnp.where(t >= S, in_SbLD, old_SbLD), slot, axis=1)
      fresh_SbLD = jax.lax.dynamic_index_in_dim(store_SMbLD, t % M, axis=1, keepdims=False)
      in_SbLD = jnp.where((stage_S == 0)[:, None, None, None], fresh_SbLD, in_SbLD)
      if R > 1:  # each stage's pass at iteration t; outside [0, R) the slot holds fill/drain garbage
        r_S = jnp.clip((t - stage_S) // M, 0, R - 1)
        w_S = jax.tree.map(lambda a: jax.vmap(lambda a_R, r: a_R[r])(a, r_S), w)
      else:
        w_S = w
      out_SbLD = nn.with_logical_constraint(run_stages(w_S, in_SbLD), buffer_names)
      return (out_SbLD, store_SMbLD), None

    T = R * M + S - 1
    (out_SbLD, store_SMbLD), _ = jax.lax.scan(tick, (out_SbLD, store_SMbLD), jnp.arange(T))
    # The last iteration's output (microbatch M-1, last pass) has not gone round yet. A select, not
    # `.at[M - 1].set`: that form gave wrong gradients on a stage-sharded mesh (XLA CPU, jax 0.10.2).
    last_M = (jnp.arange(M) == M - 1)[:, None, None, None]
    y_MbLD = jnp.where(last_M, out_SbLD[S - 1][None], store_SMbLD[0])
    y_BLD = y_MbLD.transpose(1, 0, 2, 3).reshape(B, L, D)
    return nn.with_logical_constraint(y_BLD, ("act_batch", "act_res_len", "act_embed"))
