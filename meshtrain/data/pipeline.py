"""Token sources and global batches.

A source maps a global example index to one packed sequence of `seq_len + 1` tokens, so the batch at step k
is a pure function of (seed, k): rows [start, stop) of it can be loaded by any process, and the result does
not depend on how many processes there are or on the mesh. Nothing iterates statefully, so resuming at step k
needs no iterator state in the checkpoint.

TFDS datasets (python_stdlib included) are read through `tfds.data_source` (array_record, random access) and
grain `MapDataset`s. Documents are packed into one stream (tokens, EOS, tokens, EOS, ...); sequence i is
stream[i*L : i*L + L + 1]. Only the per-document token offsets are kept in memory (and cached on disk), and a
sequence reads just the documents it overlaps.

tensorflow_datasets and grain are imported only when a TFDS source is made, so `synthetic` runs where they
are not installed (the GPU machines).
"""
import functools
import hashlib
import logging
import os
import pathlib
import queue
import re
import threading
import time

import jax
import numpy as np

from meshtrain.data import tokenizer
from meshtrain.errors import UserError
from meshtrain.step import IGNORE_ID

log = logging.getLogger(__name__)

STDLIB = "python_stdlib"
SYNTHETIC = "synthetic"
# Bump when the packing/tokenization changes, so cached offsets from older code are not reused.
INDEX_FORMAT = 1
# grain's index_shuffle walks cycles over a fixed-size domain, so its cost grows like 1/n for small n
# (measured: ~3 us per index at n=65536, 3 ms at n=10, 13 ms at n=2). Below this size a materialised
# numpy permutation per epoch is both cheap in memory and fast.
SMALL_PERMUTATION = 1 << 16
DOC_CACHE = 32  # documents kept decoded: a long file spans many consecutive sequences in evaluation order


def _derive_seed(*parts) -> int:
  """A 32-bit seed from `parts`, so nearby user seeds (0, 1, ...) give unrelated orders and splits differ."""
  digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
  return int.from_bytes(digest[:4], "little")


class Source:
  """Global example index -> packed sequence; batches are assembled from it by `rows`."""

  seq_len: int
  num_sequences: int | None  # None: infinite (synthetic)
  pad_id: int = tokenizer.PAD_ID  # the input id at padded positions (their targets are IGNORE_ID)

  def sequence_index(self, example_index: int) -> int:
    """The sequence that global example `example_index` reads (the epoch permutation, or plain order)."""
    raise NotImplementedError

  def sequence(self, seq_index: int) -> np.ndarray:
    """int32[seq_len + 1]: the tokens whose [:-1] are the inputs and [1:] the targets; IGNORE_ID past the data."""
    raise NotImplementedError

  def example(self, example_index: int) -> np.ndarray:
    return self.sequence(self.sequence_index(example_index))

  def rows(self, step: int, batch_size: int, start: int = 0, stop: int | None = None) -> dict[str, np.ndarray]:
    """Rows [start, stop) of the global batch at `step`: {"inputs", "targets"}, each int32[stop - start, L].

    Padded positions have target IGNORE_ID (the loss skips them) and input `pad_id` (the model embeds it).
    """
    stop = batch_size if stop is None else stop
    if step < 0 or not 0 <= start <= stop <= batch_size:
      raise ValueError(f"bad rows request: step={step}, rows [{start}, {stop}) of a batch of {batch_size}")
    first = step * batch_size
    seqs = np.empty((stop - start, self.seq_len + 1), np.int32)
    for row in range(start, stop):
      seqs[row - start] = self.example(first + row)
    # Contiguous copies: the host-to-device transfer of a strided view would copy it anyway, less visibly.
    inputs = np.ascontiguousarray(seqs[:, :-1])
    inputs[inputs < 0] = self.pad_id
    return {"inputs": inputs, "targets": np.ascontiguousarray(seqs[:, 1:])}


class SyntheticSource(Source):
  """Uniform random tokens below vocab_size, a function of (seed, split, index); no files, endless."""

  def __init__(self, seed: int, split: str, seq_len: int, vocab_size: int):
    self.seq_len = seq_len
    self.num_sequences = None
    self.vocab_size = vocab_size
    self._seed = _derive_seed("synthetic", seed, split)

  def sequence_index(self, example_index: int) -> int:
    return example_index

  def sequence(self, seq_index: int) -> np.ndarray:
    rng = np.random.default_rng([self._seed, seq_index])
    return rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int32)


