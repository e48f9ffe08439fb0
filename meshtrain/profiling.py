"""`--config.profile_steps=A-B`: a jax.profiler trace of training steps A..B (inclusive) in WORKDIR/profile.

View it with TensorBoard (`tensorboard --logdir WORKDIR/profile`, Profile tab, needs tensorboard-plugin-profile)
or open WORKDIR/profile/plugins/profile/<run>/perfetto_trace.json.gz on https://ui.perfetto.dev.
Steps are asynchronous: the trace starts before step A is dispatched and stops once step B has finished on the
devices, so it holds whole steps and the host-side gaps between them.
"""
import pathlib
import time

import jax

from meshtrain.config import parse_profile_steps


class StepProfiler:
  def __init__(self, steps: str, workdir: pathlib.Path, enabled: bool = True):
    self.range = parse_profile_steps(steps) if enabled else None
    self.directory = workdir / "profile"
    self.active = False
    self.write_s = 0.0  # seconds the last stop_trace took (flushing the trace to disk)

  def before(self, step: int) -> None:
    if self.range and step == self.range[0]:
      jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
      self.active = True

  def after(self, step: int, outputs) -> str | None:
    """Stops after the last profiled step has run; returns a line for the log when it did."""
    if self.active and step == self.range[1]:
      jax.block_until_ready(outputs)
      t0 = time.perf_counter()
      jax.profiler.stop_trace()
      self.write_s = time.perf_counter() - t0
      self.active = False
      return f"profile of steps {self.range[0]}-{self.range[1]} written to {self.directory}"
    return None

  def close(self) -> None:
    if self.active:  # the run ended (preempted, stopped) inside the range: keep what was traced
      jax.profiler.stop_trace()
      self.active = False
