"""`python -m meshtrain.inspect` and `python -m meshtrain.plan`: compiled figures vs hand-derived and analytic ones."""
import json
import subprocess
import sys

import pytest

from meshtrain import config as config_lib
from meshtrain.analysis import compiled as inspect_lib, estimate, planner as plan_lib
from meshtrain.cli import inspect, plan
from meshtrain.costs import perf
from meshtrain.errors import UserError

TINY = "configs/tiny.py"
LAYERS = 4  # the tiny preset's depth, used in the hand counts below


def compiled(path, *overrides):
  return inspect_lib.inspect(config_lib.load(path, list(overrides)))


@pytest.mark.parametrize("path, overrides", [
    (TINY, []),
    # The 1B preset at a short sequence and small batch: parameter shapes do not depend on either.
    ("configs/llama1b.py", ["--config.mesh.tensor=1", "--config.sharding.rules=fsdp", "--config.batch_size=8",
                            "--config.seq_len=128", "--config.model.remat=full"]),
    # Qwen3-0.6B: q/k norms, tied embeddings, head_dim 128 != d_model / heads.
    ("configs/qwen3_0_6b.py", ["--config.batch_size=8", "--config.seq_len=128", "--config.model.remat=full",
                               "--config.optimizer.grad_accum_steps=1"]),
], ids=["tiny", "1b", "qwen3-0.6b"])
def test_fsdp_over_8_holds_an_eighth_of_parameters_and_optimizer_state(path, overrides):
  r = compiled(path, "--config.mesh.data=1", "--config.mesh.fsdp=8", "--config.sharding.rules=fsdp", *overrides)
  assert r.mesh == {"fsdp": 8}
  total = r.params_bytes_total
  # Norm scales are not split (they have no `embed` axis): a fraction of a percent of the model.
  assert r.params_bytes_per_device == pytest.approx(total / 8, rel=0.02)
  assert r.optimizer_bytes_per_device == pytest.approx(2 * total / 8, rel=0.02)  # AdamW: two moments
  assert r.params_bytes_per_device == r.expected.params_bytes_per_device
  # XLA's own argument count: parameters + optimizer state + the batch, nothing replicated by accident.
  assert r.argument_bytes_per_device == pytest.approx(r.params_bytes_per_device + r.optimizer_bytes_per_device
                                                      + r.batch_bytes_per_device, abs=4096)


