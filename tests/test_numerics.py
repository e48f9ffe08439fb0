"""Every mesh layout computes the same losses and gradients as one device (float32, stated tolerances)."""
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
import xla_fast

from meshtrain import config, layout as layout_lib, mesh as mesh_lib
from meshtrain.parallel import pipeline
from meshtrain.step import IGNORE_ID

PAD_ID = 256  # the byte tokenizer's
STEPS = 3
LAYOUTS = {  # name: (mesh sizes, sharding rules)
    "data=8": ({"data": 8}, "dp"),
    "fsdp=8": ({"data": 1, "fsdp": 8}, "fsdp"),
    "fsdp=4 x tensor=2": ({"data": 1, "fsdp": 4, "tensor": 2}, "fsdp_tp"),
    "data=2 x tensor=4": ({"data": 2, "tensor": 4}, "tp"),
    "data=2 x tensor=4, sequence parallel": ({"data": 2, "tensor": 4}, "tp", {"sharding.sequence_parallel": True}),
    "sequence=4 x data=2, ring": ({"data": 2, "sequence": 4}, "dp"),
    "sequence=8, all-gather": ({"sequence": 8}, "dp", {"model.context_attention": "allgather"}),
}
# Sharded reductions add in another order than one device does: float32 rounding differs at ~1e-7 relative
# per op; after three Adam steps the losses agree to ~1e-6. A layout bug (a wrong split, a missing reduction)
# moves the loss by 1e-2 or more.
LOSS_RTOL = 2e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-7


def tiny_config(mesh_sizes, rules, overrides=None, accum=1):
  cfg = config.base_config()
  cfg.steps, cfg.batch_size, cfg.seq_len = STEPS, 16, 64
  cfg.optimizer.warmup_steps = 1
  cfg.optimizer.grad_accum_steps = accum
  cfg.mesh.update({"data": 1, "fsdp": 1, "tensor": 1, **mesh_sizes})
  cfg.sharding.rules = rules
  cfg.model.vocab_size = 384
  cfg.model.num_layers = 2  # enough to test the layer stack; halves the unrolled compile
  for key, value in (overrides or {}).items():
    group, name = key.split(".")
    cfg[group][name] = value
  return cfg


def batches(cfg):
  rng = np.random.default_rng(0)
  for _ in range(STEPS):
    tokens = rng.integers(0, 259, size=(cfg.batch_size, cfg.seq_len + 1), dtype=np.int32)
    tokens[:, -5:] = PAD_ID  # padded tails must be masked identically everywhere
    # As the pipeline pads: the input is the pad id, the target IGNORE_ID (skipped by the loss).
    yield {"inputs": tokens[:, :-1], "targets": np.where(tokens[:, 1:] == PAD_ID, IGNORE_ID, tokens[:, 1:])}


def train(cfg, devices, init_params=None):
  """Losses of STEPS updates, the gradients at the first, and the final parameters."""
  layout = layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices=devices))
  state = layout.init(cfg.seed)
  if init_params is not None:  # Adam's initial state does not depend on the parameter values
    state = state.replace(params=jax.device_put(init_params, layout.state_sharding.params))
  grad_fn, step_fn = layout.compile_grad(), layout.compile_train_step()
  losses, first_grads = [], None
  for batch in batches(cfg):
    batch = jax.device_put(batch, layout.batch_sharding)
    if first_grads is None:
      first_grads = jax.device_get(grad_fn(state.params, batch)[1])
    state, metrics = step_fn(state, batch)
    losses.append(float(metrics["loss"]))
  return np.array(losses), first_grads, jax.device_get(state.params)


@pytest.fixture(scope="module")
def reference():
  return train(tiny_config({}, "dp"), jax.devices()[:1])


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_one_device(name, reference):
  ref_losses, ref_grads, _ = reference
  losses, grads, _ = train(tiny_config(*LAYOUTS[name]), jax.devices())
  assert ref_losses[-1] < ref_losses[0]  # it is actually training
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL), grads, ref_grads)


