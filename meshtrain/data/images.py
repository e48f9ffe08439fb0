"""Image sources: labelled images of a TFDS dataset (or random ones) as deterministic batches for task=dit.

A source maps a global example index to one (image, label); the batch at step k holds examples
[k * B, (k + 1) * B), so it is a pure function of (seed, k), as for text (meshtrain/data/sources.py): rows
[start, stop) of it can be loaded by any process, and nothing but the step is needed to resume. With shuffle=True
example i is record perm_e[i mod N] of the split, perm_e a fresh permutation of its N records in epoch e = i // N,
seeded by (seed, dataset, split) like the text sources; without it, records in order, wrapping around.

Rows are {"images": float32[n, H, W, C] in [-1, 1], "labels": int32[n], "seeds": uint32[n]}. `seeds[r]` is the
row's own 32-bit seed, a hash of (seed, split, global example index): the DiT task draws the row's noise, time and
label dropout from it (meshtrain/families/dit.py), so a row's loss is the same on any layout, micro-batching or
process count, and the training step needs no PRNG state.

Any TFDS dataset with an image feature (data.image_key, uint8, fixed size) and a ClassLabel feature
(data.label_key) works: `digits` is built locally on first use (meshtrain/data/digits.py); others must be prepared
as array_record under data.data_dir (meshtrain never downloads). Records are read by random access
(`tfds.data_source`). `data.name=synthetic` gives uniform noise images with random labels and needs no files
(benchmarks; the GPU machines have no TFDS).
"""
import numpy as np

from meshtrain import config
from meshtrain.data import digits, sources, tfds_access
from meshtrain.errors import UserError

# A split whose pixels take at most this many bytes is decoded once, when its source is made, and then served from
# memory: decoding a stored PNG costs 0.2-1 ms per image (a 128-image digits batch took 85 ms on the 2-core
# machine, longer than a small DiT step), a lookup microseconds. digits (92 KB), MNIST (47 MB) and CIFAR-10
# (154 MB: no) show the scale; larger splits are decoded per read, on the input pipeline's threads.
DECODED_CACHE_BYTES = 64 << 20


def row_seeds(seed: int, split: str, first: int, count: int) -> np.ndarray:
  """uint32[count]: the seeds of global examples first .. first + count - 1 of `split` (see the module doc)."""
  return np.array([sources.derive_seed(seed, split, "noise", first + r) for r in range(count)], np.uint32)


def to_unit_range(images_uint8: np.ndarray) -> np.ndarray:
  """uint8 pixels 0..255 -> float32 in [-1, 1] (0 -> -1, 255 -> 1): the range the diffusion model works in."""
  return images_uint8.astype(np.float32) * np.float32(2 / 255) - np.float32(1)


class ImageSource:
  """Global example index -> (image uint8[H, W, C] or float32 in [-1, 1], its target); batches are made by `rows`.

  The target is a class label (task=dit: int32, batch key "labels") or a caption's ids (task=t2i: int32[S],
  batch key "captions"): `target_key` and `target_shape` say which."""

  name: str
  split: str
  image_shape: tuple[int, int, int]   # (H, W, C)
  num_classes: int
  num_examples: int | None            # None: endless (synthetic)
  target_key = "labels"
  target_shape: tuple[int, ...] = ()
  # task=t2i with a frozen text encoder: the target is the caption's row of this cache of its features
  # (meshtrain/data/text_features.py), which `rows` turns into "text_features" and "text_keep".
  text_cache = None

  def __init__(self, seed: int):
    self.seed = seed

  def example(self, example_index: int) -> tuple[np.ndarray, int | np.ndarray]:
    raise NotImplementedError

  def rows(self, step: int, batch_size: int, start: int = 0, stop: int | None = None) -> dict[str, np.ndarray]:
    """Rows [start, stop) of the global batch at `step`: {"images" float32[n, H, W, C] in [-1, 1],
    target_key int32[n, *target_shape], "seeds" uint32[n]}, n = stop - start."""
    stop = batch_size if stop is None else stop
    if step < 0 or not 0 <= start <= stop <= batch_size:
      raise ValueError(f"bad rows request: step={step}, rows [{start}, {stop}) of a batch of {batch_size}")
    first = step * batch_size + start
    images_NHWC = np.empty((stop - start, *self.image_shape), np.float32)
    targets = np.empty((stop - start, *self.target_shape), np.int32)
    for r in range(stop - start):
      image, targets[r] = self.example(first + r)
      images_NHWC[r] = to_unit_range(image) if image.dtype == np.uint8 else image
    text = {self.target_key: targets} if self.text_cache is None else self.text_cache.take(targets)
    return {"images": images_NHWC, **text, "seeds": row_seeds(self.seed, self.split, first, stop - start)}


