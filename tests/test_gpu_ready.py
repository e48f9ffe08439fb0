"""Ready for the first GPU call, proved on the CPU (issue 17): a bfloat16 step keeps its state's dtypes, attention
on a GPU is cuDNN where cuDNN can run it (in the program lowered for CUDA), every XLA flag meshtrain sets parses,
and the call's script (experiments/gpu_bench.py) retries and reports as it should.

CI also runs this file on the GPU machine's JAX (experiments/gpu_dryrun.sh), after the call's own dry run.
"""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from meshtrain import config, layout as layout_lib, mesh as mesh_lib
from meshtrain.analysis import planner as plan
from meshtrain.models import attention
from meshtrain.runtime import startup

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "experiments" / "gpu_bench.py")
gpu_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_bench)



def bench_config(name: str, **changes):
  """The config experiments/gpu_bench.py benchmarks `name` with on the GPU, with `changes` ("model.remat": ...)."""
  settings = {**gpu_bench.COMMON, **gpu_bench.MODELS[name][1], **changes}
  return config.load(f"configs/{name}.py", [f"--config.{k}={v}" for k, v in settings.items()])


def bench_overrides(name: str, **changes) -> list[str]:
  settings = {**gpu_bench.COMMON, **gpu_bench.MODELS[name][1], **changes}
  return [f"--config.{k}={v}" for k, v in settings.items()]


@pytest.mark.parametrize("remat,accum", [("save_dots", 1), ("full", 2)])  # both policies; accumulation
def test_bf16_step_returns_the_state_it_was_compiled_for(remat, accum):
  # The 8B benchmark's settings (bf16 parameters and compute) at tiny shapes, FSDP over 8 devices. A float32
  # gradient count once made Adam's moments float32: the second step then refused its own output.
  cfg = bench_config("llama8b", **{**gpu_bench.TINY, "cpu_devices": "8", "mesh.fsdp": "8", "seq_len": "64",
                                   "batch_size": "16", "model.remat": remat, "optimizer.grad_accum_steps": str(accum)})
  layout = layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh))
  step = layout.compile_train_step()
  state = layout.init(0)
  tokens = np.random.default_rng(0).integers(0, 256, (cfg.batch_size, cfg.seq_len + 1), dtype=np.int32)
  batch = jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, layout.batch_sharding)
  losses = []
  for _ in range(3):  # from the second call on, the step consumes its own output
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  want = jax.tree_util.tree_leaves_with_path(layout.state_abstract)
  got = jax.tree.leaves(state)
  assert len(got) == len(want)
  for (path, w), g in zip(want, got):
    assert g.dtype == w.dtype, f"{jax.tree_util.keystr(path)}: {g.dtype}, compiled for {w.dtype}"
    assert g.sharding.is_equivalent_to(w.sharding, g.ndim), jax.tree_util.keystr(path)
  n_params = len(jax.tree.leaves(state.params))
  assert sum(x.dtype == jax.numpy.bfloat16 for x in got) == 3 * n_params  # parameters and both Adam moments
  assert all(np.isfinite(losses)) and int(state.nonfinite_steps) == 0


def test_attention_choice_for_a_gpu_is_cudnn_exactly_where_cudnn_runs():
  r = attention.resolve
  assert r("auto", "gpu", "bfloat16", 64, 32, 8) == "cudnn"   # llama1b
  assert r("auto", "gpu", "bfloat16", 128, 32, 8) == "cudnn"  # llama8b
  assert r("auto", "cuda", "float16", 256, 8, 8, "9.0") == "cudnn"
  assert r("auto", "gpu", "float32", 64, 32, 8) == "xla"      # cuDNN's attention is half precision only
  assert r("auto", "gpu", "bfloat16", 60, 8, 4) == "xla"      # head dim not a multiple of 8
  assert r("auto", "gpu", "bfloat16", 264, 8, 4) == "xla"     # head dim over 256
  assert r("auto", "gpu", "bfloat16", 256, 8, 4, "8.0") == "xla"  # over 128 before Hopper
  assert r("auto", "gpu", "bfloat16", 128, 8, 4, "8.0") == "cudnn"
  assert r("auto", "gpu", "bfloat16", 64, 4, 8) == "xla"      # more kv heads than query heads
  assert r("auto", "cpu", "bfloat16", 64, 32, 8) == r("auto", "tpu", "bfloat16", 64, 32, 8) == "blocked"
  for impl in ("blocked", "xla", "cudnn"):  # an explicit choice is kept everywhere
    assert r(impl, "gpu", "float32", 60, 8, 4) == r(impl, "cpu", "bfloat16", 64, 8, 4) == impl
  assert "head_dim=60" in attention.cudnn_unsupported("bfloat16", 60, 8, 4)
  assert "float32" in attention.cudnn_unsupported("float32", 64, 8, 4)
  assert attention.cudnn_unsupported("bfloat16", 128, 32, 8) == ""


