"""Image data: the locally built digits TFDS dataset, image sources (batch = f(seed, step), epoch permutations,
per-row seeds), any TFDS image dataset through mocks, feature/model checks, and per-key batch shardings."""

import jax
import ml_collections
import numpy as np
import pytest
import tensorflow_datasets as tfds
import two_processes
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain import mesh as mesh_lib
from meshtrain.config import base_config
from meshtrain.data import Batches, digits, global_batch, images, make_source, process_rows, sources
from meshtrain.errors import UserError


def image_cfg(data_dir, name="digits", image_size=8, channels=1, num_classes=10, seed=0, **data):
  """A task=dit config as core's base_config and configs/dit_digits.py will have it (set here by hand)."""
  cfg = base_config()
  cfg.task = "dit"
  cfg.seed = seed
  cfg.data.name, cfg.data.data_dir = name, str(data_dir)
  cfg.data.image_key, cfg.data.label_key = "image", "label"
  cfg.data.train_split, cfg.data.eval_split = "train", "test"
  for key, value in data.items():
    cfg.data[key] = value
  cfg.model = ml_collections.ConfigDict(dict(image_size=image_size, channels=channels, num_classes=num_classes))
  return cfg


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory):
  data_dir = tmp_path_factory.mktemp("tfds")
  digits.build(str(data_dir))
  return data_dir


@pytest.fixture(scope="module")
def train_src(digits_dir):
  """The digits train source of image_cfg (each source decodes its split once: ~1 s, so tests share it)."""
  return make_source(image_cfg(digits_dir), "train", shuffle=True)


# --- the digits dataset ------------------------------------------------------------------------------------------


def test_digits_dataset_is_load_split(digits_dir, monkeypatch):
  for split, count in (("train", 1433), ("test", 364)):
    ds = tfds.data_source("digits", split=split, data_dir=str(digits_dir), download=False)
    want_images, want_labels = digits.load_split(split)
    assert len(ds) == count == len(want_labels)
    got_images = np.stack([ds[i]["image"] for i in range(len(ds))])
    got_labels = np.array([ds[i]["label"] for i in range(len(ds))])
    # Lossless (PNG) and in load_split's order, so record i of a split is image i of the split.
    assert got_images.dtype == np.uint8 and (got_images == want_images).all() and (got_labels == want_labels).all()
  features = ds.dataset_info.features
  assert features["image"].shape == (8, 8, 1) and features["label"].num_classes == 10
  assert want_images.max() == 255 and want_images.min() == 0
  assert set(np.bincount(want_labels)) <= {35, 36, 37}  # stratified: ~20% of every class in test
  # Built once: a second build reuses the files (generating again would fail here), as python_stdlib does.
  monkeypatch.setattr(digits.builder_class(), "_split_generators", lambda *a: pytest.fail("rebuilt"))
  assert digits.build(str(digits_dir)).info.splits["test"].num_examples == 364
  assert (digits_dir / ".digits.lock").exists() and not list(digits_dir.glob("**/*incomplete*"))


