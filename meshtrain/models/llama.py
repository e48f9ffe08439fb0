"""LLaMA-style decoder-only language model (Flax Linen).

Shape letters: B batch, L length, D model width, H query heads, K key/value heads, E head width, F MLP width,
V vocabulary, N layers. Every parameter and key activation names its logical axes; the rules in
meshtrain/sharding.py decide how they map onto the mesh, so this file never mentions a mesh axis.

Linen rather than NNX: its `nn.scan` + `nn.remat` + logical partitioning compose without extra glue, and the
parameters are a plain pytree that Optax and Orbax take as is.
"""
import dataclasses
import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from meshtrain import sharding
from meshtrain.models import attention, rope
from meshtrain.models.activations import swiglu
from meshtrain.models.moe import MoEConfig, MoEMLP
from meshtrain.models.params import FanIn, param, zeros as zeros_param
from meshtrain.parallel import context, pipeline

# model.init="fan_in": MaxText 0.2.5's initialisers for its default decoder (decoder_block: llama2, use_qk_norm:
# false, logits_via_embedding: false, fused_qkv/fused_mlp: false; configs/base.yml:190,218,562-563,1369), read in
# experiments/peer_maxtext/.venv/lib/python3.12/site-packages/maxtext/. DenseGeneral passes the contracted input
# axes as in_axis and the rest as out_axis (layers/linears.py:256-268), so fan_in = the product of the input dims;
# nd_dense_init is jax.nn.initializers.variance_scaling(scale, mode, distribution, in_axis, out_axis)
# (layers/initializers.py:46-71). Layers are initialised one at a time before stacking (layers/nnx_scan.py:37-50),
# so the layer axis never enters fan_in.
#   embedding [V,D]  normal(1.0), no fan-in scaling: Embed(embedding_init=normal(stddev=1.0)) (models/models.py:126-134,
#                    the [V,D] table at layers/embeddings.py:83-88). Not layers/initializers.py's default_embed_init.
#   q [D,H,E]        normal, fan_in D, then / sqrt(E): Attention's default kernel_init nd_dense_init(1.0, "fan_in",
#                    "normal") (layers/attentions.py:266; llama2 passes none, models/llama2.py:77-104), and
#                    query_init divides by depth_scaling = sqrt(head_dim) (layers/attentions.py:655-672) because the
#                    logits are never scaled: qk_product is a plain einsum (layers/attention_op.py:3122). Hence
#                    Attention below multiplies the query kernel by sqrt(E) to cancel dot_product_attention's 1/sqrt(E)
#                    (without it the peer benchmark's loss curves differ by up to 2.7x mid-run, with it by 1.3%).
#   k, v [D,K,E]     normal, fan_in D (layers/attentions.py:705-728).
#   o [H,E,D]        normal, fan_in H*E: axis=(-2,-1) makes both input dims in_axis (layers/attentions.py:807-826).
#                    No 1/sqrt(2N) depth scaling, for o or the MLP's wo.
#   gate, up [D,F]   truncated normal, fan_in D: MlpBlock's default kernel_init nd_dense_init(1.0, "fan_in",
#                    "truncated_normal") (layers/linears.py:626; llama2 passes none, models/llama2.py:116-128),
#                    wi_0 (silu) and wi_1 (linear) at layers/linears.py:709-729.
#   down [F,D]       truncated normal, fan_in F (wo, layers/linears.py:731-748).
#   head [D,V]       truncated normal, fan_in D: logits_dense, DenseGeneral's default kernel_init
#                    (layers/nnx_decoders.py:473-485, layers/linears.py:177).
#   norm scales      ones: RMSNorm's default scale_init (layers/normalizations.py:69; models/llama2.py:66-75,106-114,
#                    layers/nnx_decoders.py:466-472).
#   tied embeddings  (logits_via_embedding=true, not the peer benchmark) MaxText divides the logits by sqrt(D)
#                    (normalize_embedding_logits: true, configs/base.yml:219; layers/nnx_decoders.py:1598-1611), and
#                    so does Transformer below.
# truncated_normal draws a standard normal cut at +-2 and divides by 0.87962566 (its std), so the std is exactly
# sqrt(1/fan_in) (jax/_src/nn/initializers.py:351-387 in MaxText's JAX 0.12, the same code in meshtrain's 0.10.2).
# MaxText's dense_init_scale (configs/base.yml:208) is not used by the llama2 decoder.

REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep projections, recompute the rest
}


MAX_AUTO_UNROLL = 4  # deepest stack model.scan_unroll=0 unrolls


@dataclasses.dataclass(frozen=True)
class DenseProducts:
  """How the dense weights are stored and multiplied by the activations: a choice of the backend that runs the
  model, not of the model (ModelConfig.products). This default is the model's own layout, [in..., out...] (what
  training and checkpoints use), multiplied by XLA's einsum/dot (`dense`). Generation on the CPU hands the model
  meshtrain/kernels/cpu_matmul.py's OutInProducts instead: weights held [out..., in...] for its own kernel."""

  def permutation(self, ndim: int, n_in: int) -> tuple[int, ...] | None:
    """The order in which a weight of `ndim` axes whose first `n_in` are contracted stores them; None: as named."""
    del ndim, n_in
    return None

  def __call__(self, x, w, features: str):
    """Activations [B, L, ...] times the weight over the feature dims, `features` in the model's layout ("D,DF->F")."""
    return dense(x, w, features)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  num_layers: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  tie_embeddings: bool = False
  rope_theta: float = 10_000.0
  rope_type: str = "default"       # default | linear | llama3 | yarn (meshtrain/models/rope.py)
  rope_factor: float = 1.0         # context extension factor (linear, llama3, yarn)
  rope_original_max_len: int = 0   # the context the model was pretrained on (llama3, yarn)
  rope_low_freq_factor: float = 1.0   # llama3
  rope_high_freq_factor: float = 4.0  # llama3
  rope_beta_fast: float = 32.0     # yarn
  rope_beta_slow: float = 1.0      # yarn
  rope_attention_factor: float = 0.0  # yarn: cos/sin factor; 0: 0.1 ln(rope_factor) + 1
  attention_bias: bool = False     # biases on the q, k and v projections (Qwen2); never on o
  qk_norm: bool = False            # RMSNorm over each query and key head before the rotary embedding (Qwen3)
  sliding_window: int = 0          # > 0: each token attends to at most this many (itself included); 0: all
  norm_eps: float = 1e-5
  init: str = "normal"             # normal: normal(init_std) | fan_in: MaxText's initialisers (mapping above)
  init_std: float = 0.02
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: str = "none"
  scan_layers: bool = True
  scan_unroll: int = 0             # layers per iteration of the scanned stack; 0: auto (unrolled_layers)
  attention: str = "auto"
  context_attention: str = "ring"  # attention over a sequence split across devices: ring | allgather
  num_experts: int = 0             # > 0: every MLP is a mixture of experts (meshtrain/models/moe.py)
  experts_per_token: int = 2
  capacity_factor: float = 1.25
  aux_loss_weight: float = 1e-2
  router_z_loss_weight: float = 1e-3
  pipeline_stages: int = 1         # set from mesh.stage: layers split into this many consecutive stages
  pipeline_microbatches: int = 1
  pipeline_schedule: str = "gpipe"
  pipeline_repeats: int = 1
  products: DenseProducts = DenseProducts()  # how dense weights are stored and multiplied (the backend's choice)

  @classmethod
  def from_config(cls, model_cfg) -> "ModelConfig":
    """From the `model` config group (extra informational fields such as `preset` are ignored)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in dict(model_cfg).items() if k in names})


def moe_config(c: ModelConfig) -> MoEConfig:
  return MoEConfig(c.num_experts, c.experts_per_token, c.capacity_factor, c.aux_loss_weight, c.router_z_loss_weight)


def context_axis() -> str | None:
  """The mesh axis splitting the activations' sequence (`act_len`) under the active rules and mesh, if any."""
  axes = sharding.active_mesh_axes("act_len")
  return axes[0] if axes else None


