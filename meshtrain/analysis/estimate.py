"""What a layout costs, from shapes and arithmetic alone: memory per device, FLOPs, collectives, step time.

`python -m meshtrain.inspect` prints these expectations next to what XLA compiled; `python -m meshtrain.plan`
ranks every layout of a cluster with them. Nothing here allocates arrays or needs the devices it describes, and
nothing here knows the model family: the task's cost model (`families.cost_model(cfg)`, the contract in
meshtrain/tasks/__init__.py) gives the parameter table, the block stack to trace, the model-specific parts of the
working set, the FLOPs per example and the collectives its blocks force; this module does the arithmetic:
  - parameter and optimizer bytes: the parameter table (shapes, logical axes) under the layout's rules;
  - activation bytes: JAX's own residuals of each layer stack (what the backward loop reads under the remat
    policy, traced at the per-device shapes), per layer run, and on top of them the larger of the loss's working
    set and one layer's backward working set (what XLA's buffer assignment keeps at the peak, see `estimate`);
  - collectives: derived layer by layer from what each split forces (the task's `collectives`);
  - step time: FLOPs at the device's peak; collective bytes over the link each one crosses (NVLink inside a
    node, the network across nodes), data/fsdp traffic overlapped with compute, the rest exposed.
All of it describes the scanned layer loop. A shallow stack that `model.scan_unroll` unrolls reduces the same
gradient bytes, in as many ops as XLA's combiner makes, may gather fewer (a weight gathered for the forward pass
reused in the backward one), and needs no stacked buffers: 0.89-0.96 of the loop's predicted memory on the tiny
layouts (tests/test_inspect.py), so the prediction stays an upper bound.
"""
import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import ml_collections
from jax._src.interpreters import partial_eval as pe  # jit's own dead-code elimination, not public API
from jax.extend import core as jcore

from meshtrain import costs, families, mesh as mesh_lib, optim, sharding
from meshtrain.costs.hlo import Collective

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


@dataclasses.dataclass(frozen=True)
class Estimate:
  sizes: dict                          # mesh axis -> size
  params_bytes_total: int
  params_bytes_per_device: int
  optimizer_bytes_per_device: int
  gradient_bytes_per_device: int       # gradients (and their accumulator with grad_accum_steps > 1)
  activation_bytes_per_device: int     # residuals of every layer run, then one layer's backward or the logits
  batch_bytes_per_device: int          # the batch's arrays (LM: input and target tokens; DiT: images, labels, seeds)
  model_flops_per_step: float          # per device: the task's flops_per_example (LM: 6N + attention), what MFU counts
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


def _scan_groups(eqn) -> tuple[int, int]:
  """(consts, carry): how many of a `scan` equation's inputs are loop-invariant constants and how many the carry.

  Read from lax.scan's public semantics, not its private params (JAX 0.10 names them num_consts/num_carry, JAX 0.11+
  packs them in a tree): the body takes (consts, carry, x slices) and returns (carry, y slices), so the x inputs are
  the first whose body variable has one dimension fewer than the operand, and the y outputs likewise."""
  body = next(iter(jcore.jaxprs_in_params(eqn.params)))
  ndims = lambda outer, inner: [len(o.aval.shape) == len(i.aval.shape) for o, i in zip(outer, inner)] + [False]
  consts_and_carry, carry = ndims(eqn.invars, body.invars).index(False), ndims(eqn.outvars, body.outvars).index(False)
  return consts_and_carry - carry, carry


def rules_for_layout(cfg, sizes: dict):
  mesh = costs.abstract_mesh(sizes)
  return mesh, sharding.for_mesh(sharding.rules_for(cfg.sharding.rules, cfg.sharding.sequence_parallel), mesh)


