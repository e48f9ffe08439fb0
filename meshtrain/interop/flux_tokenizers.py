"""A Flux.1 pipeline's two prompt tokenizers, read without transformers (a test-only dependency here): CLIP's
(tokenizer/) and T5's (tokenizer_2/), giving the ids diffusers' FluxPipeline gives its text encoders
(tests/test_flux_tokenizers.py checks them against transformers, called as FluxPipeline calls it).

CLIP: the hub's FLUX.1-dev ships vocab.json and merges.txt without a tokenizer.json, so the tokenizer is assembled
here as transformers' CLIPTokenizer assembles it (the CLIPConverter's pieces: NFC, whitespace runs -> one space,
lowercase; CLIP's split regex then byte-level; BPE with '</w>' ending each word; BOS ... EOS). A tokenizer.json, where
the directory has one, is used as written but for the BOS ... EOS, which transformers always sets. The special tokens
and their matching flags come from the files transformers reads them from, in its order of precedence:
tokenizer_config.json's added_tokens_decoder when present, else special_tokens_map.json over tokenizer_config.json,
else CLIP's defaults.
T5: tokenizer.json as written (a T5TokenizerFast's), EOS '</s>' appended, padded with '<pad>' (id 0). transformers 5
rebuilds T5's normalizer and pre-tokenizer around the file's vocabulary instead; for the files transformers 5 writes
and those transformers 4's converter wrote, the ids are the same (the test compares both on its prompts).

Lengths, as FluxPipeline's `_get_clip_prompt_embeds` and `_get_t5_prompt_embeds` ask for them (padding="max_length",
truncation=True): CLIP to the tokenizer's model_max_length (77), T5 to max_sequence_length. Truncation keeps the
special tokens: CLIP's is BOS, 75 tokens, EOS; T5's is L-1 tokens then '</s>'.
"""
import json
import pathlib

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from meshtrain.errors import UserError

# CLIPTextModel's positions; the length when tokenizer_config.json names none (transformers would then pad to its
# "no limit" sentinel, which no CLIP text encoder can take).
CLIP_LENGTH = 77
# FluxPipeline.check_inputs refuses longer T5 prompts.
T5_MAX_LENGTH = 512
# transformers' VERY_LARGE_INTEGER (1e30) and its kin: a model_max_length that means "not set".
UNSET_LENGTH = 10 ** 9
CLIP_DEFAULTS = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
                 "pad_token": "<|endoftext|>"}
T5_DEFAULTS = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
# transformers' CLIPTokenizer split: the two specials whole, English contractions, letter runs, single digits, and
# runs of anything else but whitespace (which is dropped).
CLIP_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
RESAVE = ("re-save the tokenizer with transformers (its tokenizer class's from_pretrained, then save_pretrained), "
          "or copy the directory again from the model's repository")


