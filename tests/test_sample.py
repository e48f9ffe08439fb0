"""python -m meshtrain.sample: the labelled grid, the raw samples, and every bad input as one error line (exit 2)."""
import json
import re
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from meshtrain import checkpoint, hooks
from meshtrain.cli import sample
from meshtrain.errors import UserError
from meshtrain.inference import dit_sampler


def grid_cell(grid, row, col, cell):
  """The pixels of image `col` of grid row `row` (col -1: the label square), as grid_image lays them out."""
  gap = dit_sampler.GRID_GAP_PX
  top, left = gap + row * (cell + gap), gap + (1 + col) * (cell + gap)
  return grid[top:top + cell, left:left + cell]


def test_grid_rows_are_classes_with_labels(tmp_path):
  rng = np.random.default_rng(0)
  images = rng.uniform(0, 1, (7, 8, 8, 1)).astype(np.float32)
  labels = np.array([3, 1, 3, 1, 7, 3, 1])
  grid = dit_sampler.save_grid(tmp_path / "g" / "grid.png", images, labels)
  cell = 48  # 8x8 upscaled 6x
  assert grid.dtype == np.uint8 and grid.shape == (2 + 3 * (cell + 2), 2 + 4 * (cell + 2), 1)
  # Rows 1, 3, 7 (ascending); in each, that class's images in their order, upscaled by repetition.
  for row, members in enumerate([[1, 3, 6], [0, 2, 5], [4]]):
    for col, i in enumerate(members):
      want = np.round(images[i] * 255).astype(np.uint8).repeat(6, 0).repeat(6, 1)
      assert (grid_cell(grid, row, col, cell) == want).all()
  assert (grid_cell(grid, 2, 1, cell) == dit_sampler.GRID_BACKGROUND).all()  # class 7 has one image: the rest is empty
  labels_drawn = [grid_cell(grid, row, -1, cell) for row in range(3)]
  assert all((square > 200).sum() > 20 for square in labels_drawn)  # white text on black
  assert not (labels_drawn[0] == labels_drawn[1]).all() and not (labels_drawn[1] == labels_drawn[2]).all()
  # The PNG on disk is the same picture.
  assert (np.asarray(Image.open(tmp_path / "g" / "grid.png")) == grid[..., 0]).all()
  assert not list((tmp_path / "g").glob("*.tmp"))


def test_grid_clips_and_takes_colour():
  images = np.zeros((2, 28, 28, 3), np.float32)
  images[0] = 1.7   # past the range: white
  images[1, ..., 2] = -0.5  # below it: black
  grid = dit_sampler.grid_image(images, [0, 0])
  assert grid.shape == (2 + 56 + 2, 2 + 3 * (56 + 2), 3)  # 28x28 upscaled 2x
  assert (grid_cell(grid, 0, 0, 56) == 255).all() and (grid_cell(grid, 0, 1, 56) == 0).all()
  with pytest.raises(ValueError, match="a grid needs images"):
    dit_sampler.grid_image(np.zeros((2, 8, 8)), [0, 1])


def test_save_samples(tmp_path):
  images = np.random.default_rng(0).uniform(0, 1, (4, 8, 8, 1))
  labels = [2, 2, 5, 5]
  dit_sampler.save_samples(tmp_path / "s.npz", images, labels)
  with np.load(tmp_path / "s.npz") as f:
    assert f["images"].dtype == np.float32 and f["labels"].dtype == np.int32
    assert np.allclose(f["images"], images) and (f["labels"] == labels).all()
  assert dit_sampler.save_samples(tmp_path / "s.npy", images, labels) == [tmp_path / "s.npy", tmp_path / "s.labels.npy"]
  assert np.allclose(np.load(tmp_path / "s.npy"), images) and (np.load(tmp_path / "s.labels.npy") == labels).all()


def test_class_labels_fix_each_images_noise():
  labels, index = dit_sampler.class_labels([4, 0], 3)
  assert labels.tolist() == [4, 4, 4, 0, 0, 0] and index.tolist() == [0, 1, 2, 0, 1, 2]
  assert sample.parse_classes("3, 1,3", 10) == [3, 1]
  for text, message in (("1,x", "must be comma-separated class numbers"), (",", "names no class"),
                        ("0,10,-1", r"10, -1 outside the model's labels 0..9 \(model.num_classes=10\)")):
    with pytest.raises(UserError, match=message):
      sample.parse_classes(text, 10)


