"""A Flux.1 pipeline's prompt tokenizers read by meshtrain/interop/flux_tokenizers.py, against transformers' called
as diffusers' FluxPipeline calls them (`_get_clip_prompt_embeds`, `_get_t5_prompt_embeds`).

The tokenizers are tiny and made here: a CLIP vocabulary (the byte-level alphabet with and without '</w>', whole
words merged from it) written in the files the hub's FLUX.1-dev has and in those transformers writes, and a
SentencePiece unigram model trained on generated sentences, saved by T5TokenizerFast as a Flux pipeline's
tokenizer_2/ holds it. Needs the `hf` extra (transformers), as tests/test_text_encoders.py does;
MESHTRAIN_SKIP_HF_TESTS=1 skips it.
"""
import io
import json
import os
import random
import shutil

import numpy as np
import pytest

try:
  import sentencepiece as spm
  import transformers
except ImportError as e:
  if os.environ.get("MESHTRAIN_SKIP_HF_TESTS") == "1":
    pytest.skip("MESHTRAIN_SKIP_HF_TESTS=1: Hugging Face tokenizer tests skipped", allow_module_level=True)
  raise ImportError(f"tests/test_flux_tokenizers.py checks against transformers ({e}); install it with "
                    "pip install -e '.[test,hf]', or set MESHTRAIN_SKIP_HF_TESTS=1 to skip these tests "
                    "knowingly") from e

from tokenizers import pre_tokenizers

from meshtrain.errors import UserError
from meshtrain.interop import flux_tokenizers

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
# Words whose byte-level pieces get merged whole (as a word's end, '</w>') and, the first few, also as a prefix
# (so "photos" is "photo" + "s</w>"): merges fire on ASCII, on two-byte letters (é, ü) and on CJK's three bytes.
CLIP_WORDS = ["the", "a", "of", "photo", "cat", "dog", "and", "red", "sitting", "café", "über", "日本", "what",
              "'s", "!!", "...", "20", "naïve", "on", "in"]
CLIP_PREFIXES = ["photo", "cat", "sit", "ca", "ü"]
T5_WORDS = ("a photo of the cat dog sitting on red blue green chair table under bright sun light night city street "
            "café über naïve 日本 tokyo painting style oil watercolor portrait landscape mountain river forest "
            "The A Photo Cat Tokyo Painting 1 2 3 4 5 6 7 8 9 0 42 2024 , . ! ? ( ) - ' \"").split()
LONG = "the photo of a red cat sitting on the chair, and a dog! " * 80  # > 77 CLIP tokens, > 512 T5 tokens
PROMPTS = [
    "",
    "A Photo of THE Cat",
    "  several   spaces\n\nand\nnewlines\tand tabs  \r\n",
    "punctuation!!! what's (this)? a-b, c.d; 'quoted' \"double\" ... #hash @at",
    "digits 0123456789, 3.14 and 2024",
    "café über naïve Ünïcödé cafe\u0301 日本 東京 🙂🚀 emoji ﬁ ① ＡＢＣ",
    f"specials inside: {EOS} and <|ENDOFTEXT|> and {BOS}x </s> <pad> <extra_id_0>",
    "the cat " * 37 + "dog",  # 75 tokens: CLIP's BOS, 75, EOS exactly
    "the cat " * 38,  # 76 tokens: one cut
    LONG,
]


def byte_level(text: str) -> str:
  """`text` in the byte-level alphabet (GPT-2's bytes -> printable characters), as CLIP's vocab.json spells it."""
  return "".join(piece for piece, _ in pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
                 .pre_tokenize_str(text))


