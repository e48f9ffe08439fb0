"""The train command end to end: outputs, exact resume, restore onto another mesh, incompatible checkpoints."""
import gzip
import json
import shutil

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from ckpt_helpers import restore_params

from meshtrain.cli import train

FAST = ["--config", "configs/tiny.py", "--config.steps=6", "--config.seq_len=64", "--config.log_every=1",
        "--config.eval_every=3", "--config.eval_batches=1", "--config.checkpoint_every=3",
        "--config.optimizer.warmup_steps=2"]


def run(workdir, *extra):
  assert train.main([*FAST, "--workdir", str(workdir), *extra]) == 0


def records(workdir):
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def saved_params(workdir, step):
  return restore_params(workdir, step, steps=6)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("uninterrupted")
  run(workdir, "--config.profile_steps=2-3")  # profiling changes no number, so the resume tests can compare to it
  return workdir


def test_outputs(uninterrupted):
  logged = records(uninterrupted)
  train_records = [r for r in logged if "loss" in r]
  assert [r["step"] for r in train_records] == [1, 2, 3, 4, 5, 6]
  for r in train_records:
    assert {"step", "loss", "learning_rate", "grad_norm", "step_time_s", "tokens_per_sec"} <= r.keys()
    assert np.isfinite(r["loss"]) and r["tokens_per_sec"] > 0
  assert train_records[-1]["loss"] < train_records[0]["loss"]
  # MFU is tokens/s x a fixed FLOPs-per-token / peak: the ratio is one constant, a plausible fraction.
  ratios = [r["mfu"] / r["tokens_per_sec"] for r in train_records]
  # (one interval can absorb its neighbour's compute when dispatch blocks, so only the median is bounded by 1).
  assert max(ratios) == pytest.approx(min(ratios), rel=1e-9) and 0 < np.median([r["mfu"] for r in train_records]) < 1
  assert train_records[0]["startup_s"] > 0 and all("startup_s" not in r for r in train_records[1:])
  [trace] = list((uninterrupted / "profile").rglob("perfetto_trace.json.gz"))
  # Each profiled step is one StepTraceAnnotation ("train", step_num), so the profiler shows step boundaries.
  events = json.loads(gzip.decompress(trace.read_bytes()))
  events = events["traceEvents"] if isinstance(events, dict) else events
  assert sorted(e["args"]["step_num"] for e in events if e.get("name") == "train") == ["2", "3"]
  evals = [r for r in logged if "eval_loss" in r]
  assert [r["step"] for r in evals] == [3, 6] and all(r["eval_bits_per_byte"] > 0 for r in evals)
  assert sorted(p.name for p in (uninterrupted / "checkpoints").iterdir()) == ["3", "6"]
  assert json.loads((uninterrupted / "config.json").read_text())["steps"] == 6
  assert list((uninterrupted / "tensorboard").glob("events.out.tfevents.*"))
  assert (uninterrupted / "loss.png").stat().st_size > 1000


def test_resume_is_bitwise_identical(uninterrupted, tmp_path):
  # A run that stopped right after the step-3 checkpoint: same workdir contents as then.
  shutil.copytree(uninterrupted, tmp_path / "run")
  shutil.rmtree(tmp_path / "run" / "checkpoints" / "6")
  run(tmp_path / "run")
  full, resumed = records(uninterrupted), records(tmp_path / "run")
  assert [r["step"] for r in resumed] == [r["step"] for r in full]  # no duplicated or missing records
  for a, b in zip(full, resumed):
    for key in ("loss", "grad_norm", "eval_loss"):
      assert a.get(key) == b.get(key), (a["step"], key)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), saved_params(tmp_path / "run", 6),
               saved_params(uninterrupted, 6))


def test_restore_onto_another_mesh_then_continue(uninterrupted, tmp_path, capsys):
  shutil.copytree(uninterrupted, tmp_path / "run")
  shutil.rmtree(tmp_path / "run" / "checkpoints" / "6")
  # Same command, another layout: data=8 -> pipeline stages x FSDP x tensor; its step-6 checkpoint is then
  # restored onto one device below.
  run(tmp_path / "run", "--config.mesh.data=1", "--config.mesh.stage=2", "--config.mesh.fsdp=2",
      "--config.mesh.tensor=2")
  assert ("pipeline: 2 stages, 4 micro-batches, gpipe schedule; bubble 20.0% of each step idle"
          in capsys.readouterr().out)
  full, moved = records(uninterrupted), records(tmp_path / "run")
  for a, b in zip(full, moved):
    for key in ("loss", "eval_loss"):
      if key in a:  # other reduction order after the move: float32 rounding only
        np.testing.assert_allclose(b[key], a[key], rtol=2e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6), saved_params(tmp_path / "run", 6),
               saved_params(uninterrupted, 6))


def test_restore_onto_one_device_is_exact(uninterrupted):
  # saved_params restores onto a single device; the raw arrays on disk are the reference.
  raw = ocp.StandardCheckpointer().restore((uninterrupted / "checkpoints" / "6" / "state").absolute())["params"]
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), saved_params(uninterrupted, 6), raw)


def test_incompatible_checkpoint_is_refused_and_kept(uninterrupted, tmp_path, capsys):
  shutil.copytree(uninterrupted, tmp_path / "run")
  before = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
  code = train.main([*FAST, "--workdir", str(tmp_path / "run"), "--config.steps=9", "--config.model.num_layers=2",
                     "--config.model.mlp_dim=256"])
  assert code == 2
  err = capsys.readouterr().err
  assert "different model shape" in err and "model.num_layers: checkpoint 4, this run 2" in err
  assert "model.mlp_dim: checkpoint 512, this run 256" in err
  assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == before


def test_finished_run_is_left_alone(uninterrupted, capsys):
  run(uninterrupted)
  assert "nothing to do" in capsys.readouterr().out
