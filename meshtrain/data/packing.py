"""Packed text: the documents of a TFDS text split as one token stream cut into sequences, and the caches that
make it cheap.

Documents are packed into one stream (tokens, EOS, tokens, EOS, ...); sequence i is stream[i*L : i*L + L + 1].
Only the per-document token offsets are kept in memory (and cached on disk), and a sequence reads just the
documents it overlaps. TFDS datasets (python_stdlib included) are read through `tfds.data_source` (array_record,
random access) and grain `MapDataset`s; the order of sequences follows meshtrain/data/sources.py's conventions.

With the byte tokenizer a document's tokens are its bytes, read from the dataset on demand. Any other tokenizer
is run once over the split (grain threads reading, the tokenizer's own threads encoding) and its token stream
cached on disk beside the offsets, keyed by the tokenizer's fingerprint: a long document spans many sequences
that a shuffled order visits at random, and tokenizing it again for each of them would cost far more than the
copy a memory-mapped cache needs (measured in README, "Tokenizers").

`open_split` opens a text split (python_stdlib built first) and `train_texts` gives its documents as text, what a
BPE is trained on (meshtrain/data/select.py). grain is imported only when a source is made or texts are read.
"""
import concurrent.futures
import functools
import hashlib
import io
import logging
import multiprocessing
import os
import pathlib
import re
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from meshtrain import config as config_lib
from meshtrain.data import files, sources, tfds_access, tokenization as tokenizer
from meshtrain.errors import UserError
from meshtrain.step import IGNORE_ID

log = logging.getLogger(__name__)

STDLIB = "python_stdlib"  # stdlib_corpus.NAME, named here too: stdlib_corpus imports tensorflow_datasets
# Bump when the packing/tokenization changes, so cached offsets from older code are not reused.
INDEX_FORMAT = 1
# Token streams of non-byte tokenizers: documents encoded per batch (the tokenizer's threads share a batch).
ENCODE_BATCH = 256
# Documents per block of the tokenizing pass's shares: process i of n encodes blocks i, i + n, ... (ENCODE_BATCH-sized
# blocks keep each encode batch whole).
SHARE_BLOCK = ENCODE_BATCH
DOC_CACHE = 32  # documents kept decoded: a long file spans many consecutive sequences in evaluation order


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


