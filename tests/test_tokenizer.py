"""Tokenizers: the three kinds round-trip, bytes are unchanged, BPE training (library and CLI), files travel with
the run (copied, recorded, another one refused on resume), vocabulary checks, bits per byte by hand."""
import io
import json
import math
import shutil

import jax
import numpy as np
import pytest

from meshtrain import layout as layout_lib, mesh as mesh_lib
from meshtrain.cli import tokenizer as tokenizer_cli, train
from meshtrain.config import base_config
from meshtrain.data import packing, select, tokenization as tokenizer
from meshtrain.errors import UserError

TEXTS = [
    "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
    "for i in range(10):\n    print(f'héllo {i} ✓ 🐍')\n",
    "import os\nprint(os.path.join('a', 'b'))\n# the end <|endoftext|> is text here\n",
] * 20
SAMPLE = "def f(x):\n    return {'héllo': x, 'snake': '🐍'}  # <|endoftext|> stays text\n\t\n"
# Tiny runs: the tiny model's shape at one layer, short sequences, two steps; data from the first train documents.
TINY_RUN = ["--config", "configs/tiny.py", "--config.steps=2", "--config.seq_len=32", "--config.batch_size=8",
            "--config.model.num_layers=1", "--config.model.vocab_size=512", "--config.eval_every=2",
            "--config.eval_batches=1", "--config.checkpoint_every=2", "--config.log_every=1",
            "--config.data.train_split=train[:40]", "--config.data.eval_split=validation[:10]"]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
  return tokenizer.train_bpe(TEXTS, 300, tmp_path_factory.mktemp("bpe") / "tok").path.parent


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
  import sentencepiece as spm
  model = io.BytesIO()
  # identity normalization and no dummy prefix: the text comes back byte for byte; byte_fallback: any character.
  spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXTS * 5), model_writer=model, vocab_size=400,
                                 model_type="bpe", normalization_rule_name="identity", add_dummy_prefix=False,
                                 remove_extra_whitespaces=False, byte_fallback=True, pad_id=3, split_digits=True,
                                 allow_whitespace_only_pieces=True, minloglevel=2)
  path = tmp_path_factory.mktemp("sp") / "test.model"
  path.write_bytes(model.getvalue())
  return path


# --- the three kinds -----------------------------------------------------------------------------------------


def test_byte_ids_are_unchanged():
  tok = tokenizer.load("byte")
  ids = tok.encode(SAMPLE)
  assert ids.dtype == np.int32 and (ids == np.frombuffer(SAMPLE.encode(), np.uint8)).all()
  assert (ids == tokenizer.encode(SAMPLE)).all()  # the module-level byte functions of before
  assert (tok.kind, tok.vocab_size, tok.pad_id, tok.eos_id, tok.bos_id, tok.fingerprint) == (
      "byte", 259, 256, 257, 258, "byte")
  assert tok.decode(np.concatenate([[258], ids, [257, 256]])) == SAMPLE
  table = tok.token_bytes()
  assert table.shape == (259,) and (table[:256] == 1).all() and (table[256:] == 0).all()
  assert tokenizer.load("").kind == "byte"


def test_bpe_round_trip(bpe_dir):
  tok = tokenizer.load(bpe_dir)
  assert tok.kind == "hf" and tok.vocab_size == 300 and tok.path == bpe_dir / "tokenizer.json"
  assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)  # the trained specials come first
  ids = tok.encode(SAMPLE)
  assert tok.decode(ids) == SAMPLE
  assert len(ids) < len(SAMPLE.encode())  # merges learned: fewer tokens than bytes
  assert tok.eos_id not in ids  # "<|endoftext|>" inside a document is text, not the special
  assert [len(i) for i in tok.encode_batch([SAMPLE, "x"])] == [len(ids), 1]
  assert tok.decode(np.concatenate([[tok.bos_id], ids, [tok.eos_id, tok.pad_id]])) == SAMPLE
  table = tok.token_bytes()
  assert table[ids].sum() == len(SAMPLE.encode()) and (table[:3] == 0).all() and (table[3:] >= 1).all()
  assert tokenizer.load(bpe_dir / "tokenizer.json").fingerprint == tok.fingerprint == tokenizer._sha256(tok.path)


def test_bpe_directory_loads_in_transformers(bpe_dir):
  transformers = pytest.importorskip("transformers")  # the hf extra, installed in CI
  hf = transformers.AutoTokenizer.from_pretrained(str(bpe_dir))
  tok = tokenizer.load(bpe_dir)
  text = SAMPLE.replace("<|endoftext|>", "")  # transformers would turn the special's text into its id
  assert hf.encode(text, add_special_tokens=False) == tok.encode(text).tolist()
  assert hf.decode(tok.encode(text)) == text
  assert (hf.pad_token_id, hf.eos_token_id, hf.bos_token_id) == (tok.pad_id, tok.eos_id, tok.bos_id)


