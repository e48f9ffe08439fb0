"""Data layer: tokenizers (bytes, tokenizer.json, SentencePiece) and chat templates, the locally built
`python_stdlib` and `digits` TFDS datasets, a user's own files as TFDS datasets, packed deterministic token batches,
prompt/completion and chat rows, mixtures, labelled image batches (task=dit), and the grain pipeline that feeds them
to the train loop.

Modules, lowest first (each imports only modules listed before it):
  tokenization   tokenizers: bytes, Hugging Face tokenizer.json, SentencePiece; training a byte-level BPE
  chat           chat templates: conversations rendered and encoded as transformers' apply_chat_template does
  tfds_access    opening a TFDS split (and saying why it cannot be), building the local datasets, the cache lock
  files          a user's .jsonl/.json/.parquet/.txt files or `datasets` directory, converted once to a TFDS dataset
  captioned      a user's captioned pictures (a folder with metadata, class subfolders, rows), converted likewise
  stdlib_corpus  the python_stdlib dataset, built from the interpreter's standard library
  digits         the digits image dataset, built from scikit-learn's copy
  shapes         the shapes dataset: captioned pictures of coloured shapes, drawn locally (task=t2i's default)
  text_features  a frozen language model's hidden states of captions (task=t2i), computed once, cached beside the data
  sources        the Source contract, synthetic tokens, the seeds and epoch permutations every source shares
  packing        text documents (TFDS or files) packed into sequences, with their document index and token cache
  sft            prompt/completion and chat rows (loss on the completion / the assistant), python_stdlib_sft
  mixture        several sources drawn in fixed proportions (grain's mix)
  images         labelled (task=dit) and captioned (task=t2i) image sources
  select         what a config selects: its tokenizer (a bpe:N trained on first use) and its source
  loader         global batches on the devices, and `Batches`, the train loop's prefetching input
  stats          what the first steps' batches hold, per source: `python -m meshtrain.data stats` and `show`

The package imports its modules when they are first used (`data.make_source`, `data.tokenization`, ...), so that JAX,
TFDS and grain load only with what needs them: `synthetic` data works where TFDS and grain are not installed, and
the commands check a chat file (meshtrain.data.chat) before JAX loads.
"""
import importlib

# name -> the module defining it; the package's own API, imported on first use.
_EXPORTS = {"Batches": "loader", "global_batch": "loader", "process_rows": "loader", "make_source": "select",
            "tokenizer_for_config": "select", "Source": "sources", "PAD_ID": "tokenization", "EOS_ID": "tokenization",
            "BOS_ID": "tokenization", "VOCAB_SIZE": "tokenization", "encode": "tokenization", "decode": "tokenization"}
_MODULES = ("tokenization", "chat", "tfds_access", "files", "captioned", "stdlib_corpus", "digits", "shapes",
            "text_features", "sources", "packing", "sft", "mixture", "images", "select", "loader", "stats")

__all__ = [*_MODULES, *_EXPORTS]


def __getattr__(name: str):
  if name in _EXPORTS:
    return getattr(importlib.import_module(f"meshtrain.data.{_EXPORTS[name]}"), name)
  if name in _MODULES:
    return importlib.import_module(f"meshtrain.data.{name}")
  raise AttributeError(f"module 'meshtrain.data' has no attribute {name!r}")
