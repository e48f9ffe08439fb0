"""Tokenizers: bytes (the default), a Hugging Face `tokenizer.json`, or a SentencePiece `.model`.

  tok = load("byte" | "path/to/tokenizer.json" | "path/to/x.model" | "dir/holding/one")
  tok.encode(text) -> int32 ids (no specials added), tok.decode(ids) -> text (specials skipped)
  tok.token_bytes() -> int32[vocab_size]: UTF-8 bytes of each id's text (0 for specials), for bits per byte
  tok.encode_with_specials(text) -> int32 ids, special-token strings as their ids (a rendered chat template)

The byte tokenizer needs no file and nothing to download, and every string round-trips exactly: ids 0..255 are
the UTF-8 bytes, three specials above them (the module-level constants and functions below are it).

A run keeps its tokenizer in WORKDIR/tokenizer/ (`save_to_workdir`, `from_workdir`) under the usual file names
(`tokenizer.json` with `tokenizer_config.json` and `special_tokens_map.json`, or `tokenizer.model`), so
generation, export and resume need no flag; nothing there means bytes. A chat template (`chat_template.jinja`, or the
`chat_template` of `tokenizer_config.json`: `chat_template(directory)`) travels with them; meshtrain/data/chat.py
renders it. `fingerprint` (sha256 of the file) names
a tokenizer in checkpoint metadata: a copy or a move of the file is the same tokenizer, another file is not.

`tokenizers` and `sentencepiece` are imported only when such a file is loaded.
"""
import functools
import hashlib
import json
import os
import pathlib
import re
import shutil

import numpy as np

from meshtrain.errors import UserError

PAD_ID = 256     # input id at padded positions (their targets are step.IGNORE_ID)
EOS_ID = 257     # ends every document in the packed stream
BOS_ID = 258     # reserved for callers that want an explicit start token (packing does not add it)
VOCAB_SIZE = 259  # the smallest model.vocab_size that holds every id above
NUM_SPECIAL = VOCAB_SIZE - 256
# The byte tokenizer's specials by the names Hugging Face gives them (the tokenizer.json to-hf writes, chat templates).
BYTE_SPECIAL_TOKENS = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>"}

BYTE = "byte"
WORKDIR_SUBDIR = "tokenizer"
HF_FILE = "tokenizer.json"
SP_FILE = "tokenizer.model"
CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # wins over tokenizer_config.json's chat_template, as in transformers
# The specials a trained BPE gets (ids 0, 1, 2), named as GPT-2/Llama-3 name theirs so other tools recognise them.
BPE_SPECIALS = ("<|pad|>", "<|endoftext|>", "<|begin_of_text|>")
# Names under which Hugging Face tokenizers commonly carry their specials, tried when no tokenizer_config.json
# says which is which (a bare tokenizer.json does not).
_PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|finetune_right_pad_id|>")
_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]", "<|im_end|>")
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]", "<|startoftext|>")


def encode(text: str | bytes) -> np.ndarray:
  """UTF-8 bytes of `text` as uint16 ids (uint16 because specials exceed 255); bytes pass through as given."""
  if isinstance(text, str):
    # "surrogatepass" so that strings read with errors="surrogateescape" still encode instead of raising.
    text = text.encode("utf-8", errors="surrogatepass")
  return np.frombuffer(bytes(text), dtype=np.uint8).astype(np.uint16)


def num_tokens(text: str | bytes) -> int:
  """len(encode(text)) without building the array."""
  if isinstance(text, str):
    return len(text.encode("utf-8", errors="surrogatepass"))
  return len(text)


def decode(ids) -> str:
  """Text of the byte ids in `ids`; specials (and anything >= 256) are skipped, invalid UTF-8 becomes U+FFFD."""
  ids = np.asarray(ids).reshape(-1)
  ids = ids[(ids >= 0) & (ids < 256)]
  return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def _sha256(path: pathlib.Path) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