def _read_json(path: pathlib.Path, required: bool):
  if not path.is_file():
    if required:
      raise UserError(f"{str(path)!r} is missing; {RESAVE}")
    return None
  try:
    return json.loads(path.read_text(encoding="utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise UserError(f"{str(path)!r} is not valid JSON ({e}); {RESAVE}") from e


def _directory(directory) -> pathlib.Path:
  root = pathlib.Path(directory).expanduser()
  if not root.is_dir():
    raise UserError(f"{str(root)!r} is not a directory: a tokenizer directory of a Flux.1 pipeline (tokenizer/ or "
                    "tokenizer_2/, as FluxPipeline.save_pretrained writes them) was expected")
  return root


def _added_token(value, path: pathlib.Path, special: bool | None = None) -> AddedToken:
  """A token as transformers rebuilds it from its saved form: a plain string is a special token matched on the raw
  text (AddedToken's default for specials); a dict keeps the flags it was saved with."""
  if isinstance(value, str):
    return AddedToken(value, special=True)
  if not isinstance(value, dict) or not isinstance(value.get("content"), str):
    raise UserError(f"{str(path)!r}: {value!r} is not a token (a string, or an object with a 'content' string); "
                    f"{RESAVE}")
  fields = {k: v for k, v in value.items() if k in ADDED_TOKEN_FIELDS}
  if special is not None:
    fields["special"] = special
  return AddedToken(**fields)


def _special_tokens(root: pathlib.Path, defaults: dict[str, str]) -> tuple[dict[str, AddedToken], list[AddedToken]]:
  """The named special tokens (bos, eos, unk, pad) and tokenizer_config.json's added_tokens_decoder (by id), with
  the flags transformers' from_pretrained gives them: without added_tokens_decoder, special_tokens_map.json
  overrides tokenizer_config.json; a name given neither way is the tokenizer class's default."""
  config_path, map_path = root / "tokenizer_config.json", root / "special_tokens_map.json"
  config = _read_json(config_path, required=False) or {}
  if not isinstance(config, dict):
    raise UserError(f"{str(config_path)!r} holds no JSON object; {RESAVE}")
  decoder = config.get("added_tokens_decoder")
  added = []
  named = {k: config.get(k, v) for k, v in defaults.items()}
  if decoder:
    if not isinstance(decoder, dict):
      raise UserError(f"{str(config_path)!r}: added_tokens_decoder is not an object of id -> token; {RESAVE}")
    try:
      ordered = sorted(decoder.items(), key=lambda item: int(item[0]))
    except ValueError as e:
      raise UserError(f"{str(config_path)!r}: added_tokens_decoder has a key that is not a token id ({e}); "
                      f"{RESAVE}") from e
    added = [_added_token(token, config_path) for _, token in ordered]
  else:
    special_map = _read_json(map_path, required=False) or {}
    if not isinstance(special_map, dict):
      raise UserError(f"{str(map_path)!r} holds no JSON object; {RESAVE}")
    named.update({k: special_map[k] for k in defaults if k in special_map})
  source = config_path if decoder else map_path
  return {k: _added_token(v, source, special=True) for k, v in named.items() if v is not None}, added


def _add_tokens(tok: Tokenizer, named: dict[str, AddedToken], decoder: list[AddedToken]) -> None:
  """The added tokens as transformers adds them, in one call: added_tokens_decoder's, then each named special whose
  text is not among them nor already added (tokenizer.json's). A text given twice with different flags (a
  special_tokens_map.json read without added_tokens_decoder: EOS flagged normalized, pad the same text as a plain
  string) ends with the last one's flags, as the tokenizers library keeps them: normalized false, so
  '<|ENDOFTEXT|>' in a prompt stays text, where FLUX.1-dev's files (added_tokens_decoder, normalized) make it EOS."""
  known = {t.content for t in decoder} | {t.content for t in tok.get_added_tokens_decoder().values()}
  tokens = list(decoder)
  for token in named.values():
    if token.content not in known and token not in tokens:
      tokens.append(token)
  tok.add_tokens(tokens)


def _named(named: dict[str, AddedToken], key: str, root: pathlib.Path) -> str:
  if key not in named:
    raise UserError(f"{str(root)!r}: tokenizer_config.json sets {key} to null, but FluxPipeline pads and ends every "
                    f"prompt with it; set it (or delete the entry for the default) and load again")
  return named[key].content


def _merges(path: pathlib.Path) -> list[tuple[str, str]]:
  """merges.txt as the `tokenizers` library reads it (which transformers hands it to): '#version' lines skipped,
  every other line exactly two tokens separated by one space."""
  try:
    text = path.read_text(encoding="utf-8")
  except UnicodeDecodeError as e:
    raise UserError(f"{str(path)!r} is not UTF-8 text ({e}); {RESAVE}") from e
  merges = []
  lines = text.split("\n")
  if lines and lines[-1] == "":
    lines.pop()
  for number, line in enumerate(lines, 1):
    line = line.removesuffix("\r")
    if line.startswith("#version"):
      continue
    parts = line.split(" ")
    if len(parts) != 2 or not all(parts):
      raise UserError(f"{str(path)!r} line {number} ({line[:60]!r}) is not a merge: each line after '#version' must "
                      f"be two tokens separated by one space; {RESAVE}")
    merges.append((parts[0], parts[1]))
  return merges


def _clip_bpe(root: pathlib.Path, unk: str) -> Tokenizer:
  """vocab.json and merges.txt as transformers' CLIPTokenizer (the fast one, transformers 5's only one) builds them."""
  vocab_path, merges_path = root / "vocab.json", root / "merges.txt"
  vocab = _read_json(vocab_path, required=True)
  if not (isinstance(vocab, dict) and all(isinstance(v, int) and not isinstance(v, bool) for v in vocab.values())):
    raise UserError(f"{str(vocab_path)!r} is not a JSON object of token -> id (an integer); {RESAVE}")
  if not merges_path.is_file():
    raise UserError(f"{str(merges_path)!r} is missing (CLIP's BPE needs vocab.json and merges.txt); {RESAVE}")
  try:
    bpe = models.BPE(vocab=vocab, merges=_merges(merges_path), dropout=None, continuing_subword_prefix="",
                     end_of_word_suffix="</w>", fuse_unk=False, unk_token=unk)
  except Exception as e:  # the tokenizers library raises a bare Exception (e.g. a merge's token not in the vocab)
    raise UserError(f"{str(root)!r}: vocab.json and merges.txt do not make a BPE tokenizer ({e}); {RESAVE}") from e
  tok = Tokenizer(bpe)
  tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                         normalizers.Lowercase()])
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(CLIP_SPLIT), behavior="removed", invert=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False)])
  tok.decoder = decoders.ByteLevel()
  return tok