class TfdsSource(sources.Source):
  """Documents of one TFDS split packed into sequences, read by random access."""

  def __init__(self, data_source, *, name: str, split: str, text_key: str, seq_len: int, seed: int,
               shuffle: bool, index_dir: pathlib.Path | None, tok: tokenizer.Tokenizer | None = None,
               order_key: str | None = None, tokenize_workers: int = 1):
    import grain  # pylint: disable=g-import-not-at-top

    self.name, self.split, self.text_key, self.seq_len, self.shuffle = name, split, text_key, seq_len, shuffle
    self.tok = tok or tokenizer.ByteTokenizer()
    self.pad_id = self.tok.pad_id
    self.encode_seconds = None  # set when this source tokenized the split (not read from the cache)
    self.tokenize_workers = tokenize_workers  # local worker processes of the tokenizing pass (1: none)
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
    self._seed = sources.derive_seed("order", seed, order_key or name, split)
    order = grain.MapDataset.range(n)  # indices past n wrap: evaluation cycles in plain order
    if shuffle and n >= sources.SMALL_PERMUTATION:
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
    processes = jax.process_count()
    if processes > 1 and _all_processes(loaded is not None):
      return loaded
    workers = self._workers()
    if processes > 1 or (workers > 1 and loaded is None):  # the pass in shares: every process, its local workers
      try:
        return self._build_token_cache_in_shares(data_source, path, tokens_path, dtype, processes, workers)
      except OSError as e:
        log.warning("could not write the token stream's shares beside %s (%s); this process encodes it whole",
                    tokens_path, e)
    if loaded is not None:
      return loaded
    try:
      with tfds_access.file_lock(path.with_name(f".{path.name}.lock")):
        loaded = _load_token_cache(path, tokens_path, count, dtype)  # another process may have built it meanwhile
        if loaded is None:
          self.encode_seconds = write_token_cache(data_source, self.text_key, self.tok, path, tokens_path,
                                                  self._label())
          loaded = _load_token_cache(path, tokens_path, count, dtype)
    except OSError as e:
      # A read-only data dir still trains: the stream is encoded into memory, again by every run.
      log.warning("could not cache the token stream at %s (%s); it is kept in memory and recomputed each run",
                  tokens_path, e)
      stream = io.BytesIO()
      offsets, self.encode_seconds = encode_documents(data_source, self.text_key, self.tok, stream, self._label())
      return offsets, np.frombuffer(stream.getbuffer(), dtype)
    if loaded is None:
      raise RuntimeError(f"the token cache {tokens_path} just written does not read back")
    return loaded

  def _label(self, share: str = "") -> str:
    return f"{self.name}/{self.split}" + (f" ({share})" if share else "")

  def _workers(self) -> int:
    """Local worker processes for this process's part of the pass: tokenize_workers (1: none, this process
    encodes), 1 where the tokenizer has no file a worker could load."""
    return 1 if self.tok.path is None else self.tokenize_workers

  def _build_token_cache_in_shares(self, data_source, path, tokens_path, dtype, processes: int, workers: int):
    """The token cache built in processes x workers shares: share i (process i // workers's local worker
    i % workers, or the process itself when workers == 1) encodes blocks i, i + shares, ... of SHARE_BLOCK
    documents (interleaved, so that long and short documents that cluster in a corpus spread over the shares) into
    its own part files; the processes wait for each other, and the parts are joined into the cache one process
    would have written (byte for byte: the same documents, in order, with the same tokenizer). Where a part is not
    visible here (a data dir that is not shared between hosts) this process encodes it too, so each host ends with
    the whole cache."""
    count = len(data_source)
    shares = processes * workers
    me = jax.process_index()

    def part(i, what):
      return path.with_name(f"{path.name}.part{i}of{shares}.{what}")

    def encode_parts(indices):
      todo = [i for i in indices if not part(i, "offsets.npy").exists()]
      jobs = [(i, part(i, "offsets.npy"), part(i, "tokens.bin"), self._label(f"share {i + 1} of {shares}"))
              for i in todo]
      if workers == 1 or len(todo) <= 1:
        for i, offsets_path, part_tokens, label in jobs:
          write_token_cache(_Share(data_source, i, shares), self.text_key, self.tok, offsets_path, part_tokens, label)
        return
      # Fresh interpreters (spawn): this process has JAX running, whose threads a fork would not carry.
      context = multiprocessing.get_context("spawn")
      with concurrent.futures.ProcessPoolExecutor(len(jobs), mp_context=context) as pool:
        version_dir = os.fspath(data_source.dataset_info.data_dir)
        futures = [pool.submit(encode_share, version_dir, self.split, self.text_key, str(self.tok.path), i, shares,
                               offsets_path, part_tokens, label) for i, offsets_path, part_tokens, label in jobs]
        for future in futures:
          future.result()

    t0 = time.perf_counter()
    encode_parts(range(me * workers, (me + 1) * workers))
    if processes > 1:
      _all_processes(True)  # a barrier: every process has written its parts
    with tfds_access.file_lock(path.with_name(f".{path.name}.lock")):
      loaded = _load_token_cache(path, tokens_path, count, dtype)
      if loaded is None:
        encode_parts(range(shares))  # the parts not visible here (none where the data dir is shared)
        _join_parts([part(i, "offsets.npy") for i in range(shares)], [part(i, "tokens.bin") for i in range(shares)],
                    path, tokens_path, dtype)
        loaded = _load_token_cache(path, tokens_path, count, dtype)
        self.encode_seconds = time.perf_counter() - t0
    if processes > 1:
      _all_processes(True)  # every process has the joined cache open before any part is removed
    if me == 0:
      for i in range(shares):
        part(i, "offsets.npy").unlink(missing_ok=True)
        part(i, "tokens.bin").unlink(missing_ok=True)
    if loaded is None:
      raise RuntimeError(f"the token cache {tokens_path} just joined does not read back")
    return loaded

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
    return sources.permutation(self._seed, epoch, self.num_sequences)

  def sequence_index(self, example_index: int) -> int:
    return int(self._order[example_index])

  def example(self, example_index: int) -> np.ndarray:
    return self._examples[example_index]

  def documents(self, example_index: int) -> int:
    begin = self.sequence_index(example_index) * self.seq_len
    end = min(begin + self.seq_len + 1, self.num_tokens)
    first, last = np.searchsorted(self.offsets, [begin, end - 1], side="right") - 1
    return int(last - first + 1)

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