# --- the training hook, on a stand-in sampler --------------------------------------------------------------------


class FakeWriter:
  def __init__(self):
    self.records, self.images, self.lines = [], [], []

  def write(self, record):
    self.records.append(record)

  def image(self, tag, image_HWC, step):
    self.images.append((tag, image_HWC, step))

  def print(self, text):
    self.lines.append(text)


def hook_run(tmp_path, monkeypatch, data_name="digits"):
  """A SampleHook and a stand-in for the loop's Run, its sampler replaced by real test digits of the asked classes."""
  import types  # pylint: disable=g-import-not-at-top

  import ml_collections  # pylint: disable=g-import-not-at-top

  from meshtrain.data import digits  # pylint: disable=g-import-not-at-top
  test_images, test_labels = digits.load_split("test")

  class Digits:  # the first images of each class, as a perfect sampler would draw them
    def __init__(self, layout, steps, guidance):
      assert (layout, steps, guidance) == ("layout", 3, 1.5)

    def __call__(self, params, labels, index, seed):
      assert params == "params" and seed == 4
      return np.stack([test_images[np.flatnonzero(test_labels == c)[k]] / 255 for c, k in zip(labels, index)])

  monkeypatch.setattr(dit_sampler, "Sampler", Digits)
  cfg = ml_collections.ConfigDict(dict(eval_every=10, data=dict(name=data_name), model=dict(num_classes=10),
                                       sample=dict(steps=3, guidance=1.5, per_class=5, seed=4)))
  run = types.SimpleNamespace(cfg=cfg, workdir=tmp_path, layout="layout", sample_params="params", writer=FakeWriter(),
                              beat=lambda step, what: None)
  return hooks.SampleHook(cfg), run


def test_sample_hook(tmp_path, monkeypatch):
  hook, run = hook_run(tmp_path, monkeypatch)
  assert hook.every == 10
  hook.run_at(10, run)
  grid = np.asarray(Image.open(tmp_path / "samples" / "step_10.png"))
  assert grid.shape == (2 + 10 * 50, 2 + 6 * 50)
  [(tag, image, step)] = run.writer.images
  assert (tag, step) == ("samples", 10) and (image[..., 0] == grid).all()
  [record] = run.writer.records
  assert record["step"] == 10 and record["sample_accuracy"] >= 0.9 and record["sample_frechet"] < 10
  assert run.writer.lines == [f"step 10: sample accuracy {record['sample_accuracy']:.3f}, Frechet distance "
                              f"{record['sample_frechet']:.2f} ({tmp_path / 'samples' / 'step_10.png'})"]


def test_sample_hook_without_pillow_or_judge(tmp_path, monkeypatch):
  hook, run = hook_run(tmp_path, monkeypatch)
  with monkeypatch.context() as without:
    without.setitem(sys.modules, "PIL", None)  # as on a machine without pillow: `import PIL...` fails
    hook.run_at(10, run)
    hook.run_at(20, run)
  assert not (tmp_path / "samples").exists() and not run.writer.images
  assert [r["step"] for r in run.writer.records] == [10, 20]  # the scores still come
  assert "no sample grid" in run.writer.lines[0] and "pip install pillow" in run.writer.lines[0]
  assert sum("no sample grid" in line for line in run.writer.lines) == 1  # said once
  hook, run = hook_run(tmp_path, monkeypatch, data_name="mnist")  # no judge for other datasets
  hook.run_at(30, run)
  assert not run.writer.records and run.writer.lines == [f"step 30: samples in {tmp_path / 'samples' / 'step_30.png'}"]


# --- the command line ----------------------------------------------------------------------------------------


def fake_run(workdir, step=5, task="dit", num_classes=10):
  """A workdir whose checkpoint at `step` has every marker file and a meta item of `task`: enough for everything
  the command checks before it restores (no JAX, no Orbax)."""
  step_dir = workdir / "checkpoints" / str(step)
  for name in checkpoint.REQUIRED:
    (step_dir / name).parent.mkdir(parents=True, exist_ok=True)
    (step_dir / name).write_text("")
  config = {"task": task, "model": {"num_classes": num_classes, "image_size": 8, "channels": 1},
            "sample": {"steps": 16, "guidance": 2.0, "per_class": 4, "seed": 3}, "data": {"name": "digits"}}
  meta = {"config": config} if task is None else {"config": config, "task": task}
  if task is None:
    del config["task"]
  (step_dir / "meta" / "metadata").write_text(json.dumps(meta))
  return workdir


