"""Preemption: SIGTERM or SIGINT to any process makes every process stop after the same step.

With one process a signal handler sets a flag. With several, JAX's preemption sync service does the agreeing:
the process that got SIGTERM tells the coordination service, which picks the first step every process has
not yet passed, and `reached_preemption_sync_point(step)` turns true at that step everywhere. SIGINT is turned
into SIGTERM so Ctrl-C behaves the same way.
"""
import os
import signal
import threading

import jax
from jax.experimental import multihost_utils


class PreemptionNotice:
  def __init__(self):
    self.distributed = jax.process_count() > 1
    self._flag = threading.Event()
    self._previous = {}
    if self.distributed:
      # SIGTERM belongs to the runtime's notifier; only SIGINT is re-routed to it.
      self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    else:
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, lambda *_: self._flag.set())

  def reached(self, step: int) -> bool:
    """True at the step after which every process should checkpoint and stop. Call once per step."""
    if self.distributed:
      return multihost_utils.reached_preemption_sync_point(step)
    return self._flag.is_set()

  def close(self) -> None:
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
