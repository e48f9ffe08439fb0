"""`python_stdlib`: a TFDS dataset of the running interpreter's standard-library sources, built locally.

It needs no download, so training works offline out of the box, and because it is a real TFDS dataset it is
read by the same code path as any other TFDS text dataset. The split is fixed per file by a stable hash of its
path, so a given interpreter always yields the same train/validation sets.
"""
import hashlib
import os
import pathlib
import sysconfig

import tensorflow_datasets as tfds

from meshtrain.data import tfds_access

NAME = "python_stdlib"
VALIDATION_PERCENT = 5
# Third-party packages are not the standard library, and in a system Python they can be huge.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> pathlib.Path:
  # In a venv `stdlib` still points at the base interpreter's library, which is what we want.
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def source_files(root: pathlib.Path | None = None) -> list[str]:
  """Every *.py under `root`, as sorted POSIX paths relative to it."""
  root = stdlib_root() if root is None else root
  found = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
    rel_dir = pathlib.Path(dirpath).relative_to(root)
    found.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(".py"))
  return sorted(found)


def split_of(rel_path: str) -> str:
  """'train' or 'validation'; sha256 rather than hash() because hash() of str is salted per process."""
  bucket = int.from_bytes(hashlib.sha256(rel_path.encode("utf-8")).digest()[:8], "big") % 100
  return "validation" if bucket < VALIDATION_PERCENT else "train"


class PythonStdlib(tfds.core.GeneratorBasedBuilder):
  """Python standard-library `*.py` files: `text` (file contents) and `path` (relative to the stdlib root)."""

  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {"1.0.0": "Every *.py of the interpreter's stdlib; ~5% of files (by path hash) in validation."}

  def __init__(self, *, file_format=None, **kwargs):
    # array_record is the only format that can be read without TensorFlow (random access via data_source).
    super().__init__(file_format=file_format or "array_record", **kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        description=f"Python standard library sources of the interpreter that built it ({stdlib_root()}).",
        features=tfds.features.FeaturesDict({"text": tfds.features.Text(), "path": tfds.features.Text()}),
        homepage="https://docs.python.org/3/library/",
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    root = stdlib_root()
    files = source_files(root)
    if not files:
      raise RuntimeError(f"found no *.py files under the standard library at {root}")
    by_split = {"train": [], "validation": []}
    for rel in files:
      by_split[split_of(rel)].append(rel)
    return {name: self._generate_examples(root, rels) for name, rels in by_split.items()}

  def _generate_examples(self, root, rels):
    for rel in rels:
      text = (root / rel).read_bytes().decode("utf-8", errors="replace")
      # The relative path is unique, so it is the key; duplicate keys would fail the build with a misleading
      # "No module named 'tensorflow'" when TensorFlow is absent.
      yield rel, {"text": text, "path": rel}


def build(data_dir: str = "") -> PythonStdlib:
  """Builds the dataset under `data_dir` ("" = TFDS default) unless it is already there; returns the builder.
  Locked against other processes on the host and atomic (meshtrain/data/tfds_access.py's `build`)."""
  return tfds_access.build(data_dir, PythonStdlib)
