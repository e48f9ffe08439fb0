"""The language-model task: a causal Llama-style transformer (optionally mixture-of-experts), next-token
cross-entropy, evaluation in bits per byte. The contract it implements is in meshtrain/tasks/__init__.py.

Everything here that depends on the mesh is model-specific: the pipeline settings the model is built with, the
attention kernel for the platform, the zigzag token order of context parallelism, and the rejections of
combinations the model cannot run (`check_parallelism`, also used by `python -m meshtrain.plan` to skip them).
"""
import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from meshtrain import costs, mesh as mesh_lib, sharding
from meshtrain.costs import perf
from meshtrain.errors import UserError
from meshtrain.models import attention, moe
from meshtrain.models.llama import REMAT_POLICIES, Block, ModelConfig, Transformer
from meshtrain.parallel import context
from meshtrain.parallel.pipeline import pipeline_repeats
from meshtrain.tasks import lm_config


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
  if shards > 1 and 0 < m.sliding_window < cfg.seq_len:
    raise UserError(f"model.sliding_window={m.sliding_window} is shorter than seq_len={cfg.seq_len}, and the "
                    f"sequence-split attention (mesh.sequence={shards}) has no sliding window; use mesh.sequence=1 "
                    "or seq_len <= sliding_window")
  if stages > 1 and shards > 1:
    raise UserError("pipeline stages (mesh.stage > 1) with context parallelism (mesh.sequence > 1) are not "
                    "supported: ring attention's shard_map cannot run inside the pipeline's stage vmap; use one of "
                    "them")
  if stages > 1 and p.schedule == "circular" and microbatches < stages:
    raise UserError(f"the circular schedule needs pipeline.microbatches >= mesh.stage ({microbatches} < {stages})")
  if shards > 1:
    chunks = 2 * shards if cfg.sharding.causal_load_balance else shards
    if cfg.seq_len % chunks:
      raise UserError(f"seq_len={cfg.seq_len} must be divisible by {chunks} to split it over mesh.sequence={shards}"
                      + (" in zigzag order (2 chunks per device)" if cfg.sharding.causal_load_balance else ""))


class LmTask:
  kind = "lm"
  shape_fields = lm_config.SHAPE_FIELDS
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
    return flops_per_sequence(self.cfg, table)


def flops_per_sequence(cfg, table) -> float:
  """Model FLOPs of one sequence: perf.model_flops (per token: 6 x matmul parameters + causal attention) x seq_len."""
  return perf.model_flops(cfg, table) * cfg.seq_len


@dataclasses.dataclass(frozen=True)
class LayerStack(costs.BlockStack):
  """The LM's block stack as one device runs it (`CostModel.stack`): what estimate._layer_residuals traces.
  Hashable, so traces are cached per local shape."""
  model: ModelConfig            # heads, kv heads, MLP width and experts as one device of the split holds them
  sequence_parallel: bool       # the residual stream is split over `tensor` too (Megatron sequence parallelism)
  # Its per-layer batch-independent residuals are norm scales, which XLA keeps under FSDP too.
  fixed_are_weights: bool = False

  @property
  def dims(self) -> tuple[int, ...]:
    """Every other dimension of the block's values (the trace's batch must divide none of them)."""
    m = self.model
    return (m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim, m.vocab_size, max(m.num_experts, 1))

  def backward_peak(self, length: int, act: int) -> int:
    """Bytes per sequence one layer's backward holds at its peak beyond the residuals it reads: the peak is in the
    MLP, where the gradients of the gate, up and hidden activations ([l, F] each) are live. Under remat, from XLA's
    buffer assignment at that peak, six [l, F] arrays beside the recomputed forward's residuals: the hidden
    gradient, sigmoid(gate), the three products of the SwiGLU backward and a copy its weight-gradient matmul reads
    (transposed with the sequence split; with the tokens as one axis the transpose is gone and the compiled peak is
    one [l, F] lower, 0.98 predicted / compiled on data=8 with full remat, so the constant stays)."""
    return (3 if self.model.remat == "none" else 6) * length * self.model.mlp_dim * act

  def gradient_jaxpr(self, batch: int, length: int, shards: int):
    """The gradient of a two-layer `nn.scan` of the (remat-wrapped) block on [batch, length, D], with the sequence
    split over `shards` devices traced through meshtrain's ring attention on an abstract mesh."""
    model_cfg = self.model
    block = Block if model_cfg.remat == "none" else nn.remat(Block, policy=REMAT_POLICIES[model_cfg.remat],
                                                              prevent_cse=False)
    stack = nn.scan(block, variable_axes={"params": 0, "moe": 0}, split_rngs={"params": True}, in_axes=nn.broadcast,
                    length=2, metadata_params={nn.PARTITION_NAME: "layers"})(model_cfg)
    L, D, dtype = length, model_cfg.d_model, jnp.dtype(model_cfg.dtype)
    sizes = {a: 1 for a in mesh_lib.AXES} | {"sequence": shards}
    mesh = costs.abstract_mesh(sizes)
    # The parameters' shapes do not depend on the split sequence: taken outside the mesh (no ring to trace).
    params = jax.eval_shape(lambda: nn.meta.unbox(stack.init(jax.random.key(0), jnp.zeros((1, L, D), dtype),
                                                             jnp.arange(L))["params"]))
    loss = lambda p, x: stack.apply({"params": p}, x, jnp.arange(L))[0].astype(jnp.float32).sum()
    rules = sharding.for_mesh(sharding.rules_for("dp"), mesh)
    with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(rules):
      return jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, jax.ShapeDtypeStruct((batch, L, D), dtype))


