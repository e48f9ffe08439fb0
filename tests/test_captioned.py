"""Your own captioned pictures (meshtrain/data/captioned.py): every layout Hugging Face's imagefolder and `datasets`
use, pixels as Pillow gives them, one clear error per bad file, skipped and counted on request, and a run on them that
resumes bitwise."""
import io
import json
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import xla_fast
from PIL import Image

from meshtrain import config
from meshtrain.data import captioned, images
from meshtrain.errors import UserError

SIZE = 8


def picture(seed: int, height: int = SIZE, width: int = SIZE + 4) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8)


def cfg_for(name, tmp_path, **data):
  cfg = config.load("configs/t2i_tiny.py", [f"--config.data.name={name}", f"--config.data.data_dir={tmp_path / 'tfds'}",
                                            f"--config.model.image_size={SIZE}", "--config.model.patch_size=2",
                                            "--config.data.eval_fraction=0.0001"])
  cfg.unlock()
  cfg.data.update(data)
  return cfg


def read_all(cfg):
  """(pictures uint8[N, H, W, 3], captions) of the train split, in record order."""
  source = images.make_source(cfg, "train", shuffle=False)
  ds = source._records  # pylint: disable=protected-access
  rows = [ds[i] for i in range(len(ds))]
  return np.stack([r["image"] for r in rows]), [r["text"].decode() for r in rows]


