"""Tokenizer files between a Hugging Face model directory and a meshtrain workdir: which files travel, the record a
converted checkpoint keeps of them, and a run's tokenizer written as the files transformers' AutoTokenizer reads
(meshtrain's byte tokenizer as an equivalent tokenizer.json, a SentencePiece model with its tokenizer_config.json).
The chat template travels both ways (chat_template.jinja, or tokenizer_config.json's chat_template).

meshtrain.data.tokenization (which imports JAX) is imported inside the functions that use it: `python -m
meshtrain.convert` refuses a bad argument before loading it.
"""
import json
import pathlib
import shutil

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from meshtrain.data import tokenization as byte, tokenization as tokenizer_lib
from meshtrain.errors import UserError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "chat_template.jinja")


def tokenizer_files(hf_dir: pathlib.Path) -> list[pathlib.Path]:
  """The tokenizer files `hf_dir` holds, of TOKENIZER_FILES: what from-hf copies into WORKDIR/tokenizer/."""
  return [hf_dir / n for n in TOKENIZER_FILES if (hf_dir / n).is_file()]


def tokenizer_record(files: list[pathlib.Path], vocab_size: int, hf_dir: pathlib.Path) -> dict:
  """meta["tokenizer"] of the model's tokenizer (meshtrain.data.tokenization's describe(): kind, sha256 of its
  file, vocabulary size); the byte tokenizer when the directory has no tokenizer file."""
  names = {f.name: f for f in files}
  main = names.get("tokenizer.json") or names.get("tokenizer.model")
  if main is None:
    if vocab_size < tokenizer_lib.VOCAB_SIZE:
      raise UserError(f"{str(hf_dir)!r} has no tokenizer file (tokenizer.json or tokenizer.model), and vocab_size "
                      f"{vocab_size} is too small for meshtrain's byte tokenizer ({tokenizer_lib.VOCAB_SIZE} ids); "
                      "add the model's tokenizer files")
    return tokenizer_lib.ByteTokenizer().describe()
  tok = tokenizer_lib.load(str(main))
  if tok.vocab_size > vocab_size:
    raise UserError(f"{str(main)!r} has {tok.vocab_size} token ids but config.json's vocab_size is {vocab_size}; "
                    "the tokenizer does not belong to these weights")
  return tok.describe()


def byte_tokenizer_json() -> str:
  """tokenizer.json equivalent to meshtrain's byte tokenizer: id b is byte b (0..255), then pad, eos, bos.

  A byte-level BPE without merges: the ByteLevel pre-tokenizer maps each byte to one printable character (GPT-2's
  table), the vocabulary maps that character back to the byte's value, and the ByteLevel decoder turns the
  characters back into bytes (invalid UTF-8 -> U+FFFD, as meshtrain's decode)."""
  alphabet = byte.byte_level_alphabet()
  tok = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = decoders.ByteLevel()
  # The specials as Hugging Face names them (pad 256, eos 257, bos 258), added in id order: each gets the next id.
  names = byte.BYTE_SPECIAL_TOKENS
  specials = [(byte.PAD_ID, names["pad_token"]), (byte.EOS_ID, names["eos_token"]), (byte.BOS_ID, names["bos_token"])]
  for expected_id, text in sorted(specials):
    tok.add_special_tokens([AddedToken(text, special=True, normalized=False)])
    assert tok.token_to_id(text) == expected_id, (text, tok.token_to_id(text))
  return tok.to_str(pretty=True)


def run_tokenizer(workdir: pathlib.Path, record: dict):
  """The tokenizer the run in `workdir` used (WORKDIR/tokenizer/, bytes if absent), checked against the one its
  checkpoint names (meta["tokenizer"])."""
  return tokenizer_lib.from_workdir(workdir, record)


def write_tokenizer(directory: pathlib.Path, tok, workdir: pathlib.Path, seq_len: int) -> dict:
  """`tok` (the run's, see run_tokenizer) as Hugging Face files in `directory`; returns the special ids for
  config.json."""
  if tok.kind == tokenizer_lib.BYTE:
    specials = tokenizer_lib.BYTE_SPECIAL_TOKENS
    (directory / "tokenizer.json").write_text(byte_tokenizer_json())
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **specials, "model_max_length": seq_len,
         "clean_up_tokenization_spaces": False, **byte_chat_template(workdir)}, indent=2))
    (directory / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
  else:
    tokenizer_lib.write_files(tok, directory)
    if (workdir / "tokenizer" / "tokenizer_config.json").is_file():  # the model's own (an imported model's)
      shutil.copyfile(workdir / "tokenizer" / "tokenizer_config.json", directory / "tokenizer_config.json")
    elif tok.kind == "sentencepiece":
      (directory / "tokenizer_config.json").write_text(json.dumps(sentencepiece_config(tok, seq_len), indent=2))
  return {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}


def byte_chat_template(workdir: pathlib.Path) -> dict:
  """{"chat_template": ...} for the tokenizer_config.json of a byte run whose WORKDIR/tokenizer/ holds a chat
  template (a byte run has no tokenizer files there, but may be given a chat_template.jinja); {} without one."""
  template = tokenizer_lib.chat_template(workdir / tokenizer_lib.WORKDIR_SUBDIR)
  if isinstance(template, dict):
    template = [{"name": name, "template": text} for name, text in template.items()]
  return {"chat_template": template} if template else {}


def sentencepiece_config(tok, seq_len: int) -> dict:
  """tokenizer_config.json beside a run's tokenizer.model, so that AutoTokenizer encodes as meshtrain does.

  - tokenizer_class PreTrainedTokenizerFast (transformers 5's TokenizersBackend): with no tokenizer.json, it builds
    the tokenizer from the model's own settings (BPE or unigram, normalization, dummy prefix, whitespace, byte
    fallback). LlamaTokenizer assumes Llama 2's instead (BPE, always a dummy prefix, yet none when the text starts
    with a space, where SentencePiece adds one), so even a Llama-2-style model encoded differently.
  - legacy: that build's SentencePiece-exact dummy prefix (its default, stated in case it changes).
  - No BOS or EOS added, and split_special_tokens: meshtrain's encode adds none (documents are packed with EOS
    between them) and encodes text that spells "</s>" as text.
  - The specials by their pieces, the ids meshtrain used; pad is EOS when the model has no pad piece."""
  piece = lambda i: None if i is None else tok.piece(i)
  return {"tokenizer_class": "PreTrainedTokenizerFast", "legacy": True, "add_bos_token": False,
          "add_eos_token": False, "split_special_tokens": True, "bos_token": piece(tok.bos_id),
          "eos_token": piece(tok.eos_id), "pad_token": piece(tok.pad_id), "unk_token": piece(tok.unk_id),
          "model_max_length": seq_len, "clean_up_tokenization_spaces": False}