# Hand-derived from the program's structure: the layer loop (model.scan_unroll=1; tiny's 4 layers are unrolled by
# default, see the next test), 4 layers, each with 7 matrices split by FSDP:
#   data=8: one combined gradient all-reduce per layer in the backward loop + one for embedding/head/norm/loss;
#   fsdp=8: each of the 7 weights all-gathered for forward and for backward per layer, plus the head weight and
#     the token ids for the D-split embedding lookup; gradients reduced per layer + once after the loop + the
#     loss sums + the global-norm partial sums; the looked-up embeddings re-split by batch and back (all-to-all);
#   data=2 x tensor=4: per layer 2 forward all-reduces (attention out, MLP down) and 2 backward (Q/K/V and
#     gate/up input gradients); outside the layers the embedding lookup, the head input gradient, the target
#     logit, softmax max and sum, the global-norm partial sums (6); the data-axis gradient reduction as above.
HAND_COUNTS = {
    "data=8": {("all-reduce", ("data",)): LAYERS + 1},
    "fsdp=8": {("all-gather", ("fsdp",)): 2 * 7 * LAYERS + 2, ("all-reduce", ("fsdp",)): LAYERS + 3,
               ("all-to-all", ("fsdp",)): 2},
    "data=2 x tensor=4": {("all-reduce", ("tensor",)): 4 * LAYERS + 6, ("all-reduce", ("data",)): LAYERS + 1},
}
LAYOUTS = {
    "data=8": ["--config.mesh.data=8"],
    "fsdp=8": ["--config.mesh.data=1", "--config.mesh.fsdp=8", "--config.sharding.rules=fsdp"],
    "data=2 x tensor=4": ["--config.mesh.data=2", "--config.mesh.tensor=4", "--config.sharding.rules=tp"],
}
LOOP = "--config.model.scan_unroll=1"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_collective_counts_equal_hand_derived_counts(name):
  r = compiled(TINY, *LAYOUTS[name], LOOP)
  got = {(c.kind, c.axes): c.count for c in r.collectives}
  assert got == HAND_COUNTS[name]
  # The analytic model (used by plan) gives the same counts and, to the byte but for a few scalars, the same bytes.
  expected = {(c.kind, c.axes): c for c in r.expected.collectives}
  assert {k: c.count for k, c in expected.items()} == HAND_COUNTS[name]
  for c in r.collectives:
    assert c.bytes == pytest.approx(expected[(c.kind, c.axes)].bytes, rel=1e-3)
  # Memory: parameters and optimizer state exact; the total (arguments + temporaries) within 5% (compiled /
  # expected measured 0.99-1.04 on these layouts; the test below covers the pipeline and ring families).
  assert r.optimizer_bytes_per_device == r.expected.optimizer_bytes_per_device
  assert r.total_bytes_per_device == pytest.approx(r.expected.total_bytes_per_device, rel=0.05)
  # FLOPs: every dot of the compiled step (loops counted), vs 6N + attention: XLA computes the masked half of
  # causal attention too, hence a little more.
  assert 1.0 <= r.flops_per_step / r.expected.flops_per_step < 1.1


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_unrolled_layers_stay_within_the_layer_loop_model(name):
  # Tiny's default: its 4 layers unrolled (model.scan_unroll=0, no remat). The analytic model describes the loop;
  # unrolled, XLA reduces the same gradient bytes, in as many collectives as its combiner makes (data=8: one
  # gradient all-reduce instead of 5; fsdp=8: 9 all-reduces instead of 7), and
  # needs no stacked residual buffers or sliced copies: memory 0.95 / 0.96 / 0.89 of the loop's prediction on
  # these layouts. So the model stays an upper bound, and a close one.
  r = compiled(TINY, *LAYOUTS[name])
  expected = {(c.kind, c.axes): c for c in r.expected.collectives}
  assert {(c.kind, c.axes) for c in r.collectives} == set(expected)
  for c in r.collectives:
    # At most the loop's bytes: with nothing between them, XLA may reuse a weight gathered for the forward pass in
    # the backward one (fsdp=8: 7.3 of 8.1 MB of all-gathers); every gradient byte is still reduced.
    assert c.bytes <= expected[(c.kind, c.axes)].bytes * (1 + 1e-3)
    if c.kind == "all-reduce":
      assert c.bytes == pytest.approx(expected[(c.kind, c.axes)].bytes, rel=1e-3)
  merged = {(c.kind, c.axes): c.count for c in r.collectives}
  if name == "data=8":
    assert merged == {("all-reduce", ("data",)): 1}  # one gradient all-reduce for the whole model
  assert 0.85 <= r.total_bytes_per_device / r.expected.total_bytes_per_device <= 1.0


@pytest.mark.parametrize("overrides", [
    ["--config.mesh.data=4", "--config.mesh.stage=2", "--config.pipeline.microbatches=2"],
    ["--config.mesh.data=2", "--config.mesh.sequence=4"],
], ids=["pipeline", "ring"])
def test_memory_per_device_equals_compiled_within_5_percent(overrides):
  # Families the analytic model once missed by 17-20% (tensor parallelism, 8%, is checked above): a pipeline
  # (every iteration's residuals, fill and drain included, and the per-iteration backward loop's copies) and ring
  # attention (its per-step tiles, traced through the ring itself). Measured 0.96 and 0.97 of the compiled figure.
  r = compiled(TINY, *overrides)
  assert r.expected.total_bytes_per_device == pytest.approx(r.total_bytes_per_device, rel=0.05)


