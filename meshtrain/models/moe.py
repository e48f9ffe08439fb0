"""Mixture-of-experts SwiGLU MLP: a drop-in replacement for llama.MLP (`x_BLD -> y_BLD`).

Shape letters as in llama.py, plus X experts, K experts per token, C capacity (slots per expert per group),
G groups, S tokens per group. A group is one sequence of the batch (G = B, S = L), so groups follow the batch
sharding and routing never needs a collective.

GShard/Switch-style dispatch: every expert has C slots per group; tokens are written into slots with a one-hot
dispatch tensor [G, S, X, C] and read back with combine weights [G, S, X, C], all with einsums (static shapes,
no sort or ragged kernels). The dispatched activations [X, G, C, D] name their expert axis `act_expert`: when the
rules map it to an `expert` mesh axis that also splits the batch, XLA turns the two relayouts into all-to-alls
(tokens to their experts and back).

Routing choices:
- The router runs in float32 (a softmax over experts is sensitive to rounding).
- Top-k weights are renormalised over the chosen experts (Mixtral-style) when K > 1, so the output scale does
  not depend on how peaked the router is. With K = 1 renormalising would make every weight 1 and cut the router
  off from the language-model gradient, so K = 1 keeps the raw probability (Switch-style).
- Capacity priority: all first choices before any second choice, then position within the sequence. A token
  over capacity at an expert is dropped there: that expert contributes 0 and the residual stream carries it.

Auxiliary values are sown into a separate collection, "moe" (one scalar per layer each):
  load_balance_loss  X * sum_x f_x * P_x (Switch Transformer). f_x is the fraction of the top-K assignments that
                     go to x (before capacity drops, divided by K so it sums to 1) and P_x the mean router
                     probability of x, both over all tokens of the call; 1.0 when routing is uniform, for any K.
  router_z_loss      mean over tokens of logsumexp(logits)^2 (ST-MoE): keeps router logits small.
  dropped_fraction   fraction of the (token, choice) assignments dropped for lack of capacity.
  aux_loss           aux_loss_weight * load_balance_loss + router_z_loss_weight * router_z_loss: add to the loss.
Retrieve them with `y, state = model.apply(variables, x, mutable=["moe"])` and `collect(state["moe"])`. Without
`mutable=["moe"]` sow is a no-op, so evaluation pays nothing. Under nn.scan add "moe": 0 to `variable_axes`
(each value then gains a leading layer axis); `init` also returns a "moe" collection, which is not a parameter.
"""
import dataclasses
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from meshtrain.models.activations import swiglu
from meshtrain.models.params import FanIn, param

AUX_NAMES = ("load_balance_loss", "router_z_loss", "dropped_fraction", "aux_loss")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  num_experts: int = 8
  experts_per_token: int = 2
  capacity_factor: float = 1.25
  aux_loss_weight: float = 1e-2
  router_z_loss_weight: float = 1e-3


def capacity(moe: MoEConfig, tokens_per_group: int) -> int:
  """Slots per expert per group: ceil(capacity_factor * S * K / X); never above S (a token picks an expert once)."""
  c = math.ceil(moe.capacity_factor * tokens_per_group * moe.experts_per_token / moe.num_experts)
  return max(1, min(c, tokens_per_group))


class Routing(NamedTuple):
  dispatch_GSXC: jax.Array  # 1.0 where token s of group g sits in slot c of expert x
  combine_GSXC: jax.Array   # its routing weight in that slot, 0 elsewhere
  load_balance_loss: jax.Array
  router_z_loss: jax.Array
  dropped_fraction: jax.Array


def _top_k(probs_GSX, k: int):
  """k rounds of argmax (ties to the lower index, as lax.top_k). Not lax.top_k: XLA's partitioner all-gathers
  its operand across the batch shards, while argmax and one_hot split along G and S like any elementwise op."""
  weights, experts = [], []
  masked_GSX = probs_GSX
  for _ in range(k):
    expert_GS = jnp.argmax(masked_GSX, axis=-1)
    chosen_GSX = jax.nn.one_hot(expert_GS, probs_GSX.shape[-1], dtype=jnp.bool_)
    weights.append(jnp.sum(jnp.where(chosen_GSX, probs_GSX, 0.0), axis=-1))
    experts.append(expert_GS)
    masked_GSX = jnp.where(chosen_GSX, -jnp.inf, masked_GSX)
  return jnp.stack(weights, axis=-1), jnp.stack(experts, axis=-1)


def route(logits_GSX, k: int, capacity: int) -> Routing:
  """Top-k capacity routing of float32 router logits (see the module docstring for the choices)."""
  G, S, X = logits_GSX.shape
  probs_GSX = jax.nn.softmax(logits_GSX, axis=-1)
  weight_GSK, expert_GSK = _top_k(probs_GSX, k)
  if k > 1:
    weight_GSK = weight_GSK / jnp.sum(weight_GSK, axis=-1, keepdims=True)
  # Rank-major order (K before S) makes the running count give first choices priority over second ones.
  choice_GKSX = jax.nn.one_hot(jnp.swapaxes(expert_GSK, 1, 2), X, dtype=jnp.int32)
  slot_GKSX = jnp.cumsum(choice_GKSX.reshape(G, k * S, X), axis=1).reshape(G, k, S, X) - 1
  slot_GKS = jnp.sum(slot_GKSX * choice_GKSX, axis=-1)
  # one_hot of a slot >= C is all zeros: that is the drop.
  slot_GKSC = jax.nn.one_hot(slot_GKS, capacity, dtype=jnp.float32)
  # Experts chosen by one token are distinct, so summing over K never puts two choices in one (s, x) cell.
  dispatch_GSXC = jnp.einsum("GKSX,GKSC->GSXC", choice_GKSX.astype(jnp.float32), slot_GKSC)
  combine_GSXC = jnp.einsum("GKSX,GKSC,GSK->GSXC", choice_GKSX.astype(jnp.float32), slot_GKSC, weight_GSK)

  frac_X = jnp.mean(jnp.sum(choice_GKSX, axis=1).astype(jnp.float32), axis=(0, 1)) / k
  load_balance = X * jnp.sum(frac_X * jnp.mean(probs_GSX, axis=(0, 1)))
  z_loss = jnp.mean(jnp.square(jax.nn.logsumexp(logits_GSX, axis=-1)))
  dropped = 1.0 - jnp.sum(dispatch_GSXC) / (G * S * k)
  return Routing(dispatch_GSXC, combine_GSXC, load_balance, z_loss, dropped)


