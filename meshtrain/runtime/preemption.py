"""Signals: SIGTERM or SIGINT to any process makes every process stop after the same step, with a checkpoint.

Two phases. During start-up (distributed runtime, restore, compile) nothing needs saving, so the first signal
ends the process at once with a message and exit code 128 + the signal number (130 for Ctrl-C, 143 for SIGTERM);
waiting for a compile to finish, or unwinding a KeyboardInterrupt while compile threads still run (a
segmentation fault in XLA), would be worse. Once the loop runs, a signal asks for a stop after the current step:
  - one process: the handler sets a flag;
  - several: JAX's preemption sync service does the agreeing. The process that got SIGTERM tells the coordination
    service, which picks the first step every process has not yet passed, and `reached_preemption_sync_point(step)`
    turns true at that step everywhere. SIGINT is turned into SIGTERM so Ctrl-C behaves the same way. (SIGTERM
    belongs to the runtime's own handler from `jax.distributed.initialize` on, start-up included: a SIGTERM then
    stops the run at its first step, with a checkpoint.)
Further signals while the checkpoint is written are acknowledged and ignored, so the save, the metrics and the
loss plot complete; `kill -9` remains for an immediate end (the checkpoint in flight is then discarded, earlier
ones are untouched).
"""
import os
import signal
import sys
import threading

EXIT_STARTUP_SIGNAL = 128  # + the signal number, as shells report a process ended by that signal


class PreemptionNotice:
  """Install first thing in an entry point (`with PreemptionNotice() as notice:`); call `start_loop()` when
  the first step is about to be dispatched."""

  def __init__(self):
    self.distributed = False
    self._loop = False
    self._flag = threading.Event()
    self._previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def start_loop(self, distributed: bool) -> None:
    """From now on a signal stops the run after the current step, with a checkpoint."""
    self.distributed = distributed
    self._loop = True

  def _on_signal(self, signum, _frame) -> None:
    name = signal.Signals(signum).name
    if not self._loop:
      print(f"stopped: {name} during start-up, before the first step; no checkpoint was written and earlier ones "
            f"are untouched. Rerun the same command to start (or resume)", file=sys.stderr, flush=True)
      sys.stdout.flush()
      os._exit(EXIT_STARTUP_SIGNAL + signum)
    if self._flag.is_set():
      print(f"{name}: already stopping; the checkpoint is being written (kill -9 ends the process at once and "
            "discards it)", file=sys.stderr, flush=True)
      return
    self._flag.set()
    if self.distributed and signum == signal.SIGINT:
      os.kill(os.getpid(), signal.SIGTERM)  # to the runtime's notifier, which agrees on a step with the peers

  def reached(self, step: int) -> bool:
    """True at the step after which every process should checkpoint and stop. Call once per step."""
    if self.distributed:
      from jax.experimental import multihost_utils  # JAX only here: this module is imported before runtime.start
      return multihost_utils.reached_preemption_sync_point(step)
    return self._flag.is_set()

  def close(self) -> None:
    """Gives the signals back, unless a stop was requested: the process is then about to end with everything
    saved, and further signals are ignored (a Ctrl-C during JAX's exit handlers would end it with a traceback,
    and Python resets its own handlers at exit, but not an ignored signal)."""
    for sig, handler in self._previous.items():
      signal.signal(sig, signal.SIG_IGN if self._flag.is_set() else handler)
    self._previous = {}
