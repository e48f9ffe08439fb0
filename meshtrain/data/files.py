"""A user's own files as a TFDS dataset: `data.name` may be a path or a glob instead of a TFDS name.

  --config.data.name='corpus/*.jsonl'     # .jsonl / .json: one document per record, the text under data.text_key
  --config.data.name=books.parquet        # .parquet: one document per row, the same key
  --config.data.name=notes/               # a directory: every .jsonl/.json/.parquet/.txt under it (.txt: one per file)
  --config.data.name=saved/train          # a directory written by `datasets`' save_to_disk (its .arrow files)

The files are converted once, streaming (one record in memory at a time, whatever the corpus size), into array_record
files with TFDS metadata (`tfds.folder_dataset.write_metadata`), so they are read by `tfds` like any prepared TFDS
dataset: packing, the token cache, the document order, exact resume and multi-process loading are those of TFDS
data. A fraction of the documents (data.eval_fraction, by a hash of each document's content) becomes the
`validation` split, the rest `train`.

The converted dataset lives under the TFDS data dir (data.data_dir, else $TFDS_DATA_DIR or ~/tensorflow_datasets),
in `meshtrain_files/files_<key>/1.0.0/`, where the key is a hash of the files' contents (in the order of their
content hashes, so a moved or renamed file is the same corpus and an edited one a new one) and of the fields that
decide what is read. Each file's content hash is cached by its (path, size, mtime, inode), so a later run of the
same corpus reads no file. The conversion runs under a lock (one process per host converts, the others wait and
find it done) into a temporary directory renamed into place when complete: an interrupted or failed conversion
leaves nothing that a later run would read.

Bad input is a UserError naming the file and line (or row, or byte offset), before anything is trained; with
data.skip_bad_records=true a malformed record is skipped and counted instead (printed, kept in the dataset's
manifest, and written to the run's metrics as data/skipped_records).

pyarrow (a dependency of tensorflow-datasets) reads .parquet files and `datasets` directories; `datasets` itself is
not needed. TFDS, array_record and pyarrow are imported only when files are converted or opened.
"""
import codecs
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import pathlib
import re
import shutil
import socket
import tempfile
from collections.abc import Callable

import tqdm

from meshtrain import config
from meshtrain.data import tfds_access
from meshtrain.errors import UserError
from meshtrain.runtime import host

SUFFIXES = config.FILE_SUFFIXES
MANIFEST = "meshtrain_files.json"
VERSION = "1.0.0"
# Bump with any change to what a conversion writes, so a dataset converted by older code is not reused.
FORMAT = 1
SKIP_HINT = "; fix it, or set data.skip_bad_records=true to skip (and count) records that cannot be read"
HASH_CHUNK = 1 << 20
PARQUET_BATCH = 1024  # rows per read: bounded memory whatever the file's size
# Bytes read at a time from a .json array: memory holds about this much and the record being parsed, whatever the
# file's size (a constant so tests can lower it and split records across reads).
JSON_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class Fields:
  """What is read from each record: the features the dataset gets, by data.format."""
  fmt: str  # text | prompt_completion | chat
  keys: tuple[str, ...]  # text: (text_key,); prompt_completion: (prompt_key, completion_key); chat: (messages_key,)

  @classmethod
  def of(cls, data) -> "Fields":
    if data.format == "prompt_completion":
      return cls(data.format, (data.prompt_key, data.completion_key))
    if data.format == "chat":
      return cls(data.format, (data.messages_key,))
    return cls(data.format, (data.text_key,))

  def from_record(self, record, where: str) -> dict[str, str]:
    """The features of one record (a dict); BadRecord saying what is wrong at `where`."""
    if not isinstance(record, dict):
      raise BadRecord(f"{where}: a record must be a JSON object with {self._wanted()}, got {type(record).__name__}")
    missing = [k for k in self.keys if k not in record]
    if missing:
      keys = ", ".join(map(repr, record)) or "none"
      raise BadRecord(f"{where}: the record has no key {missing[0]!r} (its keys: {keys}); set {self.setting()} to the "
                      "key that holds it")
    if self.fmt == "chat":
      return {self.keys[0]: json.dumps(check_messages(record[self.keys[0]], where), ensure_ascii=False)}
    out = {}
    for key in self.keys:
      if not isinstance(record[key], str):
        raise BadRecord(f"{where}: {key!r} holds {type(record[key]).__name__}, not text")
      out[key] = record[key]
    return out

  def _wanted(self) -> str:
    return " and ".join(repr(k) for k in self.keys)

  def setting(self) -> str:
    """The config field(s) naming the keys read."""
    return {"text": "data.text_key", "chat": "data.messages_key"}.get(self.fmt, "data.prompt_key / data.completion_key")