def clip_vocab() -> tuple[dict[str, int], list[str]]:
  """vocab.json and merges.txt's lines: the alphabet, the alphabet + '</w>', each merge's result, then BOS and EOS
  last (as CLIP's 49406, 49407). Every word is merged left to right, its last piece with '</w>'."""
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
  vocab = {c: i for i, c in enumerate(alphabet + [c + "</w>" for c in alphabet])}
  merges = []

  def chain(pieces):
    left = pieces[0]
    for right in pieces[1:]:
      if f"{left} {right}" not in merges:
        merges.append(f"{left} {right}")
        vocab.setdefault(left + right, len(vocab))
      left += right

  for word in CLIP_WORDS:
    chars = list(byte_level(word))
    chain(chars[:-1] + [chars[-1] + "</w>"])
  for prefix in CLIP_PREFIXES:
    chain(list(byte_level(prefix)))
  vocab[BOS], vocab[EOS] = len(vocab), len(vocab) + 1
  return vocab, merges


def flag(content: str) -> dict:
  return {"content": content, "lstrip": False, "normalized": True, "rstrip": False, "single_word": False}


def write_clip_files(directory, config: dict, special_map: dict | None):
  directory.mkdir()
  vocab, merges = clip_vocab()
  (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
  (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  if special_map is not None:
    (directory / "special_tokens_map.json").write_text(json.dumps(special_map))
  return directory


def make_clip_dirs(root) -> dict:
  """The layouts a Flux pipeline's tokenizer/ comes in: the hub's FLUX.1-dev (no tokenizer.json; specials flagged in
  added_tokens_decoder, normalized), an older one (specials from special_tokens_map.json only), and what
  transformers 5's CLIPTokenizer.save_pretrained writes (tokenizer.json and tokenizer_config.json, no vocab.json:
  unlike transformers 4's slow class it writes a tokenizer.json)."""
  vocab, _ = clip_vocab()
  common = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS, "unk_token": EOS, "model_max_length": 77,
            "do_lower_case": True, "errors": "replace", "tokenizer_class": "CLIPTokenizer"}
  special_map = {"bos_token": flag(BOS), "eos_token": flag(EOS), "pad_token": EOS, "unk_token": flag(EOS)}
  hub = write_clip_files(root / "clip_hub", {
      **common, "add_prefix_space": False, "clean_up_tokenization_spaces": True,
      "added_tokens_decoder": {str(vocab[t]): {**flag(t), "special": True} for t in (BOS, EOS)}}, special_map)
  legacy = write_clip_files(root / "clip_legacy", common, special_map)
  saved = root / "clip_saved"
  transformers.CLIPTokenizer.from_pretrained(hub).save_pretrained(saved)
  assert (saved / "tokenizer.json").is_file() and not (saved / "vocab.json").exists()
  return {"hub": hub, "legacy": legacy, "saved": saved}


def make_t5_dirs(root) -> dict:
  """tokenizer_2/ as T5TokenizerFast.save_pretrained writes it (from a SentencePiece unigram model: pad 0, eos 1,
  unk 2, as T5's), and with the tokenizer.json transformers 4's T5 converter wrote (FLUX.1-dev's era): its normalizer
  also strips the right end and turns space runs into '▁', its pre-tokenizer splits only at '▁', which transformers 5
  ignores (it rebuilds T5's own pieces around the file's vocabulary); meshtrain reads the file as written."""
  rng = random.Random(0)
  syllables = "ka to ri mu sen lo pa vi dra que ze bo ny gh st ch ph ar el".split()  # made-up words: pieces to learn
  words = T5_WORDS + ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(150)]
  sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 14))) for _ in range(400)]
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=model, vocab_size=200,
                                 model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
                                 character_coverage=1.0, minloglevel=2)
  source = root / "t5_spiece"
  source.mkdir()
  (source / "spiece.model").write_bytes(model.getvalue())
  saved = root / "t5_saved"
  transformers.T5TokenizerFast.from_pretrained(source, model_max_length=512).save_pretrained(saved)
  old = root / "t5_v4"
  shutil.copytree(saved, old)
  data = json.loads((old / "tokenizer.json").read_text())
  assert data["normalizer"]["type"] == "Precompiled" and data["model"]["type"] == "Unigram"
  assert len(data["model"]["vocab"]) == 200 + 100  # the trained pieces, then T5's 100 sentinels
  data["normalizer"] = {"type": "Sequence", "normalizers": [
      data["normalizer"], {"type": "Strip", "strip_left": False, "strip_right": True},
      {"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": "▁"}]}
  data["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": True}
  (old / "tokenizer.json").write_text(json.dumps(data))
  (old / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<pad>",
                                                           "unk_token": "<unk>"}))
  return {"spiece": source, "saved": saved, "v4": old}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("flux_tokenizers")
  return {"clip": make_clip_dirs(root), "t5": make_t5_dirs(root)}