class Tokenizer:
  """The interface every kind implements; see the module docstring."""

  kind: str
  vocab_size: int
  pad_id: int
  eos_id: int
  bos_id: int | None
  fingerprint: str
  path: pathlib.Path | None  # the file it was loaded from (None for bytes)

  def encode(self, text: str | bytes) -> np.ndarray:
    raise NotImplementedError

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    """encode() of each text; the library kinds encode a batch on several threads."""
    return [self.encode(t) for t in texts]

  def decode(self, ids) -> str:
    raise NotImplementedError

  def encode_with_specials(self, text: str) -> np.ndarray:
    """`text` with every special-token string in it (e.g. "<|im_start|>") as that token's id, the rest encoded as
    encode() does, nothing added: how transformers encodes a rendered chat template (apply_chat_template)."""
    raise NotImplementedError

  def special_tokens(self) -> dict[str, str]:
    """Its specials by Hugging Face's names ({"eos_token": "<|endoftext|>", ...}), as to-hf writes them into a
    tokenizer_config.json for it."""
    raise NotImplementedError

  def token_bytes(self) -> np.ndarray:
    raise NotImplementedError

  @property
  def token_dtype(self):
    """The smallest unsigned dtype holding every id: token caches on disk use it."""
    return np.uint16 if self.vocab_size <= 1 << 16 else np.uint32

  def describe(self) -> dict:
    """What checkpoint metadata records: enough to refuse another tokenizer on resume."""
    return {"kind": self.kind, "fingerprint": self.fingerprint, "vocab_size": self.vocab_size}

  def __repr__(self):
    where = f", {self.path}" if self.path else ""
    return f"<{type(self).__name__} {self.kind}{where}: {self.vocab_size} ids>"


class ByteTokenizer(Tokenizer):
  kind, vocab_size, pad_id, eos_id, bos_id, fingerprint, path = BYTE, VOCAB_SIZE, PAD_ID, EOS_ID, BOS_ID, BYTE, None

  def encode(self, text):
    return encode(text).astype(np.int32)

  def decode(self, ids):
    return decode(ids)

  def encode_with_specials(self, text):
    ids = {BYTE_SPECIAL_TOKENS[k]: i for k, i in (("pad_token", PAD_ID), ("eos_token", EOS_ID), ("bos_token", BOS_ID))}
    return _split_at_specials(text, ids, self.encode)

  def special_tokens(self):
    return dict(BYTE_SPECIAL_TOKENS)

  def token_bytes(self):
    table = np.zeros(VOCAB_SIZE, np.int32)
    table[:256] = 1
    return table


def _split_at_specials(text: str, specials: dict[str, int], encode) -> np.ndarray:
  """`text` cut at the strings of `specials` (the longest first where several match), each one its id, the text
  between them encoded by `encode`."""
  if not specials:
    return np.asarray(encode(text), np.int32)
  pattern = "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))
  out = []
  for i, piece in enumerate(re.split(f"({pattern})", text)):
    if i % 2:
      out.append(np.asarray([specials[piece]], np.int32))
    elif piece:
      out.append(np.asarray(encode(piece), np.int32))
  return np.concatenate(out) if out else np.zeros(0, np.int32)


@functools.lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[int, str]:
  """GPT-2's byte-level BPE alphabet (the table tokenizers' ByteLevel pre-tokenizer applies): the printable
  character that stands for each byte."""
  printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
  chars, extra = {}, 0
  for b in range(256):
    if b in printable:
      chars[b] = chr(b)
    else:
      chars[b] = chr(256 + extra)
      extra += 1
  return chars


@functools.lru_cache(maxsize=1)
def _byte_level_decoding() -> dict[str, int]:
  """The byte-level alphabet inverted: character -> the byte it stands for."""
  return {c: b for b, c in byte_level_alphabet().items()}


def _uses(component, kind: str) -> bool:
  """Whether a tokenizer.json component (a dict, or a Sequence of them) is or contains `kind`."""
  if not isinstance(component, dict):
    return False
  if component.get("type") == kind:
    return True
  return any(_uses(c, kind) for key in ("decoders", "pretokenizers", "normalizers") for c in component.get(key) or [])