def test_inspect_json_and_fit_verdict(capsys):
  assert inspect.main(["--config", TINY, "--devices", "8", "--hbm", "0.01", "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  for key in ("params_bytes_per_device", "optimizer_bytes_per_device", "params_bytes_total", "temp_bytes_per_device",
              "flops_per_step", "collectives"):
    assert key in out
  assert out["collectives"] and set(out["collectives"][0]) >= {"kind", "axes", "count", "bytes"}
  # Short of 10 MB whatever XLA's temporaries: the arguments alone (tiny's state, replicated over data=8) are 13 MB.
  assert out["argument_bytes_per_device"] > 10e6
  assert out["fits"] is False and out["spare_bytes"] == pytest.approx(10e6 - out["total_bytes_per_device"])
  assert inspect.main(["--config", TINY, "--devices", "8", "--hbm", "1"]) == 0
  assert "fits with" in capsys.readouterr().out


def test_bad_input_is_exit_2_without_traceback(capsys):
  assert inspect.main(["--config", TINY, "--devices", "-3"]) == 2
  assert plan.main(["--config", TINY, "--devices", "12", "--nodes", "5", "--gpu", "h100"]) == 2
  err = capsys.readouterr().err
  assert "--devices" in err and "Traceback" not in err


def test_plan_node_size_defaults_to_the_gpus_node():
  # 64 H100s are 8 NVLink domains of 8, not one node of 64 (fsdp=64 over the network would be the "best" there).
  assert plan_lib.nodes_of(64, "h100", 0, 0) == (8, "H100 SXM 80GB nodes hold 8; --gpus-per-node N to change")
  assert plan_lib.nodes_of(4, "a100", 0, 0)[0] == 1  # part of one node
  assert plan_lib.nodes_of(64, "h100", 0, 4) == (16, "--gpus-per-node")
  assert plan_lib.nodes_of(64, "h100", 4, 0) == (4, "--nodes")
  assert plan_lib.nodes_of(64, "cpu", 0, 0) == (1, "this machine")
  for devices, nodes, per_node in ((12, 0, 0), (64, 8, 4), (12, 5, 0), (10, 0, 4)):
    with pytest.raises(UserError, match="--devices|--nodes"):
      plan_lib.nodes_of(devices, "h100", nodes, per_node)
  proc = subprocess.run([sys.executable, "-m", "meshtrain.plan", "--config", TINY, "--devices", "16", "--gpu", "h200",
                         "--verify", "0", "--json"], capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = json.loads(proc.stdout)
  assert out["nodes"] == 2 and out["nodes_from"].startswith("H200 SXM 141GB nodes hold 8")
  assert all(dict(r["across_nodes"]) for r in out["ranked"])  # every layout spans the two nodes with some axis


def _best(path, devices, gpu="h100", *overrides):
  cfg = config_lib.load(path, list(overrides))
  hw = perf.GPUS[gpu]
  rows, seen = plan_lib.rank(cfg, devices, 1, hw, hw.hbm_bytes, fused_attention=plan_lib.as_on_target(cfg, gpu))
  assert seen > 10 and rows
  return rows


def test_plan_picks_data_parallel_when_the_model_fits_on_one_device(capsys, tmp_path):
  args = ["--config", TINY, "--devices", "8", "--gpu", "h100", "--verify", "1", "--cache", str(tmp_path), "--json"]
  assert plan.main(args) == 0
  out = json.loads(capsys.readouterr().out)
  best = out["best"]
  assert best["layout"] == "data=8" and best["remat"] == "none" and best["grad_accum_steps"] == 1
  assert "--config.mesh.data=8" in best["overrides"] and "--config.sharding.rules=dp" in best["overrides"]
  # --verify compiled it: parameters and optimizer state as predicted, collectives as many bytes as predicted.
  (checked,) = out["verified"]
  assert checked["layout"] == "data=8"
  assert checked["params_bytes_per_device"] == best["params_bytes_per_device"]
  assert checked["optimizer_bytes_per_device"] == best["optimizer_bytes_per_device"]
  assert checked["collective_bytes"] == pytest.approx(checked["predicted_collective_bytes"], rel=1e-3)
  assert len(list(tmp_path.glob("*.json"))) == 1  # cached: a second plan does not compile again


def test_plan_picks_fsdp_when_data_parallel_does_not_fit():
  # 8B on 8 x 80 GB: parameters + Adam moments + gradients of 8B float32 weights are 128 GB per replica.
  cfg = config_lib.load("configs/llama8b.py", ["--config.batch_size=256", "--config.seq_len=2048"])
  whole = estimate.estimate(cfg, {"stage": 1, "data": 8, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1},
                            fused_attention=True)
  assert whole.params_bytes_per_device + whole.optimizer_bytes_per_device > 80e9
  rows = _best("configs/llama8b.py", 8, "h100", "--config.batch_size=256", "--config.seq_len=2048")
  assert all(dict(r.layout.sizes)["data"] < 8 for r in rows)   # pure data parallelism never fits
  assert dict(rows[0].layout.sizes)["fsdp"] > 1


def test_scan_groups_counts_consts_and_carry_from_a_known_scan():
  # estimate reads the backward layer loop's inputs as (consts, carry, xs); JAX 0.10 stored those counts as
  # num_consts/num_carry params, JAX 0.11+ does not, so estimate derives them from the scan's shapes. A scan with
  # 2 closed-over constants, 2 carries (one shaped like an x slice) and 2 xs, and ys; on JAX 0.10 also the params.
  import jax
  import jax.numpy as jnp

  def f(a, b, c, d, xs, zs):
    def body(carry, x):
      c, d = carry
      x, z = x
      return (jnp.tanh(c * a + b.sum() + x), d + z.sum()), c * 2
    return jax.lax.scan(body, (c, d), (xs, zs))

  args = (jnp.ones(3), jnp.ones((2, 3)), jnp.ones(3), jnp.ones(()), jnp.ones((5, 3)), jnp.ones((5, 4, 3)))
  (eqn,) = [e for e in jax.make_jaxpr(f)(*args).jaxpr.eqns if e.primitive.name == "scan"]
  assert estimate._scan_groups(eqn) == (2, 2)
  if "num_consts" in eqn.params:
    assert (eqn.params["num_consts"], eqn.params["num_carry"]) == (2, 2)


# The published parameter counts of today's open models (their model cards and config.json): the presets have their
# exact shapes, and the cost model counts what the model creates (biases, q/k norms, experts and router included).
OPEN_MODELS = {"configs/llama3_2_1b.py": 1_235_814_400, "configs/llama3_1_8b.py": 8_030_261_248,
               "configs/qwen2_5_0_5b.py": 494_032_768, "configs/qwen3_0_6b.py": 596_049_920,
               "configs/mixtral_8x7b.py": 46_702_792_704}


@pytest.mark.parametrize("path", OPEN_MODELS)
def test_open_model_presets_have_the_published_parameter_counts(path):
  cfg = config_lib.load(path, [])
  one = {"stage": 1, "data": 1, "fsdp": 1, "expert": 1, "sequence": 1, "tensor": 1}
  assert estimate.estimate(cfg, one).params_bytes_total == 4 * OPEN_MODELS[path]  # float32 parameters


# Planning a preset traces the gradient of its block for every distinct split of heads, sequence and remat policy
# (30 traces, ~40 s on CI's 2 busy cores, per preset): the quick pass plans Mixtral (experts, 32 devices on 4 nodes),
# the full suite every preset.
@pytest.mark.parametrize("path", [p if "mixtral" in p else pytest.param(p, marks=pytest.mark.slow)
                                  for p in OPEN_MODELS])
def test_open_model_presets_plan(path):
  cfg = config_lib.load(path, [])
  devices = 32 if OPEN_MODELS[path] > 5e9 else 8
  hw = perf.GPUS["h100"]
  rows, seen = plan_lib.rank(cfg, devices, devices // 8, hw, hw.hbm_bytes, fused_attention=plan_lib.as_on_target(
      cfg, "h100"))
  assert seen > 10 and rows  # rows: the layouts that fit, best first
  assert rows[0].estimate.total_bytes_per_device <= hw.hbm_bytes and rows[0].mfu > 0.2
