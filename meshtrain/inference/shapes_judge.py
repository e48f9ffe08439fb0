"""Whether pictures show what their captions say, on the `shapes` dataset (meshtrain/data/shapes.py): an independent
judge of a text-to-image model, built from the drawing code, never from a trained model's output.

A picture's foreground is the pixels far from the dark grey background (any channel more than FOREGROUND levels
away). Its colour is the palette colour nearest to the foreground's mean; its shape is what a scikit-learn logistic
regression makes of the foreground's mask cropped to its bounding box and resized to 8x8 (so position and size do
not matter), fitted on pictures that `shapes.draw` makes of every pair (CALIBRATION of each, fixed seed) in under a
second. On the dataset's own held-out pictures it names colour and shape right every time (tests/test_t2i.py).

  colour_accuracy  fraction of pictures whose colour is the caption's (chance 1/6)
  shape_accuracy   fraction whose shape is the caption's (chance 1/3)
  accuracy         fraction right on both (chance 1/18)
A picture with no foreground at all (a blank sample) is wrong on both counts.
"""
import functools

import numpy as np
from PIL import Image

from meshtrain.data import shapes

FOREGROUND = 60  # grey levels from the background; the background's noise is +-8, the dimmest colour 160 away
MASK_SIDE = 8
CALIBRATION = 60  # pictures per pair the shape classifier is fitted on


def foreground(picture_HWC: np.ndarray) -> np.ndarray:
  """bool[H, W]: pixels whose colour is far from the background's grey."""
  return (np.abs(picture_HWC.astype(np.int32) - shapes.BACKGROUND) > FOREGROUND).any(axis=-1)


def mask_features(mask_HW: np.ndarray) -> np.ndarray:
  """float64[MASK_SIDE**2]: the mask cropped to its bounding box and resized (zeros for an empty mask)."""
  rows, cols = np.flatnonzero(mask_HW.any(1)), np.flatnonzero(mask_HW.any(0))
  if len(rows) == 0:
    return np.zeros(MASK_SIDE * MASK_SIDE)
  crop = mask_HW[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1].astype(np.uint8) * 255
  small = Image.fromarray(crop).resize((MASK_SIDE, MASK_SIDE), Image.Resampling.BOX)
  return np.asarray(small, np.float64).reshape(-1) / 255


class Judge:
  """The shape classifier (fitted on construction) and the palette."""

  def __init__(self):
    import sklearn.linear_model, threadpoolctl  # noqa: E401  (scikit-learn and its thread pools: on first use)
    rng = np.random.default_rng(0)
    pictures, labels = [], []
    for color, shape in shapes.PAIRS:
      for _ in range(CALIBRATION):
        pictures.append(shapes.draw(color, shape, rng))
        labels.append(shapes.SHAPES.index(shape))
    with threadpoolctl.threadpool_limits(1):  # one BLAS thread: the default pool oversubscribes a small host
      self.classifier = sklearn.linear_model.LogisticRegression(C=10.0, max_iter=2000)
      self.classifier.fit(np.stack([mask_features(foreground(p)) for p in pictures]), labels)
    self.palette_names = tuple(shapes.COLORS)
    self.palette = np.array([shapes.COLORS[c] for c in self.palette_names], np.float64)

  def describe(self, pictures_NHWC) -> list[tuple[str, str]]:
    """(colour, shape) of each uint8 picture; ("none", "none") where nothing stands out of the background."""
    out = []
    for picture in np.asarray(pictures_NHWC):
      mask = foreground(picture)
      if not mask.any():
        out.append(("none", "none"))
        continue
      mean = picture[mask].astype(np.float64).mean(0)
      color = self.palette_names[int(np.argmin(((self.palette - mean) ** 2).sum(1)))]
      shape = shapes.SHAPES[int(self.classifier.predict(mask_features(mask)[None])[0])]
      out.append((color, shape))
    return out

  def score(self, pictures_NHWC, captions: list[str]) -> dict[str, float]:
    """{"colour_accuracy", "shape_accuracy", "accuracy"} of uint8 pictures made for `captions` ("a red circle")."""
    if len(captions) != len(pictures_NHWC) or not captions:
      raise ValueError(f"need one caption per picture, got {len(pictures_NHWC)} pictures and {len(captions)} captions")
    wanted = [tuple(c.split()[1:3]) for c in captions]
    seen = self.describe(pictures_NHWC)
    colour = np.array([s[0] == w[0] for s, w in zip(seen, wanted)])
    shape = np.array([s[1] == w[1] for s, w in zip(seen, wanted)])
    return {"colour_accuracy": float(colour.mean()), "shape_accuracy": float(shape.mean()),
            "accuracy": float((colour & shape).mean())}


  def report(self, pictures_NHWC, captions: list[str]) -> dict[str, float]:
    """The scores of `score` for the pictures of held-out captions (sample_heldout_*: pairs no training caption
    names) and of the others (sample_seen_*), each present when some caption is in its group."""
    out = {}
    for group, keep in (("heldout", True), ("seen", False)):
      rows = [i for i, c in enumerate(captions) if (pair_of(c) in shapes.HELDOUT) == keep]
      if rows:
        scores = self.score(np.asarray(pictures_NHWC)[rows], [captions[i] for i in rows])
        out.update({f"sample_{group}_{k}": v for k, v in scores.items()})
    return out


def pair_of(caption: str) -> tuple[str, str] | None:
  """(colour, shape) of a caption in the dataset's form ("a red circle"), else None."""
  words = caption.split()
  pair = tuple(words[1:]) if len(words) == 3 and words[0] == "a" else None
  return pair if pair in shapes.PAIRS else None


def judge_for(data_name: str, image_shape, captions: list[str]) -> "Judge | None":
  """The judge for pictures of a run on `shapes` at its own size whose captions are all in the dataset's form, else
  None: it knows no other dataset's pictures."""
  if data_name != shapes.NAME or tuple(image_shape) != (shapes.SIZE, shapes.SIZE, 3):
    return None
  return judge() if captions and all(pair_of(c) for c in captions) else None


@functools.cache
def judge() -> Judge:
  """The process's Judge, fitted on first use."""
  return Judge()