class RMSNorm(nn.Module):
  """Over the last axis: the model width (logical axis `norm`), or each head (`head_dim`, Qwen3's q/k norm)."""
  cfg: ModelConfig
  axis: str = "norm"

  @nn.compact
  def __call__(self, x_BLD):
    scale_D = param(self, "scale", (x_BLD.shape[-1],), (self.axis,), None, self.cfg.param_dtype)
    x = x_BLD.astype(jnp.float32)  # the mean of squares is taken in float32 whatever the compute dtype
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.cfg.norm_eps)
    return (x * scale_D).astype(self.cfg.dtype)


def kernel(module: nn.Module, c: ModelConfig, name: str, shape: tuple[int, ...], logical: tuple, n_in: int,
           std: float | None, fan_in: FanIn):
  """A dense weight whose first `n_in` axes are contracted with the activations: named and drawn [in..., out...]
  (the model's layout, what training and checkpoints use), stored in the order c.products chooses (generation on
  the CPU: [out..., in...], see meshtrain/kernels/cpu_matmul.py)."""
  perm = c.products.permutation(len(shape), n_in)
  return param(module, name, shape, logical, std, c.param_dtype, c.init, fan_in, perm=perm)


def dense(x, w, features: str):
  """einsum of activations [B, L, ...] with a weight over the feature dims only ("D,DF->F"), on the tokens as
  one axis [B*L, ...]: the same values and the same sharding (the batch split stays the major one), a reshape that
  is a bitcast on every backend. Not when the sequence is split too: then it stays [B, L, ...].

  Why: on [B, L, D] x [D, F], XLA's CPU backend forms the weight gradient by copying the incoming [B, L, F]
  gradient into [F, B*L] order, with the elementwise backward (SwiGLU's) fused into that strided copy; on
  [B*L, D] it passes the operand to its matmul as transposed instead, several times faster for one MLP weight
  gradient, and those copies were a large share of the tiny model's step (measured: see benchmarks/).
  """
  inputs, out = features.split("->")
  x_in, w_in = inputs.split(",")
  if context_axis():  # the sequence is split over devices: merging it with the batch would reshard (all-gathers)
    return jnp.einsum(f"BL{x_in},{w_in}->BL{out}", x, w)
  if w_in == x_in + out:
    # Heads as well ([D, H, E] -> [D, H*E], [H, E, D] -> [H*E, D]): a plain [T, K] x [K, N] matmul. On the 3-d
    # form XLA's CPU backend copied each [T, H, E] gradient into [H*E, T] order for the weight gradient.
    k = math.prod(x.shape[2:])
    y = jnp.dot(x.reshape(-1, k), w.reshape(k, -1))
    return y.reshape(*x.shape[:2], *w.shape[len(x_in):])
  y = jnp.einsum(f"T{x_in},{w_in}->T{out}", x.reshape(-1, *x.shape[2:]), w)
  return y.reshape(*x.shape[:2], *y.shape[1:])


# Logical axes of the key/value cache ([layers, batch, kv heads, slots, head dim]); meshtrain/sharding.py maps them
# like the activations they hold: the batch over the batch axes, kv heads over `tensor`. Heads before slots: the
# attention's matmuls batch over (batch, kv head), which XLA's CPU backend wants leading; stored [B, S, K, E], every
# layer's cache was transposed (copied, three times over for k and v) every token: at the 125m shape, batch 8, more
# bytes than the weights.
CACHE_AXES = ("cache_layers", "cache_batch", "cache_kv_heads", "cache_len", "cache_head_dim")


