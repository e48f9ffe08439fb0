"""Data layer: tokenizers (bytes, tokenizer.json, SentencePiece), the locally built `python_stdlib` and `digits`
TFDS datasets, packed deterministic token batches, labelled image batches (task=dit, meshtrain/data/images.py), and
the grain pipeline that feeds them to the train loop.

`stdlib_corpus` (which imports tensorflow_datasets) is not imported here, and `digits` and `images` import it only
when a dataset is built or opened, so `synthetic` data works where TFDS and grain are not installed.
"""
from meshtrain.data import digits, images, tokenizer
from meshtrain.data.pipeline import Batches, Source, global_batch, make_source, process_rows
from meshtrain.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, decode, encode

__all__ = ["tokenizer", "digits", "images", "make_source", "global_batch", "process_rows", "Batches", "Source",
           "PAD_ID", "EOS_ID", "BOS_ID", "VOCAB_SIZE", "encode", "decode"]