FOUR_AXES = """
import sys, jax, numpy as np
jax.config.update("jax_num_cpu_devices", 16)
sys.path.insert(0, "tests")
import test_numerics as t
ref_losses, ref_grads, _ = t.train(t.tiny_config({}, "dp"), jax.devices()[:1])
losses, grads, _ = t.train(t.tiny_config({"data": 2, "fsdp": 2, "sequence": 2, "tensor": 2}, "fsdp_tp",
                                         {"sharding.sequence_parallel": True}), jax.devices())
np.testing.assert_allclose(losses, ref_losses, rtol=t.LOSS_RTOL)
jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=t.GRAD_RTOL, atol=t.GRAD_ATOL), grads, ref_grads)
print("equal", losses)
"""


def test_four_axes_match_one_device():
  """data x fsdp x sequence x tensor (+ sequence parallelism) needs 16 devices: a process of its own."""
  proc = subprocess.run([sys.executable, "-c", FOUR_AXES], capture_output=True, text=True, timeout=600,
                        cwd=pathlib.Path(__file__).parents[1], env=xla_fast.env())
  assert proc.returncode == 0 and "equal" in proc.stdout, proc.stderr[-3000:]


MOE = {"model.num_experts": 8, "model.experts_per_token": 2, "model.capacity_factor": 1.5}


def test_experts_match_one_device():
  """Mixture of experts: experts split over `expert` (tokens moved by all-to-all) equals the same model on one
  device, including which tokens are dropped (capacity is per sequence, so it does not depend on the layout)."""
  ref_losses, ref_grads, _ = train(tiny_config({}, "dp", MOE), jax.devices()[:1])
  losses, grads, _ = train(tiny_config({"data": 2, "expert": 4}, "dp", MOE), jax.devices())
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL), grads, ref_grads)
  # expert x sequence x tensor: tokens routed while the sequence is split (in natural order, see layout.py)
  losses, grads, _ = train(tiny_config({"expert": 2, "sequence": 2, "tensor": 2}, "tp",
                                       {**MOE, "sharding.causal_load_balance": False}), jax.devices())
  assert np.abs(ref_grads["layers"]["moe"]["gate"]).max() > 1e-4  # the experts are in the gradient
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL), grads, ref_grads)


# The open-model features (Qwen2's biases, Qwen3's q/k norms, Llama 3's rotary scaling, Mistral's sliding window
# shorter than the sequence) on the layouts that split what they touch: heads (tensor), parameters (fsdp), the
# sequence (tensor + sequence parallel), layers (pipeline stages); context parallelism (mesh.sequence > 1, which has
# no sliding window) and experts together in the test after this one.
OPEN_MODEL = {"model.attention_bias": True, "model.qk_norm": True, "model.rope_type": "llama3",
              "model.rope_factor": 8.0, "model.rope_original_max_len": 16, "model.sliding_window": 24}
