"""What a layout costs, from shapes and arithmetic alone: memory per device, FLOPs, collectives, step time.

`python -m meshtrain.inspect` prints these expectations next to what XLA compiled; `python -m meshtrain.plan`
ranks every layout of a cluster with them. Nothing here allocates arrays or needs the devices it describes:
  - parameter and optimizer bytes: the parameter table (shapes, logical axes) under the layout's rules;
  - activation bytes: JAX's own residuals of one block (what the backward pass keeps under the remat policy),
    traced at the per-device shapes, times the layers a device holds, plus the logits;
  - collectives: derived layer by layer from what each split forces (listed in `collectives`);
  - step time: FLOPs at the device's peak; collective bytes over the link each one crosses (NVLink inside a
    node, the network across nodes), data/fsdp traffic overlapped with compute, the rest exposed.
"""
import dataclasses
import functools
import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh

from meshtrain import mesh as mesh_lib, optim, perf, sharding
from meshtrain.hlo import Collective
from meshtrain.models.llama import REMAT_POLICIES, Block, ModelConfig, Transformer

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class Estimate:
  sizes: dict                          # mesh axis -> size
  params_bytes_total: int
  params_bytes_per_device: int
  optimizer_bytes_per_device: int
  gradient_bytes_per_device: int       # gradients (and their accumulator with grad_accum_steps > 1)
  activation_bytes_per_device: int     # saved for the backward pass, one layer's recompute, logits
  batch_bytes_per_device: int          # the input and target tokens
  model_flops_per_step: float          # per device: 6N + attention, what MFU counts
  flops_per_step: float                # per device, including the recomputed forward of full remat
  bubble: float                        # pipeline idle fraction
  collectives: list[Collective]        # per device, per step

  @property
  def arguments_bytes_per_device(self) -> int:
    return self.params_bytes_per_device + self.optimizer_bytes_per_device + self.batch_bytes_per_device

  @property
  def temp_bytes_per_device(self) -> int:
    return self.gradient_bytes_per_device + self.activation_bytes_per_device

  @property
  def total_bytes_per_device(self) -> int:
    return self.arguments_bytes_per_device + self.temp_bytes_per_device


def abstract_params(cfg):
  """The model's parameters as shapes with logical axis names (boxed), traced once; no devices needed."""
  model = Transformer(ModelConfig.from_config(cfg.model))
  tokens = jax.ShapeDtypeStruct((1, cfg.seq_len), jnp.int32)
  return jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]


def rules_for_layout(cfg, sizes: dict):
  mesh = AbstractMesh(tuple(sizes[a] for a in mesh_lib.AXES), mesh_lib.AXES)
  return mesh, sharding.for_mesh(sharding.rules_for(cfg.sharding.rules, cfg.sharding.sequence_parallel), mesh)


@functools.lru_cache(maxsize=256)
def _block_residuals(model_cfg: ModelConfig, length: int, fused_attention: bool) -> tuple[int, int]:
  """(bytes, of which residual-stream bytes) JAX keeps from one block's forward pass over one sequence for its
  backward pass; every such tensor has a batch dimension, so b sequences keep b times as much.

  Traced at per-device shapes (the caller shrinks heads and MLP width by the tensor split), so it follows the
  remat policy, grouped-query attention and MoE without a hand-written formula. Parameters are not counted.
  Fused attention (cuDNN flash attention on GPUs) keeps no [length, length] scores.
  """
  def apply(block):
    return lambda p, x: block.apply(p, x, jnp.arange(length))[0]
  plain = Block(model_cfg)
  block = plain if model_cfg.remat == "none" else nn.remat(
      Block, policy=REMAT_POLICIES[model_cfg.remat], prevent_cse=False)(model_cfg)
  x = jax.ShapeDtypeStruct((1, length, model_cfg.d_model), jnp.dtype(model_cfg.dtype))
  params = jax.eval_shape(lambda: nn.meta.unbox(plain.init(jax.random.key(0), jnp.zeros(x.shape, x.dtype),
                                                          jnp.arange(length))))
  param_shapes = {(p.shape, p.dtype) for p in jax.tree.leaves(params)}
  saved = jax.eval_shape(lambda p, x: jax.vjp(apply(block), p, x)[1], params, x)
  total = stream = 0
  for leaf in jax.tree.leaves(saved):
    if (leaf.shape, leaf.dtype) in param_shapes:
      continue
    if fused_attention and leaf.shape[-2:] == (length, length):
      continue
    size = math.prod(leaf.shape) * leaf.dtype.itemsize
    total += size
    stream += size if leaf.shape == x.shape else 0
  return total, stream


