"""Token sources and global batches.

A source maps a global example index to one packed sequence of `seq_len + 1` tokens, so the batch at step k
is a pure function of (seed, k): rows [start, stop) of it can be loaded by any process, and the result does
not depend on how many processes there are or on the mesh. Nothing iterates statefully, so resuming at step k
needs no iterator state in the checkpoint.

TFDS datasets (python_stdlib included) are read through `tfds.data_source` (array_record, random access) and
grain `MapDataset`s. Documents are packed into one stream (tokens, EOS, tokens, EOS, ...); sequence i is
stream[i*L : i*L + L + 1]. Only the per-document token offsets are kept in memory (and cached on disk), and a
sequence reads just the documents it overlaps.

With the byte tokenizer a document's tokens are its bytes, read from the dataset on demand. Any other tokenizer
is run once over the split (grain threads reading, the tokenizer's own threads encoding) and its token stream
cached on disk beside the offsets, keyed by the tokenizer's fingerprint: a long document spans many sequences
that a shuffled order visits at random, and tokenizing it again for each of them would cost far more than the
copy a memory-mapped cache needs (measured in README, "Tokenizers").

`Batches` is the train loop's input: grain reads the batches of the steps ahead on worker threads (each one the
source's `rows` for this process, a pure function of the step) and a grain prefetch thread moves them onto the
devices, so loading and host-to-device transfer overlap the training step.

tensorflow_datasets and grain are imported only when a TFDS source is made or batches are iterated, so
`synthetic` runs where they are not installed (the GPU machines; there one background thread prefetches).
"""
import concurrent.futures
import functools
import hashlib
import io
import logging
import os
import pathlib
import re
import sys
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
# Token streams of non-byte tokenizers: documents encoded per batch (the tokenizer's threads share a batch).
ENCODE_BATCH = 256
# Batches: grain worker threads building the next steps' rows, and how many batches they may hold ready. Two of
# each keep a step's worth of rows in hand with room to spare (the BPE path builds a tiny-model batch in well under
# a millisecond, README "Tokenizers") without taking cores from XLA on small hosts.
READ_THREADS = 2
READ_AHEAD = 2
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


class _DocumentText:
  """A record's text as str, for tokenizers; a class so the grain map stays picklable."""

  def __init__(self, text_key):
    self.text_key = text_key

  def __call__(self, record) -> str:
    return _text_bytes(record[self.text_key]).decode("utf-8")