def _from_tokenizer_json(path: pathlib.Path) -> Tokenizer:
  try:
    return Tokenizer.from_file(str(path))
  except Exception as e:  # the tokenizers library raises a bare Exception for a file it cannot parse
    raise UserError(f"{str(path)!r} is not a tokenizer.json the tokenizers library reads ({e}); {RESAVE}") from e


def _token_id(tok: Tokenizer, token: str, role: str, root: pathlib.Path) -> int:
  token_id = tok.token_to_id(token)
  if token_id is None:
    raise UserError(f"{str(root)!r}: the {role} token {token!r} is not in the tokenizer's vocabulary; {RESAVE}")
  return token_id


def _model_max_length(root: pathlib.Path) -> int:
  config = _read_json(root / "tokenizer_config.json", required=False) or {}
  length = config.get("model_max_length") if isinstance(config, dict) else None
  if length is None or (isinstance(length, (int, float)) and length >= UNSET_LENGTH):
    return CLIP_LENGTH
  if not isinstance(length, int) or isinstance(length, bool) or length < 2:
    raise UserError(f"{str(root / 'tokenizer_config.json')!r}: model_max_length {length!r} is not a length of at "
                    f"least 2 (BOS and EOS); CLIP's is {CLIP_LENGTH}")
  return length


def clip_tokenizer(directory) -> Tokenizer:
  """CLIP's tokenizer from a pipeline's tokenizer/ directory, set to FluxPipeline's length (model_max_length, 77):
  it truncates and pads to it, with its pad token (FLUX.1-dev's is '<|endoftext|>', the EOS)."""
  root = _directory(directory)
  named, decoder = _special_tokens(root, CLIP_DEFAULTS)
  if (root / "tokenizer.json").is_file():
    tok = _from_tokenizer_json(root / "tokenizer.json")
  else:
    unk = named.get("unk_token")
    tok = _clip_bpe(root, unk.content if unk else CLIP_DEFAULTS["unk_token"])
  _add_tokens(tok, named, decoder)
  bos, eos, pad = (_named(named, k, root) for k in ("bos_token", "eos_token", "pad_token"))
  # transformers' CLIPTokenizer sets this whatever a tokenizer.json holds: BOS before and EOS after each prompt, no
  # prefix space, offsets untrimmed.
  tok.post_processor = processors.RobertaProcessing((eos, _token_id(tok, eos, "EOS", root)),
                                                    (bos, _token_id(tok, bos, "BOS", root)), False, False)
  length = _model_max_length(root)
  tok.enable_truncation(max_length=length)
  tok.enable_padding(pad_id=_token_id(tok, pad, "pad", root), pad_token=pad, length=length)
  return tok