def folder(tmp_path, n=4, metadata="jsonl"):
  root = tmp_path / "pictures"
  (root / "sub").mkdir(parents=True)
  rows = []
  for i in range(n):
    name = f"sub/{i}.png" if i % 2 else f"{i}.png"
    Image.fromarray(picture(i)).save(root / name)
    rows.append({"file_name": name, "text": f"caption {i}"})
  if metadata == "jsonl":
    (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  else:
    (root / "metadata.csv").write_text("file_name,text\n" + "".join(f"{r['file_name']},{r['text']}\n" for r in rows))
  return root


@pytest.mark.parametrize("metadata", ["jsonl", "csv"])
def test_imagefolder_metadata_pixels_are_the_centre_crop(tmp_path, metadata):
  root = folder(tmp_path, metadata=metadata)
  pixels, captions = read_all(cfg_for(root, tmp_path))
  assert captions == [f"caption {i}" for i in range(4)]
  # 8x12 pictures: already 8 high, so the square is the middle 8 columns, untouched by any resampling.
  np.testing.assert_array_equal(pixels, np.stack([picture(i)[:, 2:10] for i in range(4)]))


def test_class_subfolders_and_a_larger_picture_resized(tmp_path):
  root = tmp_path / "classes"
  for i, label in enumerate(["red_circle", "blue_square"]):
    (root / label).mkdir(parents=True)
    Image.fromarray(picture(i, 16, 24)).save(root / label / "a.jpg", quality=95)
  pixels, captions = read_all(cfg_for(root, tmp_path))
  assert sorted(captions) == ["blue square", "red circle"]
  # 16x24 -> the middle 16x16 square, resampled to 8x8 (Pillow resamples the box from the whole picture).
  theirs = Image.open(root / "red_circle" / "a.jpg").convert("RGB").resize((SIZE, SIZE), Image.Resampling.BICUBIC,
                                                                           box=(4, 0, 20, 16))
  np.testing.assert_array_equal(pixels[captions.index("red circle")], np.asarray(theirs))


def test_rows_with_paths_and_parquet_with_bytes(tmp_path):
  (tmp_path / "img").mkdir()
  Image.fromarray(picture(0)).save(tmp_path / "img" / "a.png")
  (tmp_path / "rows.jsonl").write_text(json.dumps({"image": "img/a.png", "text": "from a path"}) + "\n")
  assert read_all(cfg_for(tmp_path / "rows.jsonl", tmp_path))[1] == ["from a path"]
  buffer = io.BytesIO()
  Image.fromarray(picture(1)).save(buffer, format="WEBP", lossless=True)
  table = pa.table({"img": [{"bytes": buffer.getvalue(), "path": None}], "caption": ["from bytes"]})
  pq.write_table(table, tmp_path / "rows.parquet")
  pixels, captions = read_all(cfg_for(tmp_path / "rows.parquet", tmp_path, image_key="img", caption_key="caption"))
  assert captions == ["from bytes"]
  np.testing.assert_array_equal(pixels[0], picture(1)[:, 2:10])  # lossless WebP: the same pixels


def test_conversion_is_reused_and_redone_when_a_picture_changes(tmp_path, capsys):
  root = folder(tmp_path)
  cfg = cfg_for(root, tmp_path)
  first, _ = captioned.prepare(cfg)
  assert "converted" in capsys.readouterr().out
  assert captioned.prepare(cfg)[0].key == first.key and "converted" not in capsys.readouterr().out
  Image.fromarray(picture(9)).save(root / "0.png")
  assert captioned.prepare(cfg)[0].key != first.key


def bad_cases(root):
  """(what to do to a good folder, the error it must give)."""
  meta = root / "metadata.jsonl"
  return {
      "truncated": (lambda: (root / "0.png").write_bytes((root / "0.png").read_bytes()[:60]), r"0\.png.*damaged"),
      "empty file": (lambda: (root / "0.png").write_bytes(b""), r"0\.png is empty \(0 bytes\)"),
      "not a picture": (lambda: (root / "0.png").write_text("hello"), r"0\.png.*not a picture Pillow can read"),
      "missing": (lambda: (root / "0.png").unlink(), r"metadata\.jsonl:1 .*no such picture .*0\.png"),
      "empty caption": (lambda: meta.write_text(meta.read_text().replace('"caption 2"', '"  "')),
                        r"metadata\.jsonl:3 .*the caption is empty"),
      "bomb": (lambda: (setattr(captioned, "MAX_PIXELS", 200),
                        Image.fromarray(picture(0, 20, 20)).save(root / "0.png")),
               r"metadata\.jsonl:1 .*20x20 pixels is more than 200, a likely decompression bomb"),
  }


@pytest.mark.parametrize("case", ["truncated", "empty file", "not a picture", "missing", "empty caption", "bomb"])
def test_bad_pictures_one_error_each_or_skipped_and_counted(tmp_path, case, monkeypatch):
  monkeypatch.setattr(captioned, "MAX_PIXELS", captioned.MAX_PIXELS)  # the bomb case lowers it
  root = folder(tmp_path)
  cases = bad_cases(root)
  assert len(cases) == 6  # each one parametrized above
  spoil, message = cases[case]
  spoil()
  with pytest.raises(UserError, match=message + r".*skip_bad_records"):
    captioned.prepare(cfg_for(root, tmp_path))
  assert not list((tmp_path / "tfds" / "meshtrain_images").glob("files_*/1.0.0"))  # nothing half-written is left
  _, manifest = captioned.prepare(cfg_for(root, tmp_path, skip_bad_records=True))
  assert manifest["skipped_records"] >= 1 and manifest["documents"]["train"] == 4 - manifest["skipped_records"]


STEPS = 6
ARGS = ["--config", "configs/t2i_tiny.py", f"--config.steps={STEPS}", "--config.batch_size=8", "--config.log_every=1",
        "--config.eval_every=0", "--config.checkpoint_every=3", "--config.checkpoint_keep=10",
        "--config.optimizer.warmup_steps=2", f"--config.model.image_size={SIZE}", "--config.model.patch_size=2",
        "--config.model.d_model=32", "--config.model.num_heads=2", "--config.model.axes_dim=(4,6,6)",
        "--config.model.mlp_dim=64", "--config.model.text_width=16", "--config.model.text_heads=2",
        "--config.model.text_mlp_dim=32", "--config.model.text_len=12", "--config.data.eval_fraction=0.0001"]


@pytest.mark.slow
def test_a_captioned_folder_trains_with_one_flag_and_resumes_bitwise(tmp_path):
  root = folder(tmp_path, n=12)
  run = lambda workdir: subprocess.run(
      [sys.executable, "-m", "meshtrain.train", *ARGS, f"--config.data.name={root}",
       f"--config.data.data_dir={tmp_path / 'tfds'}", "--workdir", str(workdir)],
      capture_output=True, text=True, timeout=400, env=xla_fast.env())
  reference = run(tmp_path / "reference")
  assert reference.returncode == 0, reference.stderr[-3000:]
  shutil.copytree(tmp_path / "reference", tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / str(STEPS))
  (tmp_path / "resumed" / "metrics.jsonl").unlink()
  resumed = run(tmp_path / "resumed")
  assert resumed.returncode == 0 and "resumed from" in resumed.stdout + resumed.stderr
  losses = lambda w: {r["step"]: r["loss"] for r in map(json.loads, (w / "metrics.jsonl").read_text().splitlines())
                      if "loss" in r}
  after = {s: v for s, v in losses(tmp_path / "reference").items() if s > STEPS // 2}
  assert after and losses(tmp_path / "resumed") == after


def test_data_stats_reports_pictures_sizes_and_captions(tmp_path, capsys):
  """`python -m meshtrain.data stats` on a t2i config: the split sizes, what the first steps read and what the
  conversion saw, the numbers counted here from the same files."""
  from meshtrain.cli import data_stats
  root = folder(tmp_path, n=6)
  Image.fromarray(picture(9, height=20, width=30)).save(root / "big.png")
  with open(root / "metadata.jsonl", "a") as f:
    f.write(json.dumps({"file_name": "big.png", "text": "x" * 40}) + "\n")
  argv = ["stats", "--config", "configs/t2i_tiny.py", "--steps", "1", f"--config.data.name={root}",
          f"--config.data.data_dir={tmp_path / 'tfds'}", f"--config.model.image_size={SIZE}",
          "--config.data.eval_fraction=0.0001", "--config.eval_every=0", "--config.batch_size=14"]
  assert data_stats.main([*argv, "--json"]) == 0
  result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert result["splits"] == {"train": 7}  # no evaluation, no eval split read
  rows = result["rows"]
  assert (rows["pictures"], rows["distinct_pictures"], rows["distinct_captions"]) == (14, 7, 7)
  assert rows["caption_bytes"] == {"min": 9, "median": 9, "max": 32} and rows["at_text_len"] == round(2 / 14, 4)
  converted = result["converted"]
  assert converted["original_width"] == {"min": 12, "median": 12, "max": 30}
  assert converted["original_height"] == {"min": 8, "median": 8, "max": 20}
  assert converted["caption_chars"] == {"min": 9, "median": 9, "max": 40} and converted["skipped_records"] == 0
  assert data_stats.main(argv) == 0
  assert "fill text_len (longer ones are cut)" in capsys.readouterr().out
  assert data_stats.main(["show", *argv[1:3], *argv[5:]]) == 2
  assert "pictures a model draws are shown by python -m meshtrain.sample" in capsys.readouterr().err