class _DocumentTokens:
  """A record's byte tokens followed by EOS, as uint16."""

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
               shuffle: bool, index_dir: pathlib.Path | None, tok: tokenizer.Tokenizer | None = None):
    import grain  # pylint: disable=g-import-not-at-top

    self.name, self.split, self.text_key, self.seq_len, self.shuffle = name, split, text_key, seq_len, shuffle
    self.tok = tok or tokenizer.ByteTokenizer()
    self.pad_id = self.tok.pad_id
    self.encode_seconds = None  # set when this source tokenized the split (not read from the cache)
    self._index_path = self._index_file(index_dir, data_source) if index_dir is not None else None
    if self.tok.kind == tokenizer.BYTE:
      self._docs = grain.MapDataset.source(data_source).map(_DocumentTokens(text_key))
      self.offsets = self._load_or_build_offsets(grain.MapDataset.source(data_source).map(_DocumentLength(text_key)))
    else:
      self.offsets, self._docs = self._load_or_build_tokens(data_source)
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
    # Byte offsets keep their name of old (the caches already built stay valid); other tokenizers' streams are
    # keyed by the tokenizer file's fingerprint.
    tok_key = "" if self.tok.kind == tokenizer.BYTE else f".tok-{self.tok.fingerprint[:16]}"
    return (index_dir / "meshtrain_index" / info.full_name.replace("/", "__") /
            f"{slug}-{key}{tok_key}.v{INDEX_FORMAT}.offsets.npy")

  def _load_or_build_tokens(self, data_source) -> tuple[np.ndarray, "np.ndarray | _EncodedDocuments"]:
    """(offsets, documents) for a non-byte tokenizer: the split's token stream, from the cache or encoded now."""
    count = len(data_source)
    path = self._index_path
    if path is None:  # no files to cache beside (a TFDS mock): encode on demand, offsets from one pass
      docs = _EncodedDocuments(data_source, self.text_key, self.tok)
      sizes = np.array([0] + [len(docs[i]) for i in range(count)], np.int64)
      return np.cumsum(sizes), docs
    tokens_path = path.with_name(path.name.replace(".offsets.npy", ".tokens.bin"))
    dtype = np.dtype(self.tok.token_dtype)
    loaded = _load_token_cache(path, tokens_path, count, dtype)
    if loaded is not None:
      return loaded
    try:
      with tokenizer.file_lock(path.with_name(f".{path.name}.lock")):
        loaded = _load_token_cache(path, tokens_path, count, dtype)  # another process may have built it meanwhile
        if loaded is None:
          self._write_token_cache(data_source, path, tokens_path, dtype)
          loaded = _load_token_cache(path, tokens_path, count, dtype)
    except OSError as e:
      # A read-only data dir still trains: the stream is encoded into memory, again by every run.
      log.warning("could not cache the token stream at %s (%s); it is kept in memory and recomputed each run",
                  tokens_path, e)
      stream = io.BytesIO()
      offsets = self._encode_split(data_source, stream, dtype)
      return offsets, np.frombuffer(stream.getbuffer(), dtype)
    if loaded is None:
      raise RuntimeError(f"the token cache {tokens_path} just written does not read back")
    return loaded

  def _write_token_cache(self, data_source, path: pathlib.Path, tokens_path: pathlib.Path, dtype) -> None:
    """The split's token stream into tokens_path, then its offsets into `path`: each written aside and renamed,
    the offsets last, so offsets present mean the tokens beside them are whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_tokens = tokens_path.with_name(f"{tokens_path.name}.tmp{os.getpid()}")
    try:
      with open(tmp_tokens, "wb") as f:
        offsets = self._encode_split(data_source, f, dtype)
      os.replace(tmp_tokens, tokens_path)
    finally:
      tmp_tokens.unlink(missing_ok=True)  # an interrupted pass leaves nothing behind
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
      np.save(f, offsets)
    os.replace(tmp, path)

  def _encode_split(self, data_source, out, dtype) -> np.ndarray:
    """Writes every document's tokens and an EOS to the binary file `out`; returns the offsets. Grain threads read
    and decode the records while the tokenizer encodes batches of them on its own threads."""
    import grain  # pylint: disable=g-import-not-at-top

    count = len(data_source)
    # Printed, not logged: the first run of a new tokenizer waits here (a minute or two for python_stdlib).
    print(f"tokenizing {count} documents of {self.name}/{self.split} with the {self.tok.kind} tokenizer "
          f"({self.tok.vocab_size} ids) once; the token stream is cached", flush=True)
    texts = (grain.MapDataset.source(data_source).map(_DocumentText(self.text_key)).batch(ENCODE_BATCH,
             batch_fn=list).to_iter_dataset(grain.ReadOptions(num_threads=4, prefetch_buffer_size=4)))
    sizes = np.zeros(count + 1, np.int64)
    t0 = report = time.perf_counter()
    done = 0
    eos = np.array([self.tok.eos_id], dtype).tobytes()
    for batch in texts:
      for ids in self.tok.encode_batch(batch):
        out.write(ids.astype(dtype).tobytes())
        out.write(eos)
        done += 1
        sizes[done] = len(ids) + 1
      if time.perf_counter() - report > 10:
        report = time.perf_counter()
        log.info("tokenizing %s/%s: %d of %d documents", self.name, self.split, done, count)
    offsets = np.cumsum(sizes)
    self.encode_seconds = time.perf_counter() - t0
    print(f"tokenized {self.name}/{self.split}: {offsets[-1]:,} tokens in {self.encode_seconds:.1f}s "
          f"({offsets[-1] / max(self.encode_seconds, 1e-9):,.0f} tokens/s)", flush=True)
    return offsets

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
    if isinstance(self._docs, np.ndarray):  # a memory-mapped token stream: a view, no copy
      return self._docs[self.offsets[doc]:self.offsets[doc + 1]]
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


class _EncodedDocuments:
  """doc -> its tokens and EOS, encoded on demand (sources without files to cache a stream beside)."""

  def __init__(self, data_source, text_key: str, tok):
    self._source, self._text, self._tok = data_source, _DocumentText(text_key), tok

  def __getitem__(self, doc: int) -> np.ndarray:
    return np.append(self._tok.encode(self._text(self._source[doc])), self._tok.eos_id).astype(np.int32)


def _load_token_cache(offsets_path, tokens_path, count: int, dtype):
  """(offsets, memory-mapped tokens) if both files exist and agree with each other and the split, else None."""
  if not offsets_path.exists() or not tokens_path.exists():
    return None
  try:
    offsets = np.load(offsets_path)
    size = tokens_path.stat().st_size
    if offsets.shape == (count + 1,) and offsets[0] == 0 and size == offsets[-1] * dtype.itemsize:
      return offsets, np.memmap(tokens_path, dtype=dtype, mode="r")
    log.warning("ignoring token cache %s: it does not match the %d documents of the split", tokens_path, count)
  except (OSError, ValueError) as e:
    log.warning("ignoring unreadable token cache %s: %s", tokens_path, e)
  return None


# --- making sources ------------------------------------------------------------------------------------------


def check_vocab(cfg, tok: tokenizer.Tokenizer) -> None:
  """Refuses a model whose embedding cannot hold every id `tok` emits."""
  if cfg.model.vocab_size < tok.vocab_size:
    where = f" ({tok.path})" if tok.path else ""
    raise UserError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the vocabulary of the {tok.kind} "
                    f"tokenizer{where}, which has {tok.vocab_size} ids; set --config.model.vocab_size="
                    f"{tok.vocab_size} or more" + (f" (or data.name={SYNTHETIC} for random tokens)"
                                                   if tok.kind == tokenizer.BYTE else ""))


def make_source(cfg, split: str, shuffle: bool, tok: tokenizer.Tokenizer | None = None) -> Source:
  """The source for `split` of `cfg.data.name`; shuffle=True: a new permutation each epoch, else plain order.
  task=dit: an image source (meshtrain/data/images.py; `tok` is not used).

  `tok`: the tokenizer (default: the one cfg.data.tokenizer names, trained first if it is bpe:N).
  """
  data, name = cfg.data, cfg.data.name
  if cfg.get("task", "lm") == "dit":  # labelled images, not tokens: meshtrain/data/images.py
    from meshtrain.data import images  # pylint: disable=g-import-not-at-top
    return images.make_source(cfg, split, shuffle)
  if name == SYNTHETIC:  # seq_len > 0 and the rest of the config: config.validate, which every entry point runs
    return SyntheticSource(cfg.seed, split, cfg.seq_len, cfg.model.vocab_size)
  tok = tok or tokenizer.for_config(cfg)
  check_vocab(cfg, tok)
  if data.format == "prompt_completion":  # one prompt/completion example per row: meshtrain/data/sft.py
    from meshtrain.data import sft  # pylint: disable=g-import-not-at-top
    return sft.make_source(cfg, split, shuffle, tok)
  ds = open_split(cfg, split)
  return TfdsSource(ds, name=name, split=split, text_key=data.text_key, seq_len=cfg.seq_len, seed=cfg.seed,
                    shuffle=shuffle, index_dir=_index_dir(ds), tok=tok)


def open_split(cfg, split: str):
  """The TFDS data source of `split` of cfg.data.name (python_stdlib built first if needed), its text feature
  checked."""
  data, name = cfg.data, cfg.data.name
  if name == STDLIB:
    from meshtrain.data import stdlib_corpus  # pylint: disable=g-import-not-at-top
    stdlib_corpus.build(data.data_dir)
  ds = _open_tfds(name, split, data.data_dir)
  _check_text_feature(name, ds.dataset_info.features, data.text_key)
  return ds


class _Texts:
  """The documents of a data source as str, iterable more than once (the BPE trainer takes an iterator)."""

  def __init__(self, data_source, text_key: str):
    self._source, self._text = data_source, _DocumentText(text_key)

  def __len__(self):
    return len(self._source)

  def __iter__(self):
    import grain  # pylint: disable=g-import-not-at-top
    # Records are read and decoded on grain's threads while the trainer counts words.
    return iter(grain.MapDataset.source(self._source).map(self._text).to_iter_dataset(
        grain.ReadOptions(num_threads=4, prefetch_buffer_size=256)))


def train_texts(cfg):
  """(texts, dataset info, cache root) of cfg's train split: what `tokenizer.for_config` trains a bpe:N on, and
  the TFDS data dir it caches the result under (the user's cache dir where the data has no files, e.g. mocks)."""
  ds = open_split(cfg, cfg.data.train_split)
  root = _index_dir(ds) or pathlib.Path("~/.cache/meshtrain").expanduser()
  return _Texts(ds, cfg.data.text_key), ds.dataset_info, root


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
    known = tfds.list_builders(with_community_datasets=False) + [STDLIB, SYNTHETIC, "digits"]
    near = difflib.get_close_matches(name.split("/")[0].split(":")[0], known, n=3)
  except Exception:  # the suggestion is a nicety; never hide the real message behind a second failure
    near = []
  hint = f" (did you mean {', '.join(map(repr, near))}?)" if near else ""
  return (f"unknown dataset data.name={name!r}{hint}: it is neither {STDLIB!r} (Python's standard library, built "
          f"locally), 'digits' (handwritten digits for task=dit, built locally), {SYNTHETIC!r} (random data) nor a "
          "registered TFDS dataset. Use one of those, or the name of "
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
  """(start, stop): the contiguous rows of a global [batch_size, ...] array this process's devices hold under
  `sharding`, a NamedSharding or a dict {batch key: NamedSharding} (whose shardings must agree on the rows)."""
  if isinstance(sharding, dict):
    spans = {key: process_rows(s, batch_size) for key, s in sharding.items()}
    if len(set(spans.values())) > 1:
      raise ValueError(f"the batch shardings give this process different rows per key ({spans}); every key of a "
                       "batch must be split the same way along its first (batch) axis")
    return next(iter(spans.values()))
  # Which rows are held depends on the batch axis alone; every other axis gets the device count, which each
  # sharding of it divides, and the shape gets as many axes as the sharding's spec names (images: 4).
  rank = max(2, len(getattr(sharding, "spec", ())))
  return _process_rows(sharding, (batch_size,) + (len(sharding.device_set),) * (rank - 1))


def _on_devices(sharding, local: dict[str, np.ndarray], batch_size: int) -> dict[str, jax.Array]:
  """This process's rows of each batch array as global arrays of batch_size rows, each laid out by `sharding` (one
  NamedSharding for every key, or a dict {key: NamedSharding}); an array's other axes are its own."""
  if isinstance(sharding, dict) and set(sharding) != set(local):
    raise ValueError(f"batch keys {sorted(local)} and sharding keys {sorted(sharding)} differ")
  # Full-length rows are always valid local data: a dimension whose local size equals the global one is indexed
  # directly, so this also holds when the length axis (or any other non-batch axis) is sharded.
  return {k: jax.make_array_from_process_local_data(sharding[k] if isinstance(sharding, dict) else sharding, v,
                                                     (batch_size, *v.shape[1:])) for k, v in local.items()}


def global_batch(src, step: int, batch_size: int, sharding) -> dict[str, jax.Array]:
  """The batch at `step` as global arrays laid out by `sharding` (a NamedSharding for all keys, or a dict
  {key: NamedSharding}); this process reads only its own rows. `src`: a token or image source (its `rows`)."""
  start, stop = process_rows(sharding, batch_size)
  return _on_devices(sharding, src.rows(step, batch_size, start, stop), batch_size)


class _StepRows:
  """step -> (step, this process's rows of the global batch at that step): the grain map, a class so it pickles."""

  def __init__(self, src: Source, batch_size: int, start: int, stop: int):
    self.src, self.batch_size, self.start, self.stop = src, batch_size, start, stop

  def __call__(self, step: int):
    return step, self.src.rows(step, self.batch_size, self.start, self.stop)


class _ToDevices:
  """(step, local rows) -> (step, global arrays of batch_size rows laid out by `sharding`, as `global_batch`)."""

  def __init__(self, sharding, batch_size: int):
    self.sharding, self.batch_size = sharding, batch_size

  def __call__(self, item):
    step, local = item
    return step, _on_devices(self.sharding, local, self.batch_size)


def local_batches(src: Source, start_step: int, batch_size: int, start: int, stop: int, *, threads: int = READ_THREADS,
                  read_ahead: int = READ_AHEAD):
  """The grain IterDataset of (step, rows [start, stop) of the global batch at step) for step = start_step, ...:
  the host side of `Batches`, which `python -m meshtrain.bench --data-only` times alone."""
  import grain  # pylint: disable=g-import-not-at-top
  steps = grain.MapDataset.range(start_step, sys.maxsize).map(_StepRows(src, batch_size, start, stop))
  return steps.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=read_ahead))


