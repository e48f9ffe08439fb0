"""The cluster path on a real SLURM: cluster/local_slurm.sh runs slurmctld and two slurmd (emulated nodes n1, n2)
on this host, and the shipped cluster/slurm.sbatch is submitted to it with sbatch, as a user would.

Needs root and apt (or SLURM installed): otherwise every test skips with the reason, or fails when
MESHTRAIN_REQUIRE_SLURM=1 (CI), so a CI machine that cannot run them does not pass silently. Both emulated nodes
are this host, so a workdir on local disk is "shared". Each job gets the GPU-specific #SBATCH lines overridden
(`--gpus-per-node=0 --cpus-per-task=1`) and `--config.cpu_devices=4`: 2 processes x 4 CPU devices = 8 devices.
"""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import xla_fast
from ckpt_helpers import restore_params

# Jobs on a real SLURM, minutes each; `-m 'not slow'` leaves them out.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster" / "local_slurm.sh"
SBATCH = ROOT / "cluster" / "slurm.sbatch"
STATE_DIR = pathlib.Path(os.environ.get("MESHTRAIN_SLURM_DIR", "/var/lib/meshtrain-slurm"))
STEPS = 12
ARGS = [f"--config.steps={STEPS}", "--config.seq_len=64", "--config.log_every=1", "--config.eval_every=0",
        "--config.checkpoint_every=2", "--config.checkpoint_keep=20", "--config.optimizer.warmup_steps=1",
        "--config.mesh.data=-1"]
# The shipped script asks for 8 GPUs and 32 CPUs per node; command-line options override #SBATCH lines.
CPU_NODE = ["--gpus-per-node=0", "--cpus-per-task=1"]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
            "DEADLINE"}
# The time-limit job: one process (8 devices; the batch script's logic does not depend on the node count, and one
# process starts faster than two). slurmctld checks time limits every 30 s and sends the --signal when at most
# its time + 30 s are left (seen here; SLURM's documentation says up to 60 s early), so with --time=2 and @10 the
# signal comes 80-110 s after the start: after start-up (20-60 s here, depending on load), and at least 30 s
# before the next check can enforce the limit. The run is sized from the measured step time to need about 110 s of
# training, more than one attempt can do (at most 110 s minus start-up), so that the job must continue itself.
TIME_LIMIT = ["--nodes=1", "--time=2", "--signal=B:USR1@10"]
TIME_LIMIT_TRAINING_S = 110
TIME_LIMIT_EVERY = 10  # log_every and checkpoint_every of that run


def time_limit_args(steps: int) -> list[str]:
  return [f"--config.steps={steps}", "--config.seq_len=64", f"--config.log_every={TIME_LIMIT_EVERY}",
          "--config.eval_every=0", f"--config.checkpoint_every={TIME_LIMIT_EVERY}", "--config.optimizer.warmup_steps=1",
          "--config.mesh.data=-1", "--config.cpu_devices=8"]


_jobs = []  # every job submitted, cancelled at the end if still there


def _unavailable(reason: str):
  if os.environ.get("MESHTRAIN_REQUIRE_SLURM") == "1":
    pytest.fail(f"MESHTRAIN_REQUIRE_SLURM=1, but the SLURM tests cannot run: {reason}")
  pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster():
  """A two-node SLURM on this host, started with the project's script; stopped afterwards if it started it."""
  if os.geteuid() != 0:
    _unavailable("needs root: cluster/local_slurm.sh installs SLURM with apt and runs its daemons as root")
  if not shutil.which("slurmctld") and not shutil.which("apt-get"):
    _unavailable("SLURM is not installed and there is no apt-get to install it")
  was_running = subprocess.run([CLUSTER, "status"], capture_output=True, text=True).returncode == 0
  started = subprocess.run([CLUSTER, "start", "--nodes", "2"], capture_output=True, text=True, timeout=900)
  if started.returncode != 0:
    _unavailable(f"cluster/local_slurm.sh start failed ({started.returncode}): {started.stderr[-2000:]}")
  env = {**xla_fast.env(), "SLURM_CONF": str(STATE_DIR / "slurm.conf"), "JAX_PLATFORMS": "cpu",
         # sbatch passes the submitting environment to the job: `python` in the script is this interpreter.
         "PATH": f"{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
  try:
    yield env
  finally:
    live = [job for job in _jobs if state(job, env).get("JobState") not in TERMINAL]
    if live:
      subprocess.run(["scancel", *live], env=env)
    if not was_running:
      subprocess.run([CLUSTER, "stop"], capture_output=True, text=True, timeout=300)


def state(job: str, env) -> dict:
  """The job's fields from `scontrol show job` (JobState, Restarts, ExitCode, ...), {} once SLURM forgot it."""
  proc = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True)
  return dict(re.findall(r"(\w+)=(\S*)", proc.stdout)) if proc.returncode == 0 else {}