@flax.struct.dataclass
class KVCache:
  """Keys and values of every layer, for generation. Slots [0, end) are filled; row b's own tokens start at slot
  start_B[b] (left padding before it, never attended to), so every row writes its next token at the same slot
  `end` (one dynamic_update_slice for the batch) while its rotary position is its own: slot - start_B[b]. With
  `end` of shape [B] every row writes at its own slot (a serving engine's slots, each at its own point of its own
  request).
  k_NBKSE[i] is layer i's [B, K, S, E]: one stacked array under a scanned layer stack (the layer axis leads, as
  in the weights), a tuple of per-layer arrays for unrolled layers (each updated in place, never restacked).
  `attend` > 0 (static: part of the compiled program): the new tokens attend over slots [0, attend) only, which the
  caller guarantees hold every slot they see (a serving engine whose rows are the context long, most of them unused:
  attention reads attend slots, not S). start_B and end of R < B rows (end [R]): the tokens are those of the
  first R rows only, which alone are read and written (a serving engine decoding its busy slots, not all of them)."""
  k_NBKSE: jax.Array | tuple
  v_NBKSE: jax.Array | tuple
  start_B: jax.Array  # int32 [B]
  end: jax.Array      # int32 scalar, or [B]: each row's own next slot (meshtrain/inference/engine.py's decode slots)
  attend: int = flax.struct.field(pytree_node=False, default=0)  # 0: all S slots

  def padded(self, rows: int) -> "KVCache":
    """The cache with empty rows appended up to `rows` (their own tokens start at slot 0: never read)."""
    grow = lambda a, axis: jnp.pad(a, [(0, rows - a.shape[axis]) if i == axis else (0, 0) for i in range(a.ndim)])
    caches = [tuple(grow(a, 0) for a in x) if isinstance(x, tuple) else grow(x, 1)
              for x in (self.k_NBKSE, self.v_NBKSE)]
    return self.replace(k_NBKSE=caches[0], v_NBKSE=caches[1], start_B=grow(self.start_B, 0))


def init_cache(c: ModelConfig, batch: int, length: int, start_B) -> KVCache:
  """An empty cache of `length` slots for `batch` rows whose own tokens start at slot start_B (compute dtype),
  stacked for a scanned model (c.scan_layers), per layer otherwise."""
  shape = (batch, c.num_kv_heads, length, c.head_dim)
  if c.scan_layers:
    zeros = lambda: nn.with_logical_constraint(jnp.zeros((c.num_layers, *shape), c.dtype), CACHE_AXES)
  else:
    zeros = lambda: tuple(nn.with_logical_constraint(jnp.zeros(shape, c.dtype), CACHE_AXES[1:])
                          for _ in range(c.num_layers))
  return KVCache(zeros(), zeros(), jnp.asarray(start_B, jnp.int32), jnp.zeros((), jnp.int32))


def write_slots(cache_BKSE, new_BKLE, end):
  """The cache with new_BKLE written at slots end..end+L-1: one slot `end` for every row (a scalar), or each row's
  own (end [B], a batched dynamic_update_slice: a scatter); end [R] with R < B: into the first R rows (a scatter
  into the whole buffer, which stays in place; not a slice of the rows, written back: a copy of them per call)."""
  if jnp.ndim(end) == 0:
    return jax.lax.dynamic_update_slice(cache_BKSE, new_BKLE, (0, 0, end, 0))
  if end.shape[0] < cache_BKSE.shape[0]:
    R, L = end.shape[0], new_BKLE.shape[2]
    slot_RL = end[:, None] + jnp.arange(L, dtype=end.dtype)
    return cache_BKSE.at[jnp.arange(R)[:, None], :, slot_RL].set(new_BKLE.transpose(0, 2, 1, 3))  # [R, L, K, E]
  return jax.vmap(lambda c_KSE, n_KLE, e: jax.lax.dynamic_update_slice(c_KSE, n_KLE, (0, e, 0)))(
      cache_BKSE, new_BKLE, end)