class Batches:
  """Iterates (step, batch) from `start_step` on: the train loop's input.

  `src`: a token or image source (anything with `rows`); `sharding`: a NamedSharding for every key of the batch,
  or a dict {key: NamedSharding} (images are 4-D, their labels 1-D).
  A grain pipeline: the step indices from `start_step` (a MapDataset, so resuming at step k needs no iterator
  state), mapped to this process's rows of each step's global batch on `threads` worker threads that keep
  `read_ahead` batches ready, then moved onto the devices on grain's prefetch thread, so loading and transfer
  overlap the training step. Batch k is the source's pure function of (seed, k) whatever the thread timing. An
  exception while loading is raised by the `next()` that would have returned that batch. Call `close()` (or use
  `with`) to stop the threads. Where grain is not installed (synthetic data on the GPU machines) one thread
  prefetches instead.
  """

  def __init__(self, src: Source, start_step: int, batch_size: int, sharding, *, threads: int = READ_THREADS,
               read_ahead: int = READ_AHEAD):
    if threads < 1 or read_ahead < 1:
      raise ValueError(f"threads and read_ahead must be >= 1, got {threads} and {read_ahead}")
    start, stop = process_rows(sharding, batch_size)
    rows, to_devices = _StepRows(src, batch_size, start, stop), _ToDevices(sharding, batch_size)
    try:
      import grain  # pylint: disable=g-import-not-at-top
    except ImportError:
      self._fallback = _ThreadBatches(start_step, lambda step: to_devices(rows(step)), read_ahead)
      self._iterator = None
      return
    self._fallback = None
    local = local_batches(src, start_step, batch_size, start, stop, threads=threads, read_ahead=read_ahead)
    on_devices = grain.experimental.ThreadPrefetchIterDataset(local.map(to_devices), prefetch_buffer_size=1)
    self._iterator = iter(on_devices)

  def __iter__(self):
    return self

  def __next__(self):
    if self._fallback is not None:
      return next(self._fallback)
    if self._iterator is None:
      raise StopIteration
    return next(self._iterator)

  def close(self) -> None:
    if self._fallback is not None:
      self._fallback.close()
    if self._iterator is not None:
      self._iterator.close()
      self._iterator = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class _ThreadBatches:
  """`load(step)` for step = start, start + 1, ..., `depth` of them ahead on one thread (no grain installed)."""

  def __init__(self, start_step: int, load, depth: int):
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meshtrain-batches")
    self._load, self._next_step = load, start_step
    self._pending = [self._submit() for _ in range(depth)]

  def _submit(self):
    future = self._pool.submit(self._load, self._next_step)
    self._next_step += 1
    return future

  def __next__(self):
    if not self._pending:
      raise StopIteration
    future = self._pending.pop(0)
    item = future.result()  # re-raises what loading this step raised
    self._pending.append(self._submit())
    return item

  def close(self) -> None:
    for future in self._pending:
      future.cancel()
    self._pending = []
    self._pool.shutdown(wait=True)
