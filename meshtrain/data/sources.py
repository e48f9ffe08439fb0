"""The source contract and the deterministic order every source family shares.

A source maps a global example index to one example, so the batch at step k is a pure function of (seed, k): rows
[start, stop) of it can be loaded by any process, and the result does not depend on how many processes there are
or on the mesh. Nothing iterates statefully, so resuming at step k needs no iterator state in the checkpoint.

`Source` is a token source (one sequence of `seq_len + 1` tokens per example; packed text: meshtrain/data/
packing.py, prompt/completion rows: sft.py); image sources (images.py) follow the same `rows` contract. All of them
seed their orders with `derive_seed` and, below SMALL_PERMUTATION examples, visit each epoch in a `permutation`.
"""
import functools
import hashlib

import numpy as np

from meshtrain.data import tokenization as tokenizer

SYNTHETIC = "synthetic"  # data.name of random data: no files, endless (tokens here, images in images.py)
# grain's index_shuffle walks cycles over a fixed-size domain, so its cost grows like 1/n for small n
# (measured: ~3 us per index at n=65536, 3 ms at n=10, 13 ms at n=2). Below this size a materialised
# numpy permutation per epoch is both cheap in memory and fast.
SMALL_PERMUTATION = 1 << 16


def derive_seed(*parts) -> int:
  """A 32-bit seed from `parts`, so nearby user seeds (0, 1, ...) give unrelated orders and splits differ."""
  digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
  return int.from_bytes(digest[:4], "little")


@functools.lru_cache(maxsize=4)
def permutation(seed: int, epoch: int, n: int) -> np.ndarray:
  """The order of n examples in `epoch` (a fresh one each epoch), materialised: for n below SMALL_PERMUTATION."""
  return np.random.default_rng([seed, epoch]).permutation(n)


class Source:
  """Global example index -> packed sequence; batches are assembled from it by `rows`."""

  seq_len: int
  num_sequences: int | None  # None: infinite (synthetic)
  pad_id: int = tokenizer.PAD_ID  # the input id at padded positions (their targets are IGNORE_ID)

  def sequence_index(self, example_index: int) -> int:
    """The sequence that global example `example_index` reads (the epoch permutation, or plain order)."""
    raise NotImplementedError

  def sequence(self, seq_index: int) -> np.ndarray:
    """int32[seq_len + 1]: the tokens whose [:-1] are the inputs and [1:] the targets; IGNORE_ID past the data."""
    raise NotImplementedError

  def example(self, example_index: int) -> np.ndarray:
    return self.sequence(self.sequence_index(example_index))

  def example_pair(self, example_index: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets), each int32[seq_len], of global example `example_index`: one row of a batch."""
    seq = self.example(example_index)
    inputs = seq[:-1].copy()
    inputs[inputs < 0] = self.pad_id
    return inputs, seq[1:].copy()

  def documents(self, example_index: int) -> int:
    """How many documents (or records) the row of `example_index` reads from: what `python -m meshtrain.data stats`
    counts."""
    del example_index
    return 1

  def rows(self, step: int, batch_size: int, start: int = 0, stop: int | None = None) -> dict[str, np.ndarray]:
    """Rows [start, stop) of the global batch at `step`: {"inputs", "targets"}, each int32[stop - start, L].

    Padded positions have target IGNORE_ID (the loss skips them) and input `pad_id` (the model embeds it).
    """
    stop = batch_size if stop is None else stop
    if step < 0 or not 0 <= start <= stop <= batch_size:
      raise ValueError(f"bad rows request: step={step}, rows [{start}, {stop}) of a batch of {batch_size}")
    first = step * batch_size
    inputs = np.empty((stop - start, self.seq_len), np.int32)
    targets = np.empty((stop - start, self.seq_len), np.int32)
    for row in range(start, stop):
      inputs[row - start], targets[row - start] = self.example_pair(first + row)
    return {"inputs": inputs, "targets": targets}


class SyntheticSource(Source):
  """Uniform random tokens below vocab_size, a function of (seed, split, index); no files, endless."""

  def __init__(self, seed: int, split: str, seq_len: int, vocab_size: int):
    self.seq_len = seq_len
    self.num_sequences = None
    self.vocab_size = vocab_size
    self._seed = derive_seed("synthetic", seed, split)

  def sequence_index(self, example_index: int) -> int:
    return example_index

  def sequence(self, seq_index: int) -> np.ndarray:
    rng = np.random.default_rng([self._seed, seq_index])
    return rng.integers(0, self.vocab_size, self.seq_len + 1, dtype=np.int32)
