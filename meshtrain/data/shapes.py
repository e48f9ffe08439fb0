"""`shapes`: captioned pictures of coloured shapes, drawn locally (nothing downloaded), for text-to-image (task=t2i).

Each 32x32 RGB picture holds one shape (circle, square, triangle) in one of six colours, at a random position and
size on a dark, slightly noisy background, captioned "a red circle". Splits:
  train       15 of the 18 colour-shape pairs, 200 pictures each (3,000)
  validation  the same 15 pairs, 16 new pictures each (240): the validation loss
  heldout     the 3 pairs (HELDOUT) that no training caption names, 64 pictures each (192): whether the model
              composes words it only saw apart ("a green square": it saw green things and squares, never together)
A picture is a function of (split, index) alone (numpy's generator seeded by both), so the dataset is the same on
every machine. `draw` is the one definition of a picture; the judge (meshtrain/inference/shapes_judge.py) learns
shapes from it, never from a trained model's output.

Features `image` uint8 (32, 32, 3), `text` (the caption), `label` ClassLabel (the pair's index in PAIRS), read like any
TFDS image dataset (meshtrain/data/images.py). tensorflow_datasets is imported only when the dataset is built.
"""
import functools

import numpy as np
from PIL import Image, ImageDraw

from meshtrain.data import tfds_access

NAME = "shapes"
SIZE = 32
COLORS = {"red": (220, 40, 40), "green": (40, 190, 60), "blue": (50, 90, 230), "yellow": (230, 210, 40),
          "purple": (160, 60, 200), "white": (235, 235, 235)}
SHAPES = ("circle", "square", "triangle")
PAIRS = tuple((c, s) for c in COLORS for s in SHAPES)
# One unseen pair per shape, each in a colour seen with the other shapes.
HELDOUT = (("green", "square"), ("blue", "triangle"), ("yellow", "circle"))
SPLITS = {"train": 200, "validation": 16, "heldout": 64}  # pictures per pair
BACKGROUND = 30  # the background's grey level (0..255), plus noise of +-8


def caption(color: str, shape: str) -> str:
  return f"a {color} {shape}"


def pairs_of(split: str) -> tuple[tuple[str, str], ...]:
  """The colour-shape pairs a split draws, in PAIRS order."""
  if split not in SPLITS:
    raise ValueError(f"shapes has splits {', '.join(SPLITS)}, not {split!r}")
  heldout = split == "heldout"
  return tuple(p for p in PAIRS if (p in HELDOUT) == heldout)


def draw(color: str, shape: str, rng: np.random.Generator) -> np.ndarray:
  """One picture uint8[32, 32, 3]: `shape` in `color`, its centre and radius drawn from `rng`."""
  noise = rng.integers(-8, 9, (SIZE, SIZE, 3))
  picture = Image.fromarray(np.clip(BACKGROUND + noise, 0, 255).astype(np.uint8))
  r = rng.uniform(6, 11)
  cx, cy = rng.uniform(r + 1, SIZE - r - 1, 2)
  box = (cx - r, cy - r, cx + r, cy + r)
  pen = ImageDraw.Draw(picture)
  if shape == "circle":
    pen.ellipse(box, fill=COLORS[color])
  elif shape == "square":
    pen.rectangle(box, fill=COLORS[color])
  else:
    pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLORS[color])
  return np.asarray(picture)


def examples(split: str):
  """(image uint8[32, 32, 3], caption, label) of every picture of `split`, in order: pair by pair."""
  for color, shape in pairs_of(split):
    label = PAIRS.index((color, shape))
    for i in range(SPLITS[split]):
      rng = np.random.default_rng([list(SPLITS).index(split), label, i])
      yield draw(color, shape, rng), caption(color, shape), label


@functools.cache
def builder_class():
  """The TFDS builder of `shapes`, defined (and registered) on first call, as digits.builder_class."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  class Shapes(tfds.core.GeneratorBasedBuilder):
    """Coloured shapes with captions; see meshtrain/data/shapes.py."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "6 colours x 3 shapes at 32x32; 3 pairs held out of train and validation."}

    def __init__(self, *, file_format=None, **kwargs):
      super().__init__(file_format=file_format or "array_record", **kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
      return self.dataset_info_from_configs(
          description="Coloured shapes captioned 'a <colour> <shape>', drawn by meshtrain/data/shapes.py.",
          features=tfds.features.FeaturesDict({
              "image": tfds.features.Image(shape=(SIZE, SIZE, 3), dtype=np.uint8),
              "text": tfds.features.Text(),
              "label": tfds.features.ClassLabel(names=[caption(*p) for p in PAIRS]),
          }),
          disable_shuffling=True,  # records in `examples` order, like digits
      )

    def _split_generators(self, dl_manager):
      del dl_manager  # drawn here: nothing to download
      return {split: self._generate_examples(split) for split in SPLITS}

    def _generate_examples(self, split):
      for i, (image, text, label) in enumerate(examples(split)):
        yield i, {"image": Image.fromarray(image), "text": text, "label": label}

  return Shapes


def build(data_dir: str = ""):
  """Builds `shapes` under `data_dir` ("" = TFDS default) unless it is there (locked and atomic, as digits)."""
  return tfds_access.build(data_dir, builder_class())