def clip_reference(directory, prompts):
  """FluxPipeline._get_clip_prompt_embeds's call (tokenizer_max_length = the tokenizer's model_max_length)."""
  tok = transformers.CLIPTokenizer.from_pretrained(directory)
  assert transformers.CLIPTokenizerFast is transformers.CLIPTokenizer  # transformers 5 has only the fast one
  return tok(prompts, padding="max_length", max_length=tok.model_max_length, truncation=True,
             return_overflowing_tokens=False, return_length=False, return_tensors="pt").input_ids.numpy()


def t5_reference(directory, prompts, max_sequence_length):
  """FluxPipeline._get_t5_prompt_embeds's call."""
  tok = transformers.T5TokenizerFast.from_pretrained(directory)
  return tok(prompts, padding="max_length", max_length=max_sequence_length, truncation=True, return_length=False,
             return_overflowing_tokens=False, return_tensors="pt").input_ids.numpy()


@pytest.mark.parametrize("clip_layout", ["hub", "legacy", "saved"])
def test_clip_equals_transformers(dirs, clip_layout):
  directory = dirs["clip"][clip_layout]
  clip_tok = flux_tokenizers.clip_tokenizer(directory)
  ours, _ = flux_tokenizers.flux_ids(clip_tok, flux_tokenizers.t5_tokenizer(dirs["t5"]["saved"]), PROMPTS, 16)
  want = clip_reference(directory, PROMPTS)
  assert ours.dtype == np.int32 and ours.shape == (len(PROMPTS), 77)
  for prompt, a, b in zip(PROMPTS, ours, want):
    assert a.tolist() == b.tolist(), prompt
  vocab, merges = clip_vocab()
  bos, eos = vocab[BOS], vocab[EOS]
  assert ours[0, :3].tolist() == [bos, eos, eos]  # the empty prompt: BOS, EOS, then the pad (EOS again)
  assert ours[-3, -2:].tolist() == [vocab["dog</w>"], eos] and ours[-3, 0] == bos  # fits exactly
  assert ours[-2, -2:].tolist() == [vocab["the</w>"], eos]  # cut to BOS, 75 tokens, EOS
  assert ours[-1, 0] == bos and ours[-1, -1] == eos
  assert (ours >= 2 * 256).sum() > 100  # the merges fire: many ids past the alphabet


@pytest.mark.parametrize("t5_layout", ["saved", "v4"])
@pytest.mark.parametrize("max_sequence_length", [16, 512])
def test_t5_equals_transformers(dirs, t5_layout, max_sequence_length):
  directory = dirs["t5"][t5_layout]
  t5_tok = flux_tokenizers.t5_tokenizer(directory)
  clip_tok = flux_tokenizers.clip_tokenizer(dirs["clip"]["hub"])
  _, ours = flux_tokenizers.flux_ids(clip_tok, t5_tok, PROMPTS, max_sequence_length)
  want = t5_reference(directory, PROMPTS, max_sequence_length)
  assert ours.dtype == np.int32 and ours.shape == (len(PROMPTS), max_sequence_length)
  for prompt, a, b in zip(PROMPTS, ours, want):
    assert a.tolist() == b.tolist(), prompt
  assert ours[0].tolist() == [1] + [0] * (max_sequence_length - 1)  # the empty prompt: '</s>', then pads
  assert ours[-1, -1] == 1  # the long prompt, cut: '</s>' kept last
  assert len(set(ours.ravel().tolist())) > 40  # most of the trained pieces appear, not just unk