class Attention(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD, pos_L, kv=None, slots=None):
    """[B, L, D] -> [B, L, D]. Generation passes this layer's cache `kv` ([B, K, S, E] keys and values) and
    `slots` (KVCache's start_B, end and attend), positions [B, L]; it then returns the output and the updated
    cache."""
    c = self.cfg
    D, H, K, E = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim
    out_std = c.init_std / math.sqrt(2 * c.num_layers)  # residual branches summed N times: keep their sum O(1)
    # fan_in (MaxText): attention weights are plain normal, not truncated; the query is drawn 1/sqrt(E) smaller.
    w_q = kernel(self, c, "q", (D, H, E), ("embed", "heads", "head_dim"), 1, c.init_std,
                 FanIn(distribution="normal", scale=1 / E))
    kv_fan_in = FanIn(distribution="normal")
    w_k = kernel(self, c, "k", (D, K, E), ("embed", "kv_heads", "head_dim"), 1, c.init_std, kv_fan_in)
    w_v = kernel(self, c, "v", (D, K, E), ("embed", "kv_heads", "head_dim"), 1, c.init_std, kv_fan_in)
    w_o = kernel(self, c, "o", (H, E, D), ("heads", "head_dim", "embed"), 2, out_std,
                 FanIn(in_axes=(0, 1), distribution="normal"))
    w_q = w_q.astype(c.dtype)
    if c.init == "fan_in":
      # MaxText never scales the logits (its 1/sqrt(E) is in the query kernel's init): undo the 1/sqrt(E) that
      # dot_product_attention applies. On the weight, not on q: the same function as an unscaled softmax, and
      # the parameter keeps MaxText's scale, so Adam's steps (fixed size in parameter units) move the logits as
      # fast as in MaxText. Same at init with std 1/sqrt(D) and the usual scaling, not in training.
      w_q = w_q * jnp.asarray(math.sqrt(E), c.dtype)
    q_BLHE = c.products(x_BLD, w_q, "D,DHE->HE")
    k_BLKE = c.products(x_BLD, w_k.astype(c.dtype), "D,DKE->KE")
    v_BLKE = c.products(x_BLD, w_v.astype(c.dtype), "D,DKE->KE")
    if c.attention_bias:
      bias = lambda name, heads, axis: zeros_param(self, name, (heads, E), (axis, "head_dim"),
                                                   c.param_dtype).astype(c.dtype)
      q_BLHE = q_BLHE + bias("q_bias", H, "heads")
      k_BLKE = k_BLKE + bias("k_bias", K, "kv_heads")
      v_BLKE = v_BLKE + bias("v_bias", K, "kv_heads")
    if c.qk_norm:
      q_BLHE = RMSNorm(c, axis="head_dim", name="q_norm")(q_BLHE)
      k_BLKE = RMSNorm(c, axis="head_dim", name="k_norm")(k_BLKE)
    q_BLHE = nn.with_logical_constraint(rope.rotary(q_BLHE, pos_L, c),
                                        ("act_batch", "act_len", "act_heads", "act_head_dim"))
    k_BLKE = nn.with_logical_constraint(rope.rotary(k_BLKE, pos_L, c),
                                        ("act_batch", "act_len", "act_kv_heads", "act_head_dim"))
    v_BLKE = nn.with_logical_constraint(v_BLKE, ("act_batch", "act_len", "act_kv_heads", "act_head_dim"))
    if kv is not None:
      (k_BKSE, v_BKSE), (start_B, end, attend) = kv, slots
      write = lambda cache_BKSE, new_BLKE: nn.with_logical_constraint(write_slots(
          cache_BKSE, new_BLKE.transpose(0, 2, 1, 3).astype(cache_BKSE.dtype), end), CACHE_AXES[1:])
      k_BKSE, v_BKSE = write(k_BKSE, k_BLKE), write(v_BKSE, v_BLKE)
      rows, seen = slice(None, start_B.shape[0]), slice(None, attend or None)  # static prefixes: XLA reads only those
      o_BLHE = attention.cached_attention(q_BLHE, k_BKSE[rows, :, seen], v_BKSE[rows, :, seen], start_B, end,
                                          c.sliding_window)
      o_BLHE = nn.with_logical_constraint(o_BLHE, ("act_batch", "act_len", "act_heads", "act_head_dim"))
      return c.products(o_BLHE, w_o.astype(c.dtype), "HE,HED->D"), (k_BKSE, v_BKSE)
    if axis := context_axis():
      # The sequence is split over devices: each holds a chunk of queries and must see every earlier key (a
      # sliding window shorter than the sequence is refused with this split: families/lm.py, check_parallelism).
      pos_BL = jnp.broadcast_to(pos_L, q_BLHE.shape[:2])
      o_BLHE = context.sequence_sharded_attention(q_BLHE, k_BLKE, v_BLKE, pos_BL, mesh=jax.sharding.get_abstract_mesh(),
                                                  axis_name=axis, impl=c.context_attention, causal=True)
    else:
      o_BLHE = attention.causal_attention(q_BLHE, k_BLKE, v_BLKE, c.attention, c.sliding_window)
    o_BLHE = nn.with_logical_constraint(o_BLHE, ("act_batch", "act_len", "act_heads", "act_head_dim"))
    return c.products(o_BLHE, w_o.astype(c.dtype), "HE,HED->D")


