"""The digits judge: real digits score high accuracy and a small Frechet distance, noise scores chance and a large
one; the Frechet distance matches the textbook formula."""
import numpy as np
import pytest
import scipy.linalg

from meshtrain.data import digits
from meshtrain.inference import quality


@pytest.fixture(scope="module")
def judge():
  return quality.judge()


def per_class(images, labels, k):
  """The first k images of each class, grouped by class (what a sample grid holds)."""
  keep = np.concatenate([np.flatnonzero(labels == c)[:k] for c in range(10)])
  return images[keep], labels[keep]


def test_real_digits_score_high(judge):
  test_images, test_labels = digits.load_split("test")
  on_test = judge.score(test_images / 255, test_labels)
  assert on_test["sample_accuracy"] >= 0.95
  assert on_test["sample_frechet"] < 1e-6  # the test split against itself
  train_images, train_labels = digits.load_split("train")
  assert judge.score(train_images / 255, train_labels)["sample_accuracy"] >= 0.99  # what it was fitted on
  # 100 real digits it never scored against (train, 10 per class): high accuracy, a small distance.
  images, labels = per_class(train_images / 255, train_labels, 10)
  real = judge.score(images, labels)
  assert real["sample_accuracy"] >= 0.95 and real["sample_frechet"] < 3
  # Right images, wrong classes: accuracy is about the labels asked for.
  assert judge.score(images, (labels + 1) % 10)["sample_accuracy"] <= 0.05
  assert judge.score(images, (labels + 1) % 10)["sample_frechet"] == real["sample_frechet"]


def test_noise_scores_chance(judge):
  rng = np.random.default_rng(0)
  labels = np.repeat(np.arange(10), 10)
  noise = judge.score(rng.uniform(0, 1, (100, 8, 8, 1)), labels)
  assert 0.0 <= noise["sample_accuracy"] <= 0.25
  real = digits.load_split("train")
  images, labels = per_class(real[0] / 255, real[1], 10)
  assert noise["sample_frechet"] > 10 and noise["sample_frechet"] > 5 * judge.score(images, labels)["sample_frechet"]
  # Blank images are no digits either: the distance sees what accuracy may not.
  assert judge.score(np.zeros((100, 8, 8, 1)), labels)["sample_frechet"] > 10


def test_overshoot_is_clipped(judge):
  images, labels = per_class(*digits.load_split("test"), 5)
  images = images / 255
  stretched = np.where(images > 0.5, images + 0.3, images - 0.3)  # a sampler's overshoot past [0, 1]
  np.testing.assert_allclose(judge.features(stretched), judge.features(np.clip(stretched, 0, 1)))


def test_frechet_matches_the_reference_formula():
  rng = np.random.default_rng(1)
  a = rng.normal(size=(50, 6)) @ rng.normal(size=(6, 6))
  b = rng.normal(loc=0.5, size=(40, 6)) @ rng.normal(size=(6, 6))
  mu_a, mu_b = a.mean(0), b.mean(0)
  cov_a, cov_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
  reference = (np.sum((mu_a - mu_b) ** 2) + np.trace(cov_a + cov_b)
               - 2 * np.trace(scipy.linalg.sqrtm(cov_a @ cov_b).real))
  assert quality.frechet_distance(a, b) == pytest.approx(reference, rel=1e-9)
  assert quality.frechet_distance(b, a) == pytest.approx(reference, rel=1e-9)
  assert quality.frechet_distance(a, a) == pytest.approx(0, abs=1e-9)
  # A shift by d moves the means only: the distance grows by |d|^2 exactly.
  shift = np.array([1.0, -2.0, 0, 0, 0, 3.0])
  assert quality.frechet_distance(a + shift, a) == pytest.approx(14.0, rel=1e-9)
  # Singular covariances (fewer rows than features), where sqrtm's result is complex-noisy: still finite, >= 0.
  few = rng.normal(size=(4, 6))
  assert 0 <= quality.frechet_distance(few, b) < np.inf


def test_judge_is_fitted_once_and_checks_shapes(judge):
  assert quality.judge() is judge
  with pytest.raises(ValueError, match=r"images of shape \[N, 8, 8, 1\], not \[3, 28, 28, 1\]"):
    judge.score(np.zeros((3, 28, 28, 1)), np.zeros(3))
  with pytest.raises(ValueError, match="one label per image"):
    judge.score(np.zeros((3, 8, 8, 1)), np.zeros(2))