OPEN_MODEL_LAYOUTS = {"fsdp=4 x tensor=2": ({"data": 1, "fsdp": 4, "tensor": 2}, "fsdp_tp", {}),
                      "data=2 x tensor=4, sequence parallel": ({"data": 2, "tensor": 4}, "tp",
                                                               {"sharding.sequence_parallel": True}),
                      # one layer per stage (GPipe, 4 micro-batches), each stage's split over fsdp x tensor
                      "stage=2 x fsdp=2 x tensor=2": ({"stage": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp", {})}


@pytest.fixture(scope="module")
def open_model_reference():
  return train(tiny_config({}, "dp", OPEN_MODEL), jax.devices()[:1])


@pytest.mark.slow
@pytest.mark.parametrize("name", OPEN_MODEL_LAYOUTS)
def test_open_model_features_match_one_device(name, open_model_reference, reference):
  ref_losses, ref_grads, _ = open_model_reference
  mesh, rules, extra = OPEN_MODEL_LAYOUTS[name]
  losses, grads, _ = train(tiny_config(mesh, rules, {**OPEN_MODEL, **extra}), jax.devices())
  assert ref_losses[-1] < ref_losses[0] and not np.allclose(ref_losses, reference[0], rtol=1e-3)  # another model
  for path in (("q_bias",), ("k_norm", "scale")):  # the new parameters are in the gradient
    g = ref_grads["layers"]["attn"]
    for key in path:
      g = g[key]
    assert np.abs(g).max() > 1e-5, path
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL), grads, ref_grads)


@pytest.mark.slow
def test_open_model_features_with_experts_and_context_parallelism_match_one_device():
  """The layouts left out above in one run: a mixture of experts with q/k/v biases, q/k norms and llama3 scaling,
  its experts split over `expert`, the sequence over `sequence` (ring attention) and heads over `tensor`. No sliding
  window: context parallelism refuses one (tests/test_errors.py)."""
  features = {**MOE, **{k: v for k, v in OPEN_MODEL.items() if k != "model.sliding_window"}}
  ref_losses, ref_grads, _ = train(tiny_config({}, "dp", features), jax.devices()[:1])
  losses, grads, _ = train(tiny_config({"expert": 2, "sequence": 2, "tensor": 2}, "tp",
                                       {**features, "sharding.causal_load_balance": False}), jax.devices())
  attn, moe = ref_grads["layers"]["attn"], ref_grads["layers"]["moe"]
  for g in (attn["q_bias"], attn["k_norm"]["scale"], moe["gate"]):  # the features are in the gradient
    assert np.abs(g).max() > 1e-5
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL), grads, ref_grads)


@pytest.fixture(scope="module")
def reference_4_layers():
  return train(tiny_config({}, "dp", {"model.num_layers": 4}), jax.devices()[:1])


PIPELINES = {  # pipeline layouts: 4 layers, so that 4 stages have one each
    "stage=2 x data=4": ({"stage": 2, "data": 4}, "dp", {}),
    "stage=4 x fsdp=2": ({"stage": 4, "fsdp": 2}, "fsdp", {}),
    "stage=2 x fsdp=2 x tensor=2, circular": ({"stage": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp",
                                              {"pipeline.schedule": "circular", "pipeline.repeats": 2}),
}


@pytest.mark.parametrize("name", PIPELINES)
def test_pipeline_matches_one_device(name, reference_4_layers):
  ref_losses, ref_grads, _ = reference_4_layers
  mesh_sizes, rules, extra = PIPELINES[name]
  cfg = tiny_config(mesh_sizes, rules, {"model.num_layers": 4, "pipeline.microbatches": 4, **extra})
  layout = layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh))
  if layout.layer_order != "sequential":  # circular: the same weights, stored stage-major
    ref_grads = {**ref_grads, "layers": pipeline.to_pipeline_params(ref_grads["layers"], 2, 2)}
    init = layout_lib.build(tiny_config({}, "dp", {"model.num_layers": 4}),
                            mesh_lib.make_mesh({}, devices=jax.devices()[:1])).init(0).params
    init = {**init, "layers": pipeline.to_pipeline_params(init["layers"], 2, 2)}
  else:
    init = None
  losses, grads, _ = train(cfg, jax.devices(), init_params=init)
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL), grads, ref_grads)


def test_gradient_accumulation_matches_full_batch(reference):
  ref_losses, _, ref_params = reference
  losses, _, params = train(tiny_config({"data": 2, "fsdp": 4}, "fsdp", accum=2), jax.devices())
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5), params, ref_params)