def _text_bytes(value) -> bytes:
  """UTF-8 bytes of a text feature value (str under TFDS mocks, bytes from real files)."""
  if isinstance(value, np.ndarray):
    value = value.item()
  if isinstance(value, str):
    return value.encode("utf-8", errors="replace")
  value = bytes(value)
  try:
    value.decode("utf-8")
  except UnicodeDecodeError:
    # Bytes that are not UTF-8 still train, but as their replacement characters, like stdlib files do.
    value = value.decode("utf-8", errors="replace").encode("utf-8")
  return value


class _DocumentLength:
  """len(tokens) of one record; a class rather than a lambda so the grain map stays picklable."""

  def __init__(self, text_key):
    self.text_key = text_key

  def __call__(self, record) -> int:
    return len(_text_bytes(record[self.text_key]))


class _DocumentTokens:
  """A record's tokens followed by EOS, as uint16."""

  def __init__(self, text_key):
    self.text_key = text_key

  def __call__(self, record) -> np.ndarray:
    data = _text_bytes(record[self.text_key])
    out = np.empty(len(data) + 1, np.uint16)
    out[:-1] = np.frombuffer(data, np.uint8)
    out[-1] = tokenizer.EOS_ID
    return out


class TfdsSource(Source):
  """Documents of one TFDS split packed into sequences, read by random access."""

  def __init__(self, data_source, *, name: str, split: str, text_key: str, seq_len: int, seed: int,
               shuffle: bool, index_dir: pathlib.Path | None):
    import grain  # pylint: disable=g-import-not-at-top

    self.name, self.split, self.text_key, self.seq_len, self.shuffle = name, split, text_key, seq_len, shuffle
    self._docs = grain.MapDataset.source(data_source).map(_DocumentTokens(text_key))
    self._index_path = self._index_file(index_dir, data_source) if index_dir is not None else None
    self.offsets = self._load_or_build_offsets(grain.MapDataset.source(data_source).map(_DocumentLength(text_key)))
    self.num_documents = len(self.offsets) - 1
    self.num_tokens = int(self.offsets[-1])
    if self.num_tokens < seq_len + 1:
      raise UserError(
          f"split {split!r} of dataset {name!r} holds {self.num_tokens} tokens in {self.num_documents} documents, "
          f"fewer than one sequence needs (seq_len + 1 = {seq_len + 1}); lower seq_len or use a larger split")
    # Every sequence has at least one real target; only the last one is padded.
    self.num_sequences = -(-(self.num_tokens - 1) // seq_len)
    self._document = functools.lru_cache(maxsize=DOC_CACHE)(self._read_document)

    n = self.num_sequences
    self._seed = _derive_seed("order", seed, name, split)
    order = grain.MapDataset.range(n)  # indices past n wrap: evaluation cycles in plain order
    if shuffle and n >= SMALL_PERMUTATION:
      # Random access, O(1) memory; grain folds the epoch (index // n) into the seed.
      order = order.shuffle(seed=self._seed)
    elif shuffle:
      order = order.map_with_index(lambda index, _: int(self._small_permutation(index // n)[index % n]))
    self._order = order
    self._examples = order.map(self.sequence)

  # --- offsets -------------------------------------------------------------------------------------------

  def _index_file(self, index_dir, data_source) -> pathlib.Path:
    info = data_source.dataset_info
    # The full name carries config and data version; the split may be a slice like "train[:10%]".
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", self.split)
    key = hashlib.sha256(f"{self.split}\0{self.text_key}".encode()).hexdigest()[:10]
    return (index_dir / "meshtrain_index" / info.full_name.replace("/", "__") /
            f"{slug}-{key}.v{INDEX_FORMAT}.offsets.npy")

  def _load_or_build_offsets(self, lengths) -> np.ndarray:
    count = len(lengths)
    path = self._index_path
    if path is not None and path.exists():
      try:
        offsets = np.load(path)
        if offsets.shape == (count + 1,) and offsets[0] == 0:
          return offsets
        log.warning("ignoring index %s: it does not match the %d documents of the split", path, count)
      except (OSError, ValueError) as e:
        log.warning("ignoring unreadable index %s: %s", path, e)
    t0 = report = time.perf_counter()
    sizes = np.empty(count + 1, np.int64)
    sizes[0] = 0
    for i in range(count):
      sizes[i + 1] = lengths[i] + 1  # + EOS
      if time.perf_counter() - report > 10:  # only large datasets take long enough to need a sign of life
        report = time.perf_counter()
        log.info("indexing %s/%s: %d of %d documents", self.name, self.split, i + 1, count)
    offsets = np.cumsum(sizes)
    log.info("indexed %d documents (%d tokens) of %s/%s in %.2fs", count, offsets[-1], self.name, self.split,
             time.perf_counter() - t0)
    if path is not None:
      try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        with open(tmp, "wb") as f:
          np.save(f, offsets)
        os.replace(tmp, path)  # atomic: processes indexing at once never see a half-written file
      except OSError as e:
        log.warning("could not cache the document index at %s (%s); it is recomputed each run", path, e)
    return offsets

  # --- packing -------------------------------------------------------------------------------------------

  def _read_document(self, doc: int) -> np.ndarray:
    tokens = self._docs[doc]
    if len(tokens) != self.offsets[doc + 1] - self.offsets[doc]:
      raise RuntimeError(
          f"document {doc} of {self.name}/{self.split} has {len(tokens)} tokens but the index says "
          f"{self.offsets[doc + 1] - self.offsets[doc]}; the data changed under a cached index: delete "
          f"{self._index_path} and rerun")
    return tokens

  def _small_permutation(self, epoch: int) -> np.ndarray:
    return _permutation(self._seed, epoch, self.num_sequences)

  def sequence_index(self, example_index: int) -> int:
    return int(self._order[example_index])

  def example(self, example_index: int) -> np.ndarray:
    return self._examples[example_index]

  def sequence(self, seq_index: int) -> np.ndarray:
    length = self.seq_len + 1
    begin = seq_index * self.seq_len
    end = min(begin + length, self.num_tokens)
    out = np.full(length, IGNORE_ID, np.int32)
    doc = int(np.searchsorted(self.offsets, begin, side="right")) - 1
    pos = begin
    while pos < end:
      doc_begin, doc_end = int(self.offsets[doc]), int(self.offsets[doc + 1])
      take = min(end, doc_end) - pos
      out[pos - begin:pos - begin + take] = self._document(doc)[pos - doc_begin:pos - doc_begin + take]
      pos += take
      doc += 1
    return out


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch]).permutation(n)


# --- making sources ------------------------------------------------------------------------------------------


def make_source(cfg, split: str, shuffle: bool) -> Source:
  """The source for `split` of `cfg.data.name`; shuffle=True: a new permutation each epoch, else plain order."""
  data, name = cfg.data, cfg.data.name
  if cfg.seq_len <= 0:
    raise UserError(f"seq_len must be positive, got {cfg.seq_len}")
  if name == SYNTHETIC:
    return SyntheticSource(cfg.seed, split, cfg.seq_len, cfg.model.vocab_size)
  if cfg.model.vocab_size < tokenizer.VOCAB_SIZE:
    raise UserError(f"model.vocab_size={cfg.model.vocab_size} is too small for the byte tokenizer, which uses ids "
                    f"up to {tokenizer.VOCAB_SIZE - 1}; set model.vocab_size >= {tokenizer.VOCAB_SIZE} "
                    f"(or data.name={SYNTHETIC} for random tokens)")
  if data.format == "prompt_completion":  # one prompt/completion example per row: meshtrain/data/sft.py
    from meshtrain.data import sft  # pylint: disable=g-import-not-at-top
    return sft.make_source(cfg, split, shuffle, tokenizer.for_config(cfg))
  if name == STDLIB:
    from meshtrain.data import stdlib_corpus  # pylint: disable=g-import-not-at-top
    stdlib_corpus.build(data.data_dir)
  ds = _open_tfds(name, split, data.data_dir)
  features = ds.dataset_info.features
  _check_text_feature(name, features, data.text_key)
  return TfdsSource(ds, name=name, split=split, text_key=data.text_key, seq_len=cfg.seq_len, seed=cfg.seed,
                    shuffle=shuffle, index_dir=_index_dir(ds))


def _where(data_dir: str) -> str:
  return f"data.data_dir={data_dir!r}" if data_dir else "the default TFDS data_dir (~/tensorflow_datasets)"


def _open_tfds(name: str, split: str, data_dir: str):
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
  import difflib  # pylint: disable=g-import-not-at-top

  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  try:
    # Community datasets would be looked up over the network.
    known = tfds.list_builders(with_community_datasets=False) + [STDLIB, SYNTHETIC]
    near = difflib.get_close_matches(name.split("/")[0].split(":")[0], known, n=3)
  except Exception:  # the suggestion is a nicety; never hide the real message behind a second failure
    near = []
  hint = f" (did you mean {', '.join(map(repr, near))}?)" if near else ""
  return (f"unknown dataset data.name={name!r}{hint}: it is neither {STDLIB!r} (Python's standard library, built "
          f"locally), {SYNTHETIC!r} (random tokens) nor a registered TFDS dataset. Use one of those, or the name of "
          f"a TFDS dataset prepared as array_record under data.data_dir (now {_where(data_dir)})")


def _check_text_feature(name: str, features, text_key: str) -> None:
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


def _index_dir(ds) -> pathlib.Path | None:
  """The data dir root to cache offsets under, or None where there are no real files (e.g. tfds mocks)."""
  info = ds.dataset_info
  version_dir = pathlib.Path(os.fspath(info.data_dir))
  if not version_dir.is_dir() or not any(version_dir.glob("*.array_record*")):
    return None
  # data_dir/name[/config]/version: the full name has one path part per level.
  return version_dir.parents[len(info.full_name.split("/")) - 1]


# --- global batches ------------------------------------------------------------------------------------------


def _process_rows(sharding, shape) -> tuple[int, int]:
  spans = set()
  for index in sharding.addressable_devices_indices_map(shape).values():
    first = index[0] if index else slice(None)
    begin, end, _ = first.indices(shape[0])
    spans.add((begin, end))
  if not spans:
    raise ValueError(f"sharding {sharding} has no devices in process {jax.process_index()}")
  ordered = sorted(spans)
  begin, end = ordered[0]
  for b, e in ordered[1:]:
    if b > end:
      raise UserError(
          f"process {jax.process_index()} holds batch rows {ordered} under sharding {sharding}; they are not "
          "contiguous, so it cannot load one slice of the batch. Order the mesh so that each process's devices "
          "are adjacent along the batch axes (as jax.make_mesh does)")
    end = max(end, e)
  return begin, end


def process_rows(sharding, batch_size: int) -> tuple[int, int]:
  """(start, stop): the contiguous rows of the global [batch_size, L] array this process's devices hold."""
  # Which rows are held does not depend on the length; the device count is one every sharding of it divides.
  return _process_rows(sharding, (batch_size, len(sharding.device_set)))


def global_batch(src: Source, step: int, batch_size: int, sharding) -> dict[str, jax.Array]:
  """The batch at `step` as global arrays laid out by `sharding`; this process reads only its own rows."""
  shape = (batch_size, src.seq_len)
  start, stop = _process_rows(sharding, shape)
  local = src.rows(step, batch_size, start, stop)
  # Full-length rows are always valid local data: a dimension whose local size equals the global one is indexed
  # directly, so this also holds when the length axis is sharded.
  return {k: jax.make_array_from_process_local_data(sharding, v, shape) for k, v in local.items()}


class _Failure:
  def __init__(self, error):
    self.error = error


class Prefetcher:
  """Iterates (step, batch) from `start_step` on, preparing the next `depth` batches on a background thread.

  Loading and host-to-device transfer overlap the training step. An exception on the thread is re-raised by
  the next `next()`. Call `close()` (or use `with`) to stop the thread.
  """

  def __init__(self, src: Source, start_step: int, batch_size: int, sharding, depth: int = 2):
    if depth < 1:
      raise ValueError(f"depth must be >= 1, got {depth}")
    self._src, self._batch_size, self._sharding = src, batch_size, sharding
    self._ready = queue.Queue()
    # A slot is taken before a batch is built and returned when it is consumed: at most `depth` exist ahead.
    self._slots = threading.Semaphore(depth)
    self._stop = threading.Event()
    self._failure = None
    self._thread = threading.Thread(target=self._run, args=(start_step,), name="meshtrain-prefetch", daemon=True)
    self._thread.start()

  def _run(self, step):
    try:
      while True:
        while not self._slots.acquire(timeout=0.1):
          if self._stop.is_set():
            return
        if self._stop.is_set():
          return
        self._ready.put((step, global_batch(self._src, step, self._batch_size, self._sharding)))
        step += 1
    except BaseException as e:  # pylint: disable=broad-except
      self._ready.put(_Failure(e))

  def __iter__(self):
    return self

  def __next__(self):
    if self._failure is not None:
      raise self._failure
    while True:
      if self._stop.is_set():
        raise StopIteration
      try:
        item = self._ready.get(timeout=0.1)
        break
      except queue.Empty:
        if not self._thread.is_alive() and self._ready.empty():
          raise RuntimeError("the prefetch thread stopped without a result")  # pylint: disable=raise-missing-from
    if isinstance(item, _Failure):
      self._failure = item.error
      raise item.error
    self._slots.release()
    return item

  def close(self) -> None:
    self._stop.set()
    self._thread.join(timeout=30)
    while not self._ready.empty():
      self._ready.get_nowait()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
