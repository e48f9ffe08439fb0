"""Faults from issue 13, each with real processes: two runs on one workdir, where the coordinator listens, a
metrics line cut by a crash, a resumed run with another data order, sizes that cannot fit, and signals at awkward
moments. Each asserts a clear refusal (exit 2, one line, no traceback) or a recovery with nothing lost."""
import ipaddress
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
import xla_fast
from test_recovery import command, losses, run, start, steps_on_disk, wait_for_step

from meshtrain.runtime.launcher import free_port

# Whole training runs in subprocesses under signals, locks and refusals; `-m 'not slow'` leaves them out.
pytestmark = pytest.mark.slow


def one_line_error(proc_or_err, *words):
  err = proc_or_err if isinstance(proc_or_err, str) else proc_or_err.stderr
  lines = [line for line in err.splitlines() if line.strip() and not line.startswith("WARNING:absl")]
  assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
  for word in words:
    assert word in lines[0], lines[0]
  return lines[0]


def metrics_steps(workdir):
  return [r["step"] for r in map(json.loads, (workdir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A 16-step run (checkpoints every 4) that the refusal tests try to resume: they must leave it as it is."""
  workdir = tmp_path_factory.mktemp("finished")
  proc = run(workdir)
  assert proc.returncode == 0, proc.stderr[-2000:]
  return workdir


def snapshot(workdir):
  """Every file under workdir with its size and modification time (but the lock, which names whoever held it
  last): a refused run must change none of them."""
  return {str(p.relative_to(workdir)): (p.stat().st_size, p.stat().st_mtime_ns)
          for p in sorted(workdir.rglob("*")) if p.is_file() and p.name != "meshtrain.lock"}


def stop_and_check_history(first, workdir):
  """Preempts `first` (a long run the test raced against) and checks it kept one whole history: every step from 1
  once and in order, the checkpoint of the step it stopped at, its own config."""
  first.send_signal(signal.SIGTERM)
  out, err = first.communicate(timeout=300)
  assert first.returncode == 0 and "preempted: saved step" in out + err, err[-2000:]
  steps = metrics_steps(workdir)
  assert steps == list(range(1, steps[-1] + 1)) and steps_on_disk(workdir)[-1] == steps[-1]
  assert json.loads((workdir / "config.json").read_text())["seed"] == 0


def test_second_run_on_a_workdir_is_refused_and_the_first_is_untouched(tmp_path):
  # The first run is long and preempted at the end: with 16 steps it could finish on a loaded machine before the
  # second one reaches the lock, which would then (rightly) be free.
  first = start(tmp_path, "--config.steps=100000")
  wait_for_step(tmp_path, 2, first)
  t0 = time.monotonic()
  second = run(tmp_path, "--config.seed=1")
  refused_in = time.monotonic() - t0
  assert second.returncode == 2
  one_line_error(second, "another run is using", f"pid {first.pid}", f"host {socket.gethostname()}", "started")
  # before building, restoring or compiling anything (the time bound is loose: CI's 2 cores run other tests too)
  assert "mesh:" not in second.stdout and refused_in < 60, (refused_in, second.stdout)
  stop_and_check_history(first, tmp_path)


def test_kill9_leaves_no_stale_lock(tmp_path):
  # The lock dies with its process: the file stays behind (naming the dead holder), the next run takes it over.
  proc = start(tmp_path)
  wait_for_step(tmp_path, 2, proc)
  proc.kill()
  proc.wait()
  assert f"pid {proc.pid}" in (tmp_path / "meshtrain.lock").read_text()
  rerun = run(tmp_path, "--config.steps=4")
  assert rerun.returncode == 0, rerun.stderr[-2000:]


def listening_sockets(pids):
  """(pid, local address) of every listening TCP socket the processes hold, read from /proc (no ss needed)."""
  listening = {}  # socket inode -> address
  for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
    for row in pathlib.Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
      fields = row.split()
      if fields[3] == "0A":  # TCP_LISTEN
        raw = bytes.fromhex(fields[1].split(":")[0])
        # /proc prints the address as 32-bit words in host (little-endian) order
        packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
        address = ipaddress.ip_address(socket.inet_ntop(family, packed))
        # gRPC listens on IPv4 addresses through dual-stack sockets: ::ffff:127.0.0.1 is 127.0.0.1
        listening[fields[9]] = getattr(address, "ipv4_mapped", None) or address
  found = []
  for pid in pids:
    for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
      try:
        target = os.readlink(fd)
      except OSError:
        continue
      if target.startswith("socket:[") and target[8:-1] in listening:
        found.append((pid, listening[target[8:-1]]))
  return found


def children(pid):
  return [int(p.name) for p in pathlib.Path("/proc").iterdir() if p.name.isdigit()
          and _ppid(p) == pid]


def _ppid(proc_dir):
  try:
    return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
  except (OSError, IndexError, ValueError):
    return None


def test_a_local_launch_listens_on_loopback_only(tmp_path):
  proc = subprocess.Popen(command(tmp_path, "--config.steps=200", processes=2), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=xla_fast.env())
  try:
    wait_for_step(tmp_path, 2, proc, timeout=240)  # the coordinator, gloo and every peer connection are up
    sockets = listening_sockets(children(proc.pid))
    assert len(sockets) >= 2, sockets  # the coordinator, and each process's collectives endpoint
    assert all(address.is_loopback for _, address in sockets), sockets
  finally:
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=180)
  assert proc.returncode == 0


def test_metrics_line_cut_by_a_crash_is_dropped_on_resume(finished, tmp_path):
  import shutil
  shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 17, "loss": 2.3, "learning_ra')  # what a crash in the middle of a write leaves
  proc = run(tmp_path, "--config.steps=18")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "dropped 1 incomplete line(s)" in proc.stdout
  assert metrics_steps(tmp_path) == list(range(1, 19))


@pytest.mark.parametrize("changes, named", [
    (["--config.seed=1"], ["seed: checkpoint 0, this run 1"]),
    (["--config.batch_size=8", "--config.seq_len=32"],
     ["batch_size: checkpoint 16, this run 8", "seq_len: checkpoint 64, this run 32"]),
])
def test_resume_with_another_data_order_is_refused(finished, changes, named):
  before = snapshot(finished)
  proc = run(finished, "--config.steps=20", *changes)
  assert proc.returncode == 2
  one_line_error(proc, "another data order", "allow_data_change", *named)
  assert snapshot(finished) == before


def test_allowed_data_change_and_schedule_changes_are_logged(finished, tmp_path):
  import shutil
  shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
  proc = run(tmp_path, "--config.steps=18", "--config.seed=1", "--config.allow_data_change=true",
             "--config.optimizer.learning_rate=1e-3")
  assert proc.returncode == 0, proc.stderr[-2000:]
  for line in ("resuming with seed changed: 0 -> 1", "resuming with steps changed: 16 -> 18",
               "resuming with optimizer.learning_rate changed: 0.003 -> 0.001"):
    assert line in proc.stdout
  assert losses(tmp_path).keys() == set(range(1, 19))


def test_a_state_that_cannot_fit_is_refused_before_allocating(tmp_path):
  t0 = time.monotonic()
  proc = run(tmp_path, "--config.model.num_layers=100000")
  assert proc.returncode == 2
  one_line_error(proc, "the train state", "GB per device", "host RAM", "python -m meshtrain.inspect")
  assert time.monotonic() - t0 < 60  # no compile, no initialisation


def test_a_step_whose_temporaries_cannot_fit_is_refused_after_compiling(tmp_path):
  # 8 sequences of 8,192 tokens: attention's scores alone need ~10 GB per simulated device, 3 GB is what one has.
  proc = subprocess.run(command(tmp_path, "--config.seq_len=8192", "--config.batch_size=8"), capture_output=True,
                        text=True, timeout=600, env=xla_fast.env())
  assert proc.returncode == 2
  one_line_error(proc, "the compiled train step", "GB per device")
  assert not (tmp_path / "metrics.jsonl").exists()  # no step ran


def wait_for_output(proc, text, timeout=120):
  """Reads proc's stdout until a line containing text (stdout stays readable afterwards)."""
  deadline = time.monotonic() + timeout
  for line in proc.stdout:
    if text in line:
      return
    assert time.monotonic() < deadline, f"no {text!r} in time"
  raise AssertionError(f"the process ended before printing {text!r}: {proc.stderr.read()[-2000:]}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_while_a_resumed_run_compiles(finished, tmp_path, sig):
  import shutil
  shutil.copytree(finished, tmp_path, dirs_exist_ok=True)
  before = snapshot(tmp_path)
  # No compilation cache: the compile takes seconds, and the signal lands inside it.
  proc = start(tmp_path, "--config.steps=20", "--config.compilation_cache_dir=")
  wait_for_output(proc, "compiling the train step")
  time.sleep(0.5)
  proc.send_signal(sig)
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == 128 + sig, (proc.returncode, err[-3000:])  # not -11 (a segmentation fault)
  assert "Traceback" not in err and f"stopped: {sig.name} during start-up" in err, err[-3000:]
  after = snapshot(tmp_path)
  # config.json is rewritten (same content); nothing else changes
  assert ({k: v for k, v in after.items() if k != "config.json"}
          == {k: v for k, v in before.items() if k != "config.json"})


def test_repeated_ctrl_c_while_saving_still_saves_and_plots(tmp_path):
  proc = start(tmp_path, "--config.steps=200")
  wait_for_step(tmp_path, 3, proc)
  proc.send_signal(signal.SIGINT)
  while proc.poll() is None:  # an impatient user: Ctrl-C again every 0.2 s until the process is gone
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
  out, err = proc.communicate()
  assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
  assert "already stopping" in err and "preempted: saved step" in out + err
  saved = steps_on_disk(tmp_path)[-1]
  assert (tmp_path / "checkpoints" / str(saved) / "commit_success.txt").exists()
  assert (tmp_path / "loss.png").exists()
  assert max(losses(tmp_path)) == saved


def test_every_process_of_a_refused_multi_process_run_stops(tmp_path):
  # Without a launcher (as under srun): process 0 is refused the lock, and process 1 must stop by itself too,
  # not wait for its peer at the first collective.
  first = start(tmp_path, "--config.steps=100000")  # long, then preempted: it must hold the lock throughout
  wait_for_step(tmp_path, 2, first)
  address = f"127.0.0.1:{free_port()}"
  procs = [subprocess.Popen([sys.executable, "-m", "meshtrain.train", *command(tmp_path)[3:], "--config.cpu_devices=4"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**xla_fast.env(), "JAX_COORDINATOR_ADDRESS": address, "MESHTRAIN_NUM_PROCESSES": "2",
                                 "MESHTRAIN_PROCESS_ID": str(i)}) for i in range(2)]
  errs = [p.communicate(timeout=120)[1] for p in procs]
  assert [p.returncode for p in procs] == [2, 2], errs
  one_line_error(errs[0], "another run is using", f"pid {first.pid}")
  one_line_error(errs[1], "process 0 could not lock")
  stop_and_check_history(first, tmp_path)
