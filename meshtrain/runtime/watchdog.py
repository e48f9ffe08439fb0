"""Hang watchdog: a process that makes no progress for `timeout_s` writes a diagnostic and exits with code 4.

A peer that died or stopped inside a collective leaves every other process blocked in that collective forever;
no exception ever reaches Python. A thread that watches the loop's heartbeat is the only way out: it writes
what the process was doing (step, phase, every thread's Python stack) and ends the process, so the scheduler
sees a failure and can requeue the job, which then resumes from the last checkpoint.
"""
import faulthandler
import os
import pathlib
import sys
import threading
import time

EXIT_HANG = 4


class Watchdog:
  def __init__(self, timeout_s: float, workdir: pathlib.Path, process_index: int):
    self.timeout_s = timeout_s
    self._path = pathlib.Path(workdir) / "diagnostics" / f"hang-process{process_index}.txt"
    self._process = process_index
    self._step, self._phase, self._last = 0, "starting", time.monotonic()
    self._stop = threading.Event()
    self._thread = None
    if timeout_s > 0:
      self._thread = threading.Thread(target=self._watch, name="meshtrain-watchdog", daemon=True)
      self._thread.start()

  def beat(self, step: int, phase: str) -> None:
    """Records progress: the loop calls this before each thing that may block."""
    self._step, self._phase, self._last = step, phase, time.monotonic()

  def close(self) -> None:
    self._stop.set()

  def _watch(self) -> None:
    while not self._stop.wait(min(1.0, self.timeout_s / 10)):
      idle = time.monotonic() - self._last
      if idle > self.timeout_s:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        with open(self._path, "w") as f:
          f.write(f"process {self._process}: no progress for {idle:.0f}s (watchdog_s={self.timeout_s:g}) at step "
                  f"{self._step}, phase: {self._phase}\nPython stacks of every thread:\n")
          f.flush()
          faulthandler.dump_traceback(f, all_threads=True)
        print(f"error: process {self._process} made no progress for {idle:.0f}s at step {self._step} "
              f"({self._phase}); a peer may have died or hung. Stacks written to {self._path}. Exiting with code "
              f"{EXIT_HANG} so the job can be restarted; rerun to resume from the last checkpoint.",
              file=sys.stderr, flush=True)
        os._exit(EXIT_HANG)  # the main thread is stuck in a collective: no clean way to unwind it
