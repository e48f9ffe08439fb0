"""N local processes standing in for N hosts: what `python -m meshtrain.launch` runs.

Each process gets the distributed runtime's variables (JAX_COORDINATOR_ADDRESS on 127.0.0.1, MESHTRAIN_NUM_PROCESSES,
MESHTRAIN_PROCESS_ID: meshtrain/runtime/cluster.py reads them), its output is relayed with a `[pN] ` prefix, SIGTERM
and SIGINT are passed on to every process, and when one fails the others are stopped.
"""
import os
import signal
import socket
import subprocess
import sys
import threading
import time

GRACE_S = 30  # after a failure, how long the survivors get to stop before SIGKILL


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _relay(stream, prefix: str, out) -> None:
  # Progress bars end lines with \r: split on both so a bar still updates in place, with its prefix.
  pending = b""
  for chunk in iter(lambda: stream.read1(4096), b""):
    pending += chunk
    while True:
      cut = min((i for i in (pending.find(b"\n"), pending.find(b"\r")) if i >= 0), default=-1)
      if cut < 0:
        break
      line, end, pending = pending[:cut], pending[cut:cut + 1], pending[cut + 1:]
      out.write(prefix + line.decode(errors="replace") + end.decode())
      out.flush()
  if pending:
    out.write(prefix + pending.decode(errors="replace") + "\n")
    out.flush()


def launch(processes: int, devices_per_process: int, train_args: list[str], module: str = "meshtrain.train") -> int:
  address = f"127.0.0.1:{free_port()}"
  procs, relays = [], []
  for i in range(processes):
    env = {**os.environ, "JAX_COORDINATOR_ADDRESS": address, "MESHTRAIN_NUM_PROCESSES": str(processes),
           "MESHTRAIN_PROCESS_ID": str(i), "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", module, *train_args, f"--config.cpu_devices={devices_per_process}"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    procs.append(proc)
    for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
      relays.append(threading.Thread(target=_relay, args=(stream, f"[p{i}] ", out), daemon=True))
      relays[-1].start()

  def forward(signum, _frame):
    for p in procs:
      if p.poll() is None:
        p.send_signal(signum)
  previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    failed = None
    while True:
      failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
      if failed is not None or all(p.poll() is not None for p in procs):
        break
      time.sleep(0.1)
    if failed is not None:
      print(f"[launch] process {failed} exited with code {procs[failed].returncode}; stopping the others",
            file=sys.stderr, flush=True)
      for p in procs:
        if p.poll() is None:
          p.terminate()
      deadline = time.monotonic() + GRACE_S
      for p in procs:
        try:
          p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
          p.kill()
          p.wait()
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  for t in relays:
    t.join(timeout=5)
  return procs[failed].returncode if failed is not None else 0

