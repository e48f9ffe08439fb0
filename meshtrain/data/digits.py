"""`digits`: scikit-learn's handwritten digits (1,797 8x8 grayscale images, 10 classes) with a fixed split.

scikit-learn ships the UCI data inside the package, so nothing is downloaded. `load_split` is the one definition
of the split; the TFDS dataset built from it and the quality classifier (meshtrain/quality.py) both read it.
"""
import numpy as np

NAME = "digits"
NUM_CLASSES = 10
IMAGE_SHAPE = (8, 8, 1)
TEST_EVERY = 5  # every 5th image of each class (in file order) is a test image: 364 test, 1,433 train


def load_split(split: str) -> tuple[np.ndarray, np.ndarray]:
  """(images uint8[N, 8, 8, 1] in 0..16 scaled to 0..255, labels int64[N]) of 'train' or 'test', in file order."""
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  if split not in ("train", "test"):
    raise ValueError(f"digits has splits 'train' and 'test', not {split!r}")
  data = load_digits()
  labels = data.target
  # Rank of each image among the images of its class, in file order: stratified, so every class is ~20% test.
  rank = np.zeros(len(labels), np.int64)
  for c in range(NUM_CLASSES):
    rank[labels == c] = np.arange(np.sum(labels == c))
  keep = rank % TEST_EVERY == 0 if split == "test" else rank % TEST_EVERY != 0
  # 0..16 -> 0..255 (16 -> 255, rounded): a standard 8-bit image, so any TFDS image pipeline reads it as is.
  images = np.round(data.images[keep] * (255 / 16)).astype(np.uint8)[..., None]
  return images, labels[keep].astype(np.int64)
