"""Data layer: tokenizer, the python_stdlib TFDS corpus, packing, determinism, global batches, errors."""
import pathlib
import re
import sys

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds
import two_processes
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain.config import base_config
from meshtrain.data import (
  BOS_ID,
  EOS_ID,
  PAD_ID,
  VOCAB_SIZE,
  Batches,
  decode,
  encode,
  global_batch,
  make_source,
  packing,
  process_rows,
  sources,
  stdlib_corpus,
  tfds_access,
  tokenization as tokenizer,
)
from meshtrain.errors import UserError
from meshtrain.step import IGNORE_ID


def make_cfg(data_dir, **kw):
  cfg = base_config()
  cfg.data.data_dir = str(data_dir)
  for key, value in kw.items():
    node = cfg
    *parents, leaf = key.split("__")
    for part in parents:
      node = node[part]
    node[leaf] = value
  return cfg


@pytest.fixture(scope="session")
def stdlib_dir(tmp_path_factory):
  data_dir = tmp_path_factory.mktemp("tfds")
  stdlib_corpus.build(str(data_dir))
  return data_dir


def read_texts(data_dir, split):
  ds = tfds.data_source("python_stdlib", split=split, data_dir=str(data_dir), download=False)
  return [(ex["path"].decode(), ex["text"]) for ex in ds]


# --- tokenizer ---------------------------------------------------------------------------------------------------


def test_tokenizer_round_trip():
  text = "def f(x):\n  return 'héllo ✓ 🐍'\n"
  ids = encode(text)
  assert ids.dtype == np.uint16 and len(ids) == len(text.encode())
  assert decode(ids) == text
  assert decode(np.concatenate([[BOS_ID], ids, [EOS_ID, PAD_ID, PAD_ID]])) == text
  assert (encode(text.encode()) == ids).all()
  assert (PAD_ID, EOS_ID, BOS_ID, VOCAB_SIZE) == (256, 257, 258, 259)


# --- the corpus --------------------------------------------------------------------------------------------------


def test_stdlib_corpus_splits(stdlib_dir):
  train, valid = read_texts(stdlib_dir, "train"), read_texts(stdlib_dir, "validation")
  assert train and valid
  train_paths, valid_paths = {p for p, _ in train}, {p for p, _ in valid}
  assert not train_paths & valid_paths
  files = stdlib_corpus.source_files()
  assert train_paths | valid_paths == set(files) and len(train) + len(valid) == len(files)
  assert 0.02 < len(valid) / len(files) < 0.1
  assert all(stdlib_corpus.split_of(p) == "validation" for p in valid_paths)
  assert not any("site-packages" in p.split("/") for p in train_paths)
  root = stdlib_corpus.stdlib_root()
  for path, text in valid[:5]:
    assert text == (root / path).read_bytes().decode("utf-8", errors="replace").encode()


def test_second_build_reuses_files(stdlib_dir, monkeypatch):
  files = sorted(pathlib.Path(stdlib_dir).rglob("*array_record*"))
  before = [f.stat().st_mtime_ns for f in files]

  def fail(*args, **kwargs):
    raise AssertionError("the corpus was generated again")

  monkeypatch.setattr(stdlib_corpus.PythonStdlib, "_split_generators", fail)
  builder = stdlib_corpus.build(str(stdlib_dir))
  assert builder.info.splits["train"].num_examples > 0
  assert [f.stat().st_mtime_ns for f in files] == before


