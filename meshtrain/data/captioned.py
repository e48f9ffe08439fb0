"""Your captioned pictures as a TFDS dataset (task=t2i): `data.name` a folder, or files of rows.

  --config.data.name=pictures/      a folder as Hugging Face's `imagefolder` reads it: pictures with a
                                    metadata.jsonl or metadata.csv (in the folder or any subfolder; `file_name`
                                    relative to it, the caption in column data.caption_key, default `text`);
                                    without metadata, class subfolders (pictures/red_circle/1.png is captioned
                                    "red circle")
  --config.data.name=rows.jsonl     rows naming a picture (a path relative to the file) in data.image_key, and the
                                    caption in data.caption_key; .parquet rows may hold the picture's bytes instead
                                    (binary, or {"bytes", "path"} as `datasets` stores an Image)

Pillow decodes PNG, JPEG, WebP (and whatever else it reads); every picture is converted to RGB, resized so that its
shorter side is model.image_size and centre-cropped to a square. The conversion runs once, as for your own text
(meshtrain/data/files.py, whose lock, atomic rename and content keys it shares): the key hashes every file read and
the fields that decide what is written (image size, keys, eval fraction), so a changed picture or caption makes a new
dataset and an unchanged folder is reused. data.eval_fraction of the captions (by a hash of the caption, so every
picture of one caption lands in the same split) become the `validation` split. Records keep the order of the
inputs; the training order is the source's per-epoch permutation, so resume is exact.

Bad input is one UserError naming the file (and the metadata line or row): a 0-byte, truncated or non-image file, a
decompression bomb (more than MAX_PIXELS pixels), a picture that metadata names but that is missing, an empty
caption. With data.skip_bad_records=true they are skipped and counted instead.
"""
import csv
import dataclasses
import hashlib
import io
import json
import pathlib
import statistics
import warnings

import numpy as np
import tqdm
from PIL import Image, ImageOps, UnidentifiedImageError

from meshtrain import config
from meshtrain.data import files, tfds_access
from meshtrain.errors import UserError

IMAGE, TEXT = "image", "text"   # the converted dataset's features
PICTURES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
METADATA = ("metadata.jsonl", "metadata.csv")
ROWS = (".jsonl", ".parquet")
# Pillow's own bomb limit (89.5M pixels); a picture above it is refused before it is decoded.
MAX_PIXELS = Image.MAX_IMAGE_PIXELS
FORMAT = 1  # bump with any change to what a conversion writes


@dataclasses.dataclass(frozen=True)
class Picture:
  """One record to convert: where it is described, the picture (a file or bytes), its caption."""
  where: str
  path: pathlib.Path | None
  data: bytes | None
  caption: str | None  # None: the metadata gives none (a BadRecord when converted)


def _folder_records(folder: pathlib.Path, caption_key: str):
  """Pictures of an imagefolder: those its metadata files name, or (without metadata) every picture, captioned by
  its class subfolder."""
  metadata = sorted(p for p in folder.rglob("*") if p.name in METADATA)
  if not metadata:
    for path in sorted(p for p in folder.rglob("*") if p.suffix.lower() in PICTURES):
      label = path.parent.name if path.parent != folder else ""
      yield Picture(str(path), path, None, label.replace("_", " "))
    return
  for meta in metadata:
    rows = _csv_rows(meta) if meta.suffix == ".csv" else files.json_lines(meta)
    for where, row in rows:
      if isinstance(row, files.BadRecord):
        yield where, row
        continue
      if not isinstance(row, dict) or "file_name" not in row:
        yield where, files.BadRecord(f"{where}: a metadata row needs \"file_name\" (the picture, relative to "
                                     f"{meta.parent})")
        continue
      yield _described(where, meta.parent, row.get("file_name"), row.get(caption_key))


def _csv_rows(path: pathlib.Path):
  with open(path, newline="", encoding="utf-8") as f:
    for number, row in enumerate(csv.DictReader(f), 2):
      yield f"{path}:{number}", row


def _described(where: str, base: pathlib.Path, image, caption) -> Picture:
  """A row's picture: a path relative to `base`, bytes, or {"bytes", "path"}."""
  if isinstance(image, dict):
    image = image.get("bytes") or image.get("path")
  text = caption if isinstance(caption, str) else None
  if isinstance(image, (bytes, bytearray)):
    return Picture(where, None, bytes(image), text)
  path = base / str(image) if image else None
  return Picture(f"{where} ({path})" if path else where, path, None, text)


