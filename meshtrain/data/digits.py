"""`digits`: scikit-learn's handwritten digits (1,797 8x8 grayscale images, 10 classes) with a fixed split.

scikit-learn ships the UCI data inside the package, so nothing is downloaded. `load_split` is the one definition
of the split; the TFDS dataset built from it (`build`, on first use under data.data_dir, like python_stdlib) and the
quality classifier (inference/quality.py) both read it. As a TFDS dataset it goes through the same code path as
any other TFDS image dataset (meshtrain/data/images.py): features `image` (8, 8, 1) uint8 and `label`
ClassLabel(10), splits `train` (1,433) and `test` (364), array_record files read by random access.

tensorflow_datasets is imported only when the dataset is built: `load_split` (and so the quality classifier) works
where TFDS is not installed (the GPU machines).
"""
import functools

import numpy as np

from meshtrain.data import tfds_access

NAME = "digits"
NUM_CLASSES = 10
IMAGE_SHAPE = (8, 8, 1)
TEST_EVERY = 5  # every 5th image of each class (in file order) is a test image: 364 test, 1,433 train
SPLITS = ("train", "test")


def load_split(split: str) -> tuple[np.ndarray, np.ndarray]:
  """(images uint8[N, 8, 8, 1] in 0..16 scaled to 0..255, labels int64[N]) of 'train' or 'test', in file order."""
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  if split not in SPLITS:
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


@functools.cache
def builder_class():
  """The TFDS builder class of `digits`, defined (and so registered under the name "digits") on first call: a
  class statement at module level would import tensorflow_datasets with this module."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  class Digits(tfds.core.GeneratorBasedBuilder):
    """scikit-learn's handwritten digits: `image` uint8 (8, 8, 1) and `label` 0..9; train/test as `load_split`."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "sklearn.datasets.load_digits, 0..16 scaled to 0..255; every 5th image of each class "
                              "(file order) in test."}

    def __init__(self, *, file_format=None, **kwargs):
      # array_record: random access without TensorFlow, as for python_stdlib.
      super().__init__(file_format=file_format or "array_record", **kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
      return self.dataset_info_from_configs(
          description="Handwritten digits (UCI ML, as shipped by scikit-learn): 1,797 8x8 grayscale images of 0-9, "
                      "pixel values 0..16 scaled to 0..255.",
          features=tfds.features.FeaturesDict({
              "image": tfds.features.Image(shape=IMAGE_SHAPE, dtype=np.uint8),
              "label": tfds.features.ClassLabel(num_classes=NUM_CLASSES),
          }),
          supervised_keys=("image", "label"),
          # Records in `load_split` order (TFDS would otherwise shuffle them by key hash): example i of a split is
          # image i of load_split. Training order is the pipeline's own epoch permutation anyway.
          disable_shuffling=True,
          homepage="https://archive.ics.uci.edu/dataset/80/optical+recognition+of+handwritten+digits",
      )

    def _split_generators(self, dl_manager):
      del dl_manager  # scikit-learn ships the data: nothing to download
      return {split: self._generate_examples(split) for split in SPLITS}

    def _generate_examples(self, split):
      from PIL import Image  # pylint: disable=g-import-not-at-top
      images, labels = load_split(split)
      for i, (image, label) in enumerate(zip(images, labels)):
        # A PIL image, not the array: TFDS PNG-encodes arrays with TensorFlow, PIL images with PIL (lossless).
        # The index within the split is unique, so it is the key (duplicate keys fail the build misleadingly).
        yield i, {"image": Image.fromarray(image[..., 0], mode="L"), "label": int(label)}

  return Digits


def build(data_dir: str = ""):
  """Builds `digits` under `data_dir` ("" = TFDS default) unless it is there; returns the builder. Locked against
  other processes on the host and atomic (TFDS renames a finished temporary directory into place), like
  python_stdlib (meshtrain/data/tfds_access.py's `build` does the work and its error messages)."""
  return tfds_access.build(data_dir, builder_class())