def collect(moe_vars) -> dict[str, jax.Array]:
  """The sown "moe" collection as scalars: `aux_loss` summed over layers (add it to the loss), the rest averaged."""
  found = {name: [] for name in AUX_NAMES}
  for path, leaf in jax.tree_util.tree_leaves_with_path(moe_vars):
    names = [getattr(p, "key", None) for p in path]
    for name in AUX_NAMES:
      if name in names:
        found[name].append(jnp.ravel(leaf))
  out = {}
  for name, leaves in found.items():
    if leaves:
      flat = jnp.concatenate(leaves)
      out[name] = jnp.sum(flat) if name == "aux_loss" else jnp.mean(flat)
  return out


class MoEMLP(nn.Module):
  """cfg: a llama.ModelConfig (d_model, mlp_dim = per-expert width, dtype, param_dtype, init, init_std, num_layers)."""
  cfg: Any
  moe: MoEConfig

  @nn.compact
  def __call__(self, x_BLD):
    c, m = self.cfg, self.moe
    G, S, D = x_BLD.shape
    X, F = m.num_experts, c.mlp_dim
    C = capacity(m, S)
    out_std = c.init_std / math.sqrt(2 * c.num_layers)
    # The router's expert axis is never split (None): every token needs all X logits, and D x X is tiny.
    # model.init="fan_in": truncated normal, fan-in of one expert (D in, F out), the experts a batch axis. MaxText's
    # RoutedMoE passes in_axis=0 for its [X, D, F] kernels (maxtext/layers/moe.py:1017-1018), which makes jax
    # count fan_in = X*F: not copied, so an expert's outputs start at the scale of llama.MLP's.
    w_router = param(self, "router", (D, X), ("embed", None), c.init_std, c.param_dtype, c.init, FanIn())
    expert = FanIn(in_axes=(1,), batch_axes=(0,))
    w_gate = param(self, "gate", (X, D, F), ("expert", "embed", "mlp"), c.init_std, c.param_dtype, c.init, expert)
    w_up = param(self, "up", (X, D, F), ("expert", "embed", "mlp"), c.init_std, c.param_dtype, c.init, expert)
    w_down = param(self, "down", (X, F, D), ("expert", "mlp", "embed"), out_std, c.param_dtype, c.init, expert)

    x_GSD = nn.with_logical_constraint(x_BLD.astype(c.dtype), ("act_batch", "act_len", "act_embed"))
    logits_GSX = jnp.einsum("GSD,DX->GSX", x_GSD.astype(jnp.float32), w_router.astype(jnp.float32))
    r = route(logits_GSX, m.experts_per_token, C)
    # Routing stays with its group: no communication until the tokens move to their experts.
    dispatch_GSXC = nn.with_logical_constraint(r.dispatch_GSXC.astype(c.dtype), ("act_batch", "act_len", None, None))
    combine_GSXC = nn.with_logical_constraint(r.combine_GSXC.astype(c.dtype), ("act_batch", "act_len", None, None))

    # Groups split over the expert axis -> experts split over it: the all-to-all that sends tokens to experts.
    x_XGCD = jnp.einsum("GSXC,GSD->XGCD", dispatch_GSXC, x_GSD)
    x_XGCD = nn.with_logical_constraint(x_XGCD, ("act_expert", "act_batch", None, "act_embed"))
    gate_XGCF = jnp.einsum("XGCD,XDF->XGCF", x_XGCD, w_gate.astype(c.dtype))
    up_XGCF = jnp.einsum("XGCD,XDF->XGCF", x_XGCD, w_up.astype(c.dtype))
    h_XGCF = nn.with_logical_constraint(swiglu(gate_XGCF, up_XGCF), ("act_expert", "act_batch", None, "act_mlp"))
    y_XGCD = jnp.einsum("XGCF,XFD->XGCD", h_XGCF, w_down.astype(c.dtype))
    y_XGCD = nn.with_logical_constraint(y_XGCD, ("act_expert", "act_batch", None, "act_embed"))
    # And back: the combine contracts X and C, so its result is laid out by group again (second all-to-all).
    y_GSD = jnp.einsum("XGCD,GSXC->GSD", y_XGCD, combine_GSXC)

    self.sow("moe", "load_balance_loss", r.load_balance_loss)
    self.sow("moe", "router_z_loss", r.router_z_loss)
    self.sow("moe", "dropped_fraction", r.dropped_fraction)
    self.sow("moe", "aux_loss", m.aux_loss_weight * r.load_balance_loss + m.router_z_loss_weight * r.router_z_loss)
    return nn.with_logical_constraint(y_GSD, ("act_batch", "act_len", "act_embed"))
