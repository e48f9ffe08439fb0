"""Data layer: tokenizers (bytes, tokenizer.json, SentencePiece), the locally built `python_stdlib` TFDS dataset,
packed deterministic batches, and the grain pipeline that feeds them to the train loop.

`stdlib_corpus` (which imports tensorflow_datasets) is not imported here, so `synthetic` data works where
TFDS and grain are not installed.
"""
from meshtrain.data import tokenizer
from meshtrain.data.pipeline import Batches, Source, global_batch, make_source, process_rows
from meshtrain.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, decode, encode

__all__ = ["tokenizer", "make_source", "global_batch", "process_rows", "Batches", "Source", "PAD_ID", "EOS_ID",
           "BOS_ID", "VOCAB_SIZE", "encode", "decode"]