def sbatch(env, workdir: pathlib.Path, log: pathlib.Path, *options, args=(*ARGS, "--config.cpu_devices=4")) -> str:
  """Submits the shipped script for `workdir`, output to `log`; returns the job id."""
  proc = subprocess.run(["sbatch", "--parsable", *CPU_NODE, f"--output={log}", *options, str(SBATCH),
                         "configs/tiny.py", str(workdir), *args], cwd=ROOT, env=env, capture_output=True, text=True)
  assert proc.returncode == 0, proc.stderr
  job = proc.stdout.strip().split(";")[0]
  _jobs.append(job)
  return job


def tail(log: pathlib.Path, chars=4000) -> str:
  return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"


def wait_done(job: str, env, log: pathlib.Path, timeout: float) -> dict:
  """Polls until the job has ended (not merely an attempt of it); its final fields."""
  deadline = time.monotonic() + timeout
  while (fields := state(job, env)).get("JobState") not in TERMINAL:
    assert fields, f"SLURM no longer knows job {job}:\n{tail(log)}"
    assert time.monotonic() < deadline, f"job {job} still {fields.get('JobState')} after {timeout} s:\n{tail(log)}"
    time.sleep(1)
  return fields


def losses(workdir: pathlib.Path) -> dict[int, float]:
  path = workdir / "metrics.jsonl"
  if not path.exists():
    return {}
  return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r}


def wait_for_step(workdir, step, job, env, log, timeout=240):
  deadline = time.monotonic() + timeout
  while max(losses(workdir), default=0) < step:
    assert state(job, env).get("JobState") in ("PENDING", "RUNNING"), f"job {job} ended early:\n{tail(log)}"
    assert time.monotonic() < deadline, f"job {job} did not reach step {step} in {timeout} s:\n{tail(log)}"
    time.sleep(0.2)


def saved_steps(workdir):
  return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def assert_params_equal(a_dir, b_dir, exact=True):
  check = np.testing.assert_array_equal if exact else (
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6))  # gloo sums in another order
  jax.tree.map(check, restore_params(a_dir, STEPS, steps=STEPS), restore_params(b_dir, STEPS, steps=STEPS))


