"""A DiT trains through the same loop, checkpoints and launcher as the language model: a resumed run continues
bitwise, and two processes train like one."""
import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import xla_fast

from meshtrain import checkpoint, config, layout as layout_lib, mesh as mesh_lib

STEPS = 8
ARGS = ["--config", "configs/dit_digits.py", f"--config.steps={STEPS}", "--config.batch_size=32",
        "--config.log_every=1", "--config.eval_every=0", "--config.checkpoint_every=4", "--config.checkpoint_keep=10",
        "--config.optimizer.warmup_steps=2", "--config.model.d_model=32", "--config.model.num_layers=2",
        "--config.model.mlp_dim=64"]


def run(workdir, processes=1):
  prefix = ([sys.executable, "-m", "meshtrain.train"] if processes == 1 else
            [sys.executable, "-m", "meshtrain.launch", "--processes", str(processes), "--devices-per-process",
             str(8 // processes), "--"])
  proc = subprocess.run([*prefix, *ARGS, "--workdir", str(workdir)], capture_output=True, text=True, timeout=400,
                        env=xla_fast.env())
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def losses(workdir) -> dict[int, float]:
  rows = map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines())
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def params_at(workdir, step):
  """The parameters of checkpoint `step`, restored onto one device as host arrays."""
  cfg = config.load("configs/dit_digits.py", ARGS[2:])
  cfg.mesh.data = 1
  one = layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices=jax.devices()[:1]))
  ckpt = checkpoint.Checkpointer(workdir, keep=100)
  try:
    return jax.device_get(ckpt.restore_state(step, one.state_abstract).params)
  finally:
    ckpt.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """8 uninterrupted steps, one process, 8 devices, checkpoints at 4 and 8."""
  workdir = tmp_path_factory.mktemp("dit_reference")
  run(workdir)
  return workdir


def test_resume_is_bitwise(reference, tmp_path):
  shutil.copytree(reference, tmp_path / "run")
  shutil.rmtree(tmp_path / "run" / "checkpoints" / str(STEPS))  # as if the run had stopped after step 4's save
  proc = run(tmp_path / "run")
  assert f"resumed from {tmp_path / 'run' / 'checkpoints' / '4'}" in proc.stdout
  ref = losses(reference)
  assert sorted(ref) == list(range(1, STEPS + 1)) and abs(ref[STEPS] - ref[1]) > 1e-3
  assert losses(tmp_path / "run") == ref  # steps 5-8 recomputed to the last bit
  jax.tree.map(np.testing.assert_array_equal, params_at(tmp_path / "run", STEPS), params_at(reference, STEPS))


# A 2-process launch (~65 s on CI's busy cores): the full suite. The quick pass keeps the DiT's sharded numerics
# in process (tests/test_dit.py's layouts) and the multi-process path with the language model
# (tests/test_multiprocess.py), on every Python.
@pytest.mark.slow
def test_two_processes_train_like_one(reference, tmp_path):
  proc = run(tmp_path, processes=2)
  assert "[p0] mesh: data=8 (8 cpu devices, 2 process(es))" in proc.stdout
  ref, got = losses(reference), losses(tmp_path)
  assert sorted(got) == sorted(ref)
  np.testing.assert_allclose([got[s] for s in sorted(ref)], [ref[s] for s in sorted(ref)], rtol=2e-5)  # gloo order
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), params_at(tmp_path, STEPS),
               params_at(reference, STEPS))
