"""Several real processes (jax.distributed on 127.0.0.1, gloo) train exactly like one process with 8 devices."""
import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
import xla_fast
from ckpt_helpers import restore_params

from meshtrain.cli import train

ARGS = ["--config", "configs/tiny.py", "--config.steps=4", "--config.seq_len=64", "--config.log_every=1",
        "--config.eval_every=4", "--config.eval_batches=1", "--config.checkpoint_every=2",
        "--config.optimizer.warmup_steps=1", "--config.mesh.data=-1"]


def launch(processes, devices, workdir, *extra, timeout=300):
  # In its own process group: on a timeout the launcher and its training processes are all stopped, and what they
  # printed is in the failure (why one of them stopped and the others wait).
  proc = subprocess.Popen([sys.executable, "-m", "meshtrain.launch", "--processes", str(processes),
                           "--devices-per-process", str(devices), "--", *ARGS, "--workdir", str(workdir), *extra],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=xla_fast.env(),
                          start_new_session=True)
  try:
    stdout, stderr = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    stdout, stderr = proc.communicate()
    raise AssertionError(f"no exit within {timeout} s\n--- stdout\n{stdout[-6000:]}\n--- stderr\n"
                         f"{stderr[-6000:]}") from None
  return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def losses(workdir):
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [(r["step"], r.get("loss", r.get("eval_loss"))) for r in rows]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("one_process")
  assert train.main([*ARGS, "--workdir", str(workdir)]) == 0
  return workdir


def test_processes_match_one_process(single, tmp_path):
  # Two processes of four devices (tests/test_recovery.py's elastic resume goes from one to two and back). Not
  # more processes: with jaxlib 0.12.1, four of two and eight of one now and then hang in the first all-reduce
  # (docs/cluster.md#on-one-machine).
  processes, devices = 2, 4
  workdir, cache = tmp_path / "run", tmp_path / "compilation-cache"
  proc = launch(processes, devices, workdir, f"--config.compilation_cache_dir={cache}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  # Several CPU processes compile rather than share cached programs (meshtrain.runtime.startup.cpu_cache_works).
  assert not cache.exists()
  assert f"[p0] mesh: data=8 (8 cpu devices, {processes} process(es))" in proc.stdout
  assert "[p1] done" not in proc.stdout and "[p0] done: step 4" in proc.stdout  # only process 0 reports
  ref, got = losses(single), losses(workdir)
  assert [s for s, _ in got] == [s for s, _ in ref]
  np.testing.assert_allclose([l for _, l in got], [l for _, l in ref], rtol=2e-5)  # gloo sums in another order
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "4"]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), restore_params(workdir, 4),
               restore_params(single, 4))


@pytest.mark.slow
def test_launcher_stops_everyone_when_one_fails(tmp_path):
  # An unknown key fails in every process before the runtime starts; the launcher reports the first failure.
  proc = launch(2, 4, tmp_path, "--config.nope=1", timeout=120)
  assert proc.returncode == 2
  assert "error: unknown config key 'nope'" in proc.stderr and "[launch] process" in proc.stderr


# A process that reaches its first collective more than 30 s after another: the CPU backend's collectives (gloo)
# give peers 30 s to connect, a limit nothing configures; without runtime.barrier the early process failed with
# "Gloo context initialization failed: DEADLINE_EXCEEDED: GetKeyValue() timed out ... 29.99s" and both aborted.
LATE_PROCESS = """
import sys, time
from meshtrain.cli import train
from meshtrain.runtime import startup
initialize = startup._initialize_distributed
def then_late(cfg, settings):
  initialize(cfg, settings)
  startup.jax.devices()  # the backends connect here, all processes together; what comes after is each process's pace
  if settings["process_id"] == 1:
    time.sleep(float(sys.argv[1]))  # a slow host: loading data, restoring, compiling, or starved of CPU
startup._initialize_distributed = then_late
sys.exit(train.main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_a_process_35_s_late_is_waited_for(tmp_path):
  from meshtrain.runtime.launcher import free_port
  args = [*ARGS, "--config.steps=2", "--config.eval_every=0", "--config.checkpoint_every=0", "--config.cpu_devices=4",
          "--workdir", str(tmp_path)]
  address = f"127.0.0.1:{free_port()}"
  procs = [subprocess.Popen([sys.executable, "-c", LATE_PROCESS, "35", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**xla_fast.env(), "JAX_COORDINATOR_ADDRESS": address, "MESHTRAIN_NUM_PROCESSES": "2",
                                 "MESHTRAIN_PROCESS_ID": str(i), "JAX_PLATFORMS": "cpu"}) for i in range(2)]
  outputs = [p.communicate(timeout=400)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
  assert "done: step 2" in outputs[0] and "Gloo context initialization failed" not in outputs[0]


# One process of two fails after the distributed runtime started (here: a UserError where it builds the evaluation's
# table; the other goes on to wait for it at the first step's barrier).
FAILING_PROCESS = """
import os, sys
from meshtrain import cli, layout
from meshtrain.cli import train
from meshtrain.errors import UserError
eval_extra = layout.Layout.eval_extra
def failing(self, *args):
  if os.environ["MESHTRAIN_PROCESS_ID"] == "1":
    raise UserError("process 1 cannot go on")
  return eval_extra(self, *args)
layout.Layout.eval_extra = failing
cli.run(lambda: train.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_failing_process_exits_at_once_not_after_the_runtime_shutdown_timeout(tmp_path):
  # At a normal exit jax.distributed waits up to 300 s for every peer to shut down too; the launcher (or srun
  # --kill-on-bad-exit) stops the others only once the failed one has exited.
  from meshtrain.runtime.launcher import free_port
  args = [*ARGS, "--config.steps=2", "--config.checkpoint_every=0", "--config.cpu_devices=4",
          "--workdir", str(tmp_path)]
  address = f"127.0.0.1:{free_port()}"
  procs = [subprocess.Popen([sys.executable, "-c", FAILING_PROCESS, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**xla_fast.env(), "JAX_COORDINATOR_ADDRESS": address, "MESHTRAIN_NUM_PROCESSES": "2",
                                 "MESHTRAIN_PROCESS_ID": str(i), "JAX_PLATFORMS": "cpu"}) for i in range(2)]
  try:
    out = procs[1].communicate(timeout=120)[0]  # start-up ~30 s here; the shutdown wait alone would be 300
  finally:
    for p in procs:
      p.kill()
  assert procs[1].returncode == 2 and "error: process 1 cannot go on" in out, out[-3000:]