class _EncodedDocuments:
  """doc -> its tokens and EOS, encoded on demand (sources without files to cache a stream beside)."""

  def __init__(self, data_source, text_key: str, tok):
    self._source, self._text, self._tok = data_source, _DocumentText(text_key), tok

  def __getitem__(self, doc: int) -> np.ndarray:
    return np.append(self._tok.encode(self._text(self._source[doc])), self._tok.eos_id).astype(np.int32)


def encode_documents(data_source, text_key: str, tok, out, label: str) -> tuple[np.ndarray, float]:
  """Writes every document's tokens and an EOS to the binary file `out`; returns (offsets, seconds). Grain threads
  read and decode the records while the tokenizer encodes batches of them on its own threads."""
  import grain  # pylint: disable=g-import-not-at-top

  count = len(data_source)
  dtype = np.dtype(tok.token_dtype)
  # Printed, not logged: the first run of a new tokenizer waits here (a minute or two for python_stdlib).
  print(f"tokenizing {count} documents of {label} with the {tok.kind} tokenizer ({tok.vocab_size} ids) once; the "
        "token stream is cached", flush=True)
  texts = (grain.MapDataset.source(data_source).map(_DocumentText(text_key)).batch(ENCODE_BATCH, batch_fn=list)
           .to_iter_dataset(grain.ReadOptions(num_threads=4, prefetch_buffer_size=4)))
  sizes = np.zeros(count + 1, np.int64)
  t0 = report = time.perf_counter()
  done = 0
  eos = np.array([tok.eos_id], dtype).tobytes()
  for batch in texts:
    for ids in tok.encode_batch(batch):
      out.write(ids.astype(dtype).tobytes())
      out.write(eos)
      done += 1
      sizes[done] = len(ids) + 1
    if time.perf_counter() - report > 10:
      report = time.perf_counter()
      log.info("tokenizing %s: %d of %d documents", label, done, count)
  offsets = np.cumsum(sizes)
  seconds = time.perf_counter() - t0
  print(f"tokenized {label}: {offsets[-1]:,} tokens in {seconds:.1f}s ({offsets[-1] / max(seconds, 1e-9):,.0f} "
        "tokens/s)", flush=True)
  return offsets, seconds


def write_token_cache(data_source, text_key: str, tok, path: pathlib.Path, tokens_path: pathlib.Path,
                      label: str) -> float:
  """The documents' token stream into tokens_path, then their offsets into `path`: each written aside and renamed,
  the offsets last, so offsets present mean the tokens beside them are whole. Returns the seconds encoding took."""
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp_tokens = tokens_path.with_name(f"{tokens_path.name}.tmp{os.getpid()}")
  try:
    with open(tmp_tokens, "wb") as f:
      offsets, seconds = encode_documents(data_source, text_key, tok, f, label)
    os.replace(tmp_tokens, tokens_path)
  finally:
    tmp_tokens.unlink(missing_ok=True)  # an interrupted pass leaves nothing behind
  tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
  with open(tmp, "wb") as f:
    np.save(f, offsets)
  os.replace(tmp, path)
  return seconds


def encode_share(version_dir: str, split: str, text_key: str, tokenizer_path: str, share: int, shares: int,
                 path: pathlib.Path, tokens_path: pathlib.Path, label: str) -> None:
  """A local worker's share of the tokenizing pass (a separate process: it opens the split and the tokenizer
  itself)."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  # One encoding thread per worker: there is a worker per core, and the tokenizer's pool (Rust rayon, created on its
  # first batch) would otherwise take every core in every worker.
  os.environ["RAYON_NUM_THREADS"] = "1"
  data_source = tfds.builder_from_directory(version_dir).as_data_source(split)
  write_token_cache(_Share(data_source, share, shares), text_key, tokenizer.load(tokenizer_path), path, tokens_path,
                    label)


class _Share:
  """The records of blocks `share`, `share` + `shares`, ... of SHARE_BLOCK records, in order, as a data source:
  what one process's share of the tokenizing reads."""

  def __init__(self, data_source, share: int, shares: int):
    self._source, self._share, self._shares = data_source, share, shares
    self._count = sum(len(b) for b in share_blocks(len(data_source), share, shares))

  def __len__(self):
    return self._count

  def __getitem__(self, i):
    if not 0 <= i < self._count:
      raise IndexError(i)
    block, within = divmod(i, SHARE_BLOCK)
    return self._source[(block * self._shares + self._share) * SHARE_BLOCK + within]