@pytest.fixture(scope="module")
def runs(cluster, tmp_path_factory):
  """The uninterrupted runs the tests compare with: the shipped sbatch on two nodes (2 x 4 devices) and the same
  config in one process with 8 devices, side by side; then the time-limit job is submitted, so that its minutes
  of waiting for SLURM's clock overlap the other tests."""
  env, base = cluster, tmp_path_factory.mktemp("slurm_reference")
  job = sbatch(env, base / "two", base / "two.out")
  one = subprocess.run([sys.executable, "-m", "meshtrain.train", "--config", "configs/tiny.py", "--workdir",
                        str(base / "one"), *ARGS, "--config.cpu_devices=8"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
  assert one.returncode == 0, one.stderr[-3000:]
  fields = wait_done(job, env, base / "two.out", timeout=600)
  assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", f"{fields}\n{tail(base / 'two.out')}"
  # Steps 3.. of the one-process run: step 1 compiles, step 2 may still wait for it.
  step_s = float(np.median([r["step_time_s"] for r in map(json.loads, (base / "one" / "metrics.jsonl").read_text()
                                                          .splitlines())
                            if r.get("step", 0) > 2 and "step_time_s" in r]))
  steps = max(60, -(-int(TIME_LIMIT_TRAINING_S / step_s) // TIME_LIMIT_EVERY) * TIME_LIMIT_EVERY)
  limited = tmp_path_factory.mktemp("slurm_time_limit")
  limited_job = sbatch(env, limited / "run", limited / "job.out", *TIME_LIMIT, args=time_limit_args(steps))
  return {"two": base / "two", "two_log": base / "two.out", "one": base / "one", "job": job,
          "time_limit": (limited_job, limited / "run", limited / "job.out", steps)}


def test_sbatch_on_two_nodes_trains_like_one_process(runs):
  log = runs["two_log"].read_text()
  assert "mesh: data=8 (8 cpu devices, 2 process(es))" in log, log[-3000:]
  assert f"done: step {STEPS}" in log and log.count(f"done: step {STEPS}") == 1  # process 0 reports, once
  assert f"=== meshtrain: job {runs['job']} attempt 1 on n[1-2]" in log
  got, ref = losses(runs["two"]), losses(runs["one"])
  assert sorted(got) == list(range(1, STEPS + 1)) and sorted(got) == sorted(ref)
  np.testing.assert_allclose([got[s] for s in sorted(ref)], [ref[s] for s in sorted(ref)], rtol=2e-5)
  assert_params_equal(runs["two"], runs["one"], exact=False)


def test_scancel_term_saves_and_resubmission_resumes_bitwise(cluster, runs, tmp_path):
  env, workdir = cluster, tmp_path / "run"
  job = sbatch(env, workdir, tmp_path / "first.out")
  wait_for_step(workdir, 3, job, env, tmp_path / "first.out")
  # Without --full/--batch, scancel signals the job's steps (the training processes), not the batch script.
  subprocess.run(["scancel", "--signal=TERM", job], env=env, check=True)
  fields = wait_done(job, env, tmp_path / "first.out", timeout=120)
  first = tail(tmp_path / "first.out")
  assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", f"{fields}\n{first}"
  assert fields["Restarts"] == "0", "a job stopped with scancel --signal=TERM must end, not requeue itself"
  saved = saved_steps(workdir)[-1]
  assert f"preempted: saved step {saved} to" in first and 3 <= saved < STEPS, first
  job = sbatch(env, workdir, tmp_path / "second.out")  # the same command again
  fields = wait_done(job, env, tmp_path / "second.out", timeout=300)
  second = tail(tmp_path / "second.out")
  assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", f"{fields}\n{second}"
  assert f"resumed from {workdir / 'checkpoints' / str(saved)}" in second, second
  assert losses(workdir) == losses(runs["two"])  # every step, to the last bit
  assert_params_equal(workdir, runs["two"])


def test_scontrol_requeue_resumes_and_keeps_both_logs(cluster, runs, tmp_path):
  env, workdir, log = cluster, tmp_path / "run", tmp_path / "job.out"
  job = sbatch(env, workdir, log)
  wait_for_step(workdir, 3, job, env, log)
  subprocess.run(["scontrol", "requeue", job], env=env, check=True)
  fields = wait_done(job, env, log, timeout=300)
  text = log.read_text(errors="replace")
  assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", f"{fields}\n{text[-4000:]}"
  assert fields["Restarts"] == "1", fields
  first, _, second = text.partition(f"=== meshtrain: job {job} attempt 2 on")
  assert f"=== meshtrain: job {job} attempt 1 on" in first and second, text[-4000:]  # append, not overwrite
  assert "train step compiled" in first and "resumed from" in second, text[-4000:]
  resumed = int(re.search(r"resumed from \S+/checkpoints/(\d+)", second).group(1))
  assert 2 <= resumed < STEPS, second
  assert losses(workdir) == losses(runs["two"])
  assert_params_equal(workdir, runs["two"])


def test_srun_generate_on_two_nodes_equals_one_process(cluster, runs):
  # Generation over two nodes (srun: one task each, 4 devices, fsdp=8 across both), from the two-node run's
  # checkpoint: the ids of one process with 8 devices, and one JSON object on stdout.
  args = [sys.executable, "-m", "meshtrain.generate", "--workdir", str(runs["two"]), "--prompt-ids", "100,101,102",
          "--prompt-ids", ",".join(map(str, range(40, 57))), "--prompt-ids", "35", "--max-new-tokens", "16", "--json",
          "--config.mesh.data=1", "--config.sharding.rules=fsdp"]
  two = subprocess.run(["srun", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", *args,
                        "--config.mesh.fsdp=4", "--config.mesh.nodes.fsdp=2", "--config.cpu_devices=4"], cwd=ROOT,
                       env=cluster, capture_output=True, text=True, timeout=300)
  assert two.returncode == 0, two.stderr[-3000:]
  one = subprocess.run([*args, "--config.mesh.fsdp=8", "--config.cpu_devices=8"], cwd=ROOT, env=cluster,
                       capture_output=True, text=True, timeout=300)
  assert one.returncode == 0, one.stderr[-3000:]
  assert len(two.stdout.splitlines()) == 1, two.stdout[-3000:]  # process 0's JSON only
  assert json.loads(two.stdout)["token_ids"] == json.loads(one.stdout)["token_ids"]


@pytest.mark.parametrize("how", ["salloc", "sbatch"])
def test_inside_an_allocation_outside_srun_runs_as_one_process(cluster, how, tmp_path):
  # SLURM_NTASKS=2 and SLURM_JOB_ID are set there, but no step (SLURM_STEP_ID): not a multi-process launch.
  env, log = cluster, tmp_path / "job.out"
  command = [sys.executable, "-m", "meshtrain.inspect", "--config", "configs/tiny.py", "--config.seq_len=64"]
  if how == "salloc":
    proc = subprocess.run(["salloc", "--nodes=2", "--ntasks=2", "--cpus-per-task=1", *command], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    rc, stderr, out = proc.returncode, proc.stderr, proc.stdout + proc.stderr
  else:
    proc = subprocess.run(["sbatch", "--parsable", "--nodes=2", "--ntasks=2", "--cpus-per-task=1",
                           f"--error={tmp_path / 'job.err'}", f"--output={log}", "--wrap", " ".join(command)],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    job = proc.stdout.strip().split(";")[0]
    _jobs.append(job)
    fields = wait_done(job, env, log, timeout=300)
    rc = int(fields["ExitCode"].split(":")[0])
    stderr, out = (tmp_path / "job.err").read_text(), log.read_text() + (tmp_path / "job.err").read_text()
  assert rc == 0, out[-3000:]
  notes = [line for line in stderr.splitlines() if line.startswith("note: inside SLURM job")]
  assert len(notes) == 1, stderr[-3000:]
  assert "srun" in notes[0] and "one process" in notes[0], notes[0]


def test_time_limit_continues_the_run_until_done(cluster, runs):
  """A job whose --time is shorter than the run: SIGUSR1 to the batch script before the limit, a checkpoint, a
  requeue of itself; the next attempt resumes, until the run is done. Every attempt's log is kept."""
  env, (job, workdir, log, steps) = cluster, runs["time_limit"]
  fields = wait_done(job, env, log, timeout=900)
  text = log.read_text(errors="replace")
  assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", f"{fields}\n{text[-4000:]}"
  restarts = int(fields["Restarts"])
  assert restarts >= 1, f"the run finished within one attempt: the test did not exercise the time limit\n{text}"
  for attempt in range(1, restarts + 2):
    assert f"=== meshtrain: job {job} attempt {attempt} on" in text, text[-4000:]
  # Every requeue follows a time-limit signal. The last attempt may get the signal too, when it ends within the
  # warning window (CI once: its run reached the last step as the signal came): it then stops having finished, and
  # is not requeued.
  notices = text.count("time limit near, stopping with a checkpoint")
  assert notices in (restarts, restarts + 1), text[-4000:]
  assert text.count("by the time limit; requeueing job") == restarts, text[-4000:]
  assert text.count("preempted: saved step") in (restarts, notices) and text.count("resumed from") == restarts, \
      text[-4000:]
  # Done either way: the trainer's "done: step N", or, when the last attempt's signal came at its last step (the
  # trainer then says "preempted: saved step N"), the batch script's own line for it (CI's 3.11 suite once).
  assert (f"done: step {steps}" in text
          or f"=== meshtrain: the run reached its last step ({steps}) as the time limit came; done" in text), \
      text[-4000:]
  assert saved_steps(workdir)[-1] == steps
  logged = set(losses(workdir))  # every logged step of the run, from all attempts, in one metrics.jsonl
  assert set(range(TIME_LIMIT_EVERY, steps + 1, TIME_LIMIT_EVERY)) <= logged, sorted(logged)
