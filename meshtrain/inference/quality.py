"""Sample quality on digits, measured by a classifier: how often a class-conditional sample looks like its class,
and how far the samples' features lie from real digits'.

`Judge` is a small scikit-learn MLP (one hidden layer of 64 ReLU units) fitted on the pixels (in [0, 1]) of the
digits train split (meshtrain/data/digits.py `load_split`), deterministically (fixed seed, L-BFGS), in about a
second. It scores a set of images and the classes they were asked to be:

  sample_accuracy  fraction of images the classifier labels as their class (real test digits: 0.975; uniform
                   noise: ~0.1, chance)
  sample_frechet   Frechet distance between Gaussians fitted to the classifier's hidden features of the images
                   and of the 364 test digits, |mu_a - mu_b|^2 + tr(S_a + S_b - 2 (S_a S_b)^(1/2)), float64: the
                   FID recipe (Heusel et al. 2017) with this classifier in place of Inception. It falls as the
                   samples' spread matches real digits', which accuracy alone does not see (one perfect "3" for
                   every 3 scores accuracy 1). Like FID it is biased upwards for small sets: compare values at the
                   same count. For reference, at 100 images (10 per class): real train digits ~2, uniform
                   noise ~15, blank images ~60; all 1,433 train digits ~0.13.

The fit is cached in memory (`judge()`), so the training loop's sample hook and `python -m meshtrain.sample` pay
for it once per process.
"""
import functools

import numpy as np

from meshtrain.data import digits

HIDDEN = 64
# Weight decay: at 0.1 the hidden features vary smoothly with the pixels, so the Frechet distance separates real
# digits from noise by ~10x at 100 images and the test accuracy (0.975) is the best of the settings tried.
ALPHA = 0.1
SEED = 0


class Judge:
  """The digits classifier (fitted on construction) and the test split's feature statistics."""

  image_shape = digits.IMAGE_SHAPE

  def __init__(self):
    import sklearn.neural_network, threadpoolctl  # noqa: E401  (scikit-learn and its thread pools: on first use)
    train_images, train_labels = digits.load_split("train")
    test_images, self.test_labels = digits.load_split("test")
    self.test_images01 = test_images.astype(np.float64) / 255
    # One BLAS thread: on a small shared host the default thread pool oversubscribes the cores and the same fit
    # took 40 s instead of 1 s (measured on the 2-core machine while other jobs ran).
    with threadpoolctl.threadpool_limits(1):
      self.classifier = sklearn.neural_network.MLPClassifier((HIDDEN,), alpha=ALPHA, solver="lbfgs", max_iter=500,
                                                             random_state=SEED)
      self.classifier.fit(self._pixels(train_images.astype(np.float64) / 255), train_labels)
    self.test_features = self.features(self.test_images01)

  def _pixels(self, images01_NHWC) -> np.ndarray:
    images01_NHWC = np.asarray(images01_NHWC, np.float64)
    if images01_NHWC.ndim != 4 or images01_NHWC.shape[1:] != self.image_shape:
      raise ValueError(f"the digits judge scores images of shape [N, {', '.join(map(str, self.image_shape))}], "
                       f"not {list(images01_NHWC.shape)}")
    # Samples may overshoot [0, 1] a little; the classifier only ever saw pixels inside it.
    return np.clip(images01_NHWC, 0, 1).reshape(len(images01_NHWC), -1)

  def predict(self, images01_NHWC) -> np.ndarray:
    """int64[N]: the class of each image (pixels in [0, 1])."""
    return self.classifier.predict(self._pixels(images01_NHWC))

  def features(self, images01_NHWC) -> np.ndarray:
    """float64[N, HIDDEN]: the classifier's hidden-layer activations (ReLU) of each image."""
    pixels = self._pixels(images01_NHWC)
    return np.maximum(pixels @ self.classifier.coefs_[0] + self.classifier.intercepts_[0], 0)

  def score(self, images01_NHWC, labels_N) -> dict[str, float]:
    """{"sample_accuracy", "sample_frechet"} of images (pixels in [0, 1]) that were made to be classes `labels_N`."""
    labels_N = np.asarray(labels_N).reshape(-1)
    if len(labels_N) != len(images01_NHWC) or len(labels_N) < 2:
      raise ValueError(f"need one label per image and at least 2 images, got {len(images01_NHWC)} images and "
                       f"{len(labels_N)} labels")
    accuracy = float(np.mean(self.predict(images01_NHWC) == labels_N))
    return {"sample_accuracy": accuracy,
            "sample_frechet": frechet_distance(self.features(images01_NHWC), self.test_features)}


@functools.cache
def judge() -> Judge:
  """The process's Judge, fitted on first use."""
  return Judge()


def frechet_distance(a_NF, b_MF) -> float:
  """Frechet distance between Gaussians fitted to the rows of `a_NF` and of `b_MF` (features F), in float64.

  tr((S_a S_b)^(1/2)) is computed as tr((S_a^(1/2) S_b S_a^(1/2))^(1/2)): the two matrices are similar, and the
  second is symmetric positive semi-definite, so symmetric eigendecompositions give it without the complex round-off
  parts a general matrix square root (scipy.linalg.sqrtm of S_a S_b) produces when the covariances are singular
  (fewer images than features).
  """
  a_NF, b_MF = np.asarray(a_NF, np.float64), np.asarray(b_MF, np.float64)
  mu_a, mu_b = a_NF.mean(0), b_MF.mean(0)
  cov_a, cov_b = np.cov(a_NF, rowvar=False), np.cov(b_MF, rowvar=False)
  w, v = np.linalg.eigh(cov_a)
  root_a = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
  middle = root_a @ cov_b @ root_a
  trace_root = np.sqrt(np.clip(np.linalg.eigvalsh((middle + middle.T) / 2), 0, None)).sum()
  distance = np.sum((mu_a - mu_b) ** 2) + np.trace(cov_a) + np.trace(cov_b) - 2 * trace_root
  return float(max(distance, 0.0))  # exact arithmetic never goes below 0; round-off can, by ~1e-12
