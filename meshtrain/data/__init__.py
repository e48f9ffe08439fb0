"""Data layer: tokenizers (bytes, tokenizer.json, SentencePiece), the locally built `python_stdlib` and `digits`
TFDS datasets, packed deterministic token batches, labelled image batches (task=dit), and the grain pipeline that
feeds them to the train loop.

Modules, lowest first (each imports only modules listed before it):
  tokenizer      tokenizers: bytes, Hugging Face tokenizer.json, SentencePiece; training a byte-level BPE
  tfds_access    opening a TFDS split (and saying why it cannot be), building the local datasets, the cache lock
  stdlib_corpus  the python_stdlib dataset, built from the interpreter's standard library
  digits         the digits image dataset, built from scikit-learn's copy
  sources        the Source contract, synthetic tokens, the seeds and epoch permutations every source shares
  sft            prompt/completion rows, and the python_stdlib_sft dataset
  packing        TFDS text documents packed into sequences, with their document index and token cache
  images         labelled image sources (task=dit)
  select         what a config selects: its tokenizer (a bpe:N trained on first use) and its source
  loader         global batches on the devices, and `Batches`, the train loop's prefetching input

`stdlib_corpus` and `sft` (which import tensorflow_datasets) are not imported here, and the other modules import
tensorflow_datasets and grain only when a dataset is built or opened, so `synthetic` data works where TFDS and grain
are not installed.
"""
from meshtrain.data import digits, images, tokenizer
from meshtrain.data.loader import Batches, global_batch, process_rows
from meshtrain.data.select import make_source, tokenizer_for_config
from meshtrain.data.sources import Source
from meshtrain.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, decode, encode

__all__ = ["tokenizer", "digits", "images", "make_source", "tokenizer_for_config", "global_batch", "process_rows",
           "Batches", "Source", "PAD_ID", "EOS_ID", "BOS_ID", "VOCAB_SIZE", "encode", "decode"]
