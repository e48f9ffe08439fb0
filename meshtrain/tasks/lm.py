"""The language-model task: a causal Llama-style transformer (optionally mixture-of-experts), next-token
cross-entropy, evaluation in bits per byte. The contract it implements is in meshtrain/tasks/__init__.py.

Everything here that depends on the mesh is model-specific: the pipeline settings the model is built with, the
attention kernel for the platform, the zigzag token order of context parallelism, and the rejections of
combinations the model cannot run (`check_parallelism`, also used by `python -m meshtrain.plan` to skip them).
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from meshtrain import config as config_lib, perf
from meshtrain.errors import UserError
from meshtrain.models import attention, moe
from meshtrain.models.llama import ModelConfig, Transformer
from meshtrain.parallel import context


def pipeline_repeats(cfg, stages: int) -> int:
  """Passes through the stages: pipeline.repeats under the circular schedule with stages, else one (config.validate
  refuses repeats > 1 without circular; with one stage there is no pipeline)."""
  return cfg.pipeline.repeats if stages > 1 and cfg.pipeline.schedule == "circular" else 1


def check_parallelism(cfg, sizes: dict[str, int], microbatches: int | None = None) -> None:
  """Refuses (UserError) the mesh axis `sizes` (name -> total size) this model cannot run with. The one place these
  rules live: the layout calls it before building anything, the planner to skip such layouts (with its own
  `microbatches`, default pipeline.microbatches)."""
  stages, shards, p, m = sizes.get("stage", 1), sizes.get("sequence", 1), cfg.pipeline, cfg.model
  microbatches = p.microbatches if microbatches is None else microbatches
  repeats = pipeline_repeats(cfg, stages)
  if m.num_layers % (stages * repeats):
    raise UserError(f"model.num_layers={m.num_layers} cannot be split into mesh.stage={stages} x "
                    f"pipeline.repeats={repeats} equal layer groups; use sizes whose product divides the layer count")
  if stages > 1 and m.num_experts:
    raise UserError("pipeline stages (mesh.stage > 1) with a mixture-of-experts model are not supported: the "
                    "router's auxiliary loss is not carried through the pipeline; use mesh.stage=1")
  if shards > 1 and m.num_experts and cfg.sharding.causal_load_balance:
    raise UserError("a mixture-of-experts model under context parallelism (mesh.sequence > 1) needs "
                    "--config.sharding.causal_load_balance=false: expert capacity is given out in token order, so "
                    "the zigzag order would drop different tokens than one device does")
  if stages > 1 and shards > 1:
    raise UserError("pipeline stages (mesh.stage > 1) with context parallelism (mesh.sequence > 1) are not "
                    "supported: ring attention's shard_map cannot run inside the pipeline's stage vmap; use one of them")
  if stages > 1 and p.schedule == "circular" and microbatches < stages:
    raise UserError(f"the circular schedule needs pipeline.microbatches >= mesh.stage ({microbatches} < {stages})")
  if shards > 1:
    chunks = 2 * shards if cfg.sharding.causal_load_balance else shards
    if cfg.seq_len % chunks:
      raise UserError(f"seq_len={cfg.seq_len} must be divisible by {chunks} to split it over mesh.sequence={shards}"
                      + (" in zigzag order (2 chunks per device)" if cfg.sharding.causal_load_balance else ""))


class LmTask:
  kind = "lm"
  shape_fields = config_lib.SHAPE_FIELDS
  throughput_key = "tokens_per_sec"

  def __init__(self, cfg, mesh, platform: str | None = None):
    check_parallelism(cfg, dict(mesh.shape))
    stages, shards, p, m = mesh.shape["stage"], mesh.shape["sequence"], cfg.pipeline, cfg.model
    device = mesh.devices.flat[0]
    impl = attention.resolve(m.attention, platform or device.platform, m.dtype, m.head_dim, m.num_heads,
                             m.num_kv_heads, getattr(device, "compute_capability", None))
    model_cfg = dataclasses.replace(ModelConfig.from_config(m), pipeline_stages=stages,
                                    pipeline_microbatches=p.microbatches if stages > 1 else 1,
                                    pipeline_schedule=p.schedule, pipeline_repeats=pipeline_repeats(cfg, stages),
                                    attention=impl)
    self.cfg = cfg
    self.model = Transformer(model_cfg)
    self.units_per_example = cfg.seq_len
    # Column permutation fed to the model (context-parallel causal load balance), or None.
    self.token_order = None
    if shards > 1 and cfg.sharding.causal_load_balance:
      self.token_order = context.zigzag_permutation(cfg.seq_len, shards)[0]

  @property
  def layer_order(self) -> str:
    """How the stacked layer axis is ordered in the parameters (and checkpoints): the circular pipeline stores
    layers stage-major, so its checkpoints only fit a run with the same stages and repeats."""
    c = self.model.cfg
    if c.pipeline_stages > 1 and c.pipeline_schedule == "circular" and c.pipeline_repeats > 1:
      return f"circular(stages={c.pipeline_stages}, repeats={c.pipeline_repeats})"
    return "sequential"

  def batch_spec(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    return {k: jax.ShapeDtypeStruct((batch_size, self.cfg.seq_len), jnp.int32) for k in ("inputs", "targets")}

  def batch_axes(self) -> dict[str, tuple[str | None, ...]]:
    return {k: ("act_batch", "act_len") for k in ("inputs", "targets")}

  def init_args(self, batch_size: int) -> tuple:
    return (jnp.zeros((batch_size, self.cfg.seq_len), jnp.int32),)

  def loss(self, params, batch):
    """Summed next-token cross-entropy over the targets >= 0 (`step.IGNORE_ID` and below are skipped), plus the MoE
    auxiliary loss (a mean, so weighted by the token count) in the objective; aux holds the cross-entropy sum, the
    number of those targets and the router statistics as moe_* ({} for a dense model).
    `token_order` (a permutation of the columns, or None) feeds the model its tokens in that order with those
    positions, and permutes the targets alike: the summed loss is unchanged, only the layout of work differs.
    """
    inputs_BL, targets_BL = batch["inputs"], batch["targets"]
    if self.token_order is not None:
      inputs_BL, targets_BL = inputs_BL[:, self.token_order], targets_BL[:, self.token_order]
      logits_BLV, state = self.model.apply({"params": params}, inputs_BL, jnp.asarray(self.token_order),
                                           mutable=["moe"])
    else:
      logits_BLV, state = self.model.apply({"params": params}, inputs_BL, mutable=["moe"])
    logz_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
    valid_BL = targets_BL >= 0  # IGNORE_ID and below are not tokens
    # Ignored targets read id 0's logit (an in-range index) and are then weighted by zero.
    safe_targets_BL = jnp.where(valid_BL, targets_BL, 0)
    target_logit_BL = jnp.take_along_axis(logits_BLV, safe_targets_BL[..., None], axis=-1)[..., 0]
    weight_BL = valid_BL.astype(jnp.float32)
    loss_sum, count = jnp.sum((logz_BL - target_logit_BL) * weight_BL), jnp.sum(weight_BL)
    moe_values = moe.collect(state["moe"]) if state.get("moe") else {}
    objective = loss_sum + moe_values.get("aux_loss", 0.0) * count
    return objective, {"loss_sum": loss_sum, "count": count, **{f"moe_{k}": v for k, v in moe_values.items()}}

  def eval_extra(self, tokenizer) -> np.ndarray:
    """The eval step's bytes-per-id table: the tokenizer's `token_bytes()` zero-padded to model.vocab_size (ids the
    tokenizer never emits stand for no text). Without a tokenizer, all zeros: the compile-time template, and an
    evaluation without bits per byte."""
    vocab = self.cfg.model.vocab_size
    token_bytes = np.asarray(tokenizer.token_bytes() if tokenizer is not None else [], np.int32)
    if len(token_bytes) > vocab:
      raise UserError(f"model.vocab_size={vocab} is smaller than the tokenizer's vocabulary of {len(token_bytes)} "
                      f"ids; set --config.model.vocab_size={len(token_bytes)} or more")
    table = np.zeros(vocab, np.int32)
    table[:len(token_bytes)] = token_bytes
    return table

  def eval_sums(self, params, batch, token_bytes_V):
    """Sums for validation: cross-entropy (nats), target tokens, and the UTF-8 bytes those targets stand for.

    `token_bytes_V` (int32[model vocab], `eval_extra`) holds the bytes of each id's text (0 for specials):
    loss_sum / bytes / ln 2 is bits per byte, which compares across tokenizers where the loss per token does not.
    """
    _, aux = self.loss(params, batch)
    targets_BL = batch["targets"]
    valid_BL = targets_BL >= 0  # IGNORE_ID and below are not tokens
    bytes_BL = jnp.where(valid_BL, token_bytes_V[jnp.where(valid_BL, targets_BL, 0)], 0)
    # float32 sums are exact up to 2^24 bytes per eval step; that is 16 MB of text in one micro-batch.
    return {"loss_sum": aux["loss_sum"], "tokens": aux["count"], "bytes": jnp.sum(bytes_BL.astype(jnp.float32))}

  def eval_record(self, sums: dict) -> dict[str, float]:
    """Loss per token, and bits per byte where the data is text (synthetic ids stand for no bytes)."""
    record = {"eval_loss": float(sums["loss_sum"] / sums["tokens"])}
    if sums["bytes"] > 0 and self.cfg.data.name != "synthetic":
      record["eval_bits_per_byte"] = float(sums["loss_sum"] / sums["bytes"] / math.log(2))
    return record

  def eval_message(self, record: dict) -> str:
    """What the loop prints after an evaluation (after "step N: ")."""
    return (f"eval loss {record['eval_loss']:.4f}"
            + (f", {record['eval_bits_per_byte']:.3f} bits/byte" if "eval_bits_per_byte" in record else ""))

  def flops_per_example(self, table) -> float:
    """Model FLOPs of one sequence: perf.model_flops (per token: 6 x matmul parameters + causal attention) x seq_len."""
    return perf.model_flops(self.cfg, table) * self.cfg.seq_len
