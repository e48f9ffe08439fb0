"""`--config.profile_steps=A-B`: a jax.profiler trace of training steps A..B (inclusive) in WORKDIR/profile.

View it with TensorBoard (`tensorboard --logdir WORKDIR/profile`, Profile tab, needs tensorboard-plugin-profile)
or open WORKDIR/profile/plugins/profile/<run>/perfetto_trace.json.gz on https://ui.perfetto.dev.
Steps are asynchronous: the trace starts before step A is dispatched and stops once step B has finished on the
devices, so it holds whole steps and the host-side gaps between them.
"""
import pathlib
import time

from meshtrain.errors import UserError


def parse_steps(text: str) -> tuple[int, int] | None:
  """"" -> None, "7" -> (7, 7), "20-24" -> (20, 24); anything else is a UserError naming the format."""
  if not text:
    return None
  first, _, last = text.partition("-")
  try:
    a, b = int(first), int(last or first)
  except ValueError:
    a, b = 0, -1
  if not 1 <= a <= b:
    raise UserError(f"profile_steps={text!r} is not a step range; write A-B with 1 <= A <= B (e.g. 20-24) or one step")
  return a, b


class StepProfiler:
  def __init__(self, steps: str, workdir: pathlib.Path, enabled: bool = True):
    self.range = parse_steps(steps) if enabled else None
    self.directory = workdir / "profile"
    self.active = False
    self.write_s = 0.0  # seconds the last stop_trace took (flushing the trace to disk)

  def before(self, step: int) -> None:
    if self.range and step == self.range[0]:
      import jax
      jax.profiler.start_trace(str(self.directory), create_perfetto_trace=True)
      self.active = True

  def after(self, step: int, outputs) -> str | None:
    """Stops after the last profiled step has run; returns a line for the log when it did."""
    if self.active and step == self.range[1]:
      import jax
      jax.block_until_ready(outputs)
      t0 = time.perf_counter()
      jax.profiler.stop_trace()
      self.write_s = time.perf_counter() - t0
      self.active = False
      return f"profile of steps {self.range[0]}-{self.range[1]} written to {self.directory}"
    return None

  def close(self) -> None:
    if self.active:  # the run ended (preempted, stopped) inside the range: keep what was traced
      import jax
      jax.profiler.stop_trace()
      self.active = False