def test_digits_build_refuses_unwritable_dir(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("")
  with pytest.raises(UserError, match=r"digits dataset cannot be built there.*data\.data_dir"):
    digits.build(str(blocker / "tfds"))


# --- image sources -----------------------------------------------------------------------------------------------


def test_digits_rows(train_src):
  src = train_src  # made by select.make_source, which dispatches on task=dit
  assert isinstance(src, images.TfdsImageSource) and src.num_examples == 1433
  batch = src.rows(3, 16)
  assert batch["images"].shape == (16, 8, 8, 1) and batch["images"].dtype == np.float32
  assert batch["labels"].shape == (16,) and batch["labels"].dtype == np.int32
  assert batch["seeds"].shape == (16,) and batch["seeds"].dtype == np.uint32
  assert batch["images"].min() == -1.0 and batch["images"].max() == 1.0  # 0 -> -1, 255 -> 1
  # Each row is its record of the split, scaled: labels and pixels come from the same record.
  train_images, train_labels = digits.load_split("train")
  records = [src.record_index(3 * 16 + r) for r in range(16)]
  assert (batch["labels"] == train_labels[records]).all()
  np.testing.assert_allclose(batch["images"], train_images[records] / 127.5 - 1, atol=1e-6)
  # seeds[r] is a hash of (seed, split, global example index).
  assert batch["seeds"][5] == sources.derive_seed(0, "train", "noise", 3 * 16 + 5)
  assert len(set(batch["seeds"].tolist())) == 16


def test_reads_without_the_decoded_cache_agree(digits_dir, train_src, monkeypatch):
  cached = train_src
  monkeypatch.setattr(images, "DECODED_CACHE_BYTES", 8 * 8 - 1)  # too small for one image: every read decodes
  uncached = make_source(image_cfg(digits_dir), "train", shuffle=True)
  assert cached._decoded is not None and uncached._decoded is None
  a, b = cached.rows(4, 32), uncached.rows(4, 32)
  assert all((a[k] == b[k]).all() for k in a)  # a fresh source, read another way: batch = f(seed, step)
  part = uncached.rows(4, 32, 9, 20)  # any process can load any rows of it
  assert all((part[k] == a[k][9:20]).all() for k in a)


def test_another_seed_another_order(digits_dir, train_src):
  first = train_src.rows(7, 12)
  assert not (train_src.rows(8, 12)["seeds"] == first["seeds"]).any()
  other = make_source(image_cfg(digits_dir, seed=1), "train", shuffle=True).rows(7, 12)
  assert not (other["labels"] == first["labels"]).all() and not (other["seeds"] == first["seeds"]).any()


def test_epochs_are_permutations(train_src):
  src = train_src
  n = src.num_examples
  epoch0 = [src.record_index(i) for i in range(n)]
  epoch1 = [src.record_index(n + i) for i in range(n)]
  assert sorted(epoch0) == sorted(epoch1) == list(range(n))  # every record once per epoch
  assert epoch0 != epoch1 and epoch0 != list(range(n))       # a fresh order each epoch


def test_large_splits_permute_without_a_table(tmp_path, monkeypatch):
  """From SMALL_PERMUTATION records on, grain's index shuffle (O(1) memory) orders each epoch instead."""
  monkeypatch.setattr(sources, "SMALL_PERMUTATION", 16)
  with tfds.testing.mock_data(num_examples=40):
    src = make_source(image_cfg(tmp_path, name="mnist", image_size=28), "train", shuffle=True)
  assert src._large_order is not None
  epochs = [[src.record_index(e * 40 + i) for i in range(40)] for e in range(2)]
  assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(40)) and epochs[0] != epochs[1]
  assert epochs[0] != list(range(40))


def test_eval_split_in_order(digits_dir):
  src = make_source(image_cfg(digits_dir), "test", shuffle=False)
  test_images, test_labels = digits.load_split("test")
  batch = src.rows(0, 8)
  assert (batch["labels"] == test_labels[:8]).all()
  np.testing.assert_allclose(batch["images"], test_images[:8] / 127.5 - 1, atol=1e-6)
  assert (src.rows(1, 364)["labels"] == test_labels).all()  # wraps around: step 1 of 364 is the split again
  assert not (src.rows(1, 364)["seeds"] == src.rows(0, 364)["seeds"]).any()  # with fresh noise


def test_synthetic_images():
  cfg = image_cfg("", name="synthetic", image_size=4, channels=3, num_classes=7)
  src = make_source(cfg, "train", shuffle=True)
  batch = src.rows(2, 64)
  assert batch["images"].shape == (64, 4, 4, 3) and batch["images"].dtype == np.float32
  assert -1 <= batch["images"].min() < -0.9 and 0.9 < batch["images"].max() <= 1
  assert set(batch["labels"].tolist()) == set(range(7))
  assert (make_source(cfg, "train", shuffle=True).rows(2, 64)["images"] == batch["images"]).all()
  assert not (src.rows(3, 64)["images"] == batch["images"]).any()