@pytest.mark.parametrize("name", ["llama1b", "llama8b"])
def test_layout_and_plan_choose_attention_alike(name):
  # The layout built for a GPU resolves to cudnn: tested in the CUDA lowerings below (tracing cuDNN attention
  # needs the CUDA plugin's version module, which only their subprocess has).
  cfg = bench_config(name)
  mesh = mesh_lib.make_mesh(cfg.mesh, devices=jax.devices()[:1])
  assert layout_lib.build(cfg, mesh).model.cfg.attention == "blocked"  # this machine's CPU
  assert plan.target_attention(cfg, "h200") == plan.target_attention(cfg, "a100") == "cudnn"
  assert plan.target_attention(cfg, "cpu") == "blocked"
  cfg.model.dtype = "float32"
  assert plan.target_attention(cfg, "h100") == "xla"
  assert layout_lib.build(cfg, mesh, platform="gpu").model.cfg.attention == "xla"


def lower_for_cuda(config_path: str, *overrides: str) -> dict:
  """tests/lower_for_cuda.py in a subprocess: JAX must find the CUDA plugin stand-in when it is first imported."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT / "tests" / "cuda_standin"), str(ROOT),
                                                                  os.environ.get("PYTHONPATH"))))}
  proc = subprocess.run([sys.executable, str(ROOT / "tests" / "lower_for_cuda.py"), config_path, *overrides],
                        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_1b_step_lowered_for_cuda_calls_cudnn_and_keeps_no_scores():
  # The benchmark's 1B step (4 x 4,096 tokens, bf16 compute, save_dots), lowered for CUDA from this CPU.
  got = lower_for_cuda("configs/llama1b.py", *bench_overrides("llama1b"))
  assert got["attention"] == "cudnn"
  calls = got["custom_calls"]
  # Per layer (scanned: once in the program): the forward, the forward recomputed under remat, the backward.
  assert calls.get("__cudnn$fmhaSoftmax", 0) >= 1 and calls.get("__cudnn$fmhaSoftmaxBackward", 0) == 1, calls
  assert got["score_tensors"] == []
  # The detector sees scores where they exist: XLA's attention keeps [.., 4096, 4096] tensors.
  xla = lower_for_cuda("configs/llama1b.py", *bench_overrides("llama1b", **{"model.attention": "xla"}))
  assert xla["attention"] == "xla" and not any("cudnn" in c for c in xla["custom_calls"])
  assert any(t.startswith("tensor<4x8x4x4096x4096x") for t in xla["score_tensors"]), xla["score_tensors"]


def test_8b_step_lowered_for_cuda_calls_cudnn():
  got = lower_for_cuda("configs/llama8b.py", *bench_overrides("llama8b"))
  assert got["attention"] == "cudnn" and got["custom_calls"].get("__cudnn$fmhaSoftmaxBackward") == 1, got
  # (d_model is 4,096 too, so [B, L, D] tensors look like [L, L]: the score check is the 1B's.)


def test_every_xla_flag_meshtrain_sets_parses():
  # XLA aborts the process on an unknown flag, on every backend: a flag removed in a newer XLA would kill the GPU
  # run at start. The CPU jaxlib parses the GPU flags too (one flag registry).
  code = "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"
  flags = startup.xla_flags("", "")
  assert all(flag in flags for flag in startup.GPU_XLA_FLAGS + startup.CPU_XLA_FLAGS)
  run = lambda f: subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "XLA_FLAGS": f, "JAX_PLATFORMS": "cpu"})
  ok = run(flags)
  assert ok.returncode == 0 and ok.stdout.strip() == "3.0", ok.stderr[-2000:]
  bad = run(flags + " --xla_gpu_enable_no_such_thing=true")  # the check would catch a bad one
  assert bad.returncode != 0 and "xla_gpu_enable_no_such_thing" in bad.stderr


def test_gpu_call_retries_only_what_another_attempt_can_fix():
  oom = "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 2.1GiB"
  assert gpu_bench.next_attempt("none", "auto", 1, oom) == ("save_dots", "auto")
  assert gpu_bench.next_attempt("save_dots", "auto", 1, oom) == ("full", "auto")
  assert gpu_bench.next_attempt("full", "auto", 1, oom) is None
  cudnn = "XlaRuntimeError: INTERNAL: No valid engine configs for Matmul\n... __cudnn$fmhaSoftmax ..."
  assert gpu_bench.next_attempt("save_dots", "auto", 1, cudnn) == ("save_dots", "xla")
  assert gpu_bench.next_attempt("save_dots", "xla", 1, cudnn) is None
  assert gpu_bench.next_attempt("save_dots", "auto", 1, "TypeError: Argument 'state.opt_state' compiled with") is None
  assert gpu_bench.next_attempt("save_dots", "auto", 124, oom) is None  # out of time: another compile won't fit
  assert gpu_bench.next_attempt("save_dots", "auto", 0, "") is None


def test_gpu_call_summary_when_nothing_succeeded():
  rows = [{"name": "llama1b", "remat": "save_dots", "ok": False, "error": "rc 1: TypeError: ...", "log": "a.log"},
          {"name": "llama8b", "remat": "save_dots", "ok": False, "error": "timed out", "log": "b.log"}]
  text = gpu_bench.summarize(rows, "xla")
  assert "no run succeeded" in text and "timed out" in text and "a.log" in text


def test_gpu_call_commands():
  cmd = gpu_bench.bench_command("llama8b", "save_dots", "auto", dry_run=False)
  assert cmd[1:3] == ["-m", "meshtrain.bench"] and "--config.model.param_dtype=bfloat16" in cmd
  assert "--config.seq_len=4096" in cmd and "--config.batch_size=2" in cmd
  tiny = gpu_bench.bench_command("llama8b", "full", "xla", dry_run=True)
  keys = [x.split("=")[0] for x in tiny if x.startswith("--config.")]
  assert len(keys) == len(set(keys)) and "--config.seq_len=128" in tiny and "--config.model.remat=full" in tiny


def test_docs_gpu_call_is_the_scripts():
  # The docs' one-call procedure names what the script needs: the carried folder, its command, its wheels.
  page = (ROOT / "docs" / "development.md").read_text()
  section = page.split("\n## The first GPU call\n", 1)[1].split("\n## ", 1)[0]
  assert '`carry`: `["experiments/wheels"]`' in section
  assert "`command`: `python3 experiments/gpu_bench.py`" in section
  assert gpu_bench.WHEEL_DIR == ROOT / "experiments" / "wheels"
  for spec in gpu_bench.WHEELS:
    name, version = spec.split("==")
    assert f"{name} {version}" in section
  assert f"XLA_PYTHON_CLIENT_MEM_FRACTION={gpu_bench.MEM_FRACTION}" in section
  assert "experiments/wheels/" in (ROOT / ".gitignore").read_text()  # carried, never committed


@pytest.mark.parametrize("failure,attempts", [("RESOURCE_EXHAUSTED: Out of memory while trying to allocate", 2),
                                              ("TypeError: Argument types differ", 1)])
def test_gpu_call_when_every_run_fails(tmp_path, monkeypatch, failure, attempts):
  # The whole call (set-up, smoke test, both models, summary) with a benchmark that always fails this way:
  # out of memory is retried once with full remat, anything else not at all; each attempt keeps its own log.
  fail = [sys.executable, "-c", f"import sys; print({failure!r}, file=sys.stderr); sys.exit(1)"]
  monkeypatch.setattr(gpu_bench, "bench_command", lambda name, remat, attention, dry_run: fail + [name, remat])
  rc = gpu_bench.main(["--dry-run", "--results", str(tmp_path / "out"), "--site", str(tmp_path / "site")])
  assert rc == 1
  rows = [json.loads(line) for line in (tmp_path / "out" / "gpu_bench.jsonl").read_text().splitlines()]
  assert [(r["name"], r["remat"], r["attention_requested"]) for r in rows] == [
      (n, m, "xla") for n in gpu_bench.MODELS for m in ("save_dots", "full")[:attempts]]  # xla: no cuDNN on the CPU
  assert all(not r["ok"] and failure[:20] in r["error"] for r in rows)
  logs = sorted(p.name for p in (tmp_path / "out").iterdir())
  assert logs == sorted(["console.log", "setup.log", "gpu_bench.jsonl"] + [r["log"] for r in rows])
  assert "no run succeeded" in (tmp_path / "out" / "console.log").read_text()


def test_checkpoint_arrays_get_checksums_with_this_orbax():
  # The GPU machine's Orbax (0.12.4, which the GPU dry run installs) builds array metadata in another function than
  # the registry's newest; its first GPU run wrote checkpoints without array checksums (a warning) until
  # integrity.BUILDERS named both.
  from meshtrain.checkpoint import integrity
  assert integrity.enable_array_checksums() == integrity.ARRAY_CHECKSUM