def test_sentencepiece_round_trip(sp_model):
  tok = tokenizer.load(sp_model)
  assert tok.kind == "sentencepiece" and tok.vocab_size == 400
  assert (tok.pad_id, tok.eos_id, tok.bos_id) == (3, 2, 1)
  ids = tok.encode(SAMPLE)
  assert tok.decode(ids) == SAMPLE
  assert tok.decode(np.concatenate([[tok.bos_id], ids, [tok.eos_id, tok.pad_id]])) == SAMPLE
  table = tok.token_bytes()
  assert table[ids].sum() == len(SAMPLE.encode()) and table[tok.eos_id] == 0 and table[tok.pad_id] == 0
  assert tokenizer.load(sp_model.parent).fingerprint == tok.fingerprint  # a directory holding one .model


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing.json", "does not exist"),
    (lambda d: (d / "bad.json").write_text("{not json") and d / "bad.json", "not a readable Hugging Face"),
    (lambda d: (d / "bad.model").write_bytes(b"\x00garbage") and d / "bad.model", "not a readable SentencePiece"),
    (lambda d: d, "holds no tokenizer.json or tokenizer.model"),
    (lambda d: "bpe:12", "bpe:N with 259 <= N <= 1,048,576"),
])
def test_bad_tokenizer_is_one_line(tmp_path, make, message):
  spec = make(tmp_path)
  with pytest.raises(UserError, match=message) as e:
    if str(spec).startswith("bpe:"):
      tokenizer.parse_bpe_spec(spec)
    else:
      tokenizer.load(spec)
  assert "\n" not in str(e.value)


def test_workdir_copy(bpe_dir, sp_model, tmp_path):
  assert tokenizer.from_workdir(tmp_path).kind == "byte"  # nothing there: bytes
  tokenizer.save_to_workdir(tokenizer.load("byte"), tmp_path)
  assert not (tmp_path / "tokenizer").exists()
  for source, files in ((bpe_dir, {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}),
                        (sp_model, {"tokenizer.model"})):
    tok = tokenizer.load(source)
    tokenizer.save_to_workdir(tok, tmp_path)
    assert {p.name for p in (tmp_path / "tokenizer").iterdir()} == files  # replaced whole, nothing left over
    copy = tokenizer.from_workdir(tmp_path)
    assert (copy.kind, copy.fingerprint) == (tok.kind, tok.fingerprint)
    assert (copy.encode(SAMPLE) == tok.encode(SAMPLE)).all()
  assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tokenizer")]  # no staging left behind


# --- training a BPE on a dataset ----------------------------------------------------------------------------


