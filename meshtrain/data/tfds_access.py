"""TFDS access: opening a split of a dataset prepared as array_record files, building the datasets meshtrain makes
itself (python_stdlib, python_stdlib_sft, digits), and where the caches it keeps beside them go.

`open_tfds` reads with `tfds.data_source` (random access, no TensorFlow) and never downloads; when a split cannot
be opened it says why (unknown name, not prepared, no such split, an empty or unparsable slice, a format without
random access) and what to set. `build` is the one locked, atomic build of a locally made dataset, and `file_lock`
the lock every cache under the data dir is built under (the datasets, token streams, trained BPEs).

tensorflow_datasets is imported inside the functions that need it, so importing this module (and the sources that
use it) works where TFDS is not installed (the GPU machines run synthetic data).
"""
import contextlib
import difflib
import fcntl
import os
import pathlib

import numpy as np

from meshtrain.errors import UserError


@contextlib.contextmanager
def file_lock(path: pathlib.Path):
  """An exclusive flock on `path`: one process on a host (or on a file system with locks) builds a cache at a time
  (the BPE, the token cache, the locally built datasets); the others wait, then find it built."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "w") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def build(data_dir: str, builder_class):
  """Builds the dataset of `builder_class` (a tfds GeneratorBasedBuilder made from local files: meshtrain/data/
  stdlib_corpus.py, sft.py, digits.py) under `data_dir` ("" = TFDS default) unless it is already there; returns the
  builder. Locked against other processes on the host and atomic (TFDS renames a finished temporary directory into
  place)."""
  name = builder_class.name
  builder = builder_class(data_dir=data_dir or None)
  if not builder.data_path.exists():
    root = pathlib.Path(builder.data_dir_root)
    where = f"data.data_dir={data_dir!r}" if data_dir else f"the default TFDS data_dir ({root})"
    fix = ("point data.data_dir at a writable directory, or build it once where you can write (python -c \"from "
           f"{builder_class.__module__} import build; build('DIR')\") and point data.data_dir at DIR")
    existing = next(p for p in [root, *root.parents] if p.exists())
    if not existing.is_dir():
      raise UserError(f"{where} lies under {str(existing)!r}, which is a file, so the {name} dataset cannot be built "
                      f"there; {fix}")
    if not os.access(existing, os.W_OK | os.X_OK):
      raise UserError(f"{where} is not writable ({existing} is read-only for this user), and the {name} dataset is "
                      f"not built there yet (it is built on first use); {fix}")
    try:
      # Several processes on one host may start at once; TFDS's rename of its temp dir would fail for the loser.
      with file_lock(root / f".{name}.lock"):
        # A no-op ("Reusing dataset") when another process finished the build while we waited for the lock.
        builder_class(data_dir=data_dir or None).download_and_prepare()
    except OSError as e:
      raise UserError(f"cannot build the {name} dataset under {where}: {e.strerror or e} ({e.filename or root}); "
                      f"{fix}") from e
    # A fresh builder reads the split sizes from the written metadata.
    builder = builder_class(data_dir=data_dir or None)
  return builder


def _where(data_dir: str) -> str:
  """Where TFDS looks for `data_dir`: TFDS's own default follows $TFDS_DATA_DIR."""
  if data_dir:
    return f"data.data_dir={data_dir!r}"
  if os.environ.get("TFDS_DATA_DIR"):
    return f"$TFDS_DATA_DIR ({os.environ['TFDS_DATA_DIR']}; data.data_dir is unset)"
  return "the default TFDS data_dir (~/tensorflow_datasets)"