def _rows_records(path: pathlib.Path, image_key: str, caption_key: str):
  if path.suffix == ".parquet":
    fields = files.Fields("text", (image_key, caption_key))
    rows = files.table_rows(files.Input("parquet", path, (path,)), fields)
  else:
    rows = files.json_lines(path)
  for where, row in rows:
    if isinstance(row, files.BadRecord):
      yield where, row
      continue
    if not isinstance(row, dict) or image_key not in row:
      keys = ", ".join(map(repr, row)) if isinstance(row, dict) else type(row).__name__
      yield where, files.BadRecord(f"{where}: the row has no {image_key!r} (its keys: {keys}); set data.image_key "
                                   "to the key naming the picture")
      continue
    yield _described(where, path.parent, row[image_key], row.get(caption_key))


def records(spec: str, data):
  """Picture, or (where, BadRecord), for every record `spec` names, in a deterministic order."""
  for path in config.matching_paths("data.name", spec):
    if path.is_dir():
      yield from _folder_records(path, data.caption_key)
    elif path.suffix in ROWS:
      yield from _rows_records(path, data.image_key, data.caption_key)
    else:
      raise UserError(f"cannot read {str(path)!r} as captioned pictures: give a folder (pictures with metadata.jsonl "
                      f"or metadata.csv, or class subfolders) or rows in {', '.join(ROWS)}")


def inputs(spec: str) -> list[pathlib.Path]:
  """Every file the conversion of `spec` may read, sorted: what the dataset's key hashes."""
  found = []
  for path in config.matching_paths("data.name", spec):
    if path.is_dir():
      found += [p for p in path.rglob("*") if p.is_file() and (p.suffix.lower() in PICTURES or p.name in METADATA)]
    else:
      found.append(path)
      if path.suffix == ".jsonl":  # the pictures its rows name: an edited picture is a new dataset
        found += [p for p in path.parent.rglob("*") if p.is_file() and p.suffix.lower() in PICTURES]
  return sorted(set(found))


def resolve(cfg) -> files.Corpus:
  data = cfg.data
  root = files.data_root(data.data_dir) / "meshtrain_images"
  paths = inputs(data.name)
  hashes = [files.input_hash(files.Input("file", p, (p,)), root / "hashes") for p in paths]
  identity = {"format": FORMAT, "files": [[str(p), h] for p, h in zip(paths, hashes)], "size": cfg.model.image_size,
              "keys": [data.image_key, data.caption_key], "eval_fraction": data.eval_fraction,
              "skip_bad_records": bool(data.skip_bad_records)}
  key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
  return files.Corpus(data.name, tuple(files.Input("file", p, (p,)) for p in paths), tuple(hashes), key, root)


def decode(picture: Picture, size: int) -> tuple[np.ndarray, tuple[int, int]]:
  """(uint8[size, size, 3], the original (width, height)); BadRecord saying what is wrong with the picture."""
  where = picture.where
  if picture.caption is None:
    raise files.BadRecord(f"{where}: no caption; give each picture its caption (set data.caption_key to the column "
                          "holding it)")
  if not picture.caption.strip():
    raise files.BadRecord(f"{where}: the caption is empty")
  if picture.path is not None:
    if not picture.path.is_file():
      raise files.BadRecord(f"{where}: no such picture {picture.path}")
    if picture.path.stat().st_size == 0:
      raise files.BadRecord(f"{where}: {picture.path} is empty (0 bytes)")
  elif not picture.data:
    raise files.BadRecord(f"{where}: the picture's bytes are empty")
  source = picture.path if picture.path is not None else io.BytesIO(picture.data)
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("error", Image.DecompressionBombWarning)
      with Image.open(source) as image:
        width, height = image.size
        if width * height > MAX_PIXELS:
          raise files.BadRecord(f"{where}: {width}x{height} pixels is more than {MAX_PIXELS:,}, a likely "
                                "decompression bomb; shrink the picture")
        image.load()
        fitted = ImageOps.fit(image.convert("RGB"), (size, size), Image.Resampling.BICUBIC)
  except files.BadRecord:
    raise
  except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
    raise files.BadRecord(f"{where}: a likely decompression bomb ({e})") from None
  except UnidentifiedImageError:
    raise files.BadRecord(f"{where}: not a picture Pillow can read") from None
  except (OSError, SyntaxError, ValueError) as e:  # Pillow's truncated or corrupt files
    raise files.BadRecord(f"{where}: a damaged picture ({e})") from None
  return np.asarray(fitted, np.uint8), (width, height)


