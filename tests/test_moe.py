"""Mixture-of-experts MLP: capacity and drop order, auxiliary losses, a float64 per-token reference, and expert
parallelism (same numbers on a data x expert mesh, with all-to-all in the compiled HLO)."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain.models import moe as moe_lib
from meshtrain.models.llama import ModelConfig

D, F, X, K, B, L = 16, 32, 4, 2, 4, 8
CFG = ModelConfig(vocab_size=32, num_layers=2, d_model=D, num_heads=2, num_kv_heads=2, head_dim=8, mlp_dim=F)


def make(capacity_factor, seed=0, batch=B, skew=0.0):
  """Module, params and input; router logits set by hand: router = [I; 0], so logits = x[..., :X].

  Weights have std 1/sqrt(fan_in) (not init_std) so outputs are O(1) and absolute tolerances are meaningful.
  """
  moe = moe_lib.MoEConfig(num_experts=X, experts_per_token=K, capacity_factor=capacity_factor,
                          aux_loss_weight=0.1, router_z_loss_weight=0.01)
  model = moe_lib.MoEMLP(CFG, moe)
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(batch, L, D)).astype(np.float32)
  x[..., 0] += skew  # a favourite expert, so that capacity overflows
  # Parameters drawn here rather than by model.init: the same shapes, and no init program to compile.
  shapes = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
  params = {name: (rng.normal(size=s.value.shape) / np.sqrt(s.value.shape[-2])).astype(np.float32)
            for name, s in shapes.items()}
  params["router"] = np.eye(D, X, dtype=np.float32)
  return model, params, x


def apply(model, params, x):
  y, state = model.apply({"params": params}, x, mutable=["moe"])
  return y, moe_lib.collect(state["moe"])


def run(model, params, x):
  return jax.jit(apply, static_argnums=0)(model, params, x)


def top_k(logits_BSX):
  """Per token, float64: chosen experts by rank and their renormalised weights."""
  p = np.exp(logits_BSX - logits_BSX.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  top = np.argsort(-p, axis=-1, kind="stable")[..., :K]
  w = np.take_along_axis(p, top, -1)
  return top, w / w.sum(-1, keepdims=True), p


def expected_slots(top_BSK, C):
  """Slot of every (token, rank) in its expert's buffer, -1 if dropped: first choices first, then position."""
  slot = -np.ones(top_BSK.shape, int)
  for b in range(top_BSK.shape[0]):
    used = np.zeros(X, int)
    for r in range(K):
      for s in range(top_BSK.shape[1]):
        e = top_BSK[b, s, r]
        if used[e] < C:
          slot[b, s, r], used[e] = used[e], used[e] + 1
  return slot


def reference(params, x, slot=None):
  """Dense per-token loop in float64 over each token's kept top-k experts."""
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  x = np.asarray(x, np.float64)
  top, w, _ = top_k(x @ p["router"])
  y = np.zeros_like(x)
  for b, s, r in np.ndindex(*top.shape):
    if slot is None or slot[b, s, r] >= 0:
      e, xt = top[b, s, r], x[b, s]
      g = xt @ p["gate"][e]
      y[b, s] += w[b, s, r] * ((g / (1 + np.exp(-g)) * (xt @ p["up"][e])) @ p["down"][e])
  return y