def test_one_tokenizer_serves_both_lengths(dirs):
  """flux_ids sets T5's length on each call: a shorter call after a longer one is the longer one cut."""
  clip_tok = flux_tokenizers.clip_tokenizer(dirs["clip"]["hub"])
  t5_tok = flux_tokenizers.t5_tokenizer(dirs["t5"]["saved"])
  clip_512, long_ids = flux_tokenizers.flux_ids(clip_tok, t5_tok, ["a red cat"], 512)
  clip_16, short_ids = flux_tokenizers.flux_ids(clip_tok, t5_tok, ["a red cat"], 16)
  assert short_ids.tolist() == long_ids[:, :16].tolist() and clip_16.tolist() == clip_512.tolist()
  clip_none, t5_none = flux_tokenizers.flux_ids(clip_tok, t5_tok, [], 16)
  assert clip_none.shape == (0, 77) and t5_none.shape == (0, 16)


def test_bad_tokenizer_directories(dirs, tmp_path):
  legacy = dirs["clip"]["legacy"]
  cases = {
      "no vocab": (lambda d: (d / "vocab.json").unlink(), "vocab.json' is missing"),
      "no merges": (lambda d: (d / "merges.txt").unlink(), "merges.txt' is missing"),
      "three-part merge": (lambda d: (d / "merges.txt").write_text("#version: 0.2\nt h e\n"), "line 2"),
      "blank merge line": (lambda d: (d / "merges.txt").write_text("#version: 0.2\n\nt h\n"), "line 2"),
      "merge outside the vocab": (lambda d: (d / "merges.txt").write_text("#version: 0.2\nq z\n"),
                                  "do not make a BPE tokenizer"),
      "vocab not JSON": (lambda d: (d / "vocab.json").write_text("{not json"), "not valid JSON"),
      "vocab of strings": (lambda d: (d / "vocab.json").write_text('{"a": "0"}'), "token -> id"),
      "config not JSON": (lambda d: (d / "tokenizer_config.json").write_text("[1,"), "not valid JSON"),
      "null pad": (lambda d: [(d / "tokenizer_config.json").write_text('{"pad_token": null}'),
                              (d / "special_tokens_map.json").unlink()], "pad_token to null"),
      "bad length": (lambda d: (d / "tokenizer_config.json").write_text('{"model_max_length": "77"}'),
                     "model_max_length"),
      "bad tokenizer.json": (lambda d: (d / "tokenizer.json").write_text('{"model": 1}'),
                             "not a tokenizer.json"),
  }
  for name, (change, message) in cases.items():
    directory = tmp_path / name.replace(" ", "_")
    shutil.copytree(legacy, directory)
    change(directory)
    with pytest.raises(UserError, match=message):
      flux_tokenizers.clip_tokenizer(directory)
  with pytest.raises(UserError, match="not a directory"):
    flux_tokenizers.clip_tokenizer(tmp_path / "absent")
  with pytest.raises(UserError, match=r"spiece.model but no tokenizer.json.*T5TokenizerFast"):
    flux_tokenizers.t5_tokenizer(dirs["t5"]["spiece"])
  (tmp_path / "t5_empty").mkdir()
  with pytest.raises(UserError, match="tokenizer.json' is missing"):
    flux_tokenizers.t5_tokenizer(tmp_path / "t5_empty")
  clip_tok = flux_tokenizers.clip_tokenizer(dirs["clip"]["hub"])
  t5_tok = flux_tokenizers.t5_tokenizer(dirs["t5"]["saved"])
  for prompts, length, message in (("a cat", 16, "list of strings"), ([1], 16, "list of strings"),
                                   (["a"], 513, "from 1 to 512"), (["a"], 0, "from 1 to 512")):
    with pytest.raises(UserError, match=message):
      flux_tokenizers.flux_ids(clip_tok, t5_tok, prompts, length)