class HfTokenizer(Tokenizer):
  """A Hugging Face `tokenizers` tokenizer.json (GPT-2/Llama-3 style byte-level BPE, or SentencePiece-converted)."""

  kind = "hf"

  def __init__(self, path: pathlib.Path):
    import tokenizers  # the GPU machine's package set lacks it: only a tokenizer.json run imports it

    self.path = path
    try:
      self._spec = json.loads(path.read_text(encoding="utf-8"))
      self._tok = tokenizers.Tokenizer.from_str(json.dumps(self._spec))
    except Exception as e:  # pylint: disable=broad-except  # OSError, bad JSON, and tokenizers' bare Exception
      raise UserError(f"data.tokenizer={str(path)!r} is not a readable Hugging Face tokenizer.json "
                      f"({' '.join(str(e).split())[:160]}); pass a tokenizer.json, a SentencePiece .model, "
                      "a directory holding one, or byte") from e
    # Text is data: a document containing "<|endoftext|>" must not turn into the special id.
    self._tok.encode_special_tokens = True
    vocab = self._tok.get_vocab(with_added_tokens=True)
    self.vocab_size = max(vocab.values()) + 1
    self._id_to_token = {i: t for t, i in vocab.items()}
    self._specials = {a["content"]: a["id"] for a in self._spec.get("added_tokens", []) if a.get("special")}
    named = self._configured_specials(path.parent)
    self.eos_id = self._special(named.get("eos_token"), _EOS_NAMES)
    if self.eos_id is None:
      raise UserError(f"tokenizer {path} has no end-of-text token (none of {', '.join(_EOS_NAMES)}, and no "
                      "eos_token in a tokenizer_config.json beside it); packing separates documents with one: add "
                      "eos_token to its tokenizer_config.json")
    self.bos_id = self._special(named.get("bos_token"), _BOS_NAMES)
    pad = self._special(named.get("pad_token"), _PAD_NAMES)
    # Padded inputs are never trained on (their targets are ignored), so any real id serves; EOS is the usual one.
    self.pad_id = self.eos_id if pad is None else pad
    self.fingerprint = _sha256(path)
    self._chat_tok = None  # encode_with_specials' copy, made on first use

  def _configured_specials(self, directory: pathlib.Path) -> dict[str, str]:
    """pad/eos/bos token strings from tokenizer_config.json / special_tokens_map.json beside the file."""
    named = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
      try:
        config = json.loads((directory / name).read_text(encoding="utf-8"))
      except (OSError, ValueError):
        continue
      for key in ("pad_token", "eos_token", "bos_token"):
        value = config.get(key)
        if isinstance(value, dict):  # {"content": ..., "lstrip": ...} form
          value = value.get("content")
        if isinstance(value, str):
          named.setdefault(key, value)
    return named

  def _special(self, configured: str | None, candidates) -> int | None:
    vocab = self._tok.get_vocab(with_added_tokens=True)
    for name in ([configured] if configured else []) + list(candidates):
      if name in vocab:
        return vocab[name]
    return None

  def encode(self, text):
    if isinstance(text, bytes):
      text = text.decode("utf-8", errors="replace")
    return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, np.int32)

  def encode_batch(self, texts):
    texts = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
    return [np.asarray(e.ids, np.int32) for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

  def decode(self, ids):
    ids = [int(i) for i in np.asarray(ids).reshape(-1) if 0 <= i < self.vocab_size]
    return self._tok.decode(ids, skip_special_tokens=True)

  def encode_with_specials(self, text):
    if self._chat_tok is None:
      import tokenizers  # likewise
      # A second copy of the tokenizer that matches its special tokens in the text (tokenizers' own matching of
      # the added tokens, as transformers encodes); the first keeps encoding them as text.
      self._chat_tok = tokenizers.Tokenizer.from_str(json.dumps(self._spec))
      self._chat_tok.encode_special_tokens = False
    return np.asarray(self._chat_tok.encode(text, add_special_tokens=False).ids, np.int32)

  def special_tokens(self):
    return hf_special_tokens(self)

  def token_bytes(self):
    table = np.zeros(self.vocab_size, np.int32)
    byte_level = _uses(self._spec.get("decoder"), "ByteLevel") or _uses(self._spec.get("pre_tokenizer"), "ByteLevel")
    byte_fallback = bool((self._spec.get("model") or {}).get("byte_fallback"))
    decoding = _byte_level_decoding()
    specials = set(self._specials.values())
    for i, token in self._id_to_token.items():
      if i in specials:
        continue
      if byte_level:
        # Each alphabet character is one byte; anything else (an added normal token) is its own UTF-8 text.
        table[i] = sum(1 if c in decoding else len(c.encode("utf-8")) for c in token)
      elif byte_fallback and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
        table[i] = 1
      else:
        # SentencePiece-style pieces mark a space with U+2581; WordPiece marks a continuation with ##.
        table[i] = len(token.removeprefix("##").replace("\u2581", " ").encode("utf-8"))
    return table


class SentencePieceTokenizer(Tokenizer):
  kind = "sentencepiece"

  def __init__(self, path: pathlib.Path):
    import sentencepiece  # likewise: only a SentencePiece run imports it

    self.path = path
    try:
      self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as e:
      raise UserError(f"data.tokenizer={str(path)!r} is not a readable SentencePiece model "
                      f"({' '.join(str(e).split())[:160]}); pass a SentencePiece .model, a tokenizer.json, a "
                      "directory holding one, or byte") from e
    self.vocab_size = self._sp.get_piece_size()
    self.eos_id = self._sp.eos_id()
    if self.eos_id < 0:
      raise UserError(f"SentencePiece model {path} has no end-of-sentence piece (eos_id=-1); packing separates "
                      "documents with one: train it with eos_id set")
    self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
    self.pad_id = self._sp.pad_id() if self._sp.pad_id() >= 0 else self.eos_id
    self.unk_id = self._sp.unk_id()  # every SentencePiece model has one
    self.fingerprint = _sha256(path)

  def piece(self, i: int) -> str:
    """The piece (token string) of id `i`, e.g. "</s>"."""
    return self._sp.id_to_piece(i)

  def encode(self, text):
    if isinstance(text, bytes):
      text = text.decode("utf-8", errors="replace")
    return np.asarray(self._sp.encode(text, out_type=int), np.int32)

  def encode_batch(self, texts):
    texts = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts]
    return [np.asarray(ids, np.int32) for ids in self._sp.encode(texts, out_type=int, num_threads=os.cpu_count())]

  def decode(self, ids):
    ids = [int(i) for i in np.asarray(ids).reshape(-1) if 0 <= i < self.vocab_size]
    return self._sp.decode(ids)

  def encode_with_specials(self, text):
    # The control pieces and <unk> are the special tokens transformers gives a tokenizer built from the model
    # (PreTrainedTokenizerFast); it encodes each stretch of text between them as SentencePiece encodes it alone.
    specials = {self._sp.id_to_piece(i): i for i in range(self.vocab_size)
                if self._sp.is_control(i) or self._sp.is_unknown(i)}
    return _split_at_specials(text, specials, self.encode)

  def special_tokens(self):
    named = {"bos_token": self.bos_id, "eos_token": self.eos_id, "pad_token": self.pad_id, "unk_token": self.unk_id}
    return {k: self.piece(i) for k, i in named.items() if i is not None}

  def token_bytes(self):
    table = np.zeros(self.vocab_size, np.int32)
    for i in range(self.vocab_size):
      if self._sp.is_control(i) or self._sp.is_unknown(i) or self._sp.is_unused(i):
        continue
      if self._sp.is_byte(i):
        table[i] = 1
      else:
        table[i] = len(self._sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
    return table


# --- loading ------------------------------------------------------------------------------------------------


def _load_file(path: pathlib.Path) -> Tokenizer:
  if path.suffix == ".json":
    return HfTokenizer(path)
  with open(path, "rb") as f:
    head = f.read(1)
  # A tokenizer.json starts with "{"; a SentencePiece model is a protobuf, whatever its name.
  return HfTokenizer(path) if head == b"{" else SentencePieceTokenizer(path)


@functools.lru_cache(maxsize=8)
def _load_cached(resolved: str, mtime_ns: int) -> Tokenizer:
  del mtime_ns  # part of the cache key only: a rewritten file is loaded again
  return _load_file(pathlib.Path(resolved))


def load(spec: str | os.PathLike) -> Tokenizer:
  """The tokenizer `spec` names: "byte", a tokenizer.json, a SentencePiece .model, or a directory holding one."""
  spec = os.fspath(spec).strip() if spec is not None else ""
  if spec in ("", BYTE):
    return ByteTokenizer()
  if spec.startswith("bpe:"):
    raise UserError(f"tokenizer {spec!r} is trained from a config's dataset: load it with "
                    "meshtrain.data.tokenizer_for_config(cfg), or pass the trained tokenizer's path")
  path = pathlib.Path(spec).expanduser()
  if path.is_dir():
    for name in (HF_FILE, SP_FILE):
      if (path / name).is_file():
        path = path / name
        break
    else:
      models = sorted(path.glob("*.model"))
      if len(models) != 1:
        raise UserError(f"tokenizer directory {spec!r} holds no {HF_FILE} or {SP_FILE} (nor exactly one *.model); "
                        "pass the tokenizer file itself, or byte")
      path = models[0]
  if not path.is_file():
    raise UserError(f"tokenizer {spec!r} does not exist; pass byte, a tokenizer.json, a SentencePiece .model, a "
                    "directory holding one, or bpe:N (trained on the dataset on first use)")
  try:
    return _load_cached(str(path.resolve()), path.stat().st_mtime_ns)
  except OSError as e:
    raise UserError(f"cannot read tokenizer {spec!r}: {e.strerror or e}") from e


def from_workdir(workdir: str | os.PathLike, record: dict | None = None) -> Tokenizer:
  """The tokenizer the run in `workdir` uses (WORKDIR/tokenizer/), bytes if there is none. With `record` (a
  checkpoint's meta["tokenizer"], describe()'s dict) it must be the one the checkpoint was trained with, by its
  file's fingerprint: another tokenizer would turn the same ids into other text. UserError otherwise."""
  directory = pathlib.Path(workdir) / WORKDIR_SUBDIR
  if not directory.is_dir() or not any((directory / n).is_file() for n in (HF_FILE, SP_FILE)):
    tok = ByteTokenizer()
  else:
    tok = load(directory)
  if record and record.get("fingerprint", tok.fingerprint) != tok.fingerprint:
    raise UserError(f"the checkpoint was trained with the {record.get('kind')} tokenizer "
                    f"{record['fingerprint'][:12]}..., but {str(directory)!r} holds {tok.kind} "
                    f"{tok.fingerprint[:12]}...; restore the run's own tokenizer files there")
  return tok


def hf_special_tokens(tok: HfTokenizer) -> dict[str, str]:
  """eos, pad (and bos) of a tokenizer.json by their token strings, as its generated side files name them."""
  name = lambda i: None if i is None else tok._id_to_token[i]  # pylint: disable=protected-access
  specials = {"eos_token": name(tok.eos_id), "pad_token": name(tok.pad_id)}
  if tok.bos_id is not None:
    specials["bos_token"] = name(tok.bos_id)
  return specials


def _hf_side_files(tok: HfTokenizer) -> dict[str, str]:
  """tokenizer_config.json and special_tokens_map.json contents, so transformers' AutoTokenizer loads the dir."""
  specials = hf_special_tokens(tok)
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 30, "clean_up_tokenization_spaces":
            False, **specials}
  return {"tokenizer_config.json": json.dumps(config, indent=2),
          "special_tokens_map.json": json.dumps(specials, indent=2)}