def test_route_hand_case_first_choices_win():
  # Token 0 prefers expert 1, tokens 1-3 expert 0; second choices are the other expert. Two slots each.
  logits = jnp.array([[[0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]])
  r = moe_lib.route(logits, k=2, capacity=2)
  d = np.asarray(r.dispatch_GSXC)[0]  # [S, X, C]
  want = np.zeros((4, 2, 2))
  want[1, 0, 0] = want[2, 0, 1] = 1  # expert 0: first choices of tokens 1, 2 (token 3's and token 0's 2nd dropped)
  want[0, 1, 0] = want[1, 1, 1] = 1  # expert 1: token 0's first choice, then token 1's second
  np.testing.assert_array_equal(d, want)
  assert float(r.dropped_fraction) == 0.5


def test_capacity_respected_and_drops_in_priority_order():
  model, params, x = make(capacity_factor=0.5, skew=2.0)
  C = moe_lib.capacity(model.moe, L)
  assert C == 2  # ceil(0.5 * 8 * 2 / 4)
  r = jax.jit(moe_lib.route, static_argnums=(1, 2))(x @ params["router"], K, C)
  d = np.asarray(r.dispatch_GSXC)  # [G, S, X, C]
  assert d.sum(axis=(1, 3)).max() <= C and d.sum(axis=1).max() <= 1  # <= C tokens per expert, one per slot
  top, _, _ = top_k(x[..., :X].astype(np.float64))
  slot = expected_slots(top, C)
  want = np.zeros_like(d)
  for b, s, k in zip(*np.nonzero(slot >= 0)):
    want[b, s, top[b, s, k], slot[b, s, k]] = 1
  np.testing.assert_array_equal(d, want)
  dropped = np.mean(slot < 0)
  assert dropped > 0.3  # the case really overflows
  y, aux = run(model, params, x)
  np.testing.assert_allclose(aux["dropped_fraction"], dropped, rtol=1e-6)
  # Dropped choices contribute nothing; kept ones keep their full renormalised weight.
  np.testing.assert_allclose(y, reference(params, x, slot), rtol=1e-5, atol=1e-5)


def test_aux_losses_match_hand_computation():
  model, params, x = make(capacity_factor=2.0, seed=1, skew=1.0)
  _, aux = run(model, params, x)
  logits = x[..., :X].astype(np.float64)
  top, _, p = top_k(logits)
  f = np.array([(top == e).sum() for e in range(X)]) / (B * L * K)
  lb = X * np.sum(f * p.mean(axis=(0, 1)))
  m = logits.max(-1)
  z = np.mean((m + np.log(np.exp(logits - m[..., None]).sum(-1))) ** 2)
  np.testing.assert_allclose(aux["load_balance_loss"], lb, rtol=1e-5)
  np.testing.assert_allclose(aux["router_z_loss"], z, rtol=1e-5)
  np.testing.assert_allclose(aux["aux_loss"], 0.1 * lb + 0.01 * z, rtol=1e-5)


def test_no_drops_equals_dense_reference():
  model, params, x = make(capacity_factor=X / K)  # C = S: nothing can drop
  # A dense router, so routing depends on every input feature (not just the first X).
  params["router"] = np.random.default_rng(3).normal(size=(D, X)).astype(np.float32)
  y, aux = run(model, params, x)
  assert float(aux["dropped_fraction"]) == 0.0
  # float32 compute vs float64 reference: outputs are O(1), so 1e-5 relative / absolute.
  np.testing.assert_allclose(y, reference(params, x), rtol=1e-5, atol=1e-5)


def test_sown_values_stack_under_scan():
  class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return x + moe_lib.MoEMLP(CFG, moe_lib.MoEConfig(num_experts=X, experts_per_token=K))(x), None

  stack = nn.scan(Layer, variable_axes={"params": 0, "moe": 0}, split_rngs={"params": True}, length=2,
                  metadata_params={nn.PARTITION_NAME: "layers"})()
  x = jnp.ones((B, L, D))
  shapes = nn.meta.unbox(jax.eval_shape(stack.init, jax.random.key(0), x, None)["params"])
  params = jax.tree.map(lambda s: jnp.full(s.shape, 0.1, s.dtype), shapes)
  _, state = jax.jit(lambda p: stack.apply({"params": p}, x, None, mutable=["moe"]))(params)
  assert state["moe"]["MoEMLP_0"]["aux_loss"][0].shape == (2,)  # one value per layer
  assert set(moe_lib.collect(state["moe"])) == set(moe_lib.AUX_NAMES)


# Expert parallelism: experts split over `expert`, the batch over (data, expert). `act_expert` comes before
# `act_batch` (Flax gives a mesh axis to the first rule that claims it), and `act_batch` falls back to `data`
# alone where `expert` is already taken by the expert dimension of the dispatched activations.
EP_RULES = (("expert", "expert"), ("act_expert", "expert"), ("act_batch", ("data", "expert")), ("act_batch", "data"),
            ("embed", None), ("mlp", None), ("act_len", None), ("act_embed", None), ("act_mlp", None))


def test_expert_parallel_matches_single_device_and_uses_all_to_all():
  model, params, x = make(capacity_factor=1.0, batch=8, skew=1.0)  # some drops, to cover them too
  ct = np.random.default_rng(5).normal(size=x.shape).astype(np.float32)

  def loss(params, x):
    y, aux = apply(model, params, x)
    return jnp.sum(y * ct) + aux["aux_loss"], (y, aux)

  fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
  want = jax.jit(fn)(params, x)

  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh), nn.logical_axis_rules(EP_RULES):
    abstract = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, EP_RULES)
    p_sharded = jax.device_put(params, shardings)
    x_sharded = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
    assert p_sharded["gate"].sharding.spec == P("expert", None, None)
    compiled = jax.jit(fn).lower(p_sharded, x_sharded).compile()
    got = compiled(p_sharded, x_sharded)
  assert re.search(r" all-to-all(-start)?\(", compiled.as_text())
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), got, want)