def t5_tokenizer(directory) -> Tokenizer:
  """T5's tokenizer from a pipeline's tokenizer_2/ directory (its tokenizer.json), with its pad token ('<pad>',
  id 0) and '</s>' appended to every prompt; flux_ids sets its length per call (max_sequence_length)."""
  root = _directory(directory)
  path = root / "tokenizer.json"
  if not path.is_file():
    if (root / "spiece.model").is_file():
      raise UserError(f"{str(root)!r} has spiece.model but no tokenizer.json: meshtrain reads T5's tokenizer from "
                      "the tokenizer.json a fast tokenizer writes; re-save it with transformers: "
                      f"T5TokenizerFast.from_pretrained({str(root)!r}).save_pretrained({str(root)!r})")
    raise UserError(f"{str(path)!r} is missing (T5's tokenizer, as T5TokenizerFast.save_pretrained writes it); "
                    f"{RESAVE}")
  named, decoder = _special_tokens(root, T5_DEFAULTS)
  tok = _from_tokenizer_json(path)
  _add_tokens(tok, named, decoder)
  eos, pad = _named(named, "eos_token", root), _named(named, "pad_token", root)
  # transformers' T5Tokenizer sets this whatever the file holds: every prompt ends with EOS.
  tok.post_processor = processors.TemplateProcessing(
      single=["$A", eos], pair=["$A", eos, "$B", eos], special_tokens=[(eos, _token_id(tok, eos, "EOS", root))])
  tok.no_truncation()
  tok.enable_padding(pad_id=_token_id(tok, pad, "pad", root), pad_token=pad)
  return tok


def _fixed_length_ids(tok: Tokenizer, prompts: list[str], length: int) -> np.ndarray:
  """Every prompt's ids cut and padded to `length`: the tokenizers library keeps room for the special tokens when it
  truncates, as transformers does (it truncates through the same library)."""
  padding = tok.padding or {}
  tok.enable_truncation(max_length=length)
  tok.enable_padding(pad_id=padding.get("pad_id", 0), pad_token=padding.get("pad_token", "<pad>"), length=length)
  ids = [encoding.ids for encoding in tok.encode_batch(prompts, add_special_tokens=True)]
  return np.asarray(ids, np.int32).reshape(len(prompts), length)


def flux_ids(clip_tok: Tokenizer, t5_tok: Tokenizer, prompts: list[str],
             max_sequence_length: int) -> tuple[np.ndarray, np.ndarray]:
  """The ids FluxPipeline gives its two text encoders: CLIP's int32 [N, 77] (the tokenizer's length) and T5's
  int32 [N, max_sequence_length]. The tokenizers come from clip_tokenizer and t5_tokenizer; T5's length is set
  on it here, so one tokenizer serves any max_sequence_length."""
  if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
    raise UserError(f"the prompts must be a list of strings, not {type(prompts).__name__} {prompts!r:.80}")
  if isinstance(max_sequence_length, bool) or not isinstance(max_sequence_length, (int, np.integer)) \
      or not 1 <= max_sequence_length <= T5_MAX_LENGTH:
    raise UserError(f"max_sequence_length {max_sequence_length!r}: T5's prompt length must be from 1 to "
                    f"{T5_MAX_LENGTH}, as FluxPipeline takes it")
  clip_length = (clip_tok.truncation or {}).get("max_length") or CLIP_LENGTH
  return _fixed_length_ids(clip_tok, prompts, clip_length), _fixed_length_ids(t5_tok, prompts,
                                                                              int(max_sequence_length))