class MLP(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD):
    c = self.cfg
    out_std = c.init_std / math.sqrt(2 * c.num_layers)
    # fan_in (MaxText's MlpBlock): truncated normal, 1/sqrt(D) in, 1/sqrt(F) out.
    w_gate = kernel(self, c, "gate", (c.d_model, c.mlp_dim), ("embed", "mlp"), 1, c.init_std, FanIn())
    w_up = kernel(self, c, "up", (c.d_model, c.mlp_dim), ("embed", "mlp"), 1, c.init_std, FanIn())
    w_down = kernel(self, c, "down", (c.mlp_dim, c.d_model), ("mlp", "embed"), 1, out_std, FanIn())
    gate_BLF = c.products(x_BLD, w_gate.astype(c.dtype), "D,DF->F")
    up_BLF = c.products(x_BLD, w_up.astype(c.dtype), "D,DF->F")
    h_BLF = nn.with_logical_constraint(swiglu(gate_BLF, up_BLF), ("act_batch", "act_len", "act_mlp"))
    return c.products(h_BLF, w_down.astype(c.dtype), "F,FD->D")


class Block(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD, pos_L, kv=None, slots=None):
    """(x, None); with a layer's cache `kv` (generation, see Attention) (x, the updated cache)."""
    c = self.cfg
    residual = lambda x: nn.with_logical_constraint(x, ("act_batch", "act_res_len", "act_embed"))
    h_BLD = residual(RMSNorm(c, name="attn_norm")(x_BLD))
    if kv is None:
      x_BLD = residual(x_BLD + Attention(c, name="attn")(h_BLD, pos_L))
    else:
      a_BLD, kv = Attention(c, name="attn")(h_BLD, pos_L, kv, slots)
      x_BLD = residual(x_BLD + a_BLD)
    mlp = MoEMLP(c, moe_config(c), name="moe") if c.num_experts else MLP(c, name="mlp")
    x_BLD = residual(x_BLD + mlp(residual(RMSNorm(c, name="mlp_norm")(x_BLD))))
    return x_BLD, kv


def unrolled_layers(c: ModelConfig) -> int:
  """Layers per loop iteration of the scanned stack: model.scan_unroll, or when 0 (auto) every layer (no loop)
  for a stack of at most MAX_AUTO_UNROLL layers without rematerialization or a sequence split, else 1.

  A loop keeps its residuals in stacked [layers, ...] buffers that are zero-filled, then written and read with
  dynamic slices each iteration; unrolled, XLA also merges per-layer gradient all-reduces: more tokens/s for a
  small compile-time cost (measured: see benchmarks/). Not under remat: unrolled, XLA schedules the
  recomputation next to the forward pass it repeats (full remat compiled to no-remat's memory). Not with the
  sequence split: an unrolled ring-attention step loaded from the persistent compilation cache deadlocks on the
  CPU (devices wait in different collectives; freshly compiled it runs), so those layouts keep the loop.
  """
  if c.scan_unroll:
    return c.scan_unroll
  return c.num_layers if c.num_layers <= MAX_AUTO_UNROLL and c.remat == "none" and not context_axis() else 1


def layers_as(params: dict, num_layers: int, stacked: bool) -> dict:
  """The parameter tree with its layers stacked (`layers`, [N, ...] leaves: a scanned model's) or one subtree per
  layer (`layer_0`, ...: an unrolled model's), whichever `params` has; numpy or jax arrays."""
  if stacked and "layers" not in params:
    per_layer = [params[f"layer_{i}"] for i in range(num_layers)]
    rest = {k: v for k, v in params.items() if not k.startswith("layer_")}
    stack = lambda *a: np.stack(a) if isinstance(a[0], np.ndarray) else jnp.stack(a)
    return {**rest, "layers": jax.tree.map(stack, *per_layer)}
  if not stacked and "layers" in params:
    rest = {k: v for k, v in params.items() if k != "layers"}
    return {**rest, **{f"layer_{i}": jax.tree.map(lambda a: a[i], params["layers"]) for i in range(num_layers)}}
  return params


