"""inspect's expectation and plan for the text-to-image model (task=t2i): the analytic model (meshtrain/analysis/
estimate.py with the task's cost model, meshtrain/families/t2i.py) against the compiled train step, and `plan` on
configs/t2i_tiny.py."""
import dataclasses
import json

import flax.linen as nn
import jax
import pytest
from test_plan_dit import LAYOUTS  # the same four layouts as the DiT's

from meshtrain import config as config_lib, families
from meshtrain.analysis import compiled as inspect_lib, estimate
from meshtrain.cli import plan
from meshtrain.families import t2i
from meshtrain.models import flux
from meshtrain.models.flux import FluxConfig

T2I = "configs/t2i_tiny.py"
LAYERS = 2  # the tiny preset's depth of each of its three stacks (text encoder, double, single), each a loop
# Hand-derived from Flux's blocks (the derivation is families/t2i.py CostModel.collectives), 2 blocks per stack:
#   data=8: one combined gradient all-reduce per block in the backward loops + one for everything else;
#   fsdp=8: per block every split weight gathered for the forward pass, and the matrices again for the backward
#     one (biases are not read back): encoder 8 (q, k, v, out, MLP up, down; out and down biases) + 6, double 18
#     (the same and the modulation, per stream) + 14, single 8 (modulation, q, k, v, out, MLP up, down; out bias)
#     + 7; outside the blocks 10 split weights (img_in, txt_in, the embedders' output layers, their biases, the
#     final modulation, out), txt_in again for its input gradient, the batch rows of the column-split embedders
#     (timestep features, pooled text, two hidden layers) and the caption ids (16). Gradients: per block (6), per
#     other split gradient but the embedders' output weights and the byte embedding (12), the rest (1). Nine
#     all-to-alls of the condition, two of the looked-up bytes;
#   data=2 x tensor=4: per block the attention and MLP outputs forward and the Q/K/V and MLP input gradients
#     backward: encoder 2 + 2, double 3 + 2 (XLA combines two of the four forward ones), single 1 + 1 (each
#     combined); the global-norm partial sums; the data-axis gradient reduction as for data=8.
# fsdp x tensor is left out, as for the DiT: XLA's partitioner reshards the embedders' column split through
# partial-group collective-permutes there, which the model does not follow (its memory is checked).
HAND_COUNTS = {
    "data=8": {("all-reduce", ("data",)): 3 * LAYERS + 1},
    "fsdp=8": {("all-gather", ("fsdp",)): LAYERS * (8 + 6 + 18 + 14 + 8 + 7) + 16,
               ("all-reduce", ("fsdp",)): 3 * LAYERS + 13, ("all-to-all", ("fsdp",)): 11},
    "data=2 x tensor=4": {("all-reduce", ("tensor",)): LAYERS * (4 + 5 + 2) + 1,
                          ("all-reduce", ("data",)): 3 * LAYERS + 1},
}


# The stacks as loops, what the cost model describes (the tiny stacks of 2 blocks are unrolled by default; unrolled,
# XLA keeps no stacked residual buffers and needs less, as for the language model, tests/test_inspect.py).
LOOP = "--config.model.scan_unroll=1"


@pytest.fixture(scope="module")
def compiled():
  reports = {}

  def get(name):
    if name not in reports:
      reports[name] = inspect_lib.inspect(config_lib.load(T2I, ["--config.cpu_devices=8", LOOP, *LAYOUTS[name]]))
    return reports[name]
  return get


# fsdp x tensor, a fourth compile (12 s), in the full suite only.
@pytest.mark.parametrize("name", [n if n in HAND_COUNTS else pytest.param(n, marks=pytest.mark.slow) for n in LAYOUTS])
def test_memory_per_device_equals_compiled_within_5_percent(name, compiled):
  r = compiled(name)
  e = r.expected
  # Parameters and optimizer state exactly: the parameter table under the layout's rules.
  assert r.params_bytes_per_device == e.params_bytes_per_device
  assert r.optimizer_bytes_per_device == e.optimizer_bytes_per_device
  # The total within 5%: the three stacks' residuals (each traced, at per-device heads under a tensor split), then
  # the highest of their backward peaks. Compiled / predicted in LAYOUTS' order, measured on JAX 0.10.2:
  # 0.964 / 0.958 / 1.003 / 0.962 (with full remat: 0.97 / 0.89 / 0.97 on the first three, an upper bound).
  assert r.total_bytes_per_device == pytest.approx(e.total_bytes_per_device, rel=0.05)


@pytest.mark.parametrize("name", list(HAND_COUNTS))
def test_collectives_equal_hand_derived_counts_and_bytes(name, compiled):
  r = compiled(name)
  assert {(c.kind, c.axes): c.count for c in r.collectives} == HAND_COUNTS[name]
  expected = {(c.kind, c.axes): c for c in r.expected.collectives}
  assert {k: c.count for k, c in expected.items()} == HAND_COUNTS[name]
  for c in r.collectives:  # to the byte but for the loss and global-norm scalars
    assert c.bytes == pytest.approx(expected[(c.kind, c.axes)].bytes, rel=1e-3)
  if "tensor" not in name:
    # FLOPs: every dot of the compiled step against flux.flops_per_image x images per device. A tensor split runs
    # the per-image modulations and embedders on every tensor device, so there the program does more (1.05).
    assert r.flops_per_step / r.expected.flops_per_step == pytest.approx(1.0, abs=0.01)


