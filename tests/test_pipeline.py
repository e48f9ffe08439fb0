"""The pipelined block stack computes what llama's `nn.scan` stack computes, on one device and on stage meshes.

Tolerance: outputs and gradients agree to 1e-5 (absolute and relative, float32). The pipeline runs the same
per-layer ops in the same order per microbatch; only reductions split over devices (fsdp) add in another order
(~1e-7 relative). A scheduling bug (a microbatch dropped, shifted or run through a wrong layer) is O(1).
"""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain.errors import UserError
from meshtrain.models.llama import Block, ModelConfig
from meshtrain.parallel import pipeline

CFG = ModelConfig(vocab_size=64, num_layers=4, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)
B, L, D = 16, 8, 32
TOL = dict(rtol=1e-5, atol=1e-5)
AXES = ("stage", "data", "fsdp")
# Only what these layouts need; every other logical name is unmapped, i.e. replicated.
RULES = {"dp": (("layers", "stage"), ("act_stage", "stage"), ("act_batch", ("data", "fsdp")))}
RULES["fsdp"] = RULES["dp"] + (("embed", "fsdp"),)


class Stack(nn.Module):
  """llama's scanned stack on its own: the reference."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_BLD, pos_L):
    stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=nn.broadcast,
                    length=self.cfg.num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
    return stack(self.cfg, name="layers")(x_BLD, pos_L)[0]


def loss_and_grads(model):
  """(loss, y), (param grads, input grads) of a fixed random projection of the stack's output."""
  ct_BLD = jax.random.normal(jax.random.key(2), (B, L, D))

  def loss(params, x_BLD):
    y_BLD = model.apply({"params": params}, x_BLD, jnp.arange(L))
    return jnp.sum(y_BLD * ct_BLD), y_BLD
  return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


@pytest.fixture(scope="module")
def reference():
  x_BLD = jax.random.normal(jax.random.key(1), (B, L, D))
  params = nn.meta.unbox(jax.jit(Stack(CFG).init)(jax.random.key(0), x_BLD, jnp.arange(L))["params"])
  return x_BLD, params, jax.jit(loss_and_grads(Stack(CFG)))(params, x_BLD)


class Piped(nn.Module):
  """The pipeline where llama's Transformer puts its stack (name "layers"), so the parameter trees line up."""
  stages: int
  micro: int
  repeats: int = 1

  @nn.compact
  def __call__(self, x_BLD, pos_L):
    return pipeline.Pipeline(Block, CFG, self.stages, self.micro, "circular" if self.repeats > 1 else "gpipe",
                             self.repeats, name="layers")(x_BLD, pos_L)


def assert_matches(got, want, stages, repeats):
  (loss, y_BLD), (grads, gx_BLD) = got
  (want_loss, want_y), (want_grads, want_gx) = want
  np.testing.assert_allclose(y_BLD, want_y, **TOL)
  np.testing.assert_allclose(gx_BLD, want_gx, **TOL)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  grads = pipeline.from_pipeline_params(jax.device_get(grads["layers"]), stages, repeats)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, **TOL), grads, want_grads["layers"])


def test_bubble_fraction():
  assert pipeline.bubble_fraction(1, 8) == 0
  assert pipeline.bubble_fraction(4, 4) == pytest.approx(3 / 7)
  assert pipeline.bubble_fraction(4, 16) == pytest.approx(3 / 19)
  assert pipeline.bubble_fraction(4, 4, num_repeats=2) == pytest.approx(3 / 11)  # circular: R*M in place of M


def test_parameter_tree_is_the_scanned_stacks():
  # Same scan, same scope: same names, shapes, logical axes and initial values, so checkpoints carry over.
  init = lambda m: jax.jit(m.init)(jax.random.key(0), jnp.zeros((B, L, D)), jnp.arange(L))["params"]
  got, want = init(Piped(2, 4)), init(Stack(CFG))
  assert nn.get_partition_spec(got) == nn.get_partition_spec(want)
  assert nn.get_partition_spec(got)["layers"]["mlp"]["up"] == P("layers", "embed", "mlp")
  jax.tree.map(np.testing.assert_array_equal, nn.meta.unbox(got), nn.meta.unbox(want))


@pytest.mark.parametrize("stages,micro,repeats", [(2, 4, 1), (4, 4, 1), (2, 4, 2)])
def test_one_device_matches_scanned_stack(reference, stages, micro, repeats):
  x_BLD, params, want = reference
  params = {"layers": pipeline.to_pipeline_params(params["layers"], stages, repeats)}
  got = jax.jit(loss_and_grads(Piped(stages, micro, repeats)))(params, x_BLD)
  assert_matches(got, want, stages, repeats)


# The other stage layouts (stage=4 x fsdp=2, circular on stage x fsdp x tensor) are trained end to end against
# one device in test_numerics.py; this one also pins the collectives.
@pytest.mark.parametrize("mesh_shape,rules,repeats", [((2, 4, 1), "dp", 1)])
def test_stage_mesh_matches_scanned_stack(reference, mesh_shape, rules, repeats):
  x_BLD, params, want = reference
  stages, rules = mesh_shape[0], RULES[rules]
  mesh = jax.make_mesh(mesh_shape, AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)
  model = Piped(stages, 4, repeats)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    abstract = jax.eval_shape(model.init, jax.random.key(0), x_BLD, jnp.arange(L))["params"]
    param_sh = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    x_sh = NamedSharding(mesh, P(("data", "fsdp")))
    params = jax.device_put({"layers": pipeline.to_pipeline_params(params["layers"], stages, repeats)}, param_sh)
    x_BLD = jax.device_put(x_BLD, x_sh)
    step = jax.jit(loss_and_grads(model), in_shardings=(param_sh, x_sh),
                   out_shardings=((None, x_sh), (param_sh, x_sh))).lower(params, x_BLD).compile()
    got = step(params, x_BLD)
  assert_matches(got, want, stages, repeats)
  # Each device holds only its stage's layers...
  up = params["layers"]["mlp"]["up"]
  assert up.sharding.spec[0] == "stage"
  assert up.addressable_shards[0].data.shape[0] == CFG.num_layers // stages
  # ...activations move between stages by collective-permute (the shift), and no weight is gathered across
  # stages (with replicated weights inside a stage, the dp layout has no all-gather at all).
  hlo = step.as_text()
  assert re.search(r"collective-permute(-start)?\(", hlo)
  if rules == RULES["dp"]:
    assert not re.search(r"all-gather(-start)?\(", hlo)


def test_rejects_bad_shapes():
  x_BLD, pos_L = jnp.zeros((B, L, D)), jnp.arange(L)
  for model, what in [(Piped(3, 4), "not divisible by stages"), (Piped(2, 3), "microbatches"),
                      (Piped(2, 1, 2), "needs microbatches >= stages")]:
    with pytest.raises(UserError, match=what):
      jax.eval_shape(model.init, jax.random.key(0), x_BLD, pos_L)
