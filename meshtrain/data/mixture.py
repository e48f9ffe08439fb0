"""A mixture of token sources (data.mixture="SRC=WEIGHT,SRC=WEIGHT"), drawn in fixed proportions.

Global example i of the mixture is example j of source k, where (k, j) is grain's `MapDataset.mix` selection: a
deterministic interleaving in which every window of sum(weights) examples (weights made integers) holds each
source's share, and source k's examples are taken in its own order (its own shuffled epochs, seeded by its own name).
So the batch at step s is a pure function of (seed, s): exact on resume, the same on any number of processes, and
each batch holds the sources in the stated proportions (up to rounding within a batch), not merely on average.
"""
import sys

import numpy as np

from meshtrain.data import sources
from meshtrain.errors import UserError


class _Tagged:
  """j -> (k, j): a source's index tagged with the source's position, the element grain mixes (picklable)."""

  def __init__(self, k: int):
    self.k = k

  def __call__(self, j: int) -> tuple[int, int]:
    return self.k, j


class MixtureSource(sources.Source):
  """Rows drawn from `parts` in proportion to `weights`; `names` label them (stats, messages)."""

  def __init__(self, parts: list[sources.Source], weights: list[float], names: list[str]):
    import grain  # pylint: disable=g-import-not-at-top

    if len({p.seq_len for p in parts}) > 1 or len({p.pad_id for p in parts}) > 1:
      raise UserError(f"the sources of data.mixture ({', '.join(names)}) differ in sequence length or padding id; "
                      "they must share one tokenizer and seq_len")
    self.parts, self.names = parts, names
    self.weights = [w / sum(weights) for w in weights]
    self.seq_len, self.pad_id = parts[0].seq_len, parts[0].pad_id
    self.num_sequences = None  # every source cycles through its epochs: the mixture never runs out
    # Each source as an index space as long as grain allows (a source's example(j) wraps into later epochs), so the
    # mixture's length, the shortest source over its share, stays beyond any run.
    span = sys.maxsize // 4
    self._mixed = grain.MapDataset.mix([grain.MapDataset.range(span).map(_Tagged(k)) for k in range(len(parts))],
                                       weights)

  def source_of(self, example_index: int) -> tuple[int, int]:
    """(k, j): global example `example_index` is example j of source k."""
    return self._mixed[example_index]

  def sequence_index(self, example_index: int) -> int:
    raise TypeError("a mixture's example is one source's example; use source_of()")

  def example_pair(self, example_index: int) -> tuple[np.ndarray, np.ndarray]:
    k, j = self.source_of(example_index)
    return self.parts[k].example_pair(j)

  def documents(self, example_index: int) -> int:
    k, j = self.source_of(example_index)
    return self.parts[k].documents(j)