def test_remat_recomputes_the_blocks_and_the_batch_is_counted_by_its_spec():
  cfg = config_lib.load(T2I, ["--config.model.remat=full"])
  c = FluxConfig.from_config(cfg.model)
  model = families.cost_model(cfg)
  # Full remat runs every block's forward again: a third of the blocks' share of the training FLOPs.
  no_blocks = FluxConfig.from_config({**cfg.model.to_dict(), "text_layers": 0, "double_layers": 0, "single_layers": 0})
  assert model.recomputed_flops_per_example(None) == pytest.approx(
      (t2i.flops_per_image(c) - t2i.flops_per_image(no_blocks)) / 3)
  sizes = {"stage": 1, "data": 8, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1}
  e = estimate.estimate(cfg, sizes)
  assert e.flops_per_step - e.model_flops_per_step == pytest.approx(
      model.recomputed_flops_per_example(None) * cfg.batch_size / 8)
  assert model.batch_bytes_per_example(64) == 32 * 32 * 3 * 4 + 32 * 4 + 4  # image, caption ids, seed
  assert [s.stack.kind for s in model.stacks(sizes)] == ["text", "double", "single"]


def test_plan_ranks_t2i_layouts(capsys):
  args = ["--config", T2I, "--devices", "8", "--gpu", "h100", "--verify", "0", "--json"]
  assert plan.main(args) == 0
  out = json.loads(capsys.readouterr().out)
  assert set(out["unsupported_axes"]) == {"sequence", "stage"}
  ranked = out["ranked"]
  assert len(ranked) > 10 and out["fits"] == len(ranked)
  times = [r["step_time_s"] for r in ranked]
  assert times == sorted(times)
  assert not any("sequence=" in r["layout"] or "stage=" in r["layout"] for r in ranked)
  assert {r["remat"] for r in ranked} == {"none", "full"}
  assert any("tensor=" in r["layout"] for r in ranked) and any("fsdp=" in r["layout"] for r in ranked)
  # 2.3M parameters: nothing needs splitting, and data parallelism moves the fewest bytes.
  best = out["best"]
  assert best["layout"] == "data=8" and best["images_per_sec_per_device"] > 0 and 0 < best["mfu"] <= 1


# Flux.1-dev's form at the tiny preset's sizes (configs/flux_dev.py at full size): a frozen pipeline's cached text
# features, CLIP's pooled vector of its own width, the guidance embedding, no text norm or mask.
FLUX_DEV = ["--config.model.text_encoder=pipeline", "--config.model.pipeline=FLUX.1-dev",
            "--config.model.pooled_width=48", "--config.model.guidance_embed=True", "--config.model.text_norm=False",
            "--config.model.text_mask=False", "--config.model.channels=4", "--config.model.caption_dropout=0.0"]


def test_flux_dev_form_params_equal_the_model_and_flops_count_the_guidance_mlp():
  cfg = config_lib.load(T2I, FLUX_DEV)
  c = FluxConfig.from_config(cfg.model)
  model = families.cost_model(cfg)
  # The parameters plan and inspect count (their table) are the initialised model's, to the element.
  params = flux.Flux(c).init(jax.random.key(0), *t2i.model_inputs(c, 2))["params"]
  count = sum(a.size for a in jax.tree.leaves(params))
  sizes = {"stage": 1, "data": 8, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1}
  assert estimate.estimate(cfg, sizes).params_bytes_total == count * 4  # float32
  D, Q = c.d_model, flux.FREQUENCIES
  shapes = {k: v.shape for k, v in nn.meta.unbox(model.abstract_params()).items() if not isinstance(v, dict)}
  assert "text_norm" not in shapes and "text" not in params  # no norm of the features, no encoder's weights
  assert shapes["vector_in"] == (48, D) and shapes["guidance_in"] == (Q, D) and shapes["guidance_out"] == (D, D)
  # FLOPs: the guidance MLP (Q -> D -> D) once more than the time's, the vector MLP from the pooled width, no encoder.
  plain = dataclasses.replace(c, guidance_embed=False)
  assert t2i.flops_per_image(c) - t2i.flops_per_image(plain) == 3 * 2 * (Q * D + D * D)
  own_width = dataclasses.replace(plain, pooled_width=0)  # the pooled vector the features' mean, text_width wide
  assert t2i.flops_per_image(own_width) - t2i.flops_per_image(plain) == 3 * 2 * (c.text_width - 48) * D
  assert model.flops_per_example(None) == t2i.flops_per_image(c)
  assert model.batch_bytes_per_example(64) == (
      32 * 32 * 4 * 4 + 32 * 128 * 4 + 32 + 48 * 4 + 4)  # latents, features, keep, pooled, seed


# Against the compile (a fifth compile, 8 s; in the full suite only): the guidance embedder runs column-split as the
# time MLP does, on a constant input: one more gathered hidden layer, its output weight's gradient not reduced, four
# more all-to-alls of the condition (13); measured on JAX 0.10.2.
@pytest.mark.slow
def test_flux_dev_form_fsdp_collectives_equal_compiled():
  r = inspect_lib.inspect(config_lib.load(T2I, ["--config.cpu_devices=8", LOOP, *FLUX_DEV, *LAYOUTS["fsdp=8"]]))
  hand = {("all-gather", ("fsdp",)): LAYERS * (18 + 14 + 8 + 7) + 18, ("all-reduce", ("fsdp",)): 2 * LAYERS + 16,
          ("all-to-all", ("fsdp",)): 13}
  assert {(c.kind, c.axes): c.count for c in r.collectives} == hand
  expected = {(c.kind, c.axes): c for c in r.expected.collectives}
  assert {k: c.count for k, c in expected.items()} == hand
  for c in r.collectives:
    assert c.bytes == pytest.approx(expected[(c.kind, c.axes)].bytes, rel=1e-3)
  assert r.params_bytes_per_device == r.expected.params_bytes_per_device
  assert r.total_bytes_per_device == pytest.approx(r.expected.total_bytes_per_device, rel=0.06)