def error_of(argv, capsys):
  assert sample.main(argv) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and err.count("\n") == 1, err
  return err


@pytest.mark.parametrize("extra, message", [
    (["--guidance", "-0.5"], r"--guidance -0.5 must be a finite number >= 0"),
    (["--guidance", "nan"], r"--guidance nan must be a finite number >= 0"),
    (["--per-class", "0"], r"--per-class 0 must be at least 1"),
    (["--steps", "0"], r"--steps 0 must be at least 1"),
    (["--seed", "-1"], r"--seed -1 must be in 0 \.\. 4294967295"),
    (["--classes", "0,12"], r"--classes '0,12': 12 outside the model's labels 0\.\.9"),
    (["--npy", "x.txt"], r"--npy x\.txt: name it FILE\.npz"),
    (["--step", "7"], r"--step 7: .* has checkpoints at steps 5"),
    (["--config.model.num_classes=3"], r"--config\.model\.num_classes cannot be set for sampling"),
    (["--bogus"], r"--bogus"),
])
def test_bad_arguments(tmp_path, capsys, extra, message):
  run = fake_run(tmp_path / "run")
  err = error_of(["--workdir", str(run), "--out", str(tmp_path / "g.png"), *extra], capsys)
  assert re.search(message, err), err


def test_bad_out_and_workdir(tmp_path, capsys):
  run = fake_run(tmp_path / "run")
  assert "--out g.jpg: the grid is written as a PNG" in error_of(["--workdir", str(run), "--out", "g.jpg"], capsys)
  (tmp_path / "d.png").mkdir()
  assert "is a directory" in error_of(["--workdir", str(run), "--out", str(tmp_path / "d.png")], capsys)
  assert "no such directory" in error_of(["--workdir", str(tmp_path / "nope"), "--out", "g.png"], capsys)
  (tmp_path / "empty").mkdir()
  assert "no complete checkpoint" in error_of(["--workdir", str(tmp_path / "empty"), "--out", "g.png"], capsys)
  assert "required: --out" in error_of(["--workdir", str(run)], capsys)


@pytest.mark.parametrize("task", ["lm", None])  # None: a checkpoint from before tasks existed (a language model)
def test_language_model_workdir(tmp_path, capsys, task):
  run = fake_run(tmp_path / "lm", task=task)
  err = error_of(["--workdir", str(run), "--out", str(tmp_path / "g.png")], capsys)
  assert f"{run} was trained with task=lm" in err
  assert "sample needs an image model (task=t2i or dit); use python -m meshtrain.generate" in err


def test_defaults_come_from_the_run(tmp_path):
  run = fake_run(tmp_path / "run", num_classes=4)
  args, cfg, workdir, step = sample.parse_args(["--workdir", str(run), "--out", "g.png", "--config.mesh.data=2",
                                                "--config.cpu_devices=2"])
  assert (args.classes, args.per_class, args.steps, args.guidance, args.seed) == ([0, 1, 2, 3], 4, 16, 2.0, 3)
  assert (step, workdir, cfg.task, cfg.cpu_devices, cfg.mesh.data, cfg.data.name) == (5, run, "dit", 2, 2, "digits")
  args, *_ = sample.parse_args(["--workdir", str(run), "--out", "g.png", "--classes", "2", "--guidance", "0",
                                "--per-class", "9", "--steps", "3", "--seed", "11"])
  assert (args.classes, args.per_class, args.steps, args.guidance, args.seed) == ([2], 9, 3, 0.0, 11)