class Transformer(nn.Module):
  """tokens [B, L] int32 (and optionally each column's position [L]) -> logits [B, L, V] float32.

  Positions default to 0..L-1; context parallelism with causal load balancing passes a permutation (the tokens
  and targets are permuted the same way, see meshtrain/parallel/context.py).
  """
  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens_BL, pos_L=None, cache: KVCache | None = None, every_column: bool = False):
    """Training and evaluation: logits [B, L, V]. Generation passes a KVCache: tokens_BL then go into slots
    end..end+L-1 and the result is (logits of the last column [B, 1, V], or of every column [B, L, V] with
    `every_column`, the updated cache)."""
    c = self.cfg
    if cache is not None:
      return self._generate(tokens_BL, cache, every_column)
    pos_L = jnp.arange(tokens_BL.shape[1]) if pos_L is None else pos_L
    # fan_in: MaxText's token embedding is normal(1.0) (fan-in 1); the first RMSNorm makes its scale harmless.
    embed_VD = param(self, "embedding", (c.vocab_size, c.d_model), ("vocab", "embed"), c.init_std, c.param_dtype,
                     c.init, FanIn(in_axes=(), distribution="normal"))
    x_BLD = jnp.take(embed_VD, tokens_BL, axis=0).astype(c.dtype)
    x_BLD = nn.with_logical_constraint(x_BLD, ("act_batch", "act_res_len", "act_embed"))
    block = Block
    if c.remat != "none":
      # Under scan, CSE across iterations cannot undo the remat, so its prevention (which costs speed) is off.
      block = nn.remat(Block, policy=REMAT_POLICIES[c.remat], prevent_cse=not c.scan_layers)
    if c.pipeline_stages > 1:
      x_BLD = pipeline.Pipeline(block, c, schedule=c.pipeline_schedule, num_repeats=c.pipeline_repeats,
                                name="layers")(x_BLD, pos_L)
    elif c.scan_layers:
      # One block compiled once and iterated: compile time and HLO size independent of depth. MoE auxiliary
      # values ("moe" collection) get a leading layer axis like the parameters.
      stack = nn.scan(block, variable_axes={"params": 0, "moe": 0}, split_rngs={"params": True},
                      in_axes=nn.broadcast, length=c.num_layers, unroll=unrolled_layers(c),
                      metadata_params={nn.PARTITION_NAME: "layers"})
      x_BLD, _ = stack(c, name="layers")(x_BLD, pos_L)
    else:
      for i in range(c.num_layers):
        x_BLD, _ = block(c, name=f"layer_{i}")(x_BLD, pos_L)
    x_BLD = RMSNorm(c, name="final_norm")(x_BLD)
    if c.tie_embeddings:
      logits_BLV = c.products(x_BLD, embed_VD.astype(c.dtype), "D,VD->V")
      if c.init == "fan_in":
        # A normal(1.0) table would give logits of std sqrt(D); MaxText divides them by sqrt(D) (mapping above).
        logits_BLV = logits_BLV / jnp.asarray(math.sqrt(c.d_model), logits_BLV.dtype)
    else:
      head_DV = kernel(self, c, "head", (c.d_model, c.vocab_size), ("embed", "vocab"), 1, c.init_std, FanIn())
      logits_BLV = c.products(x_BLD, head_DV.astype(c.dtype), "D,DV->V")
    return nn.with_logical_constraint(logits_BLV.astype(jnp.float32), ("act_batch", "act_len", "act_vocab"))

  def _generate(self, tokens_BL, cache: KVCache, every_column: bool = False):
    """Prefill (L prompt columns) or decode (L = 1) against the cache; same parameters, same names as __call__.

    No remat, pipeline or sequence split here: nothing is differentiated, and meshtrain/inference/generator.py runs
    the model unpipelined on a mesh without a sequence axis. Only the last column's logits are computed unless
    `every_column` (a server's prompt logprobs): with left padding it is every row's last token, the one whose next
    token is wanted, and a prefill's [B, L, V] logits would cost L times more.
    """
    c = self.cfg
    embed_VD = param(self, "embedding", (c.vocab_size, c.d_model), ("vocab", "embed"), c.init_std, c.param_dtype,
                     c.init, FanIn(in_axes=(), distribution="normal"))
    x_BLD = jnp.take(embed_VD, tokens_BL, axis=0).astype(c.dtype)
    x_BLD = nn.with_logical_constraint(x_BLD, ("act_batch", "act_res_len", "act_embed"))
    slot_BL = cache.end.reshape(-1, 1) + jnp.arange(tokens_BL.shape[1], dtype=jnp.int32)  # [1, L] or [B, L]
    pos_BL = slot_BL - cache.start_B[:, None]  # each row counts from its own first token
    kv, slots = (cache.k_NBKSE, cache.v_NBKSE), (cache.start_B, cache.end, cache.attend)
    if c.scan_layers:
      stack = nn.scan(Block, variable_axes={"params": 0, "moe": 0}, split_rngs={"params": True},
                      in_axes=(nn.broadcast, 0, nn.broadcast), length=c.num_layers, unroll=unrolled_layers(c),
                      metadata_params={nn.PARTITION_NAME: "layers"})
      x_BLD, (k_NBKSE, v_NBKSE) = stack(c, name="layers")(x_BLD, pos_BL, kv, slots)
      k_NBKSE, v_NBKSE = (nn.with_logical_constraint(a, CACHE_AXES) for a in (k_NBKSE, v_NBKSE))
    else:
      ks, vs = [], []
      for i in range(c.num_layers):
        x_BLD, (k_BKSE, v_BKSE) = Block(c, name=f"layer_{i}")(x_BLD, pos_BL, (kv[0][i], kv[1][i]), slots)
        ks.append(k_BKSE)
        vs.append(v_BKSE)
      k_NBKSE, v_NBKSE = tuple(ks), tuple(vs)
    x_BLD = RMSNorm(c, name="final_norm")(x_BLD if every_column else x_BLD[:, -1:])
    if c.tie_embeddings:
      logits_BLV = c.products(x_BLD, embed_VD.astype(c.dtype), "D,VD->V")
      if c.init == "fan_in":
        logits_BLV = logits_BLV / jnp.asarray(math.sqrt(c.d_model), logits_BLV.dtype)
    else:
      head_DV = kernel(self, c, "head", (c.d_model, c.vocab_size), ("embed", "vocab"), 1, c.init_std, FanIn())
      logits_BLV = c.products(x_BLD, head_DV.astype(c.dtype), "D,DV->V")
    logits_BLV = nn.with_logical_constraint(logits_BLV.astype(jnp.float32), ("act_batch", "act_len", "act_vocab"))
    new_cache = cache.replace(k_NBKSE=k_NBKSE, v_NBKSE=v_NBKSE, end=cache.end + tokens_BL.shape[1])
    return logits_BLV, new_cache


class HiddenStates(nn.Module):
  """tokens [B, L] -> the residual stream after the first cfg.num_layers blocks [B, L, D], through the final norm
  with `normed`: Hugging Face's hidden_states[k] (its last one is normed). A frozen text encoder's features
  (meshtrain/data/text_features.py). The parameter names are Transformer's, so a language model's parameters (its
  first k stacked layers) apply as they are; the head is not used."""
  cfg: ModelConfig
  normed: bool

  @nn.compact
  def __call__(self, tokens_BL):
    c = self.cfg
    embed_VD = param(self, "embedding", (c.vocab_size, c.d_model), ("vocab", "embed"), c.init_std, c.param_dtype,
                     c.init, FanIn(in_axes=(), distribution="normal"))
    x_BLD = jnp.take(embed_VD, tokens_BL, axis=0).astype(c.dtype)
    if c.num_layers:
      stack = nn.scan(Block, variable_axes={"params": 0, "moe": 0}, split_rngs={"params": True},
                      in_axes=nn.broadcast, length=c.num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
      x_BLD, _ = stack(c, name="layers")(x_BLD, jnp.arange(tokens_BL.shape[1]))
    return RMSNorm(c, name="final_norm")(x_BLD) if self.normed else x_BLD