class BadRecord(ValueError):
  """One record that cannot be read; the message names where it is."""


def check_messages(messages, where: str) -> list[dict]:
  """A chat record's messages: a non-empty list of {"role": str, "content": str, ...} with an assistant turn."""
  if not isinstance(messages, list) or not messages:
    raise BadRecord(f"{where}: messages must be a non-empty list of {{\"role\", \"content\"}} objects, got "
                    f"{type(messages).__name__}")
  for i, message in enumerate(messages):
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
      raise BadRecord(f"{where}: message {i} must be an object with a string \"role\" and \"content\"")
    if not isinstance(message.get("content"), str):
      raise BadRecord(f"{where}: message {i} ({message['role']}) has no string \"content\"")
  if not any(m["role"] == "assistant" for m in messages):
    raise BadRecord(f"{where}: the conversation has no assistant message, so nothing in it would be trained")
  return messages


# --- finding the files --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Input:
  """One unit of the corpus: a file, or a `datasets` directory (its .arrow files)."""
  kind: str  # jsonl | json | parquet | txt | arrow
  path: pathlib.Path
  parts: tuple[pathlib.Path, ...]  # the files read: (path,) for a file, the .arrow files of a datasets directory


def _datasets_dir(path: pathlib.Path) -> Input | None:
  if (path / "dataset_dict.json").is_file():
    splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
    raise UserError(f"data.name={str(path)!r} is a `datasets` DatasetDict with splits {', '.join(splits)}; point "
                    f"data.name at one split's directory (e.g. {path / (splits[0] if splits else 'train')}), and "
                    "data.eval_name at another to evaluate on it")
  if not (path / "state.json").is_file():
    return None
  state = json.loads((path / "state.json").read_text())
  parts = tuple(path / f["filename"] for f in state.get("_data_files", []))
  missing = [p for p in parts if not p.is_file()]
  if not parts or missing:
    raise UserError(f"{path} looks like a `datasets` directory (it has state.json) but its data files "
                    f"{', '.join(map(str, missing)) or '(none listed)'} are missing; save it again with save_to_disk")
  return Input("arrow", path, parts)


def find_inputs(spec: str) -> list[Input]:
  """The files (and `datasets` directories) `spec` names, in sorted path order; UserError when it names none."""
  paths = config.matching_paths("data.name", spec)
  inputs = []
  for path in paths:
    if path.is_dir():
      found = _datasets_dir(path)
      if found is not None:
        inputs.append(found)
        continue
      files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
      if not files and spec == str(path):
        raise UserError(f"directory {str(path)!r} holds no {', '.join(SUFFIXES)} file and is not a `datasets` "
                        "directory (save_to_disk); point data.name at your files")
      inputs.extend(Input(p.suffix[1:], p, (p,)) for p in files)
    elif path.suffix in SUFFIXES:
      inputs.append(Input(path.suffix[1:], path, (path,)))
    elif path.is_file() and len(paths) == 1:
      raise UserError(f"cannot read {str(path)!r}: its suffix {path.suffix or '(none)'!r} is not one of "
                      f"{', '.join(SUFFIXES)}; rename it, or convert it to JSON lines with a \"text\" key")
  if not inputs:
    raise UserError(f"data.name={spec!r} matches no {', '.join(SUFFIXES)} file or `datasets` directory")
  return inputs


# --- content keys ---------------------------------------------------------------------------------------------------


def _file_hash(path: pathlib.Path, cache_dir: pathlib.Path) -> str:
  """sha256 of a file's bytes, cached by its (real path, size, mtime, inode) so an unchanged file is read once."""
  st = path.stat()
  stat_key = hashlib.sha256(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}".encode()).hexdigest()
  cached = cache_dir / stat_key[:32]
  try:
    return cached.read_text().strip()
  except OSError:
    pass
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while chunk := f.read(HASH_CHUNK):
      digest.update(chunk)
  value = digest.hexdigest()
  try:
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    tmp.write_text(value)
    os.replace(tmp, cached)
  except OSError:  # a read-only data dir: hashed again next time, nothing else changes
    pass
  return value