def share_blocks(count: int, share: int, shares: int) -> list[range]:
  """The document ranges of blocks share, share + shares, ... of SHARE_BLOCK of `count` documents."""
  return [range(b * SHARE_BLOCK, min((b + 1) * SHARE_BLOCK, count))
          for b in range(share, -(-count // SHARE_BLOCK), shares)]


def _all_processes(value: bool) -> bool:
  """Whether `value` holds on every process of the job: an all-gather, so also a barrier."""
  return bool(np.all(multihost_utils.process_allgather(np.array([value]))))


def _join_parts(offsets_paths, tokens_paths, path: pathlib.Path, tokens_path: pathlib.Path, dtype) -> None:
  """The parts' blocks of documents, back in document order, into tokens_path, and their offsets into `path`: each
  written aside and renamed, the offsets last (as write_token_cache)."""
  shares = len(offsets_paths)
  parts = [np.load(p) for p in offsets_paths]
  streams = [np.memmap(p, dtype=dtype, mode="r") if os.path.getsize(p) else np.zeros(0, dtype) for p in tokens_paths]
  sizes = [np.diff(p) for p in parts]
  count = sum(len(s) for s in sizes)
  ordered = np.zeros(count + 1, np.int64)
  tmp_tokens = tokens_path.with_name(f"{tokens_path.name}.tmp{os.getpid()}")
  try:
    with open(tmp_tokens, "wb") as out:
      taken = [0] * shares  # documents of each part written so far
      for block in range(-(-count // SHARE_BLOCK)):
        i = block % shares
        n = min(SHARE_BLOCK, count - block * SHARE_BLOCK)
        first, last = parts[i][taken[i]], parts[i][taken[i] + n]
        out.write(streams[i][first:last].tobytes())
        ordered[block * SHARE_BLOCK + 1:block * SHARE_BLOCK + n + 1] = sizes[i][taken[i]:taken[i] + n]
        taken[i] += n
    os.replace(tmp_tokens, tokens_path)
  finally:
    tmp_tokens.unlink(missing_ok=True)
  offsets = np.cumsum(ordered)
  tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
  with open(tmp, "wb") as f:
    np.save(f, offsets)
  os.replace(tmp, path)


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


# --- opening text splits -------------------------------------------------------------------------------------


def open_split(cfg, split: str, name: str | None = None):
  """The TFDS data source of `split` of `name` (default cfg.data.name), its text features checked: a TFDS dataset
  (python_stdlib built first if needed), or local files (a path or glob: converted once, meshtrain/data/files.py;
  "train" is what data.eval_fraction does not hold out, "validation" what it does)."""
  data = cfg.data
  name = data.name if name is None else name
  if config_lib.is_path(name):
    ds = files.open_split(name, split, data, data.eval_fraction)
  else:
    if name == STDLIB:
      # stdlib_corpus imports tensorflow_datasets: loaded only when python_stdlib is opened.
      from meshtrain.data import stdlib_corpus  # pylint: disable=g-import-not-at-top
      stdlib_corpus.build(data.data_dir)
    ds = tfds_access.open_tfds(name, split, data.data_dir)
  if data.format == "text":
    tfds_access.check_text_feature(name, ds.dataset_info.features, data.text_key)
  return ds


def order_name(name: str, ds) -> str:
  """The name a source's document order is seeded with: a TFDS name as given; for files, the converted dataset's
  content key, so that the same files moved elsewhere keep their order."""
  return ds.dataset_info.name if config_lib.is_path(name) else name


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


def bpe_corpus(cfg) -> str:
  """The dataset a bpe:N tokenizer is trained on: data.name, or a mixture's first source."""
  return config_lib.parse_mixture(cfg.data.mixture)[0][0] if cfg.data.mixture else cfg.data.name


def train_texts(cfg):
  """(texts, dataset info, cache root) of cfg's train split: what `select.tokenizer_for_config` trains a bpe:N on, and
  the TFDS data dir it caches the result under (the user's cache dir where the data has no files, e.g. mocks)."""
  ds = open_split(cfg, cfg.data.train_split, bpe_corpus(cfg))
  root = tfds_access.index_dir(ds) or pathlib.Path("~/.cache/meshtrain").expanduser()
  return _Texts(ds, cfg.data.text_key), ds.dataset_info, root
