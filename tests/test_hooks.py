"""The train loop's hooks: the timer's paused time, when periodic work runs, the order hooks see the loop in, a
hook attached from outside (bench's loop clock), and TensorBoard images."""
import json
import pathlib
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from meshtrain import config as config_lib, hooks, loop
from meshtrain.metrics import MetricsWriter


class FakeClock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def test_timer_keeps_paused_time_out_of_step_time(monkeypatch):
  clock = FakeClock()
  monkeypatch.setattr(hooks.time, "perf_counter", clock)
  timer = hooks.Timer(step=0)
  clock.now += 3.0                      # steps 1-3 run for 3 s
  with timer.paused():
    clock.now += 10.0                   # an evaluation: not step time
  timer.exclude(2.0)                    # a trace write measured elsewhere, inside the next 2 s
  clock.now += 2.0
  assert timer.step_time(3) == pytest.approx(1.0)  # (3 + 10 + 2 - 10 - 2) s / 3 steps
  assert timer.paused_s == pytest.approx(12.0)
  clock.now += 0.5
  assert timer.step_time(4) == pytest.approx(0.5)  # from the mark: the earlier pauses no longer count


class Run:
  last_step = 10


@pytest.mark.parametrize("every,due", [(3, [3, 6, 9, 10]), (5, [5, 10]), (0, [10])])
def test_periodic_runs_every_n_steps_and_at_the_last(every, due):
  assert [s for s in range(1, 11) if hooks.Periodic(every).due(s, Run())] == due


class Recorder(hooks.Hook):
  def __init__(self, name, calls, stop_at=None, fail_close=False):
    self.name, self.calls, self.stop_at, self.fail_close = name, calls, stop_at, fail_close

  def after(self, step, run):
    self.calls.append((self.name, step))
    if step == self.stop_at:
      run.stopped = True

  def close(self):
    self.calls.append((self.name, "close"))
    if self.fail_close:
      raise RuntimeError(f"{self.name} failed to close")


def test_hooks_in_order_a_stop_skips_the_rest_and_every_hook_closes_last_first():
  calls = []
  run = type("R", (), {"stopped": False})()
  chain = hooks.Hooks([Recorder("a", calls), Recorder("b", calls, stop_at=2, fail_close=True), Recorder("c", calls)])
  chain.after(1, run)
  chain.after(2, run)
  assert calls == [("a", 1), ("b", 1), ("c", 1), ("a", 2), ("b", 2)] and run.stopped
  calls.clear()
  with pytest.raises(RuntimeError, match="b failed"):
    chain.close()  # b's failure does not keep a from closing
  assert calls == [("c", "close"), ("b", "close"), ("a", "close")]


class Probe(hooks.Periodic):
  """At every 3rd step and the last: what the loop had written by then, and whether the timer was paused."""

  def __init__(self, workdir):
    super().__init__(3)
    self.workdir, self.seen, self.befores, self.afters, self.ended = workdir, [], [], [], 0

  def before(self, step, run):
    self.befores.append(step)

  def after(self, step, run):
    self.afters.append(step)
    super().after(step, run)

  def run_at(self, step, run):
    logged = [json.loads(line)["step"] for line in (self.workdir / "metrics.jsonl").read_text().splitlines()]
    paused_before = run.timer.paused_s
    time.sleep(0.2)
    self.seen.append((step, logged[-1], paused_before, int(run.state.step)))

  def end(self, run):
    self.ended += 1


@pytest.fixture(scope="module")
def hooked_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("hooks")
  cfg = config_lib.load("configs/tiny.py", [
      "--config.steps=5", "--config.seq_len=32", "--config.log_every=1", "--config.eval_every=0",
      "--config.checkpoint_every=0", "--config.optimizer.warmup_steps=1", "--config.model.num_layers=1",
      "--config.model.num_experts=2", "--config.model.experts_per_token=1"])  # MoE: the loss has metrics of its own
  probe, clock = Probe(workdir), hooks.LoopClock()
  timing = loop.run(cfg, workdir, hooks=[probe, clock])
  return workdir, probe, clock, timing


def test_an_attached_hook_sees_every_step_in_order_with_metrics_written_first(hooked_run):
  workdir, probe, _, timing = hooked_run
  assert probe.befores == probe.afters == [1, 2, 3, 4, 5] and probe.ended == 1
  # Periodic work at steps 3 and 5, each after that step's metrics are in metrics.jsonl (log in step order), with
  # the state of that step.
  assert [(s, last, state) for s, last, _, state in probe.seen] == [(3, 3, 3), (5, 5, 5)]
  # The timer was paused around each: the 0.2 s of sleep at step 3 is paused time, not step time.
  paused = [p for _, _, p, _ in probe.seen]
  assert paused[1] - paused[0] >= 0.2
  assert timing["startup_s"] > 0 and timing["compile_s"] > 0
  # The task's own scalars (the MoE router's) are logged with each step.
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert all(r["moe_aux_loss"] > 0 and 0 <= r["moe_dropped_fraction"] < 1 for r in records)