def test_tokenizer_cli_trains_bpe(tmp_path, capsys):
  out = tmp_path / "bpe"
  argv = ["train", "--config", "configs/tiny.py", "--config.data.train_split=train[:30]", "--vocab-size", "400"]
  assert tokenizer_cli.main([*argv, "--out", str(out)]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["vocab_size"] == 400 and report["documents"] == 30 and report["dataset"].endswith("/train[:30]")
  tok = tokenizer.load(out)
  assert tok.vocab_size == 400 and tok.fingerprint == report["fingerprint"]
  text = "import collections\n"
  assert tok.decode(tok.encode(text)) == text
  assert tokenizer_cli.main([*argv, "--out", str(out)]) == 2  # never overwrites
  assert "not an empty directory" in capsys.readouterr().err
  assert tokenizer_cli.main([*argv[:-1], "100", "--out", str(tmp_path / "small")]) == 2
  assert "too small" in capsys.readouterr().err


def test_bpe_spec_is_trained_once_and_cached(tmp_path, monkeypatch):
  cfg = base_config()
  cfg.data.train_split = "train[:25]"
  cfg.data.tokenizer = "bpe:320"
  texts, info, root = packing.train_texts(cfg)
  cached = root / "meshtrain_tokenizers" / info.full_name.replace("/", "__") / "bpe320-train_25_-text"
  shutil.rmtree(cached, ignore_errors=True)
  first = select.tokenizer_for_config(cfg)
  assert first.vocab_size == 320 and first.path == cached / "tokenizer.json"
  assert len(texts) == 25
  monkeypatch.setattr(tokenizer, "train_bpe", lambda *a, **k: 1 / 0)  # a second use must not train again
  assert select.tokenizer_for_config(cfg).fingerprint == first.fingerprint
  shutil.rmtree(cached)


# --- bits per byte ------------------------------------------------------------------------------------------


def test_bits_per_byte_of_a_bpe_batch_by_hand(bpe_dir):
  """The eval step's bytes are the UTF-8 bytes of the target text (decoded, counted here without the table), and
  its loss the cross-entropy over targets >= 0 (computed here in numpy from the model's logits)."""
  tok = tokenizer.load(bpe_dir)
  cfg = base_config()
  cfg.update(seq_len=24, batch_size=4)
  cfg.model.num_layers, cfg.model.vocab_size = 1, 384  # more ids than the tokenizer's 300: padded with 0 bytes
  stream = np.concatenate([np.append(tok.encode(t), tok.eos_id) for t in TEXTS[:4]])
  seqs = stream[:4 * 25].reshape(4, 25).astype(np.int32)
  seqs[-1, -6:] = -1  # padding: IGNORE_ID targets, pad-id inputs, as the pipeline makes them
  batch = {"inputs": np.where(seqs[:, :-1] < 0, tok.pad_id, seqs[:, :-1]), "targets": seqs[:, 1:]}
  layout = layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices=jax.devices()[:1]))
  params = layout.init(0).params
  out = jax.device_get(layout.compile_eval_step()(params, jax.device_put(batch, layout.batch_sharding),
                                                  layout.eval_extra(tok)))
  targets = batch["targets"]
  valid = targets >= 0
  # The valid targets, row after row, are one stretch of the stream: decoded at once (EOS skipped), whole
  # characters only, so its UTF-8 length is the text's bytes whichever tokens split a character.
  by_hand_bytes = len(tok.decode(targets[valid]).encode())
  assert by_hand_bytes > 1.5 * valid.sum()  # merges: tokens of several bytes, so not one byte per target
  assert out["bytes"] == by_hand_bytes and out["tokens"] == valid.sum()
  with layout.context():  # the model's activation constraints resolve against the mesh
    logits = np.asarray(jax.jit(layout.model.apply)({"params": params}, batch["inputs"]), np.float64)
  logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  picked = np.take_along_axis(logits, np.where(valid, targets, 0)[..., None], -1)[..., 0]
  by_hand_loss = ((logz - picked) * valid).sum()
  np.testing.assert_allclose(out["loss_sum"], by_hand_loss, rtol=1e-5)
  bits_per_byte = out["loss_sum"] / out["bytes"] / math.log(2)
  assert 0 < bits_per_byte == pytest.approx(by_hand_loss / by_hand_bytes / math.log(2), rel=1e-5)


# --- the tokenizer travels with the run ---------------------------------------------------------------------


def test_run_keeps_its_tokenizer_and_refuses_another(bpe_dir, sp_model, tmp_path, capsys):
  workdir = tmp_path / "run"
  run = lambda *extra: train.main([*TINY_RUN, "--workdir", str(workdir), *extra])
  assert run(f"--config.data.tokenizer={bpe_dir}") == 0
  copied = tokenizer.from_workdir(workdir)
  assert copied.kind == "hf" and copied.fingerprint == tokenizer.load(bpe_dir).fingerprint
  meta = json.loads((workdir / "checkpoints" / "2" / "meta" / "metadata").read_text())
  assert meta["tokenizer"] == {"kind": "hf", "fingerprint": copied.fingerprint, "vocab_size": 300}
  evals = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line]
  assert evals and all(r["eval_bits_per_byte"] > 0 for r in evals)
  capsys.readouterr()

  # Another tokenizer (or bytes, the default) on resume: refused before anything compiles, the checkpoint kept.
  for other in (f"--config.data.tokenizer={sp_model}", "--config.data.tokenizer=byte"):
    assert run("--config.steps=4", other) == 2
    err = capsys.readouterr().err
    assert "trained with the hf tokenizer" in err and "(the run's copy)" in err and err.count("\n") == 1
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2"]
  assert tokenizer.from_workdir(workdir).fingerprint == copied.fingerprint

  # The same file elsewhere (the run's own copy) is the same tokenizer: compared by fingerprint, not path.
  assert run(f"--config.data.tokenizer={workdir / 'tokenizer'}") == 0
  assert "nothing to do" in capsys.readouterr().out


def test_vocab_smaller_than_tokenizer_is_refused(bpe_dir, tmp_path, capsys):
  assert train.main([*TINY_RUN, "--workdir", str(tmp_path / "run"), f"--config.data.tokenizer={bpe_dir}",
                     "--config.model.vocab_size=256"]) == 2
  err = capsys.readouterr().err
  assert "model.vocab_size=256 is smaller than" in err and "300 ids" in err and err.count("\n") == 1
  assert not (tmp_path / "run" / "checkpoints").exists()