# --- any TFDS image dataset (mocks) ------------------------------------------------------------------------------


def test_tfds_image_dataset_through_mock_data(tmp_path):
  cfg = image_cfg(tmp_path, name="mnist", image_size=28)
  with tfds.testing.mock_data(num_examples=30):
    src = make_source(cfg, "train", shuffle=True)
    batch = src.rows(1, 8)
    ds = tfds.data_source("mnist", split="train", download=False)
    record = ds[src.record_index(8 + 3)]
  assert src.num_examples == 30
  assert batch["images"].shape == (8, 28, 28, 1) and batch["labels"].dtype == np.int32
  assert batch["labels"][3] == record["label"]
  np.testing.assert_allclose(batch["images"][3], record["image"] / 127.5 - 1, atol=1e-6)


@pytest.mark.parametrize("name, overrides, message", [
    ("mnist", dict(image_size=8), r"dataset 'mnist' has 28x28 images with 1 channel\(s\), but the model takes "
                                  r"model.image_size=8, model.channels=1; set --config.model.image_size=28 "
                                  r"--config.model.channels=1"),
    ("mnist", dict(image_size=28, channels=3), r"set --config.model.image_size=28 --config.model.channels=1"),
    ("mnist", dict(image_size=28, num_classes=5), r"has 10 classes \(labels 0..9\), more than model.num_classes=5; "
                                                  r"set --config.model.num_classes=10"),
    ("mnist", dict(image_size=28, image_key="picture"),
     r"has no feature data.image_key='picture'; its features are: image \(Image\), label \(ClassLabel\); set "
     r"--config.data.image_key to one of its image features \(image\)"),
    ("mnist", dict(image_size=28, label_key="image"),
     r"has a feature that is not a ClassLabel at data.label_key='image'.*set --config.data.label_key to one of its "
     r"ClassLabel features \(label\)"),
    ("lm1b", {}, r"dataset 'lm1b' has no feature data.image_key='image'; its features are: text \(Text\); it has no "
                 r"image feature, so it cannot train an image model"),
])
def test_bad_image_dataset(tmp_path, name, overrides, message):
  model = {k: overrides.pop(k) for k in ("image_size", "channels", "num_classes") if k in overrides}
  cfg = image_cfg(tmp_path, name=name, **model, **overrides)
  with tfds.testing.mock_data(num_examples=4), pytest.raises(UserError, match=message) as error:
    make_source(cfg, "train", shuffle=True)
  assert "\n" not in str(error.value)


def test_missing_split_names_the_splits(digits_dir):
  cfg = image_cfg(digits_dir)
  with pytest.raises(UserError, match="dataset 'digits' has no split 'validation'; its splits are: test, train"):
    make_source(cfg, "validation", shuffle=False)


# --- global batches with per-key shardings -----------------------------------------------------------------------


def test_global_batch_per_key_shardings(train_src):
  mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 4})
  rows = P(("data", "fsdp"))
  shardings = {"images": NamedSharding(mesh, P(("data", "fsdp"), None, None, None)),
               "labels": NamedSharding(mesh, rows), "seeds": NamedSharding(mesh, rows)}
  src = train_src
  assert process_rows(shardings, 16) == (0, 16)
  batch = global_batch(src, 5, 16, shardings)
  want = src.rows(5, 16)
  for key, array in batch.items():
    assert array.sharding == shardings[key] and array.shape == want[key].shape
    assert (np.asarray(array) == want[key]).all()
  assert {s.data.shape for s in batch["images"].addressable_shards} == {(2, 8, 8, 1)}
  with Batches(src, 5, 16, shardings) as it:
    (step, first), (step2, second) = next(it), next(it)
  assert (step, step2) == (5, 6)
  assert all((np.asarray(first[k]) == want[k]).all() for k in want)
  assert (np.asarray(second["labels"]) == src.rows(6, 16)["labels"]).all()
  with pytest.raises(ValueError, match=r"batch keys \['images', 'labels', 'seeds'\] and sharding keys"):
    global_batch(src, 5, 16, {"images": shardings["images"]})