def open_tfds(name: str, split: str, data_dir: str):
  """The `tfds.data_source` of `split` of dataset `name` under `data_dir`; UserError saying why and what to set when
  it cannot be opened."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  try:
    # download=False: meshtrain never fetches data at run time; python_stdlib was built just before.
    return tfds.data_source(name, split=split, data_dir=data_dir or None, download=False)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise UserError(_unknown_dataset_message(name, data_dir)) from e
  except Exception as e:  # diagnosed below; anything not recognised is re-raised unchanged
    error = e
  builder = tfds.builder(name, data_dir=data_dir or None)
  if not (builder.data_path / "dataset_info.json").exists():
    raise UserError(
        f"TFDS dataset {name!r} is not prepared under {_where(data_dir)} (looked in {builder.data_path}); meshtrain "
        "never downloads at run time. Prepare it once as array_record files (e.g. `tfds build "
        f"{name.split(':')[0]} --file_format=array_record --data_dir=DIR` where it can be downloaded) and set "
        "data.data_dir=DIR, or use data.name=python_stdlib (built locally) or data.name=synthetic") from error
  splits = ", ".join(sorted(builder.info.splits)) or "none"
  if "unknown split" in str(error).lower():
    raise UserError(f"dataset {name!r} has no split {split!r}; its splits are: {splits}. Set data.train_split / "
                    "data.eval_split to one of them (slices such as 'train[:90%]' also work)") from error
  try:
    examples = builder.info.splits[split].num_examples
  except Exception as e:  # pylint: disable=broad-except
    if "split" not in str(e).lower():
      raise error from e
    raise UserError(f"data split {split!r} of dataset {name!r} cannot be parsed ({str(e).splitlines()[0]}); set "
                    f"data.train_split / data.eval_split to a split ({splits}) or a slice of one such as "
                    "'train[:90%]', 'train[1000:]' or 'train+validation'") from error
  if examples == 0:
    raise UserError(f"data split {split!r} of dataset {name!r} holds no examples; set data.train_split / "
                    f"data.eval_split to a non-empty split ({splits}) or slice (e.g. 'train[:90%]'), or eval_every=0 "
                    "to skip evaluation") from error
  if isinstance(error, NotImplementedError):
    raise UserError(
        f"TFDS dataset {name!r} under {builder.data_path} is stored as {builder.info.file_format}, which has no "
        "random access (and needs TensorFlow); regenerate it with --file_format=array_record") from error
  raise error


def _unknown_dataset_message(name: str, data_dir: str) -> str:
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  # The names data.name takes besides registered TFDS datasets, written out: their modules (stdlib_corpus.NAME,
  # digits.NAME, sources.SYNTHETIC) sit above this one.
  stdlib, synthetic = "python_stdlib", "synthetic"
  try:
    # Community datasets would be looked up over the network.
    known = tfds.list_builders(with_community_datasets=False) + [stdlib, synthetic, "digits"]
    near = difflib.get_close_matches(name.split("/")[0].split(":")[0], known, n=3)
  except Exception:  # the suggestion is a nicety; never hide the real message behind a second failure
    near = []
  hint = f" (did you mean {', '.join(map(repr, near))}?)" if near else ""
  return (f"unknown dataset data.name={name!r}{hint}: it is neither {stdlib!r} (Python's standard library, built "
          f"locally), 'digits' (handwritten digits for task=dit, built locally), {synthetic!r} (random data) nor a "
          "registered TFDS dataset. Use one of those, or the name of "
          f"a TFDS dataset prepared as array_record under data.data_dir (now {_where(data_dir)})")


def check_text_feature(name: str, features, text_key: str) -> None:
  """UserError, naming the text features dataset `name` has, unless its feature `text_key` is text."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  def is_text(f):
    return isinstance(f, tfds.features.Text) or (
        isinstance(f, tfds.features.Tensor) and f.shape == () and np.dtype(f.np_dtype).kind in "SUO")

  items = dict(features.items()) if hasattr(features, "items") else {}
  texts = [k for k, f in items.items() if is_text(f)]
  choice = (f"set data.text_key to one of its text features: {', '.join(texts)}" if texts
            else "it has no text feature, so it cannot be used for language modelling")
  if text_key not in items:
    raise UserError(f"dataset {name!r} has no feature data.text_key={text_key!r}; its features are: "
                    f"{', '.join(items) or 'none'}; {choice}")
  if not is_text(items[text_key]):
    raise UserError(f"feature data.text_key={text_key!r} of dataset {name!r} is {items[text_key]!r}, not text; "
                    f"{choice}")


def index_dir(ds) -> pathlib.Path | None:
  """The data dir root to cache offsets under, or None where there are no real files (e.g. tfds mocks)."""
  info = ds.dataset_info
  version_dir = pathlib.Path(os.fspath(info.data_dir))
  if not version_dir.is_dir() or not any(version_dir.glob("*.array_record*")):
    return None
  # data_dir/name[/config]/version: the full name has one path part per level.
  return version_dir.parents[len(info.full_name.split("/")) - 1]