class CostModel:
  """What meshtrain/analysis/estimate.py needs of the language model, from the config alone (no mesh, no devices): the
  contract's `cost_model` (meshtrain/tasks/__init__.py)."""
  throughput_key = LmTask.throughput_key
  unsupported_axes: dict[str, str] = {}   # every axis splits the LM (expert only with experts: `num_experts`)
  remat_policies = lm_config.REMAT_POLICIES

  def __init__(self, cfg):
    self.cfg = cfg
    self.length = cfg.seq_len             # tokens of one example
    self.units_per_example = cfg.seq_len
    self.num_experts = cfg.model.num_experts

  def check_parallelism(self, sizes: dict, microbatches: int | None = None) -> None:
    check_parallelism(self.cfg, sizes, microbatches)

  def attention_on(self, platform: str, capability: str | None) -> str:
    m = self.cfg.model
    return attention.resolve(m.attention, platform, m.dtype, m.head_dim, m.num_heads, m.num_kv_heads, capability)

  def abstract_params(self):
    model = Transformer(ModelConfig.from_config(self.cfg.model))
    tokens = jax.ShapeDtypeStruct((1, self.cfg.seq_len), jnp.int32)
    return jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]

  def flops_per_example(self, table) -> float:
    return flops_per_sequence(self.cfg, table)

  def recomputed_flops_per_example(self, table) -> float:
    """Recomputed in the backward pass: full remat the whole forward (2 of the 6 FLOPs per parameter and token, and a
    third of the attention); save_dots keeps the projections but recomputes attention's batched dots."""
    remat = self.cfg.model.remat
    if remat == "full":
      return self.flops_per_example(table) / 3
    if remat == "save_dots":
      return perf.model_flops_per_token(self.cfg.model, self.cfg.seq_len, 0) * self.cfg.seq_len / 3
    return 0.0

  def batch_bytes_per_example(self, length: int) -> int:
    return 2 * length * 4                 # input and target ids, int32, of the tokens on a device

  def stack(self, sizes: dict) -> LayerStack:
    """The model as one device of the tensor (and expert) split computes it."""
    tensor = sizes["tensor"]
    m = ModelConfig.from_config(self.cfg.model)
    kv = m.num_kv_heads // tensor if m.num_kv_heads % tensor == 0 else m.num_kv_heads
    local = dataclasses.replace(m, num_heads=m.num_heads // tensor, num_kv_heads=kv, mlp_dim=m.mlp_dim // tensor,
                                num_experts=m.num_experts // sizes["expert"] if m.num_experts else 0)
    return LayerStack(local, self.cfg.sharding.sequence_parallel)

  def stacks(self, sizes: dict) -> list[costs.Stacked]:
    """One stack: the decoder's layers."""
    return [costs.Stacked(self.stack(sizes), self.cfg.model.num_layers, "layers/", self.length)]

  def loss_bytes(self, b: int, l: int, sizes: dict, act: int) -> int:
    """The loss: float32 logits and their exponentials, [b, l, V] each (XLA writes the logits' gradient over the
    latter), and that gradient cast to the compute dtype for the head's matmuls unless that is float32; all freed
    before the layers' backward."""
    vocab, tensor = self.cfg.model.vocab_size, sizes["tensor"]
    vocab_local = vocab // tensor if vocab % tensor == 0 else vocab
    return b * l * vocab_local * (2 * 4 + (act if act < 4 else 0))

  def collectives(self, sizes, table, gathered, b: int, l: int, act: int) -> list:
    """Collectives per device per step, derived from what each split forces, in the program's own terms.

    One micro-step (x grad_accum_steps) of a model with N layers per device:
      data / fsdp: each layer's gradients are reduced as the backward pass produces them (one combined
        reduction per layer, N), plus one for the embedding, head, final norm and loss sums after the loop;
      fsdp: every weight split over `fsdp` is all-gathered before its forward use and again for its backward use
        (2 per weight per layer); the gradient reduction is an all-reduce on the CPU, a reduce-scatter on GPUs;
      tensor: one all-reduce of the [b, l, D] block output after the attention output and after the MLP down
        projection (2 per layer forward, again under full remat's recompute), and in the backward pass one
        combined all-reduce of the input gradients of Q/K/V (3 x [b, l, D]) and one of gate/up (2 x [b, l, D]);
      sequence: gradients summed over the sequence shards (per layer, as for data); ring attention passes K and
        V around the ring, one permute each of K, V forward and dK, dV backward per ring step;
      stage: each pipeline iteration hands a [micro-batch, l, D] activation to the next stage, forward and back,
        and the data-axis gradient reduction runs once per pipeline iteration;
      expert: two all-to-alls of the dispatched tokens per MoE layer forward (dispatch, combine), two backward.
    Bytes are the buffer per device per execution (full gathered size for all-gathers), summed over executions.
    """
    cfg = self.cfg
    m = cfg.model
    accum = cfg.optimizer.grad_accum_steps
    stages, tensor, shards, experts = sizes["stage"], sizes["tensor"], sizes["sequence"], sizes["expert"]
    layers = m.num_layers // stages
    remat_full = m.remat == "full"
    bld = b * l * m.d_model * act
    out = costs.CollectiveList(sizes)
    add = out.add

    fsdp = sizes["fsdp"] > 1
    micro, repeats, iterations = costs.pipeline_shape(cfg, stages)
    runs = iterations * layers // repeats  # times a device runs one of its layers, each on b / micro rows
    if sizes["data"] > 1 or fsdp:
      layer_grads = sum(r.bytes_per_device for r in costs.layer_rows(gathered))
      # An FSDP-split embedding is looked up slice by slice with every token id gathered, so its gradient needs no
      # reduction; split gradients need one more for the global-norm partial sums, and the loss sums go separately.
      other = [r for r in gathered if not r.path.startswith("layers/") and not (fsdp and r.path == "embedding")]
      if stages == 1:
        add("all-reduce", ("data", "fsdp"), accum * (layers + 1 + (2 if fsdp else 0)),
            accum * (layer_grads + sum(r.bytes_per_device for r in other)))
      else:
        # Inside the pipeline loop XLA reduces each iteration's layer gradients as they appear, before summing the
        # iterations: every loop iteration pays a full reduction of the stage's layers (fill and drain included).
        per_iteration = layers // repeats
        add("all-reduce", ("data", "fsdp"), accum * (iterations * per_iteration + 2 + (2 if fsdp else 0)),
            accum * (iterations * layer_grads // repeats + sum(r.bytes_per_device for r in other)))
    if shards > 1:
      # Each sequence shard saw different tokens, so every gradient is summed over `sequence` too (XLA keeps it a
      # separate reduction from the data-axis one).
      add("all-reduce", ("sequence",), accum * (layers + 1), accum * sum(r.bytes_per_device for r in gathered))
    if fsdp:
      split = [g for r, g in zip(table, gathered) if g.path.startswith("layers/") and "fsdp" in str(r.spec)]
      head = [g for g in gathered if g.path == "head"]
      # Per layer every split weight is gathered for its forward and again for its backward use; outside the
      # layers the head once, and the token ids for the embedding lookup.
      # In a pipeline the layers run once per loop iteration, so their collectives do too.
      add("all-gather", ("fsdp",), accum * (2 * len(split) * runs + len(head) + 1),
          accum * (2 * sum(g.bytes_per_device for g in split) * runs // layers + sum(g.bytes_per_device for g in head)
                   + b * sizes["fsdp"] * l * 4))
      # The looked-up [b, l, D/fsdp] embeddings are re-split by batch (and their gradient back): two all-to-alls.
      # (the lookup happens before the cast to the compute dtype, so in the parameter dtype).
      add("all-to-all", ("fsdp",), accum * 2, accum * 2 * b * l * m.d_model * jnp.dtype(m.param_dtype).itemsize)
    if tensor > 1:
      forward = 2 * runs * (2 if remat_full else 1)
      # Outside the layers: the vocabulary-split embedding lookup and head input gradient ([b, l, D] each), the
      # target logit, max and sum of the vocabulary-split softmax ([b, l] each), the global-norm partial sums.
      add("all-reduce", ("tensor",), accum * (forward + 2 * runs + 6),
          accum * ((forward + 5 * runs) * bld // micro + 2 * bld + 3 * b * l * 4))
    if shards > 1:
      # Per layer and ring step: K and V forward (again under full remat's recompute), dK and dV backward, one
      # permute each; the positions travel once per step for all layers (the loop hoists them).
      kv_one = b * l * (m.num_kv_heads // tensor if m.num_kv_heads % tensor == 0 else m.num_kv_heads) * m.head_dim * act
      per_step = (4 + (2 if remat_full else 0)) * layers
      add("collective-permute", ("sequence",), accum * (shards - 1) * (per_step + 1),
          accum * (shards - 1) * (per_step * kv_one + b * l * 4))
    if stages > 1:
      # Each loop iteration rolls the [S, b/M, l, D] buffer by one stage (one permute forward, two for its
      # gradient), plus one in and one out of the loop; the stage-replicated buffers' gradients (the M-slot input
      # store and the M + 1-slot output) are summed over `stage`, twice.
      slot = bld // micro
      add("collective-permute", ("stage",), accum * (3 * iterations + 2), accum * (3 * iterations + 2) * slot)
      add("all-reduce", ("stage",), accum * 2, accum * (2 * micro + 1) * slot)
    if experts > 1 and m.num_experts:
      capacity = math.ceil(m.capacity_factor * b * l * m.experts_per_token / m.num_experts) * m.num_experts
      add("all-to-all", ("expert",), accum * 4 * layers, accum * 4 * layers * capacity * m.d_model * act)
    return out