@functools.lru_cache(maxsize=16)
def _optimizer_scalar_bytes(optimizer_json: str, steps: int) -> int:
  """Bytes of the optimizer's replicated scalar counters (step counts): they do not depend on the parameters, so
  a one-leaf tree stands in for the model, and the planner traces this once per optimizer, not per layout."""
  import ml_collections
  tx = optim.make_optimizer(ml_collections.ConfigDict(json.loads(optimizer_json)), steps)
  state = jax.eval_shape(tx.init, {"w": jax.ShapeDtypeStruct((1,), jnp.float32)})
  return sum(x.dtype.itemsize for x in jax.tree.leaves(state) if x.ndim == 0)


def _pipeline_shape(cfg, stages: int) -> tuple[int, int, int]:
  """(micro-batches M, passes R, loop iterations R*M + S - 1) of the pipeline schedule; (1, 1, 1) without stages."""
  if stages == 1:
    return 1, 1, 1
  micro = cfg.pipeline.microbatches
  repeats = cfg.pipeline.repeats if cfg.pipeline.schedule == "circular" else 1
  return micro, repeats, repeats * micro + stages - 1


def _local_model(cfg, tensor: int, experts: int) -> ModelConfig:
  """The model as one device of the tensor (and expert) split computes it."""
  m = ModelConfig.from_config(cfg.model)
  kv = m.num_kv_heads // tensor if m.num_kv_heads % tensor == 0 else m.num_kv_heads
  return dataclasses.replace(m, num_heads=m.num_heads // tensor, num_kv_heads=kv, mlp_dim=m.mlp_dim // tensor,
                             num_experts=m.num_experts // experts if m.num_experts else 0)


def estimate(cfg, sizes: dict, boxed_params=None, fused_attention: bool = False) -> Estimate:
  """The expected per-device costs of training `cfg` on a mesh of `sizes` (mesh axis -> size).

  Raises UserError (from the parameter table) when a dimension does not split evenly.
  """
  boxed = abstract_params(cfg) if boxed_params is None else boxed_params
  mesh, rules = rules_for_layout(cfg, sizes)
  table = sharding.param_table(boxed, mesh, rules)
  gathered = sharding.param_table(boxed, *rules_for_layout(cfg, {**sizes, "fsdp": 1}))  # weights as used
  m, n_dev = cfg.model, math.prod(sizes.values())
  accum = cfg.optimizer.grad_accum_steps
  stages, tensor, shards = sizes["stage"], sizes["tensor"], sizes["sequence"]
  micro, repeats, iterations = _pipeline_shape(cfg, stages)
  batch_ways = math.prod(sizes[a] for a in mesh_lib.BATCH_AXES)
  b = cfg.batch_size // accum // batch_ways        # sequences per device per micro-step
  l = cfg.seq_len // shards                        # tokens of each sequence on a device
  layers = m.num_layers // stages
  act = _DTYPE_BYTES[m.dtype]

  params_pd = sum(r.bytes_per_device for r in table)
  # AdamW keeps two moments per parameter in the parameter dtype, and a few replicated scalar counters.
  optimizer_pd = 2 * params_pd + _optimizer_scalar_bytes(cfg.optimizer.to_json(), cfg.steps)
  grads_pd = params_pd * (2 if accum > 1 else 1)   # accumulation keeps a running sum beside each micro-step's
  local = _local_model(cfg, tensor, sizes["expert"])
  per_layer, stream = (b * n for n in _block_residuals(local, l, fused_attention))
  if cfg.sharding.sequence_parallel and tensor > 1:
    per_layer -= stream - stream // tensor         # the residual stream is split over `tensor` as well
  recompute = 0 if m.remat == "none" else b * _block_residuals(dataclasses.replace(local, remat="none"), l,
                                                               fused_attention)[0]
  if shards > 1:
    # Ring attention is meshtrain's own JAX code (never a fused kernel): each of the n-1 further ring steps keeps
    # its [l, l] tile of float32 scores and probabilities and the K/V block it received.
    heads, kv = local.num_heads, local.num_kv_heads
    ring = (shards - 1) * b * (2 * heads * l * l * 4 + 2 * l * kv * m.head_dim * act)
    if m.remat == "none":
      per_layer += ring
    else:
      recompute += ring
  vocab_local = m.vocab_size // tensor if m.vocab_size % tensor == 0 else m.vocab_size
  logits = 3 * b * l * vocab_local * 4             # float32 logits, their softmax and their gradient
  # FSDP holds one layer's gathered weights for the forward and one for the backward use at any time.
  gathered_layer = sum(r.bytes_per_device for r in _layer_rows(gathered)) // layers if sizes["fsdp"] > 1 else 0
  # A pipeline runs its layers M + S - 1 times per step (the fill and drain iterations too, on placeholder
  # rows), and autodiff keeps every run's residuals.
  pipeline_runs = iterations / (repeats * micro)
  activations = layers * per_layer * pipeline_runs + recompute + logits + 2 * gathered_layer

  model_flops = perf.model_flops(cfg, table) * cfg.batch_size * cfg.seq_len / n_dev  # the work splits evenly
  # Recomputed in the backward pass: full remat the whole forward (2 of the 6 FLOPs per parameter and token, and
  # a third of the attention); save_dots keeps the projections but recomputes attention's batched dots.
  attention = perf.model_flops_per_token(m, cfg.seq_len, 0) * cfg.batch_size * cfg.seq_len / n_dev
  recomputed = {"none": 0.0, "save_dots": attention / 3, "full": model_flops / 3}[m.remat]
  bubble = (stages - 1) / iterations
  return Estimate(
      sizes=dict(sizes), params_bytes_total=sum(r.size * r.dtype.itemsize for r in table),
      params_bytes_per_device=params_pd, optimizer_bytes_per_device=optimizer_pd,
      gradient_bytes_per_device=grads_pd, activation_bytes_per_device=int(activations),
      batch_bytes_per_device=2 * (cfg.batch_size // batch_ways) * l * 4,
      model_flops_per_step=model_flops, flops_per_step=model_flops + recomputed, bubble=bubble,
      collectives=collectives(cfg, sizes, table, gathered, b, l, act))


def _layer_rows(rows):
  return [r for r in rows if r.path.startswith("layers/")]


def collectives(cfg, sizes, table, gathered, b: int, l: int, act: int) -> list[Collective]:
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
  m = cfg.model
  accum = cfg.optimizer.grad_accum_steps
  stages, tensor, shards, experts = sizes["stage"], sizes["tensor"], sizes["sequence"], sizes["expert"]
  layers = m.num_layers // stages
  remat_full = m.remat == "full"
  bld = b * l * m.d_model * act
  out: list[Collective] = []

  def add(kind, axes, count, nbytes):
    axes = tuple(a for a in mesh_lib.AXES if a in axes and sizes[a] > 1)
    if axes and count:
      out.append(Collective(kind, axes, int(count), int(nbytes), True))

  fsdp = sizes["fsdp"] > 1
  micro, repeats, iterations = _pipeline_shape(cfg, stages)
  runs = iterations * layers // repeats  # times a device runs one of its layers, each on b / micro rows
  if sizes["data"] > 1 or fsdp:
    layer_grads = sum(r.bytes_per_device for r in _layer_rows(gathered))
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
    add("all-to-all", ("fsdp",), accum * 2, accum * 2 * b * l * m.d_model * _DTYPE_BYTES[m.param_dtype])
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


def link_of(axes, across_nodes: dict) -> str:
  """'network' when any of the axes spans nodes, else 'node' (NVLink / the same host)."""
  return "network" if any(across_nodes.get(a, 1) > 1 for a in axes) else "node"


def wire_bytes(c: Collective, sizes: dict) -> float:
  """Bytes each device sends for `c` with ring algorithms: (n-1)/n of the buffer, twice for an all-reduce."""
  n = math.prod(sizes[a] for a in c.axes)
  if n <= 1:
    return 0.0
  share = (n - 1) / n
  return c.bytes * {"all-reduce": 2 * share, "all-gather": share, "reduce-scatter": share,
                    "all-to-all": share, "collective-permute": 1.0}[c.kind]


# Axes whose traffic XLA's GPU scheduler overlaps with compute (meshtrain sets the latency-hiding scheduler and
# pipelined FSDP collectives): gradient reductions run during the backward pass, the next layer's weights are
# gathered during this layer's compute. Tensor, sequence, expert and stage traffic sits on the critical path.
OVERLAPPED_AXES = ("data", "fsdp")


@dataclasses.dataclass(frozen=True)
class StepTime:
  compute_s: float     # FLOPs at the peak, stretched by the pipeline bubble
  overlapped_s: float  # data / fsdp collectives: hidden behind compute up to compute_s
  exposed_s: float     # every other collective: on the critical path
  network_s: float     # the part of the two above that crosses nodes (informational)
  overlap: bool = True

  @property
  def total_s(self) -> float:
    if not self.overlap:
      return self.compute_s + self.overlapped_s + self.exposed_s
    return max(self.compute_s, self.overlapped_s) + self.exposed_s


# Start-up cost of one collective (NCCL's small-message latency, order of magnitude): what makes many small
# collectives (a pipeline's hops, tensor parallelism of a small model) slower than their bytes suggest.
LATENCY_S = {"node": 10e-6, "network": 25e-6}


def step_time(est: Estimate, collectives_list, peak: float, node_bw: float, network_bw: float,
              across_nodes: dict, overlap: bool = True) -> StepTime:
  compute = est.flops_per_step / peak / (1 - est.bubble)
  overlapped = exposed = network = 0.0
  for c in collectives_list:
    link = link_of(c.axes, across_nodes)
    seconds = wire_bytes(c, est.sizes) / (network_bw if link == "network" else node_bw) + c.count * LATENCY_S[link]
    network += seconds if link == "network" else 0.0
    if set(c.axes) <= set(OVERLAPPED_AXES):
      overlapped += seconds
    else:
      exposed += seconds
  return StepTime(compute, overlapped, exposed, network, overlap)