def test_bench_loop_clock_times_the_loop_from_outside(hooked_run):
  workdir, probe, clock, _ = hooked_run
  # From the fetch of step 1's metrics (at step 2) to the end: the devices ran steps 2-5 in that window.
  assert clock.steps == 4
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  step_times = sum(r["step_time_s"] for r in records if r["step"] >= 2)
  # The probe slept 0.2 s at steps 3 and 5 inside the clock's window, with the timer paused: excluded from the loop
  # time as from the step times, so the loop time is the sum of steps 2-5's times, not 0.4 s more.
  assert clock.seconds == pytest.approx(step_times, abs=0.15)


def read_events(directory: pathlib.Path):
  """Every Event in the TensorBoard files under `directory` (TFRecord framing: length, crc, data, crc)."""
  from tensorboardX.proto import event_pb2
  events = []
  for path in sorted(directory.glob("events.out.tfevents.*")):
    data = path.read_bytes()
    offset = 0
    while offset < len(data):
      (length,) = struct.unpack("<Q", data[offset:offset + 8])
      event = event_pb2.Event()
      event.ParseFromString(data[offset + 12:offset + 12 + length])
      events.append(event)
      offset += 12 + length + 4
  return events


def test_metrics_writer_image_is_a_tensorboard_image(tmp_path):
  import io

  from PIL import Image
  image = (np.arange(6 * 4 * 3).reshape(6, 4, 3) * 3).astype(np.uint8)
  writer = MetricsWriter(tmp_path, total_steps=10, start_step=0)
  writer.image("samples", image, step=7)
  with pytest.raises(ValueError, match="uint8"):
    writer.image("samples", image.astype(np.float32), step=8)
  writer.close()
  values = [(e.step, v) for e in read_events(tmp_path / "tensorboard") for v in e.summary.value]
  [(step, value)] = [(s, v) for s, v in values if v.tag == "samples"]
  assert step == 7 and (value.image.height, value.image.width, value.image.colorspace) == (6, 4, 3)
  np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(value.image.encoded_image_string))), image)
  MetricsWriter(tmp_path / "other", 10, 0, enabled=False).image("samples", image, 1)  # not process 0: nothing
  assert not (tmp_path / "other").exists()


WRITER_WITHOUT_TORCH = """
import importlib.util, sys
import numpy as np
from meshtrain.metrics import MetricsWriter
assert importlib.util.find_spec("torch"), "torch is not installed: nothing to check"
writer = MetricsWriter(sys.argv[1], total_steps=2, start_step=0)
writer.write({"step": 1, "loss": 2.0})
writer.image("samples", np.zeros((4, 4, 3), np.uint8), step=1)
writer.close()
print("torch imported" if "torch" in sys.modules else "torch not imported")
import torch  # still importable afterwards
print("torch", torch.__version__)
"""


def test_metrics_writer_does_not_import_torch(tmp_path):
  """tensorboardX imports torch whenever it is installed (2 s of every run's start-up): the writer keeps it out,
  and its events (a scalar, an image) are still written; torch itself still imports afterwards."""
  pytest.importorskip("torch")
  proc = subprocess.run([sys.executable, "-c", WRITER_WITHOUT_TORCH, str(tmp_path)], capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.splitlines()[0] == "torch not imported" and proc.stdout.splitlines()[1].startswith("torch ")
  tags = {v.tag for e in read_events(tmp_path / "tensorboard") for v in e.summary.value}
  assert tags == {"loss", "samples"}


def test_metrics_writer_close_on_a_full_disk_is_a_note_not_a_traceback(tmp_path, capsys):
  """A run stopping because its checkpoint could not be written (a full disk) closes its metrics in a `finally`:
  an OSError there replaced the run's `stopped:` line and exit 3 with a traceback and exit 1."""
  writer = MetricsWriter(tmp_path, total_steps=10, start_step=0)
  writer.write({"step": 1, "loss": 2.0})

  def full():
    raise OSError(28, "No space left on device")
  writer._tb.close = full
  writer.close()
  err = capsys.readouterr().err
  assert "note: could not finish writing TensorBoard events (No space left on device)" in err
  assert (tmp_path / "loss.png").is_file()  # what could be written still was
