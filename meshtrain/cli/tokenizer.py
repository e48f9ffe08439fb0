"""Tokenizer tools.

  python -m meshtrain.tokenizer train --config CONFIG --vocab-size N --out DIR [--config.KEY=VALUE ...]

trains a byte-level BPE of N ids (specials <|pad|>, <|endoftext|>, <|begin_of_text|> first, then the 256 bytes)
with Hugging Face `tokenizers` on the train split of the config's TFDS dataset, and writes DIR/tokenizer.json
with tokenizer_config.json and special_tokens_map.json, so transformers' AutoTokenizer.from_pretrained(DIR) loads
it. Train with it by --config.data.tokenizer=DIR and --config.model.vocab_size=N (or more).

  python -m meshtrain.tokenizer show --config CONFIG [--text TEXT]

prints the tokenizer the config names (kind, ids, specials, fingerprint) and how it splits TEXT.
"""
import json
import pathlib
import time

from meshtrain import cli, config as config_lib
from meshtrain.errors import ArgumentParser, UserError


def train(cfg, vocab_size: int, out: str) -> dict:
  from meshtrain.data import packing, sources, tokenization as tokenizer  # TFDS: after the config is checked
  if vocab_size < 256 + len(tokenizer.BPE_SPECIALS):
    raise UserError(f"--vocab-size {vocab_size} is too small: the 256 byte tokens and {len(tokenizer.BPE_SPECIALS)} "
                    f"specials come first; pass at least {256 + len(tokenizer.BPE_SPECIALS)}, e.g. 4096")
  if vocab_size > tokenizer.MAX_BPE_VOCAB:
    raise UserError(f"--vocab-size {vocab_size:,} is more than the {tokenizer.MAX_BPE_VOCAB:,} ids meshtrain trains "
                    "(today's largest vocabularies have about 262,000); pass e.g. 4096 or 32000")
  if cfg.data.name == sources.SYNTHETIC:
    raise UserError("data.name=synthetic has no text to train a tokenizer on; use a config with a TFDS dataset "
                    "(python_stdlib is built locally)")
  out_dir = pathlib.Path(out).expanduser()
  if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
    raise UserError(f"--out {out} exists and is not an empty directory; pass a new directory (nothing is overwritten)")
  texts, info, _ = packing.train_texts(cfg)
  t0 = time.perf_counter()
  try:
    tok = tokenizer.train_bpe(texts, vocab_size, out_dir, length=len(texts))
  except OSError as e:
    raise UserError(f"cannot write the tokenizer to --out {out}: {e.strerror or e}") from e
  return {"out": str(out_dir), "vocab_size": tok.vocab_size, "documents": len(texts),
          "dataset": f"{info.full_name}/{cfg.data.train_split}", "seconds": round(time.perf_counter() - t0, 1),
          "fingerprint": tok.fingerprint}


def show(cfg, text: str) -> dict:
  from meshtrain.data import select  # likewise
  tok = select.tokenizer_for_config(cfg)
  raw = text.encode("utf-8", "surrogateescape")  # argv bytes that are not UTF-8 arrive as surrogates
  try:
    raw.decode("utf-8")
  except UnicodeDecodeError as e:
    if tok.kind != "byte":  # text tokenizers take Unicode text; bytes of no encoding have no pieces there
      raise UserError(f"--text is not valid UTF-8 (byte {raw[e.start]:#04x} at offset {e.start}); the {tok.kind} "
                      "tokenizer encodes Unicode text: pass UTF-8") from None
  ids = tok.encode(raw)
  return {"kind": tok.kind, "path": str(tok.path) if tok.path else None, "vocab_size": tok.vocab_size,
          "pad_id": tok.pad_id, "eos_id": tok.eos_id, "bos_id": tok.bos_id, "fingerprint": tok.fingerprint,
          "text": raw.decode("utf-8", "backslashreplace"), "ids": ids.tolist(),
          "pieces": [tok.decode([i]) for i in ids], "bytes_per_token": round(len(raw) / max(len(ids), 1), 2)}


@cli.command
def main(argv: list[str]) -> int:
  parser = ArgumentParser(prog="python -m meshtrain.tokenizer", description=__doc__.split("\n\n")[0])
  commands = parser.add_subparsers(dest="command", required=True)
  train_parser = commands.add_parser("train", help="train a byte-level BPE on a config's dataset")
  train_parser.add_argument("--config", required=True, help="Python config file, e.g. configs/tiny.py")
  train_parser.add_argument("--vocab-size", type=int, required=True, help="ids in the trained tokenizer")
  train_parser.add_argument("--out", required=True, help="new directory for tokenizer.json and its side files")
  show_parser = commands.add_parser("show", help="describe the config's tokenizer and encode a text")
  show_parser.add_argument("--config", required=True)
  show_parser.add_argument("--text", default="def main():\n    return 0\n")
  args, overrides = parser.parse_known_args(argv)
  cfg = config_lib.load(args.config, overrides)
  result = train(cfg, args.vocab_size, args.out) if args.command == "train" else show(cfg, args.text)
  print(json.dumps(result))
  return 0