# --- packing -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len", [7, 4096])
def test_packed_rows_reproduce_the_document_stream(stdlib_dir, seq_len, monkeypatch):
  split = "validation[:20]"
  stream = np.concatenate([np.append(np.frombuffer(text, np.uint8).astype(np.int32), EOS_ID)
                           for _, text in read_texts(stdlib_dir, split)])
  src = make_source(make_cfg(stdlib_dir, seq_len=seq_len), split, shuffle=False)
  n = src.num_sequences
  assert n == -(-(len(stream) - 1) // seq_len)
  batch = src.rows(0, n, 0, n)
  assert batch["inputs"].dtype == np.int32 and batch["inputs"].shape == (n, seq_len)
  # Past the data, inputs are the pad id and targets IGNORE_ID (the loss skips them); every sequence has a target.
  inputs = np.concatenate([stream, np.full(seq_len + 1, PAD_ID)])
  targets = np.concatenate([stream, np.full(seq_len + 1, IGNORE_ID)])
  assert (batch["inputs"].reshape(-1) == inputs[:n * seq_len]).all()
  assert (batch["targets"].reshape(-1) == targets[1:n * seq_len + 1]).all()
  assert (batch["targets"] == IGNORE_ID).sum() == n * seq_len - (len(stream) - 1)  # exactly the tail past the data
  assert (batch["inputs"][:, 1:] == np.where(batch["targets"][:, :-1] < 0, PAD_ID, batch["targets"][:, :-1])).all()
  # Evaluation order cycles: the next "step" starts over.
  again = src.rows(1, n, 0, 3)
  assert (again["inputs"] == batch["inputs"][:3]).all()

  # The offsets were cached: a second source must not read every document again.
  monkeypatch.setattr(packing._DocumentLength, "__call__", lambda self, record: 1 / 0)
  src2 = make_source(make_cfg(stdlib_dir, seq_len=seq_len), split, shuffle=False)
  assert (src2.offsets == src.offsets).all()
  assert list(pathlib.Path(stdlib_dir, "meshtrain_index").rglob("*.npy"))


def test_bpe_source_packs_the_tokenized_stream(stdlib_dir, tmp_path, monkeypatch):
  """Another tokenizer: the split is tokenized once into a cached stream, packed exactly like bytes."""
  split = "validation[:20]"
  texts = [text.decode() for _, text in read_texts(stdlib_dir, split)]
  tok = tokenizer.train_bpe(texts, 300, tmp_path / "bpe")
  stream = np.concatenate([np.append(tok.encode(text), tok.eos_id) for text in texts])
  seq_len = 16
  src = make_source(make_cfg(stdlib_dir, seq_len=seq_len), split, shuffle=False, tok=tok)
  n = src.num_sequences
  assert src.num_tokens == len(stream) and n == -(-(len(stream) - 1) // seq_len)
  batch = src.rows(0, n, 0, n)
  assert (batch["inputs"].reshape(-1) == np.append(stream, [tok.pad_id] * seq_len)[:n * seq_len]).all()
  assert (batch["targets"].reshape(-1) == np.append(stream, [IGNORE_ID] * seq_len)[1:n * seq_len + 1]).all()
  caches = list(pathlib.Path(stdlib_dir, "meshtrain_index").rglob(f"*tok-{tok.fingerprint[:16]}*.tokens.bin"))
  assert len(caches) == 1 and caches[0].stat().st_size == 2 * len(stream)  # uint16 ids

  # A second source reads the cache: nothing is tokenized again. Shuffled, the batch at a step is the same
  # whichever process loads which rows.
  monkeypatch.setattr(type(tok), "encode_batch", lambda *a: 1 / 0)
  again = make_source(make_cfg(stdlib_dir, seq_len=seq_len), split, shuffle=False, tok=tok)
  assert (again.rows(0, n, 0, n)["inputs"] == batch["inputs"]).all()
  shuffled = make_source(make_cfg(stdlib_dir, seq_len=seq_len), split, shuffle=True, tok=tok)
  for step in (0, 3):
    whole = shuffled.rows(step, 8)
    parts = [shuffled.rows(step, 8, a, a + 2) for a in (0, 2, 4, 6)]
    for key in ("inputs", "targets"):
      assert (np.concatenate([p[key] for p in parts]) == whole[key]).all()
  assert not (shuffled.rows(0, 8)["inputs"] == batch["inputs"][:8]).all()

  # A data dir the cache cannot be written to: the stream is encoded into memory instead, the same tokens.
  monkeypatch.undo()
  def read_only(path):
    raise PermissionError(13, "Permission denied", str(path))
  monkeypatch.setattr(tfds_access, "file_lock", read_only)  # the lock is the first write
  uncached = make_source(make_cfg(stdlib_dir, seq_len=seq_len), "validation[:5]", shuffle=False, tok=tok)
  first = np.concatenate([np.append(tok.encode(text), tok.eos_id) for text in texts[:5]])
  assert uncached.num_tokens == len(first) and (uncached.rows(0, 2)["inputs"].reshape(-1) == first[:2 * seq_len]).all()


# --- determinism -------------------------------------------------------------------------------------------------


def test_batches_are_pure_functions_of_seed_and_step(stdlib_dir):
  cfg = make_cfg(stdlib_dir, seq_len=64)
  src = make_source(cfg, "train", shuffle=True)
  B = 8
  shares = [(0, 2), (2, 4), (4, 6), (6, 8)]
  for step in (0, 1, 17, 100_000):
    whole = src.rows(step, B, 0, B)
    for key in ("inputs", "targets"):
      parts = np.concatenate([src.rows(step, B, a, b)[key] for a, b in shares])
      assert (parts == whole[key]).all()
  other = make_source(make_cfg(stdlib_dir, seq_len=64), "train", shuffle=True)
  assert all((other.rows(s, B)["inputs"] == src.rows(s, B)["inputs"]).all() for s in (0, 5))
  reseeded = make_source(make_cfg(stdlib_dir, seq_len=64, seed=1), "train", shuffle=True)
  assert not (reseeded.rows(0, B)["inputs"] == src.rows(0, B)["inputs"]).all()
  assert not (make_source(cfg, "train", shuffle=False).rows(0, B)["inputs"] == src.rows(0, B)["inputs"]).all()


@pytest.mark.parametrize("small_limit", [0, 1 << 30], ids=["grain_shuffle", "numpy_permutation"])
def test_each_epoch_is_a_new_permutation(stdlib_dir, monkeypatch, small_limit):
  monkeypatch.setattr(sources, "SMALL_PERMUTATION", small_limit)
  src = make_source(make_cfg(stdlib_dir, seq_len=1024), "validation[:30]", shuffle=True)
  n = src.num_sequences
  assert 100 < n < 5000
  epochs = [[src.sequence_index(e * n + i) for i in range(n)] for e in range(2)]
  assert sorted(epochs[0]) == list(range(n)) and sorted(epochs[1]) == list(range(n))
  assert epochs[0] != epochs[1] and epochs[0] != list(range(n))
  i = n + 3
  assert (src.example(i) == src.sequence(epochs[1][3])).all()


# --- global batches ----------------------------------------------------------------------------------------------


def test_global_batch_matches_rows(stdlib_dir):
  src = make_source(make_cfg(stdlib_dir, seq_len=32), "train", shuffle=True)
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  B = 16
  for spec in (P(("data", "fsdp"), None), P(), P("data", "fsdp")):
    sharding = NamedSharding(mesh, spec)
    assert process_rows(sharding, B) == (0, B)
    batch = global_batch(src, 3, B, sharding)
    expected = src.rows(3, B, 0, B)
    for key in ("inputs", "targets"):
      assert batch[key].shape == (B, 32) and batch[key].dtype == np.int32
      assert batch[key].sharding == sharding
      assert (np.asarray(batch[key]) == expected[key]).all()


@pytest.mark.parametrize("grain_installed", [True, False], ids=["grain", "no_grain"])
def test_batches(stdlib_dir, monkeypatch, grain_installed):
  src = make_source(make_cfg(stdlib_dir, seq_len=32), "train", shuffle=True)
  if not grain_installed:  # the GPU machines (synthetic data, no grain): one thread prefetches instead
    monkeypatch.setitem(sys.modules, "grain", None)
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  sharding = NamedSharding(mesh, P(("data", "fsdp"), None))
  # Resuming at step 5 needs no iterator state: the batches from there are those of an uninterrupted run.
  with Batches(src, 5, 8, sharding) as batches:
    assert (batches._iterator is None) != grain_installed  # pylint: disable=protected-access
    for expected_step, (step, batch) in zip(range(5, 12), batches):
      assert step == expected_step
      assert batch["inputs"].sharding == sharding
      for key in ("inputs", "targets"):
        assert (np.asarray(batch[key]) == src.rows(step, 8)[key]).all()

  class Broken(sources.SyntheticSource):
    def rows(self, step, *args):
      if step == 2:
        raise ValueError("disk on fire")
      return super().rows(step, *args)

  broken = Broken(0, "train", 32, 300)
  batches = Batches(broken, 0, 8, sharding)
  assert [step for step, _ in (next(batches), next(batches))] == [0, 1]
  with pytest.raises(ValueError, match="disk on fire"):
    next(batches)
  batches.close()


# --- other datasets ----------------------------------------------------------------------------------------------


def test_registered_tfds_dataset_through_mock_data(tmp_path):
  cfg = make_cfg(tmp_path, seq_len=16, data__name="lm1b")
  with tfds.testing.mock_data(num_examples=40):
    src = make_source(cfg, "train", shuffle=True)
    batch = src.rows(2, 4)
  assert src.num_documents == 40 and src.num_sequences > 4
  assert batch["inputs"].shape == (4, 16) and batch["inputs"].dtype == np.int32
  assert ((batch["inputs"] >= 0) & (batch["inputs"] < VOCAB_SIZE)).all()
  assert not (tmp_path / "meshtrain_index").exists()  # mocks have no files to index


def test_synthetic_source():
  cfg = make_cfg("", seq_len=24, data__name="synthetic", model__vocab_size=100)
  src = make_source(cfg, "train", shuffle=True)
  assert src.num_sequences is None
  a = src.rows(7, 8)
  assert a["inputs"].shape == (8, 24) and a["inputs"].dtype == np.int32
  assert ((a["inputs"] >= 0) & (a["inputs"] < 100)).all()
  assert (a["inputs"][:, 1:] == a["targets"][:, :-1]).all()
  assert (make_source(cfg, "train", shuffle=True).rows(7, 8)["inputs"] == a["inputs"]).all()
  assert (src.rows(7, 8, 3, 5)["inputs"] == a["inputs"][3:5]).all()
  assert not (src.rows(8, 8)["inputs"] == a["inputs"]).all()
  cfg.seed = 1
  assert not (make_source(cfg, "train", shuffle=True).rows(7, 8)["inputs"] == a["inputs"]).all()


# --- user errors -------------------------------------------------------------------------------------------------


def test_unknown_dataset(tmp_path):
  with pytest.raises(UserError, match="unknown dataset.*'no_such_corpus'.*python_stdlib.*synthetic.*data_dir"):
    make_source(make_cfg(tmp_path, data__name="no_such_corpus"), "train", shuffle=True)


def test_messages_name_tfds_data_dir_when_it_decides(tmp_path, monkeypatch):
  """With data.data_dir unset TFDS looks in $TFDS_DATA_DIR when it is set: the message names that, not ~."""
  monkeypatch.setenv("TFDS_DATA_DIR", str(tmp_path / "x"))
  cfg = make_cfg(tmp_path, data__name="lm1b")
  cfg.data.data_dir = ""
  with pytest.raises(UserError, match=re.escape(f"not prepared under $TFDS_DATA_DIR ({tmp_path / 'x'}; ")):
    make_source(cfg, "train", shuffle=True)


def test_dataset_not_prepared(tmp_path):
  with pytest.raises(UserError, match="not prepared.*array_record"):
    make_source(make_cfg(tmp_path, data__name="lm1b"), "train", shuffle=True)


def test_missing_split(stdlib_dir):
  with pytest.raises(UserError, match="no split 'test'.*train, validation"):
    make_source(make_cfg(stdlib_dir), "test", shuffle=False)


def test_missing_text_feature(stdlib_dir):
  with pytest.raises(UserError, match="no feature data.text_key='body'; its features are: (text, path|path, text); "
                     "set data.text_key"):
    make_source(make_cfg(stdlib_dir, data__text_key="body"), "train", shuffle=True)


def test_split_smaller_than_one_sequence(stdlib_dir):
  with pytest.raises(UserError, match="fewer than one sequence.*lower seq_len"):
    make_source(make_cfg(stdlib_dir, seq_len=10_000_000), "validation[:1]", shuffle=False)


def test_vocab_too_small_for_bytes(stdlib_dir):
  with pytest.raises(UserError, match="model.vocab_size=256 is smaller than the vocabulary of the byte tokenizer, "
                                      "which has 259 ids"):
    make_source(make_cfg(stdlib_dir, model__vocab_size=256), "train", shuffle=True)


_TWO_PROCESS_SCRIPT = """
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from meshtrain.config import base_config
from meshtrain.data import global_batch, make_source, process_rows
cfg = base_config()
cfg.data.data_dir = sys.argv[3]
cfg.seq_len = 32
src = make_source(cfg, "train", shuffle=True)
mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
for spec in (P(("data", "fsdp"), None), P()):
  sharding = NamedSharding(mesh, spec)
  batch = global_batch(src, 11, 16, sharding)
  full = multihost_utils.process_allgather(batch["inputs"], tiled=True)
  assert (np.asarray(full) == src.rows(11, 16)["inputs"]).all(), spec
  print("rows", spec, process_rows(sharding, 16), flush=True)
"""


def test_two_processes_assemble_the_same_global_batch(stdlib_dir, tmp_path):
  outs = two_processes.run(_TWO_PROCESS_SCRIPT, tmp_path, str(stdlib_dir))
  assert "rows P(('data', 'fsdp'), None) (0, 8)" in outs[0] and "rows P(('data', 'fsdp'), None) (8, 16)" in outs[1]
  assert all("rows P() (0, 16)" in out for out in outs)
