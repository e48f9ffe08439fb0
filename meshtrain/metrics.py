"""Where a run's numbers go: metrics.jsonl, TensorBoard event files, the progress bar, and a loss-curve PNG.

Only process 0 writes; other processes get a writer that does nothing, so the loop needs no `if`.
"""
import json
import pathlib
import sys

import numpy as np
import tqdm

THROUGHPUT_KEYS = ("tokens_per_sec", "images_per_sec")  # the tasks' throughput_key: shown whole on the progress bar


def _summary_writer():
  """tensorboardX's SummaryWriter, imported here: only process 0 pays for it.

  tensorboardX imports torch whenever torch is installed (the hf extra installs it), only so that it can accept
  torch tensors, which meshtrain never passes: 2 s of every run's start-up (12.8 -> 10.7 s to the first step of
  the tiny config, 3 runs each) and ~300 MB. torch is hidden from that one import (None in sys.modules is
  Python's "not importable", which tensorboardX catches), so it takes numpy arrays alone; a process that has
  imported torch already keeps it, and torch imports normally afterwards."""
  hide = "torch" not in sys.modules
  if hide:
    sys.modules["torch"] = None
  try:
    from tensorboardX import SummaryWriter  # with torch hidden (above): only while it is imported
  finally:
    if hide:
      del sys.modules["torch"]
  return SummaryWriter


class MetricsWriter:
  def __init__(self, workdir: str | pathlib.Path, total_steps: int, start_step: int, enabled: bool = True):
    self.enabled = enabled
    self.path = pathlib.Path(workdir) / "metrics.jsonl"
    if not enabled:
      return
    self._tb = _summary_writer()(str(pathlib.Path(workdir) / "tensorboard"))
    if self.path.exists():
      self._keep_history(start_step)
    self._file = open(self.path, "a")
    self._bar = tqdm.tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                          bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}] {postfix}")

  def _keep_history(self, start_step: int) -> None:
    """A resumed run appends; records past the checkpoint it resumes from are about to be recomputed. A line that
    is not a complete record (a crash in the middle of writing it) is dropped with a note, never fatal."""
    kept, broken = [], []
    for number, line in enumerate(self.path.read_text(errors="replace").splitlines(), 1):
      try:
        record = json.loads(line) if line.strip() else None
      except json.JSONDecodeError:
        record = None
        broken.append(number)
      if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= start_step:
        kept.append(line)
    if broken:
      print(f"{self.path}: dropped {len(broken)} incomplete line(s) (line {', '.join(map(str, broken))}), "
            "left by an interrupted write", flush=True)
    # Replaced whole, never rewritten in place: a crash during the rewrite leaves the old history intact.
    tmp = self.path.with_name(self.path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(self.path)

  def write(self, record: dict) -> None:
    """One JSON line per record (must contain `step`); every numeric field also goes to TensorBoard."""
    if not self.enabled:
      return
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    for key, value in record.items():
      if key != "step" and isinstance(value, (int, float)):
        self._tb.add_scalar(key, value, record["step"])
    shown = {k: record[k] for k in ("loss", "eval_loss", *THROUGHPUT_KEYS) if k in record}
    if shown:
      self._bar.set_postfix({k: f"{v:,.0f}" if k in THROUGHPUT_KEYS else f"{v:,.3f}" for k, v in shown.items()},
                            refresh=False)

  def image(self, tag: str, image_HWC, step: int) -> None:
    """A TensorBoard image summary: uint8 [H, W, C] (C = 1 or 3), e.g. a grid of samples."""
    if not self.enabled:
      return
    image_HWC = np.asarray(image_HWC)
    if image_HWC.dtype != np.uint8 or image_HWC.ndim != 3 or image_HWC.shape[-1] not in (1, 3):
      raise ValueError(f"MetricsWriter.image takes uint8 [H, W, 1 or 3], got {image_HWC.dtype} {image_HWC.shape}")
    self._tb.add_image(tag, image_HWC, step, dataformats="HWC")
    self._tb.flush()

  def advance(self, step: int) -> None:
    if self.enabled:
      self._bar.update(step - self._bar.n)

  def print(self, text: str) -> None:
    if self.enabled:
      self._bar.write(text)

  def close(self) -> None:
    """Closes the bar, the TensorBoard events and metrics.jsonl, and draws loss.png. On a full disk (a run stopping
    because its checkpoint could not be written, often) what cannot be written is named in one note: an OSError
    here would replace the run's own message with a traceback."""
    if not self.enabled:
      return
    self._bar.close()
    failed = []
    for what, close in (("TensorBoard events", self._tb.close), ("metrics.jsonl", self._file.close),
                        ("loss.png", lambda: plot_losses(self.path, self.path.with_name("loss.png")))):
      try:
        close()
      except (OSError, ImportError) as e:  # ImportError: no matplotlib (the GPU machines), no loss.png
        failed.append(f"{what} ({getattr(e, 'strerror', None) or e})")
    if failed:
      print(f"note: could not finish writing {', '.join(failed)} in {self.path.parent}", file=sys.stderr)


def plot_losses(metrics_path: pathlib.Path, png_path: pathlib.Path) -> None:
  """Train and eval loss against step, from metrics.jsonl (the whole history, across resumes)."""
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top  (absent on the GPU machines: no plot)
  plt.switch_backend("Agg")  # no display on training machines
  records = [json.loads(line) for line in open(metrics_path) if line.strip()]
  train = [(r["step"], r["loss"]) for r in records if "loss" in r]
  evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
  fig, ax = plt.subplots(figsize=(7, 4))
  for points, label, style in ((train, "train loss", "-"), (evals, "eval loss", "o-")):
    if points:
      ax.plot(*zip(*points), style, label=label)
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats/token)")
  ax.grid(alpha=0.3)
  if train or evals:  # a writer closed before any loss was logged (images only) plots empty axes, no legend
    ax.legend()
  fig.tight_layout()
  fig.savefig(png_path, dpi=100)
  plt.close(fig)