def test_one_sharding_still_means_every_key(train_src):
  """The LM's form: one NamedSharding for all keys; a 1-D batch-axis spec also fits 4-D images."""
  mesh = mesh_lib.make_mesh({"data": 8})
  sharding = NamedSharding(mesh, P("data"))
  src = train_src
  batch = global_batch(src, 0, 8, sharding)
  assert batch["images"].shape == (8, 8, 8, 1) and batch["labels"].shape == (8,)
  assert (np.asarray(batch["seeds"]) == src.rows(0, 8)["seeds"]).all()
  assert jax.tree.all(jax.tree.map(lambda a: a.sharding == sharding, batch))


_TWO_PROCESS_SCRIPT = """
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from meshtrain.config import base_config
from meshtrain.data import Batches, global_batch, make_source, process_rows
cfg = base_config()
cfg.task, cfg.data.name, cfg.data.data_dir = "dit", "digits", sys.argv[3]
cfg.data.image_key, cfg.data.label_key = "image", "label"
cfg.model = ml_collections.ConfigDict(dict(image_size=8, channels=1, num_classes=10))
src = make_source(cfg, "train", shuffle=True)
mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
rows = ("data", "fsdp")
shardings = {"images": NamedSharding(mesh, P(rows, None, None, None)), "labels": NamedSharding(mesh, P(rows)),
             "seeds": NamedSharding(mesh, P(rows))}
print("rows", process_rows(shardings, 16), flush=True)
with Batches(src, 11, 16, shardings) as batches:
  for batch in (global_batch(src, 11, 16, shardings), next(batches)[1]):
    for key, want in src.rows(11, 16).items():
      assert (np.asarray(multihost_utils.process_allgather(batch[key], tiled=True)) == want).all(), key
print("same batch", flush=True)
"""


def test_two_processes_assemble_the_same_image_batch(digits_dir, tmp_path):
  outs = two_processes.run(_TWO_PROCESS_SCRIPT, tmp_path, str(digits_dir))
  assert all("same batch" in out for out in outs)
  assert "rows (0, 8)" in outs[0] and "rows (8, 16)" in outs[1]


DIT_CONFIG = '''
from meshtrain.config import base_config
from meshtrain import presets


def get_config():
  c = base_config()
  c.task = "dit"
  c.model = presets.dit_model_config("digits")
  c.data.name, c.data.train_split, c.data.eval_split = "digits", "train", "test"
  c.steps, c.batch_size, c.optimizer.warmup_steps = 2, 8, 1
  return c
'''


@pytest.mark.parametrize("flags, message", [
    (["--config.data.image_key=picture"], "error: dataset 'digits' has no feature data.image_key='picture'; its "
     "features are: image (Image), label (ClassLabel); set --config.data.image_key to one of its image features "
     "(image)"),
    (["--config.model.image_size=16", "--config.model.patch_size=4"], "error: dataset 'digits' has 8x8 images with "
     "1 channel(s), but the model takes model.image_size=16, model.channels=1; set --config.model.image_size=8 "
     "--config.model.channels=1"),
    (["--config.model.num_classes=4"], "error: dataset 'digits' has 10 classes (labels 0..9), more than "
     "model.num_classes=4; set --config.model.num_classes=10"),
])
def test_train_refuses_bad_image_data(digits_dir, tmp_path, capsys, flags, message):
  """Through the train command: exit 2 and one line, before anything is compiled."""
  pytest.importorskip("meshtrain.families.dit")
  from meshtrain.cli import train  # pylint: disable=g-import-not-at-top
  (tmp_path / "dit.py").write_text(DIT_CONFIG)
  assert train.main(["--config", str(tmp_path / "dit.py"), "--workdir", str(tmp_path / "run"),
                     f"--config.data.data_dir={digits_dir}", *flags]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1] == message and sum(line.startswith("error:") for line in err) == 1, err