def input_hash(item: Input, cache_dir: pathlib.Path) -> str:
  if len(item.parts) == 1 and item.parts[0] == item.path:
    return _file_hash(item.path, cache_dir)
  return hashlib.sha256("\0".join(_file_hash(p, cache_dir) for p in item.parts).encode()).hexdigest()


def data_root(data_dir: str) -> pathlib.Path:
  """The TFDS data dir the converted datasets go under: data.data_dir, else $TFDS_DATA_DIR, else TFDS's default."""
  return pathlib.Path(os.path.expanduser(data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets"))


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A resolved `data.name` path: its inputs, ordered by content, and the key of its converted dataset."""
  spec: str
  inputs: tuple[Input, ...]  # in the order of their content hashes
  hashes: tuple[str, ...]
  key: str
  root: pathlib.Path  # <data root>/meshtrain_files

  @property
  def name(self) -> str:
    return f"files_{self.key}"

  @property
  def version_dir(self) -> pathlib.Path:
    return self.root / self.name / VERSION


def resolve(spec: str, data, eval_fraction: float) -> Corpus:
  """The corpus `spec` names, with the key of its conversion under `data`'s fields and `eval_fraction`."""
  root = data_root(data.data_dir) / "meshtrain_files"
  inputs = find_inputs(spec)
  hashes = [input_hash(item, root / "hashes") for item in inputs]
  ordered = sorted(zip(hashes, inputs), key=lambda pair: (pair[0], str(pair[1].path)))
  fields = Fields.of(data)
  identity = {"format": FORMAT, "files": [h for h, _ in ordered], "kinds": [i.kind for _, i in ordered],
              "fields": [fields.fmt, *fields.keys], "eval_fraction": eval_fraction,
              "skip_bad_records": bool(data.skip_bad_records)}
  key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
  return Corpus(spec, tuple(i for _, i in ordered), tuple(h for h, _ in ordered), key, root)


# --- reading records ------------------------------------------------------------------------------------------------


def json_lines(path: pathlib.Path):
  """(where, record or BadRecord) for each non-blank line of a JSON-lines file, read one line at a time."""
  offset = 0
  with open(path, "rb") as f:
    for number, raw in enumerate(f, 1):
      where = f"{path}:{number}"
      start, offset = offset, offset + len(raw)
      if not raw.strip():
        continue
      try:
        text = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        yield where, BadRecord(f"{where}: not UTF-8 at byte offset {start + e.start} of the file "
                               f"({raw[e.start:e.start + 4]!r}); re-encode the file as UTF-8")
        continue
      try:
        yield where, json.loads(text)
      except json.JSONDecodeError as e:
        yield where, BadRecord(f"{where}: not valid JSON ({e.msg} at column {e.colno})")


def _json_file(path: pathlib.Path):
  """A .json file: a JSON array of records (streamed), or JSON lines (what `datasets`' to_json writes)."""
  with open(path, "rb") as f:
    head = f.read(4096).lstrip()
  if not head.startswith(b"["):
    yield from json_lines(path)
    return
  yield from _json_array(path)


# An error this close to the end of what has been read may only mean the record goes on past it: read more first.
_JSON_TAIL = 16
# What a byte that is not UTF-8 decodes to under surrogateescape; valid UTF-8 never decodes to these.
_NOT_UTF8 = re.compile("[\udc80-\udcff]")
_WHITESPACE = re.compile(r"[ \t\n\r]*")


class _ArrayText:
  """A .json file's text, decoded a chunk at a time, with the byte offset of each character kept for messages.

  Bytes that are not UTF-8 are decoded with surrogateescape, so the JSON structure around them still parses and only
  the record holding them is bad."""

  def __init__(self, f):
    self.f = f
    self.decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
    self.text = ""
    self.start = 0  # byte offset in the file of self.text[0]
    self.eof = False
    self.has_bad_bytes = False

  def more(self, keep_from: int) -> int:
    """Drops the text before `keep_from`, reads the next chunk; the new index of what was at `keep_from`."""
    self.start += len(self.text[:keep_from].encode("utf-8", "surrogateescape"))
    # At least as much as is kept, so the reads double: a record longer than a chunk is parsed again a few times
    # (its total cost linear in its length), not once per chunk.
    chunk = self.f.read(max(JSON_CHUNK, len(self.text) - keep_from))
    self.eof = not chunk
    self.text = self.text[keep_from:] + self.decoder.decode(chunk, final=self.eof)
    self.has_bad_bytes = _NOT_UTF8.search(self.text) is not None  # once per read, not per record
    return 0

  def offset(self, pos: int) -> int:
    return self.start + len(self.text[:pos].encode("utf-8", "surrogateescape"))

  def skip_space(self, pos: int) -> int:
    """The index of the next character that is not JSON whitespace (len(text) at the end of the file)."""
    while True:
      pos = _WHITESPACE.match(self.text, pos).end()
      if pos < len(self.text) or self.eof:
        return pos
      pos = self.more(pos)

  def not_utf8(self, where: str, begin: int, end: int) -> BadRecord | None:
    found = _NOT_UTF8.search(self.text, begin, end) if self.has_bad_bytes else None
    if found is None:
      return None
    raw = self.text[found.start():found.start() + 4].encode("utf-8", "surrogateescape")
    return BadRecord(f"{where}: not UTF-8 at byte offset {self.offset(found.start())} of the file ({raw!r}); "
                     "re-encode the file as UTF-8")


def _json_array(path: pathlib.Path):
  """(where, record or BadRecord) for each element of a top-level JSON array, parsed one at a time from text read
  JSON_CHUNK bytes at a time. A record that is not JSON ends the file (where the next record starts cannot be told),
  and a record holding bytes that are not UTF-8 is bad alone."""
  decoder = json.JSONDecoder()
  unreadable = "; the records after it in the array are not read"
  with open(path, "rb") as f:
    text = _ArrayText(f)
    pos = text.skip_space(text.more(0))
    if text.text[pos:pos + 1] != "[":  # what the caller's bytes.lstrip() skips is more than JSON's whitespace
      yield f"{path}", BadRecord(f"{path}: not valid JSON (expecting '[' at byte offset {text.offset(pos)})")
      return
    pos, index = pos + 1, 0
    while True:
      where = f"{path}[{index}]"
      pos = text.skip_space(pos)
      if pos == len(text.text):
        yield where, BadRecord(f"{where}: not valid JSON (the file ends inside the array, at byte offset "
                               f"{text.offset(pos)}: is it cut short?)")
        return
      if text.text[pos] == "]":
        break
      if index:
        if text.text[pos] != ",":
          yield where, (text.not_utf8(where, pos, pos + 1) or BadRecord(
              f"{where}: not valid JSON (expecting ',' or ']' after record {index - 1} at byte offset "
              f"{text.offset(pos)}){unreadable}"))
          return
        pos = text.skip_space(pos + 1)
      while True:
        try:
          record, end = decoder.raw_decode(text.text, pos)
        except json.JSONDecodeError as e:
          # A record cut by the end of what was read fails near that end (or, inside a string, as unterminated):
          # read more and parse it again from its start. Anywhere else the record is not JSON.
          if not text.eof and (e.pos + _JSON_TAIL >= len(text.text) or e.msg.startswith("Unterminated string")):
            pos = text.more(pos)
            continue
          yield where, (text.not_utf8(where, pos, e.pos + 1) or BadRecord(
              f"{where}: not valid JSON ({e.msg.removesuffix(' at')} at byte offset {text.offset(e.pos)})"
              f"{unreadable}"))
          return
        if not text.eof and end + _JSON_TAIL > len(text.text):  # a number ("1" of "1e+30") may go on past the read
          pos = text.more(pos)
          continue
        break
      yield where, text.not_utf8(where, pos, end) or record
      pos, index = end, index + 1
    end = text.skip_space(pos + 1)
    if end < len(text.text):
      yield f"{path}", BadRecord(f"{path}: not valid JSON (more after the array's closing ']', at byte offset "
                                 f"{text.offset(end)})")


def _txt_file(path: pathlib.Path, key: str):
  raw = path.read_bytes()
  try:
    yield f"{path}", {key: raw.decode("utf-8")}
  except UnicodeDecodeError as e:
    yield f"{path}", BadRecord(f"{path}: not UTF-8 at byte offset {e.start} ({raw[e.start:e.start + 4]!r}); "
                               "re-encode the file as UTF-8")


def _check_columns(where: str, names: list[str], fields: Fields) -> None:
  missing = [k for k in fields.keys if k not in names]
  if missing:
    raise UserError(f"{where} has no column {missing[0]!r} (its columns: {', '.join(map(repr, names))}); set "
                    f"{fields.setting()} to the column that holds it")


def table_rows(item: Input, fields: Fields):
  """(where, record) for each row of a .parquet file or a `datasets` directory's .arrow files, a batch at a time."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  row = 0
  if item.kind == "parquet":
    try:
      parquet = pq.ParquetFile(item.path)
    except (pa.ArrowException, OSError) as e:
      raise UserError(f"{item.path}: not a readable parquet file ({e})") from e
    _check_columns(str(item.path), parquet.schema_arrow.names, fields)
    batches = parquet.iter_batches(batch_size=PARQUET_BATCH, columns=list(fields.keys))
  else:
    def arrow_batches():
      for part in item.parts:
        with pa.memory_map(str(part)) as source:
          reader = pa.ipc.open_stream(source)
          _check_columns(str(item.path), reader.schema.names, fields)
          yield from reader
    batches = arrow_batches()
  for batch in batches:
    columns = {k: batch.column(k).to_pylist() for k in fields.keys}
    for i in range(batch.num_rows):
      yield f"{item.path} row {row}", {k: columns[k][i] for k in fields.keys}
      row += 1


def records(item: Input, fields: Fields):
  """(where, record dict or BadRecord) for every record of one input."""
  if item.kind == "jsonl":
    return json_lines(item.path)
  if item.kind == "json":
    return _json_file(item.path)
  if item.kind == "txt":
    if fields.fmt != "text":
      raise UserError(f"{item.path}: a .txt file is one plain-text document, which data.format={fields.fmt} cannot "
                      "use; give .jsonl, .json or .parquet records")
    return _txt_file(item.path, fields.keys[0])
  return table_rows(item, fields)


# --- converting -----------------------------------------------------------------------------------------------------


def in_eval(serialized: bytes, eval_fraction: float) -> bool:
  """Whether a document is held out: a stable hash of its content below `eval_fraction` (so duplicates of a
  document all land in the same split)."""
  bucket = int.from_bytes(hashlib.blake2b(serialized, digest_size=8).digest(), "big")
  return bucket < eval_fraction * 2 ** 64


def _convert(corpus: Corpus, fields: Fields, eval_fraction: float, skip_bad: bool, out: pathlib.Path) -> dict:
  """Writes the corpus's records as array_record shards with TFDS metadata into `out`; returns the manifest."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top

  features = tfds.features.FeaturesDict({k: tfds.features.Text() for k in fields.keys})
  splits = ("train", "validation")
  writers = {s: array_record_module.ArrayRecordWriter(
      str(out / f"{corpus.name}-{s}.array_record-00000-of-00001"), "group_size:1") for s in splits}
  counts, skipped, first_bad = dict.fromkeys(splits, 0), 0, None
  total = sum(p.stat().st_size for item in corpus.inputs for p in item.parts)
  with tqdm.tqdm(total=total, unit="B", unit_scale=True, desc=f"converting {corpus.spec}", mininterval=2,
                 disable=total < 64 << 20) as bar:
    try:
      for item in corpus.inputs:
        for where, record in records(item, fields):
          try:
            if isinstance(record, BadRecord):
              raise record
            serialized = features.serialize_example(fields.from_record(record, where))
          except BadRecord as e:
            if not skip_bad:
              raise UserError(f"{e}{SKIP_HINT}") from None
            skipped += 1
            first_bad = first_bad or str(e)
            continue
          split = "validation" if in_eval(serialized, eval_fraction) else "train"
          writers[split].write(serialized)
          counts[split] += 1
        bar.update(sum(p.stat().st_size for p in item.parts))
    finally:
      for w in writers.values():
        w.close()
  if counts["train"] == 0:
    what = f"all {skipped} records were bad (the first: {first_bad})" if skipped else "it holds no records"
    raise UserError(f"data.name={corpus.spec!r} gives an empty training corpus: {what}" +
                    ("" if skipped or not counts["validation"] else
                     f" outside the held-out data.eval_fraction={eval_fraction}"))
  infos = [tfds.core.SplitInfo(name=s, shard_lengths=[counts[s]],
                               num_bytes=(out / f"{corpus.name}-{s}.array_record-00000-of-00001").stat().st_size)
           for s in splits]
  tfds.folder_dataset.write_metadata(
      data_dir=out, features=features, split_infos=infos, check_data=False,
      description=f"Converted by meshtrain from {corpus.spec} ({len(corpus.inputs)} inputs).")
  return {"spec": corpus.spec, "inputs": [str(i.path) for i in corpus.inputs], "hashes": list(corpus.hashes),
          "format": fields.fmt, "keys": list(fields.keys), "eval_fraction": eval_fraction,
          "documents": counts, "skipped_records": skipped, "first_skipped": first_bad}


def prepare(spec: str, data, eval_fraction: float, quiet: bool = False) -> tuple[Corpus, dict]:
  """The converted dataset of the files `spec` names (converting them first if no run has): (corpus, manifest)."""
  corpus = resolve(spec, data, eval_fraction)
  fields, skip_bad = Fields.of(data), bool(data.skip_bad_records)
  manifest = converted(corpus, lambda out: _convert(corpus, fields, eval_fraction, skip_bad, out), "documents")
  if manifest["skipped_records"] and not quiet:
    print(f"data: skipped {manifest['skipped_records']} bad records of {spec} (data.skip_bad_records=true); the "
          f"first: {manifest['first_skipped']}", flush=True)
  return corpus, manifest


def converted(corpus: Corpus, write: Callable[[pathlib.Path], dict], what: str) -> dict:
  """The manifest of `corpus`'s conversion, which `write(out)` makes (writing the dataset into `out`, returning the
  manifest with its "documents" per split) unless a run already has. One process per host converts (a lock); the
  conversion goes into a temporary directory beside the final one, renamed into place when whole: a failure or a
  kill leaves no directory a later run would take for a finished conversion."""
  manifest_path = corpus.version_dir / MANIFEST
  if not manifest_path.is_file():
    with tfds_access.file_lock(corpus.root / f".{corpus.name}.lock"):
      if not manifest_path.is_file():  # another process may have converted it while we waited
        _convert_into_place(corpus, write, what)
  return json.loads(manifest_path.read_text())


def _clear_dead_conversions(parent: pathlib.Path) -> None:
  """Removes the temporary directories of this host's conversions whose process is gone (killed with -9: nothing
  ran its cleanup). Called under the conversion's lock; another host's are left to it."""
  for tmp in parent.glob(f".{VERSION}.tmp-{socket.gethostname()}-*"):
    if not host.process_alive(tmp.name.removeprefix(f".{VERSION}.tmp-{socket.gethostname()}-").split("-")[0]):
      shutil.rmtree(tmp, ignore_errors=True)


def _convert_into_place(corpus: Corpus, write: Callable[[pathlib.Path], dict], what: str) -> None:
  corpus.version_dir.parent.mkdir(parents=True, exist_ok=True)
  _clear_dead_conversions(corpus.version_dir.parent)
  tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{VERSION}.tmp-{socket.gethostname()}-{os.getpid()}-",
                                      dir=corpus.version_dir.parent))
  try:
    manifest = write(tmp)
    # The manifest last: its presence is what says the conversion is whole.
    with io.open(tmp / MANIFEST, "w", encoding="utf-8") as f:
      json.dump(manifest, f, indent=1)
    try:
      os.rename(tmp, corpus.version_dir)
    except OSError:
      if not (corpus.version_dir / MANIFEST).is_file():  # not another host's finished copy: a real failure
        raise
    docs = manifest["documents"]
    print(f"data: converted {corpus.spec} ({len(corpus.inputs)} inputs) into {corpus.version_dir}: "
          f"{docs['train']} training and {docs['validation']} held-out {what}", flush=True)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
    if not corpus.version_dir.exists():
      with contextlib.suppress(OSError):  # not empty: another process's conversion is under way there
        corpus.version_dir.parent.rmdir()


def skipped_records(cfg) -> int:
  """Records the conversion of cfg's files skipped (data.skip_bad_records=true), over data.name or the mixture's
  paths and data.eval_name; 0 where no files are read."""
  data = cfg.data
  names = [n for n, _ in config.parse_mixture(data.mixture)] if data.mixture else [data.name]
  names += [data.eval_name] if data.eval_name else []
  return sum(prepare(n, data, data.eval_fraction, quiet=True)[1]["skipped_records"] for n in names
             if config.is_path(n))


def open_split(spec: str, split: str, data, eval_fraction: float):
  """The TFDS data source of `split` ("train", "validation", or a slice of one) of the files `spec` names."""
  corpus, manifest = prepare(spec, data, eval_fraction)
  base = split.split("[")[0]
  if base in manifest["documents"] and not manifest["documents"][base]:
    raise UserError(f"data.eval_fraction={eval_fraction} holds out none of the {manifest['documents']['train']} "
                    f"documents of {spec}, so it has no {base} split to evaluate on; raise data.eval_fraction, give "
                    "data.eval_name=PATH of files to evaluate on, or set eval_every=0")
  return tfds_access.open_tfds(corpus.name, split, str(corpus.root))