def caption_ids(text: str, length: int) -> np.ndarray:
  """int32[length]: the caption's UTF-8 bytes as ids 1..256 (0 is padding), cut at `length` bytes: what the text
  encoder of task=t2i reads (meshtrain/models/flux.py)."""
  data = text.encode("utf-8")[:length]
  ids = np.zeros(length, np.int32)
  ids[:len(data)] = np.frombuffer(data, np.uint8).astype(np.int32) + 1
  return ids


def caption_text(value) -> str:
  """A TFDS Text feature's value as read (bytes) as a string."""
  return value.decode("utf-8") if isinstance(value, bytes) else str(value)


class Captions:
  """Captions -> the text condition a t2i batch holds (numpy, the keys of meshtrain/families/t2i.py `text_keys`):
  the own encoder's caption ids {"captions": int32[N, S]}, or the frozen encoder's {"text_features": float32[N, S,
  G], "text_keep": bool[N, S]}, computed as the training data's cache computed them. What sampling, the training
  run's sample grid and the server turn prompts into; the language model is loaded on the first prompts."""

  def __init__(self, model_cfg):
    self.model_cfg = model_cfg
    self._frozen = None

  def __call__(self, captions: list[str]) -> dict[str, np.ndarray]:
    m = self.model_cfg
    if m.text_encoder == "own":
      return {"captions": np.stack([caption_ids(t, m.text_len) for t in captions]).astype(np.int32)}
    if self._frozen is None:
      from meshtrain.data import text_features  # pylint: disable=g-import-not-at-top  (JAX, the checkpoint reader)
      self._frozen = text_features.FrozenTextEncoder(m)
    return self._frozen(captions)

  def blank(self, n: int) -> dict[str, np.ndarray]:
    """The same arrays for n rows, all zeros: padding rows, and the inputs a sampler is compiled and warmed with."""
    from meshtrain.families import t2i  # pylint: disable=g-import-not-at-top  (JAX: the batch's shapes are its)
    c = t2i.FluxConfig.from_config(self.model_cfg)
    spec = t2i.batch_spec(c, n)
    return {k: np.zeros(spec[k].shape, spec[k].dtype) for k in t2i.text_keys(c)}


class SyntheticImageSource(ImageSource):
  """Uniform noise in [-1, 1] and uniform labels (or, with text_len, random printable captions of that many bytes), a
  function of (seed, split, index); no files, endless."""

  def __init__(self, seed: int, split: str, image_shape: tuple[int, int, int], num_classes: int, text_len: int = 0,
               text_cache=None):
    """text_cache: a frozen text encoder's stand-in (random features); each image takes one of its rows."""
    super().__init__(seed)
    self.name, self.split, self.image_shape = sources.SYNTHETIC, split, tuple(image_shape)
    self.num_classes = num_classes
    self.num_examples = None
    self.text_len, self.text_cache = text_len, text_cache
    if text_len:
      self.target_key, self.target_shape = "captions", (text_len,)
    if text_cache is not None:
      self.target_key, self.target_shape = "caption_rows", ()
    self._seed = sources.derive_seed("synthetic_images", seed, split)

  def example(self, example_index: int) -> tuple[np.ndarray, int | np.ndarray]:
    rng = np.random.default_rng([self._seed, example_index])
    image = rng.uniform(-1, 1, self.image_shape).astype(np.float32)
    if self.text_cache is not None:
      return image, int(rng.integers(len(self.text_cache.keep)))
    if self.text_len:
      return image, caption_ids(bytes(rng.integers(32, 127, self.text_len).tolist()).decode(), self.text_len)
    return image, int(rng.integers(self.num_classes))