def _summary(values: list[int]) -> dict:
  return {"min": min(values), "median": statistics.median(values), "max": max(values)} if values else {}


def _write(cfg, corpus: files.Corpus, out: pathlib.Path) -> dict:
  """Decodes every picture into array_record shards with TFDS metadata in `out`; returns the manifest."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

  data, size = cfg.data, cfg.model.image_size
  features = tfds.features.FeaturesDict({IMAGE: tfds.features.Image(shape=(size, size, 3), dtype=np.uint8,
                                                                    encoding_format="png"),
                                         TEXT: tfds.features.Text()})
  splits = ("train", "validation")
  writers = {s: array_record_module.ArrayRecordWriter(
      str(out / f"{corpus.name}-{s}.array_record-00000-of-00001"), "group_size:1") for s in splits}
  counts, skipped, first_bad = dict.fromkeys(splits, 0), 0, None
  widths, heights, lengths = [], [], []
  try:
    for item in tqdm.tqdm(records(data.name, data), desc=f"converting {data.name}", unit=" pictures",
                          mininterval=2):
      try:
        if isinstance(item, tuple):
          raise item[1]
        pixels, (width, height) = decode(item, size)
      except files.BadRecord as e:
        if not data.skip_bad_records:
          raise UserError(f"{e}{files.SKIP_HINT}") from None
        skipped, first_bad = skipped + 1, first_bad or str(e)
        continue
      split = "validation" if files.in_eval(item.caption.encode("utf-8"), data.eval_fraction) else "train"
      # A PIL image, not the array: TFDS encodes arrays with TensorFlow (not installed), PIL images with Pillow.
      writers[split].write(features.serialize_example({IMAGE: Image.fromarray(pixels), TEXT: item.caption}))
      counts[split] += 1
      widths.append(width)
      heights.append(height)
      lengths.append(len(item.caption))
  finally:
    for w in writers.values():
      w.close()
  if counts["train"] == 0:
    what = f"all {skipped} pictures were bad (the first: {first_bad})" if skipped else "it names no pictures"
    raise UserError(f"data.name={data.name!r} gives no training pictures: {what}")
  infos = [tfds.core.SplitInfo(name=s, shard_lengths=[counts[s]],
                               num_bytes=(out / f"{corpus.name}-{s}.array_record-00000-of-00001").stat().st_size)
           for s in splits]
  tfds.folder_dataset.write_metadata(data_dir=out, features=features, split_infos=infos, check_data=False,
                                     description=f"Captioned pictures converted by meshtrain from {data.name}.")
  return {"spec": data.name, "inputs": len(corpus.inputs), "image_size": size, "documents": counts,
          "skipped_records": skipped, "first_skipped": first_bad,
          "original_width": _summary(widths), "original_height": _summary(heights),
          "caption_chars": _summary(lengths)}


def prepare(cfg, quiet: bool = False) -> tuple[files.Corpus, dict]:
  """(corpus, manifest) of cfg.data.name's pictures, converted first unless a run already has."""
  corpus = resolve(cfg)
  manifest = files.converted(corpus, lambda out: _write(cfg, corpus, out), "pictures")
  if manifest["skipped_records"] and not quiet:
    print(f"data: skipped {manifest['skipped_records']} bad pictures of {cfg.data.name} (data.skip_bad_records="
          f"true); the first: {manifest['first_skipped']}", flush=True)
  return corpus, manifest


def open_split(cfg, split: str):
  """The TFDS data source of `split` ("train", "validation", or a slice) of cfg.data.name's converted pictures."""
  corpus, manifest = prepare(cfg)
  base = split.split("[")[0]
  if base in manifest["documents"] and not manifest["documents"][base]:
    raise UserError(f"data.eval_fraction={cfg.data.eval_fraction} holds out none of the "
                    f"{manifest['documents']['train']} pictures of {cfg.data.name}, so there is no {base} split; "
                    "raise data.eval_fraction or set eval_every=0")
  return tfds_access.open_tfds(corpus.name, split, str(corpus.root))