@dataclasses.dataclass(frozen=True)
class _Residuals:
  """Bytes per device that the forward pass of a scanned stack of blocks keeps for the backward pass."""
  layer: int    # per layer and sequence: what the forward loop stacks, one slice per layer, for the backward loop
  layer_fixed: int  # per layer, whatever the batch (the LM's broadcast norm scales, DiT's reshaped weights)
  stream: int   # of which residual-stream tensors ([l, D] per sequence)
  shared: int   # per sequence, once for all layers: loop-invariant (the LM's causal mask, DiT's condition)
  fixed: int    # once, whatever the batch (the rotary tables)


@functools.lru_cache(maxsize=256)
def _layer_residuals(stack, length: int, fused_attention: bool, shards: int = 1) -> _Residuals:
  """What JAX keeps from the forward pass of the layer stack for its backward pass, per device.

  `stack` (the task's, hashable) traces the way the model runs: the gradient of a two-layer `nn.scan` of the
  (remat-wrapped) block, at per-device heads and MLP width (the task shrinks them by the tensor split); with the
  sequence split over `shards` devices, through the model's sequence-split attention (everything the block keeps
  is split along the sequence). The residuals are what the backward scan reads after dead code is
  removed: the forward scan's stacked outputs, and its loop-invariant inputs, which JAX hoists out of the loop
  and keeps once for all layers (the LM's mask and rotary tables depend on the positions alone; DiT's condition
  vector is per image). So it follows the remat policy, grouped-query attention, MoE and the ring without a
  hand-written formula; parameters are not counted. Fused attention (cuDNN flash attention on GPUs) keeps no
  [L, L] scores.
  """
  L, D = length * shards, stack.width
  # A batch of p sequences, p a prime that divides no other dimension: a residual is per sequence iff p divides
  # its size. (Concrete, not symbolic: a symbolic batch changes which residuals JAX keeps in the ring's conds.)
  dims = (L, length, D, shards, max(shards - 1, 1), *stack.dims)
  batch = next(p for p in range(11, 1000, 2) if all(p % q for q in range(3, p, 2)) and all(d % p for d in dims))
  closed = stack.gradient_jaxpr(batch, L, shards)
  jaxpr = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))[0]
  scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
  backward, stacked_out = scans[-1], {v for e in scans[:-1] for v in e.outvars}
  # XLA makes a reshape a bitcast of its operand: stacked residuals that are reshapes of one value inside the
  # forward loop (the model's projections flatten [b, l, D] to [b*l, D], once per projection) share one buffer.
  source = {}
  for e in scans[:-1]:
    body = next(iter(jcore.jaxprs_in_params(e.params)))
    reshaped = {q.outvars[0]: q.invars[0] for q in body.eqns if q.primitive.name == "reshape"}
    for outer, inner in zip(e.outvars, body.outvars):
      origin = reshaped.get(inner, inner)
      source[outer] = (origin, tuple(origin.aval.shape))
  seen = set()
  consts, carry = _scan_groups(backward)
  layer = layer_fixed = stream = shared = fixed = 0
  for i, v in enumerate(backward.invars):
    if not isinstance(v, jcore.Var) or v in jaxpr.invars or consts <= i < consts + carry:
      continue  # parameters, the input, the incoming cotangent
    if fused_attention and v.aval.shape[-2:] == (L, L):
      continue
    origin, shape = source.get(v, (v, tuple(v.aval.shape[1:])))
    if origin in seen:
      continue
    seen.add(origin)
    size = math.prod(v.aval.shape) * v.aval.dtype.itemsize
    per_seq, once = (size // batch, 0) if size % batch == 0 else (0, size)
    if i >= consts and v in stacked_out:             # [2 layers, b, ...]
      layer, layer_fixed = layer + per_seq // 2, layer_fixed + once // 2
      stream += per_seq // 2 if shape == (batch, L, D) else 0
    else:
      shared, fixed = shared + per_seq, fixed + once
  return _Residuals(layer // shards, layer_fixed // shards, stream // shards, shared // shards, fixed // shards)


@functools.lru_cache(maxsize=16)
def _optimizer_scalar_bytes(optimizer_json: str, steps: int) -> int:
  """Bytes of the optimizer's replicated scalar counters (step counts): they do not depend on the parameters, so
  a one-leaf tree stands in for the model, and the planner traces this once per optimizer, not per layout."""
  tx = optim.make_optimizer(ml_collections.ConfigDict(json.loads(optimizer_json)), steps)
  state = jax.eval_shape(tx.init, {"w": jax.ShapeDtypeStruct((1,), jnp.float32)})
  return sum(x.dtype.itemsize for x in jax.tree.leaves(state) if x.ndim == 0)


def estimate(cfg, sizes: dict, boxed_params=None, fused_attention: bool = False) -> Estimate:
  """The expected per-device costs of training `cfg` on a mesh of `sizes` (mesh axis -> size).

  Raises UserError (from the parameter table) when a dimension does not split evenly.
  """
  model = families.cost_model(cfg)
  boxed = model.abstract_params() if boxed_params is None else boxed_params
  mesh, rules = rules_for_layout(cfg, sizes)
  table = sharding.param_table(boxed, mesh, rules)
  gathered = sharding.param_table(boxed, *rules_for_layout(cfg, {**sizes, "fsdp": 1}))  # weights as used
  m, n_dev = cfg.model, math.prod(sizes.values())
  accum = cfg.optimizer.grad_accum_steps
  stages, tensor, shards = sizes["stage"], sizes["tensor"], sizes["sequence"]
  micro, repeats, iterations = costs.pipeline_shape(cfg, stages)
  batch_ways = math.prod(sizes[a] for a in mesh_lib.BATCH_AXES)
  b = cfg.batch_size // accum // batch_ways        # sequences (images) per device per micro-step
  l = model.length // shards                       # tokens of each sequence on a device
  act = _DTYPE_BYTES[m.dtype]

  params_pd = sum(r.bytes_per_device for r in table)
  # AdamW keeps two moments per parameter in the parameter dtype, and a few replicated scalar counters.
  optimizer_pd = 2 * params_pd + _optimizer_scalar_bytes(cfg.optimizer.to_json(), cfg.steps)
  if cfg.optimizer.ema_decay > 0:  # the average of the parameters, float32, split as they are
    optimizer_pd += sum(r.bytes_per_device // r.dtype.itemsize * 4 for r in table)
  grads_pd = params_pd * (2 if accum > 1 else 1)   # accumulation keeps a running sum beside each micro-step's

  def residuals(s, length):
    r = _layer_residuals(s, length // shards, fused_attention, shards)
    split = r.stream - r.stream // tensor if s.sequence_parallel and tensor > 1 else 0
    return dataclasses.replace(r, layer=r.layer - split)  # the residual stream is split over `tensor` as well

  rows = b // micro                                # sequences of one pipeline micro-batch (b without stages)
  # Each scanned stack (the LM's, DiT's one; Flux's encoder, double and single stacks in turn) keeps its residuals;
  # the backward loops run in reverse order, each freeing its own, so a stack's backward has every earlier one's.
  live = peak = 0                                  # residuals of the stacks so far; the highest backward peak
  for stacked_run in model.stacks(sizes):
    stack, ls, layers = stacked_run.stack, stacked_run.length // shards, stacked_run.layers // stages
    kept = residuals(stack, stacked_run.length)
    runs = iterations * layers // repeats          # layer runs per device and micro-step, fill and drain included
    # The forward loop writes each layer run's residuals into buffers allocated for all runs before it starts (a
    # pipeline keeps every iteration's, [T, P, b/M, ...]), and the backward loop reads them back: live from the
    # first forward to the last backward, with the loop-invariant ones beside them once.
    # A task whose batch-independent layer residuals are its weights as the block's matmuls use them (DiT: the
    # reshaped projections) gets them gathered again for the backward pass under FSDP (the second all-gather per
    # weight and layer in its collectives), not kept; the LM's are norm scales, kept.
    layer_fixed = 0 if stack.fixed_are_weights and sizes["fsdp"] > 1 else kept.layer_fixed
    stacked = runs * (rows * kept.layer + layer_fixed) + rows * kept.shared + kept.fixed
    layer_weights = sum(r.bytes_per_device for r in gathered if r.path.startswith(stacked_run.prefix)) // layers
    if repeats > 1:
      # The circular schedule picks each iteration's pass of weights with a gather inside the loop: to autodiff
      # those are values of the iteration like any other, kept for every layer run.
      stacked += runs * layer_weights
    # The backward of one layer holds, at its peak, about one layer's residuals again: the slices it reads (XLA
    # copies those it cannot fuse into their consumers) and the cotangents it writes; under remat, the recomputed
    # forward's residuals. On top of those, what the task's block holds at that peak beyond its residuals
    # (`stack.backward_peak`: the LM's MLP gradients, see meshtrain/families/lm.py), the layer's weights as it uses
    # them (sliced out of the stacked parameters, gathered under FSDP), and the gradient of the residual stream
    # that the backward loop carries from layer to layer, [b, l, D].
    backward = rows * (residuals(stack.without_remat(), stacked_run.length).layer + stack.backward_peak(ls, act))
    backward += layer_weights + rows * ls * stack.width * act
    live += stacked
    peak = max(peak, live + backward)
  pipeline = 0
  if stages > 1:
    # Each stage keeps its copy of the M-slot input store and the output slot, [M + 1, b/M, l, D]. (Pipelines are
    # the LM's: one stack, whose `layers`, `kept` and `layer_weights` the loop above left.)
    pipeline = (micro + 1) * rows * l * m.d_model * act
    passes = layers // repeats
    if passes > 1:
      # With more than one layer per stage and pass, each iteration's backward is a loop of its own (XLA drops a
      # one-trip loop): its loop state copies that iteration's slice of the stacked residuals and the stage's
      # weights, and carries the iteration's layer gradients until they join the running sum (counted with the
      # gradients).
      stage_weights = layer_weights * passes
      pipeline += passes * rows * kept.layer + stage_weights
      grads_pd += stage_weights
  # The loss and what runs outside the layer stack (the LM's logits, DiT's final layer): the task's working set,
  # freed before the layers' backward.
  loss = model.loss_bytes(b, l, sizes, act)
  # The gradients (zeroed at the start of the step) and the stacked residuals are live throughout; the peak is
  # the larger of the loss and one layer's backward on top of them (`peak`: of the stack whose backward is highest).
  # Not counted: XLA copies every AdamW moment at the start of the step (its parameter-update fusion recomputes
  # the new moments from the old ones, while another fusion writes the new moments into the donated buffers), 2x
  # the parameters of temporaries, but reuses the freed moment buffers for the step's other temporaries. Each
  # freed buffer holds one temporary at a time, so part of it can stay empty: XLA's figure is higher by that
  # (0.1-2 MB on the tiny model's layouts, up to 7% of the total; more where the moments are large next to the
  # activations, 18% with a 32K vocabulary).
  activations = pipeline + max(peak, live + loss)

  # The task's FLOPs per example by formula (the MFU numerator); the work splits evenly over the devices.
  model_flops = model.flops_per_example(table) * cfg.batch_size / n_dev
  recomputed = model.recomputed_flops_per_example(table) * cfg.batch_size / n_dev
  bubble = (stages - 1) / iterations
  return Estimate(
      sizes=dict(sizes), params_bytes_total=sum(r.size * r.dtype.itemsize for r in table),
      params_bytes_per_device=params_pd, optimizer_bytes_per_device=optimizer_pd,
      gradient_bytes_per_device=grads_pd, activation_bytes_per_device=int(activations),
      batch_bytes_per_device=(cfg.batch_size // batch_ways) * model.batch_bytes_per_example(l),
      model_flops_per_step=model_flops, flops_per_step=model_flops + recomputed, bubble=bubble,
      collectives=model.collectives(sizes, table, gathered, b, l, act))


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