class TfdsImageSource(ImageSource):
  """The records of one split of a TFDS image dataset, read by random access in per-epoch permuted order."""

  def __init__(self, data_source, *, name: str, split: str, image_key: str, label_key: str,
               image_shape: tuple[int, int, int], num_classes: int, seed: int, shuffle: bool, text_len: int = 0,
               text_cache=None):
    """label_key: the ClassLabel feature; with text_len > 0, the caption (Text) feature, read as caption_ids, or
    with text_cache, as its row of the cache."""
    super().__init__(seed)
    self.name, self.split, self.image_key, self.label_key = name, split, image_key, label_key
    self.text_len, self.text_cache = text_len, text_cache
    if text_len:
      self.target_key, self.target_shape = "captions", (text_len,)
    if text_cache is not None:
      self.target_key, self.target_shape = "caption_rows", ()
    self.image_shape, self.num_classes, self.shuffle = tuple(image_shape), num_classes, shuffle
    self._records = data_source
    self.num_examples = len(data_source)
    if self.num_examples == 0:
      raise UserError(f"data split {split!r} of dataset {name!r} holds no images; set data.train_split / "
                      "data.eval_split to a non-empty split or slice")
    self._decoded = None  # (images uint8[N, H, W, C], targets [N, ...]) when the split is small enough to keep
    if self.num_examples * int(np.prod(self.image_shape)) <= DECODED_CACHE_BYTES:
      decoded = [self._read(i) for i in range(self.num_examples)]
      self._decoded = (np.stack([image for image, _ in decoded]), np.stack([target for _, target in decoded]))
    # The order is seeded like the text sources' (packing.TfdsSource), so the two families share one convention.
    self._order_seed = sources.derive_seed("order", seed, name, split)
    self._large_order = None
    if shuffle and self.num_examples >= sources.SMALL_PERMUTATION:
      import grain  # pylint: disable=g-import-not-at-top
      # Random access in O(1) memory; grain folds the epoch (index // N) into the seed.
      self._large_order = grain.MapDataset.range(self.num_examples).shuffle(seed=self._order_seed)

  def record_index(self, example_index: int) -> int:
    """The record of the split that global example `example_index` reads."""
    n = self.num_examples
    if not self.shuffle:
      return example_index % n
    if self._large_order is not None:
      return int(self._large_order[example_index])
    permutation = sources.permutation(self._order_seed, example_index // n, n)
    return int(permutation[example_index % n])

  def example(self, example_index: int) -> tuple[np.ndarray, int | np.ndarray]:
    record = self.record_index(example_index)
    if self._decoded is not None:
      return self._decoded[0][record], self._decoded[1][record]
    return self._read(record)

  def _read(self, record: int) -> tuple[np.ndarray, int | np.ndarray]:
    """(image uint8[H, W, C], label or caption ids) of record `record` of the split, read and decoded from the
    dataset's files."""
    values = self._records[record]
    image, target = np.asarray(values[self.image_key]), values[self.label_key]
    if self.text_len:
      text = caption_text(target)
      target = caption_ids(text, self.text_len) if self.text_cache is None else self.text_cache.row(text)
    else:
      target = int(target)
    if image.shape != self.image_shape:
      # A dataset whose info declares the shape cannot hold another; this guards datasets written by hand.
      raise RuntimeError(f"record {record} of {self.name}/{self.split} has an image of shape {image.shape}, not the "
                         f"{self.image_shape} its features declare")
    return image, target


# --- making sources ------------------------------------------------------------------------------------------


def make_source(cfg, split: str, shuffle: bool) -> ImageSource:
  """The image source for `split` of cfg.data.name (digits is built first if needed), its features checked against
  cfg.data.image_key / label_key and the model (image_size, channels, num_classes). task=t2i: captioned images."""
  data, model = cfg.data, cfg.model
  if cfg.task == "t2i":
    return make_captioned_source(cfg, split, shuffle)
  expected = (model.image_size, model.image_size, model.channels)
  if data.name == sources.SYNTHETIC:
    return SyntheticImageSource(cfg.seed, split, expected, model.num_classes)
  if data.name == digits.NAME:
    digits.build(data.data_dir)
  ds = tfds_access.open_tfds(data.name, split, data.data_dir)
  image_shape, num_classes = check_features(data.name, ds.dataset_info.features, data.image_key, data.label_key)
  check_model(data.name, image_shape, num_classes, model)
  return TfdsImageSource(ds, name=data.name, split=split, image_key=data.image_key, label_key=data.label_key,
                         image_shape=image_shape, num_classes=num_classes, seed=cfg.seed, shuffle=shuffle)


def check_features(name: str, features, image_key: str, label_key: str) -> tuple[tuple[int, int, int], int]:
  """((H, W, C), num_classes) of dataset `name`'s image feature `image_key` and ClassLabel `label_key`; UserError,
  naming the features it has and the flag to set, when either is missing or of another kind."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  items = dict(features.items()) if hasattr(features, "items") else {}
  listing = "its features are: " + (", ".join(f"{k} ({type(f).__name__})" for k, f in items.items()) or "none")
  for flag, key, kind, (article, noun), without in (
      ("image_key", image_key, tfds.features.Image, ("an", "image"), "it has no image feature, so it cannot train an "
       "image model (task=dit); use data.name=digits or a TFDS image dataset"),
      ("label_key", label_key, tfds.features.ClassLabel, ("a", "ClassLabel"), "it has no ClassLabel feature, and the "
       "class-conditional model (task=dit) needs one; use data.name=digits or a TFDS image dataset with class labels")):
    if not isinstance(items.get(key), kind):
      what = "no feature" if key not in items else f"a feature that is not {article} {noun} at"
      matching = [k for k, f in items.items() if isinstance(f, kind)]
      fix = f"set --config.data.{flag} to one of its {noun} features ({', '.join(matching)})" if matching else without
      raise UserError(f"dataset {name!r} has {what} data.{flag}={key!r}; {listing}; {fix}")
  image = items[image_key]
  shape = tuple(image.shape)
  if len(shape) != 3 or any(d is None for d in shape):
    raise UserError(f"feature data.image_key={image_key!r} of dataset {name!r} has images of shape {shape} (None: "
                    "varies); the model needs one fixed size, so prepare the dataset with fixed-size images")
  if np.dtype(image.np_dtype) != np.uint8:
    raise UserError(f"feature data.image_key={image_key!r} of dataset {name!r} holds {np.dtype(image.np_dtype)} "
                    "pixels; only 8-bit images (uint8, 0..255) are read")
  return shape, int(items[label_key].num_classes)


def check_model(name: str, image_shape: tuple[int, int, int], num_classes: int, model) -> None:
  """UserError when the model cannot take the dataset's images or labels (cfg.model: image_size, channels,
  num_classes)."""
  check_image_size(name, image_shape, model)
  if num_classes > model.num_classes:
    raise UserError(f"dataset {name!r} has {num_classes} classes (labels 0..{num_classes - 1}), more than "
                    f"model.num_classes={model.num_classes}; set --config.model.num_classes={num_classes}")


def check_image_size(name: str, image_shape: tuple[int, int, int], model) -> None:
  """UserError when the dataset's images are not the model's square model.image_size x model.channels."""
  height, width, channels = image_shape
  if height != width:
    raise UserError(f"dataset {name!r} has {height}x{width} images; the model takes square images "
                    "(model.image_size), so use a dataset of square images")
  if (height, channels) != (model.image_size, model.channels):
    raise UserError(f"dataset {name!r} has {height}x{width} images with {channels} channel(s), but the model takes "
                    f"model.image_size={model.image_size}, model.channels={model.channels}; set "
                    f"--config.model.image_size={height} --config.model.channels={channels}")


def make_captioned_source(cfg, split: str, shuffle: bool) -> ImageSource:
  """task=t2i: the captioned images of cfg.data.name: `shapes` (built locally first), a folder or rows of your own
  pictures (converted once: meshtrain/data/captioned.py), a TFDS dataset with an image and a Text feature
  (data.image_key, data.caption_key), or synthetic."""
  data, model = cfg.data, cfg.model
  if model.pipeline:
    raise UserError(f"model.pipeline={model.pipeline!r}: training on a Flux.1 pipeline's latents (its VAE and text "
                    "encoders' cached outputs) is not built yet; sample the model with python -m meshtrain.sample, or "
                    "export it with python -m meshtrain.convert to-diffusers")
  expected = (model.image_size, model.image_size, model.channels)
  frozen = model.text_encoder != "own"
  if frozen:
    from meshtrain.data import text_features  # pylint: disable=g-import-not-at-top  (JAX)
    text_features.source_meta(model)  # a wrong encoder is refused before any picture is converted
  if data.name == sources.SYNTHETIC:
    cache = text_features.synthetic_cache(model, cfg.seed) if frozen else None
    return SyntheticImageSource(cfg.seed, split, expected, 1, text_len=model.text_len, text_cache=cache)
  from meshtrain.data import captioned, shapes  # pylint: disable=g-import-not-at-top  (Pillow: not on GPU machines)
  if config.is_path(data.name):
    ds, keys = captioned.open_split(cfg, split), (captioned.IMAGE, captioned.TEXT)
  else:
    if data.name == shapes.NAME:
      shapes.build(data.data_dir)
    ds, keys = tfds_access.open_tfds(data.name, split, data.data_dir), (data.image_key, data.caption_key)
  image_shape = check_caption_features(data.name, ds.dataset_info.features, *keys)
  check_image_size(data.name, image_shape, model)
  cache = None
  if frozen:
    info = ds.dataset_info
    dataset = {"name": info.full_name, "dir": str(info.data_dir), "split": split, "records": len(ds),
               "bytes": [int(s.num_bytes) for s in info.splits.values()]}
    cache = text_features.cached(cfg, dataset, lambda: [caption_text(ds[i][keys[1]]) for i in range(len(ds))])
  return TfdsImageSource(ds, name=data.name, split=split, image_key=keys[0], label_key=keys[1],
                         image_shape=image_shape, num_classes=1, seed=cfg.seed, shuffle=shuffle,
                         text_len=model.text_len, text_cache=cache)


def check_caption_features(name: str, features, image_key: str, caption_key: str) -> tuple[int, int, int]:
  """(H, W, C) of dataset `name`'s fixed-size uint8 image feature `image_key`, which also has a Text feature
  `caption_key`; UserError naming its features and the flag to set otherwise."""
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top

  items = dict(features.items()) if hasattr(features, "items") else {}
  listing = "its features are: " + (", ".join(f"{k} ({type(f).__name__})" for k, f in items.items()) or "none")
  texts = [k for k, f in items.items() if isinstance(f, tfds.features.Text)]
  if not isinstance(items.get(caption_key), tfds.features.Text):
    fix = (f"set --config.data.caption_key to one of its text features ({', '.join(texts)})" if texts else
           "task=t2i needs captions; use data.name=shapes or a folder of your own captioned pictures")
    raise UserError(f"dataset {name!r} has no text feature data.caption_key={caption_key!r}; {listing}; {fix}")
  image = items.get(image_key)
  if not isinstance(image, tfds.features.Image):
    raise UserError(f"dataset {name!r} has no image feature data.image_key={image_key!r}; {listing}")
  shape = tuple(image.shape)
  if len(shape) != 3 or any(d is None for d in shape) or np.dtype(image.np_dtype) != np.uint8:
    raise UserError(f"feature data.image_key={image_key!r} of dataset {name!r} holds {shape} images of "
                    f"{np.dtype(image.np_dtype)}; task=t2i reads fixed-size uint8 images (or give your pictures as "
                    "a folder: they are resized to model.image_size)")
  return shape