def test_module_entry_point(tmp_path):
  """`python -m meshtrain.sample` exits 2 with one line, before JAX starts."""
  proc = subprocess.run([sys.executable, "-m", "meshtrain.sample", "--workdir", str(tmp_path), "--out", "g.png",
                         "--guidance", "-1"], capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--guidance -1.0 must be" in proc.stderr


# --- a trained DiT: the hook during training, then the command on another mesh ---------------------------------

TINY_DIT = '''
from meshtrain.config import base_config
from meshtrain import presets


def get_config():
  c = base_config()
  c.task = "dit"
  c.model = presets.dit_model_config("digits")
  c.model.d_model, c.model.num_layers, c.model.num_heads, c.model.mlp_dim = 32, 1, 2, 64
  c.data.name, c.data.train_split, c.data.eval_split = "digits", "train", "test"
  c.steps, c.batch_size, c.log_every, c.optimizer.warmup_steps = 2, 8, 1, 1
  c.eval_every, c.eval_batches = 2, 1  # evaluation, the sample hook and the checkpoint run at the last step
  c.sample.steps, c.sample.per_class, c.sample.guidance = 2, 2, 1.5
  return c
'''


@pytest.fixture(scope="module")
def dit_run(tmp_path_factory):
  pytest.importorskip("meshtrain.families.dit")  # the DiT task (meshtrain/families/dit.py) returns the sample hook
  from meshtrain.cli import train  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp("dit")
  (root / "tiny_dit.py").write_text(TINY_DIT)
  assert train.main(["--config", str(root / "tiny_dit.py"), "--workdir", str(root / "run"),
                     f"--config.data.data_dir={root / 'tfds'}"]) == 0
  return root / "run"


def test_hook_writes_grid_and_quality(dit_run):
  records = [json.loads(line) for line in (dit_run / "metrics.jsonl").read_text().splitlines()]
  scores = [r for r in records if "sample_accuracy" in r]
  assert [r["step"] for r in scores] == [2]
  assert 0 <= scores[0]["sample_accuracy"] <= 1 and scores[0]["sample_frechet"] > 0
  grid = np.asarray(Image.open(dit_run / dit_sampler.SAMPLES_DIR / "step_2.png"))
  assert grid.shape == (2 + 10 * 50, 2 + 3 * 50)  # 10 classes x (label + 2 images), 48-px cells


def test_cli_reproduces_the_runs_grid_on_another_mesh(dit_run, tmp_path, capsys):
  argv = ["--workdir", str(dit_run), "--config.cpu_devices=8", "--config.mesh.data=2", "--config.mesh.fsdp=2",
          "--config.mesh.tensor=2"]
  assert sample.main([*argv, "--out", str(tmp_path / "all.png"), "--npy", str(tmp_path / "all.npz")]) == 0
  line = capsys.readouterr().out
  assert re.fullmatch(r"step 2: 20 samples \(2 of each of classes 0,1,2,3,4,5,6,7,8,9; 2 steps, guidance 1.5, "
                      r"seed 0\) -> \S+all.png, \S+all.npz; sample accuracy [01]\.\d{3}, Frechet distance \d+\.\d\d "
                      r"\(digits judge\)\n", line), line
  # The run's settings and noise on a data x fsdp x tensor mesh: the picture the hook drew on data=8.
  ours = np.asarray(Image.open(tmp_path / "all.png")).astype(int)
  hooks = np.asarray(Image.open(dit_run / dit_sampler.SAMPLES_DIR / "step_2.png")).astype(int)
  assert ours.shape == hooks.shape and np.abs(ours - hooks).max() <= 1
  # Fewer classes, more images, on a third mesh: image k of class c is the same image.
  assert sample.main(["--workdir", str(dit_run), "--config.cpu_devices=8", "--config.mesh.data=1",
                      "--config.mesh.fsdp=8", "--classes", "7,3", "--per-class", "3",
                      "--out", str(tmp_path / "two.png"), "--npy", str(tmp_path / "two.npz")]) == 0
  with np.load(tmp_path / "two.npz") as f:
    images, labels = f["images"], f["labels"]
  assert images.shape == (6, 8, 8, 1) and labels.tolist() == [7, 7, 7, 3, 3, 3]
  assert 0 <= images.min() and images.max() <= 1
  with np.load(tmp_path / "all.npz") as f:
    assert f["labels"].tolist() == [c for c in range(10) for _ in range(2)]
    np.testing.assert_allclose(f["images"][6:8], images[3:5], atol=1e-5)    # class 3, k = 0, 1
    np.testing.assert_allclose(f["images"][14:16], images[0:2], atol=1e-5)  # class 7, k = 0, 1
  capsys.readouterr()
  err = error_of(["--workdir", str(dit_run), "--out", str(tmp_path / "x.png"), "--classes", "10"], capsys)
  assert "--classes '10': 10 outside the model's labels 0..9" in err