@pytest.mark.parametrize("scan,remat", [(True, "full"), (False, "save_dots")])
def test_remat_and_unrolled_layers_match(scan, remat, reference):
  ref_losses, ref_grads, _ = reference
  cfg = tiny_config({"fsdp": 8}, "fsdp")
  cfg.model.scan_layers, cfg.model.remat = scan, remat
  ref_init = layout_lib.build(tiny_config({}, "dp"), mesh_lib.make_mesh({}, devices=jax.devices()[:1])).init(0)
  unstack = lambda tree: tree if scan else {**{k: v for k, v in tree.items() if k != "layers"},
                          **{f"layer_{i}": jax.tree.map(lambda x: x[i], tree["layers"])
                             for i in range(cfg.model.num_layers)}}
  losses, grads, _ = train(cfg, jax.devices(), init_params=unstack(jax.device_get(ref_init.params)))
  np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL), grads, unstack(ref_grads))


def test_bfloat16_compute_keeps_float32_parameters(reference):
  ref_losses, _, _ = reference
  cfg = tiny_config({"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp")
  cfg.model.dtype = "bfloat16"
  losses, grads, params = train(cfg, jax.devices())
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(params) + jax.tree.leaves(grads))
  # bfloat16 keeps 8 bits of mantissa: the loss of a 6-nat model agrees to about 1e-2.
  np.testing.assert_allclose(losses, ref_losses, atol=2e-2)


def test_sequence_parallel_splits_the_residual_stream():
  """Megatron SP: the residual stream [B/data, L, D] is gathered before each tensor-parallel half (and the
  partial sums reduced back into sequence shards); without it the stream stays whole and no such gather exists."""
  def activation_gathers(sequence_parallel):
    cfg = tiny_config({"data": 2, "tensor": 4}, "tp", {"sharding.sequence_parallel": sequence_parallel})
    text = layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh)).compile_train_step().as_text()
    return len(re.findall(r"= f32\[8,64,128\]\{[0-9,]+\} all-gather(-start)?\(", text))
  assert activation_gathers(False) == 0
  assert activation_gathers(True) >= 4  # at least attention and MLP inputs of both layers, forward


def test_swiglu_gradient_equals_autodiff_and_keeps_two_arrays():
  """The hand-written SwiGLU backward (meshtrain/models/activations.py) equals autodiff of silu(g) * u, and keeps
  only its two inputs for the backward pass (autodiff keeps more arrays of that shape)."""
  from meshtrain.models.activations import swiglu
  rng = np.random.default_rng(0)
  g, u, dh = (jax.numpy.asarray(rng.normal(scale=3.0, size=(2, 8, 16)), jax.numpy.float32) for _ in range(3))
  reference = lambda g, u: jax.nn.silu(g) * u
  out, vjp = jax.vjp(swiglu, g, u)
  ref_out, ref_vjp = jax.vjp(reference, g, u)
  np.testing.assert_array_equal(out, ref_out)
  for got, want in zip(vjp(dh), ref_vjp(dh)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  kept = lambda f: [x for x in jax.tree.leaves(jax.eval_shape(lambda g, u: jax.vjp(f, g, u)[1], g, u))
                    if x.shape == g.shape]
  assert len(kept(swiglu)) == 2 and len(kept(reference)) > 2


def test_weight_gradients_read_activations_without_a_transposed_copy():
  """The projections contract the tokens as one axis (`dense` in meshtrain/models/llama.py), so XLA's CPU backend
  takes each weight-gradient matmul's activation operand as transposed in place. On [B, L, D] einsums it copied
  the [b, l, F] gradient into [F, b, l] order with the SwiGLU backward fused in: two such transposes per layer,
  ~40% of a one-device step. Weight transposes ([D, F]) are fine: D differs from the sequence length here."""
  cfg = tiny_config({"data": 8}, "dp")
  text = layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh)).compile_train_step().as_text()
  shapes = [[int(d) for d in dims.split(",")]
            for dims in re.findall(r"= f32\[([0-9,]+)\]\{[0-9,]+\} transpose\(", text)]
  mlp = [s for s in shapes if cfg.model.mlp_dim in s]  # weights [D, F] = [128, 512]; before: also [512, 2, 64]
  assert mlp and [s for s in mlp if cfg.seq_len in s] == []