def chat_template(directory: str | os.PathLike) -> str | dict[str, str] | None:
  """The chat template(s) of the tokenizer files in `directory`, as transformers' AutoTokenizer reads them:
  chat_template.jinja if there is one, else tokenizer_config.json's chat_template (a string, or a list of
  {"name", "template"}, returned as {name: template}); None if neither has one."""
  directory = pathlib.Path(directory)
  try:
    return (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
  except FileNotFoundError:
    pass
  except (OSError, UnicodeDecodeError) as e:
    raise UserError(f"cannot read the chat template {str(directory / CHAT_TEMPLATE_FILE)!r}: {e}") from e
  try:
    config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    raise UserError(f"cannot read {str(directory / CONFIG_FILE)!r}: {e}") from e
  template = config.get("chat_template") if isinstance(config, dict) else None
  if isinstance(template, list):
    try:
      return {t["name"]: t["template"] for t in template}
    except (TypeError, KeyError) as e:
      raise UserError(f"{str(directory / CONFIG_FILE)!r}: chat_template is a list but not of "
                      '{"name": ..., "template": ...} entries') from e
  return template or None


def write_files(tok: Tokenizer, directory: pathlib.Path) -> None:
  """Writes `tok`'s files into the existing `directory` under their usual names (nothing for bytes), with the
  chat template beside it: chat_template.jinja as it is; a single template only its tokenizer_config.json holds,
  where that file is not copied (a SentencePiece model's, a tokenizer.json under another name), as
  chat_template.jinja."""
  copied_config = False
  if tok.kind == "hf":
    shutil.copyfile(tok.path, directory / HF_FILE)
    for name, text in _hf_side_files(tok).items():
      source = tok.path.parent / name
      # The tokenizer's own side files carry more (chat template, added-token details); ours only what we know.
      if source.is_file() and tok.path.name == HF_FILE:
        shutil.copyfile(source, directory / name)
        copied_config |= name == CONFIG_FILE
      else:
        (directory / name).write_text(text)
  elif tok.kind == "sentencepiece":
    shutil.copyfile(tok.path, directory / SP_FILE)
  if tok.kind == BYTE:
    return
  if (tok.path.parent / CHAT_TEMPLATE_FILE).is_file():
    shutil.copyfile(tok.path.parent / CHAT_TEMPLATE_FILE, directory / CHAT_TEMPLATE_FILE)
  elif not copied_config:
    template = chat_template(tok.path.parent)
    if isinstance(template, str):  # several named ones travel only in their tokenizer_config.json
      (directory / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")


def save_to_workdir(tok: Tokenizer, workdir: str | os.PathLike) -> None:
  """Copies `tok`'s file(s) into WORKDIR/tokenizer/, whole or not at all (written aside, then renamed)."""
  workdir = pathlib.Path(workdir)
  target = workdir / WORKDIR_SUBDIR
  if tok.kind == BYTE:
    return  # no directory means bytes
  if target.is_dir() and from_workdir(workdir).fingerprint == tok.fingerprint:
    return
  tmp = workdir / f".{WORKDIR_SUBDIR}.tmp{os.getpid()}"
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  write_files(tok, tmp)
  if target.exists():
    # Only a run with a new tokenizer gets here (a resume with another one is refused before), e.g. a workdir
    # whose earlier run never saved a checkpoint: the old copy goes, the new one takes its place.
    old = workdir / f".{WORKDIR_SUBDIR}.old{os.getpid()}"
    os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)
  else:
    os.replace(tmp, target)


# --- training a byte-level BPE (on a config's dataset: meshtrain/data/select.py's tokenizer_for_config) -------


# The largest BPE meshtrain trains: 4x today's largest vocabularies (Gemma's 262k). The trainer allocates per id, so
# a mistyped 10^9 would abort the process inside the tokenizers library instead of being refused.
MAX_BPE_VOCAB = 1 << 20


def parse_bpe_spec(spec: str) -> int | None:
  """N for "bpe:N", None for any other spec."""
  match = re.fullmatch(r"bpe:(\d+)", spec.strip())
  if not spec.strip().startswith("bpe:"):
    return None
  if not match or not 256 + len(BPE_SPECIALS) <= int(match.group(1)) <= MAX_BPE_VOCAB:
    raise UserError(f"data.tokenizer={spec!r}: write bpe:N with {256 + len(BPE_SPECIALS)} <= N <= {MAX_BPE_VOCAB:,} "
                    "(the 256 byte tokens and the specials come first), e.g. bpe:4096")
  return int(match.group(1))


def train_bpe(texts, vocab_size: int, out_dir: pathlib.Path, length: int | None = None) -> HfTokenizer:
  """Trains a byte-level BPE of `vocab_size` ids on the iterable `texts`; writes out_dir/tokenizer.json and the
  transformers side files (written aside and renamed, so out_dir appears whole or not at all). Ids 0, 1, 2 are
  the specials pad, end-of-text, begin-of-text; the 256 bytes follow, so every string encodes."""
  import tokenizers  # likewise

  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(BPE_SPECIALS),
                                           show_progress=False,
                                           initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer, length=length)
  out_dir = pathlib.Path(out_dir)
  out_dir.parent.mkdir(parents=True, exist_ok=True)
  tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir()
  tok.save(str(tmp / HF_FILE))
  for name, text in _hf_side_files(HfTokenizer(tmp / HF_FILE)).items():
    (tmp / name).write_text(text)
  if out_dir.exists():
    shutil.rmtree(out_dir)
  os.replace(tmp, out_dir)
  return HfTokenizer(out_dir / HF_FILE)
