"""Byte-level tokenizer: ids 0..255 are the UTF-8 bytes, three specials above them.

Bytes need no vocabulary file and nothing to download, and every string round-trips exactly.
"""
import numpy as np

PAD_ID = 256     # fills the tail of the last sequence; the loss ignores targets equal to it
EOS_ID = 257     # ends every document in the packed stream
BOS_ID = 258     # reserved for callers that want an explicit start token (packing does not add it)
VOCAB_SIZE = 259  # the smallest model.vocab_size that holds every id above
NUM_SPECIAL = VOCAB_SIZE - 256


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
