"""optimizer.ema_decay: the average of the parameters the train step keeps (meshtrain/step.py), in the checkpoint,
read by every reader of a run, and refused on resume when a run would start or stop keeping it."""
import json
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import xla_fast
from test_captioned import ARGS, STEPS
from test_t2i import B, shape_batch, tiny_cfg

from meshtrain import checkpoint, layout as layout_lib, mesh as mesh_lib
from meshtrain.checkpoint import reader


def host(tree):
  return jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float64), tree)


def test_the_average_follows_its_recurrence_and_holds_over_a_skipped_step():
  """ema_k = d_k ema_{k-1} + (1 - d_k) params_k, d_k = min(decay, (1 + k) / (10 + k)), from the initial parameters,
  against a float64 reference on the parameters each step produced; a step whose gradients are not finite (step 3,
  injected) leaves the average where it was, as it leaves the parameters."""
  decay, steps = 0.9, 5
  cfg = tiny_cfg()
  cfg.steps, cfg.batch_size = steps, B
  cfg.optimizer.warmup_steps, cfg.optimizer.ema_decay = 1, decay
  cfg.faults.nan_at_step = 3
  cfg.mesh.update({"data": 8})
  layout = layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh))
  state, step = layout.init(cfg.seed), layout.compile_train_step()
  expected = host(state.params)
  np.testing.assert_array_equal(jax.tree.leaves(host(state.ema_params))[0], jax.tree.leaves(expected)[0])
  for k in range(1, steps + 1):
    batch = jax.device_put(shape_batch(offset=k * B, seed_base=100 * k), layout.batch_shardings)
    state, _ = step(state, batch)
    params = host(state.params)
    if k != cfg.faults.nan_at_step:
      d = min(decay, (1 + k) / (10 + k))
      expected = jax.tree.map(lambda e, p: d * e + (1 - d) * p, expected, params)
    got = host(state.ema_params)
    jax.tree.map(lambda g, e: np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-7), got, expected)
  assert int(state.nonfinite_steps) == 1
  assert all(a.dtype == np.float32 for a in jax.tree.leaves(state.ema_params))
  moved = [float(np.max(np.abs(e - p))) for e, p in zip(jax.tree.leaves(host(state.ema_params)),
                                                         jax.tree.leaves(host(state.params)))]
  assert max(moved) > 1e-4  # the average lags the parameters: a test that they differ can fail


def train(workdir, *extra):
  return subprocess.run([sys.executable, "-m", "meshtrain.train", *ARGS, "--config.data.name=synthetic",
                         "--workdir", str(workdir), *extra], capture_output=True, text=True, timeout=400,
                        env=xla_fast.env())


@pytest.mark.slow
def test_a_run_keeps_its_average_resumes_it_bitwise_and_readers_use_it(tmp_path):
  ema = "--config.optimizer.ema_decay=0.99"
  reference = train(tmp_path / "reference", ema)
  assert reference.returncode == 0, reference.stderr[-3000:]
  shutil.copytree(tmp_path / "reference", tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / str(STEPS))
  resumed = train(tmp_path / "resumed", ema)
  assert resumed.returncode == 0 and "resumed from" in resumed.stdout + resumed.stderr
  # The readers (sample, serve, generate, init_from, convert) get the average, not the last parameters.
  averages = {w: host(checkpoint.load_params(tmp_path / w)[0]) for w in ("reference", "resumed")}
  jax.tree.map(np.testing.assert_array_equal, averages["reference"], averages["resumed"])
  source = reader._ParamsSource(tmp_path / "reference", STEPS)  # pylint: disable=protected-access
  assert source.key == "ema_params"
  last = host(source.restore(source.stored))
  jax.tree.map(np.testing.assert_array_equal, last, averages["reference"])
  source.key = "params"
  raw = host(source.restore(source.stored))
  assert any(not np.array_equal(a, r) for a, r in zip(jax.tree.leaves(averages["reference"]), jax.tree.leaves(raw)))
  # A run cannot start or stop keeping the average on resume: one line, exit 2, nothing written.
  refused = train(tmp_path / "reference", f"--config.steps={STEPS + 3}")
  assert refused.returncode == 2, refused.stderr[-2000:]
  assert "was written with optimizer.ema_decay=0.99, this run has 0" in refused.stderr
  assert checkpoint.checkpoint_steps(tmp_path / "reference")[-1] == STEPS
  records = [json.loads(line) for line in (tmp_path / "reference" / "metrics.jsonl").read_text().splitlines()]
  assert records[-1]["step"] == STEPS
