"""Fine-tuning: masked targets train nothing, init_from starts a new run from another's parameters, and the
python_stdlib_sft prompt/completion dataset."""
import json

import jax
import numpy as np
import pytest
import tensorflow_datasets as tfds

from meshtrain import checkpoint, config as config_lib, layout as layout_lib, mesh as mesh_lib
from meshtrain.cli import train
from meshtrain.data import sft, stdlib_corpus, tokenization as tokenizer
from meshtrain.errors import UserError
from meshtrain.step import IGNORE_ID

# A model smaller than tiny (faster compiles); source and fine-tuning runs share it, as init_from requires.
MODEL = ["--config.model.num_layers=2", "--config.model.d_model=64", "--config.model.num_heads=4",
         "--config.model.num_kv_heads=2", "--config.model.mlp_dim=128"]
FAST = ["--config", "configs/tiny.py", "--config.seq_len=64", "--config.batch_size=8", "--config.log_every=1",
        "--config.eval_batches=1", "--config.optimizer.warmup_steps=0", *MODEL]


def one_device_layout(*overrides, batch_size=8, seq_len=64):
  cfg = config_lib.load("configs/tiny.py", [*MODEL, f"--config.batch_size={batch_size}", f"--config.seq_len={seq_len}",
                                            "--config.mesh.data=1", *overrides])
  return layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices=jax.devices()[:1]))


# --- the loss on completions only ---------------------------------------------------------------------------------


def sft_batch(rng, lengths, seq_len, vocab=256):
  """Rows of random prompts and completions of the (prompt, completion) `lengths`."""
  pairs = [sft.encode_example(rng.integers(0, vocab, p), rng.integers(0, vocab, c), seq_len, tokenizer.PAD_ID,
                              tokenizer.EOS_ID) for p, c in lengths]
  return {"inputs": np.stack([p[0] for p in pairs]), "targets": np.stack([p[1] for p in pairs])}


def test_masked_targets_contribute_exactly_zero_gradient():
  layout = one_device_layout(batch_size=4, seq_len=32)
  params = layout.init(0).params
  grad_fn = layout.compile_grad()
  batch = sft_batch(np.random.default_rng(0), [(5, 6), (20, 3), (3, 40), (30, 30)], 32)  # padded, cut, both
  masked = batch["targets"] < 0
  assert masked.any() and (~masked).any() and (batch["inputs"] == tokenizer.PAD_ID).any()
  loss, grads = jax.device_get(grad_fn(params, batch))

  # The value a masked target holds, and what the padding after the last target feeds the model, change nothing.
  other = {"targets": np.where(masked, -1000, batch["targets"]),
           "inputs": np.where(batch["inputs"] == tokenizer.PAD_ID, 7, batch["inputs"])}
  loss_other, grads_other = jax.device_get(grad_fn(params, other))
  assert loss_other == loss
  jax.tree.map(np.testing.assert_array_equal, grads_other, grads)

  # The loss is the mean cross-entropy over the completion targets alone, computed here by hand.
  logits = np.asarray(jax.device_get(jax.jit(layout.model.apply)({"params": params}, batch["inputs"])), np.float64)
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  picked = np.take_along_axis(logp, np.maximum(batch["targets"], 0)[..., None], -1)[..., 0]
  np.testing.assert_allclose(loss, -picked[~masked].mean(), rtol=1e-5)

  # The test can see a difference: changing one completion target changes the gradient.
  row, col = np.argwhere(~masked)[0]
  changed = {**batch, "targets": batch["targets"].copy()}
  changed["targets"][row, col] = (changed["targets"][row, col] + 1) % 256
  _, grads_changed = jax.device_get(grad_fn(params, changed))
  assert not np.array_equal(grads_changed["embedding"], grads["embedding"])


def test_encode_example_masks_the_prompt_and_padding():
  inputs, targets = sft.encode_example(np.array([1, 2, 3]), np.array([4, 5]), 8, 99, 7)
  assert inputs.tolist() == [1, 2, 3, 4, 5, 99, 99, 99]
  assert targets.tolist() == [-1, -1, 4, 5, 7, -1, -1, -1]  # the completion and its EOS
  # Too long: the prompt keeps its end, the completion its start (and at least half the row), no EOS.
  inputs, targets = sft.encode_example(np.arange(10, 30), np.arange(40, 50), 8, 99, 7)
  assert inputs.tolist() == [26, 27, 28, 29, 40, 41, 42, 43] and targets.tolist() == [-1, -1, -1, 40, 41, 42, 43, 44]


# --- the python_stdlib_sft dataset ----------------------------------------------------------------------------------


def test_examples_from_source():
  text = ('class A:\n    def method(self, x):\n        """Doubles x."""\n        # why\n        return 2 * x\n\n'
          'def outer():\n    """Outer."""\n    def inner():\n        """Inner."""\n        return 1\n    return inner\n'
          'def no_doc():\n    return 0\n'
          'def one_line(): "doc"; return 1\n'
          'def only_doc():\n    """Nothing after."""\n').replace("\n", "\r\n")
  found = {line: (prompt, completion) for line, prompt, completion in sft.examples(text)}
  assert found[2] == ('def method(self, x):\n    """Doubles x."""\n', "    # why\n    return 2 * x\n")
  assert found[7][1] == '    def inner():\n        """Inner."""\n        return 1\n    return inner\n'
  assert found[9] == ('def inner():\n    """Inner."""\n', "    return 1\n")
  assert sorted(found) == [2, 7, 9]
  assert sft.examples("def broken(:\n") == []


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
  """python_stdlib_sft built from 40 train and 8 validation files of the stdlib (the whole build takes ~20 s)."""
  files = stdlib_corpus.source_files()
  subset = ([f for f in files if stdlib_corpus.split_of(f) == "train"][:40]
            + [f for f in files if stdlib_corpus.split_of(f) == "validation"][:8])
  data_dir = tmp_path_factory.mktemp("tfds")
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(stdlib_corpus, "source_files", lambda root=None: subset)
    sft.build(str(data_dir))
  return data_dir


def test_dataset_builds_with_the_stdlib_split(sft_dir):
  for split in ("train", "validation"):
    ds = tfds.data_source(sft.NAME, split=split, data_dir=str(sft_dir), download=False)
    assert len(ds) > 10
    for record in ds:
      prompt, completion, where = (record[k].decode() for k in ("prompt", "completion", "path"))
      assert prompt.startswith(("def ", "async def ")) and completion.strip(), where
      assert stdlib_corpus.split_of(where.split(":")[0]) == split  # a file's functions stay in its split
  assert sft.build(str(sft_dir)).info.splits["train"].num_examples == len(
      tfds.data_source(sft.NAME, split="train", data_dir=str(sft_dir), download=False))  # reused, not rebuilt


def sft_config(sft_dir, *extra):
  return config_lib.load("configs/sft_tiny.py", [f"--config.data.data_dir={sft_dir}", "--config.seq_len=128",
                                                 "--config.init_from=", *extra])


def test_source_rows(sft_dir):
  cfg = sft_config(sft_dir)
  tok = tokenizer.load("byte")
  src = sft.make_source(cfg, cfg.data.name, "train", shuffle=True, tok=tok)
  batch = src.rows(3, 16)
  assert batch["inputs"].shape == batch["targets"].shape == (16, 128)
  # Rows are a function of (seed, step): any slice of the batch is the same rows, a second source agrees.
  again = sft.make_source(cfg, cfg.data.name, "train", shuffle=True, tok=tok)
  for key in ("inputs", "targets"):
    assert (again.rows(3, 16, 4, 9)[key] == batch[key][4:9]).all()
  assert not (src.rows(4, 16)["inputs"] == batch["inputs"]).all()
  # Each row: its trained targets are exactly the completion (+ EOS) that follows the prompt's tokens.
  ds = tfds.data_source(sft.NAME, split="train", data_dir=str(sft_dir), download=False)
  for row in range(16):
    record = ds[src.sequence_index(3 * 16 + row)]
    prompt, completion = tok.encode(record["prompt"].decode()), tok.encode(record["completion"].decode())
    trained = batch["targets"][row][batch["targets"][row] != IGNORE_ID]
    expected = np.concatenate([completion, [tok.eos_id]])
    assert len(trained) > 0 and (trained == expected[:len(trained)]).all()
    if len(prompt) + len(expected) <= 129:
      assert len(trained) == len(expected) and (batch["targets"][row][:len(prompt) - 1] == IGNORE_ID).all()


# --- init_from ----------------------------------------------------------------------------------------------------


def run(workdir, *extra):
  return train.main([*FAST, "--workdir", str(workdir), *extra])


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  workdir = tmp_path_factory.mktemp("source")
  assert run(workdir, "--config.steps=2", "--config.eval_every=0") == 0
  return workdir


def restore_state(workdir, step, *overrides):
  one = one_device_layout(*overrides)
  ckpt = checkpoint.Checkpointer(workdir, keep=100)
  try:
    return jax.device_get(ckpt.restore_state(step, one.state_abstract)), ckpt.read_meta(step)
  finally:
    ckpt.close()


def test_init_from_starts_at_step_0_with_the_params_and_a_fresh_optimizer(source, sft_dir, tmp_path, capsys):
  # Step 1's update is dropped (an injected NaN, skipped), so checkpoint 1 holds the state the run started from.
  tune = ["--config.steps=1", "--config.eval_every=1", f"--config.init_from={source}/checkpoints/2",
          "--config.data.name=python_stdlib_sft", "--config.data.format=prompt_completion",
          f"--config.data.data_dir={sft_dir}", "--config.faults.nan_at_step=1", "--config.nonfinite=skip"]
  assert run(tmp_path / "tune", *tune) == 0
  out = capsys.readouterr().out
  assert f"initialised from {source}/checkpoints/2: parameters only" in out and "step 0 (init_from): eval loss" in out
  state, meta = restore_state(tmp_path / "tune", 1, "--config.steps=1")
  source_params, _ = checkpoint.load_params(source, 2)
  jax.tree.map(np.testing.assert_array_equal, state.params, source_params)
  for leaf in jax.tree.leaves(state.opt_state):  # Adam's count and moments as tx.init makes them
    assert not np.asarray(leaf).any()
  assert int(state.step) == 1 and meta["init_from"] == {"workdir": str(source), "step": 2, "params_only": False}
  assert meta["config"]["init_from"] == f"{source}/checkpoints/2"
  records = [json.loads(line) for line in (tmp_path / "tune" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if "eval_loss" in r] == [0, 1]
  assert records[0]["eval_loss"] == records[-1]["eval_loss"]  # nothing was trained

  # The same command with more steps resumes the fine-tuning run's own checkpoint and says so.
  assert run(tmp_path / "tune", *[a.replace("steps=1", "steps=2") for a in tune]) == 0
  out = capsys.readouterr().out
  assert "is ignored" in out and "resuming from step 1" in out and "initialised from" not in out
  _, meta = restore_state(tmp_path / "tune", 2, "--config.steps=2")
  assert meta["init_from"]["step"] == 2  # still recorded after the resume


def test_converted_params_only_workdir(source, tmp_path, capsys):
  # What python -m meshtrain.convert from-hf writes: params only, at step 0, meta "params_only".
  params, meta = checkpoint.load_params(source)

  def convert(workdir, **extra_meta):
    ckpt = checkpoint.Checkpointer(workdir, keep=1)
    ckpt.save(0, {"params": params}, {"config": meta["config"], "params_only": True, "source": "test", **extra_meta})
    ckpt.wait()
    ckpt.close()

  converted = tmp_path / "converted"
  convert(converted)
  capsys.readouterr()
  # Training in it is refused: there is nothing to resume.
  assert run(converted, "--config.steps=2") == 2
  err = capsys.readouterr().err
  assert "holds converted parameters" in err and f"--config.init_from={converted}" in err and len(err.splitlines()) == 1
  # Fine-tuning from it starts from its parameters.
  tune = tmp_path / "tune"
  assert run(tune, "--config.steps=1", "--config.eval_every=0", f"--config.init_from={converted}",
             "--config.faults.nan_at_step=1", "--config.nonfinite=skip") == 0
  state, meta = restore_state(tune, 1, "--config.steps=1")
  jax.tree.map(np.testing.assert_array_equal, state.params, params)
  assert meta["init_from"] == {"workdir": str(converted), "step": 0, "params_only": True}
  # Another storage dtype: the parameters are cast.
  assert run(tmp_path / "bf16", "--config.steps=1", "--config.eval_every=0", f"--config.init_from={converted}",
             "--config.faults.nan_at_step=1", "--config.nonfinite=skip", "--config.model.param_dtype=bfloat16") == 0
  state, _ = restore_state(tmp_path / "bf16", 1, "--config.steps=1", "--config.model.param_dtype=bfloat16")
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b.astype(a.dtype)), state.params, params)
  assert {leaf.dtype.name for leaf in jax.tree.leaves(state.params)} == {"bfloat16"}
  # A model trained with another tokenizer: its ids mean other text, so this run must use its tokenizer.
  convert(tmp_path / "other_tokenizer", tokenizer={"kind": "hf", "fingerprint": "f" * 64})
  capsys.readouterr()
  assert run(tmp_path / "tune2", "--config.steps=1", f"--config.init_from={tmp_path / 'other_tokenizer'}") == 2
  err = capsys.readouterr().err
  assert "was trained with the hf tokenizer ffffffffffff" in err and len(err.splitlines()) == 1
  assert f"--config.data.tokenizer={tmp_path / 'other_tokenizer' / 'tokenizer'}" in err
  # Another model too: one refusal names every flag to add, the tokenizer's included.
  assert run(tmp_path / "tune2", "--config.steps=1", f"--config.init_from={tmp_path / 'other_tokenizer'}",
             "--config.model.mlp_dim=96") == 2
  err = capsys.readouterr().err
  assert f"--config.model.mlp_dim=128 --config.data.tokenizer={tmp_path / 'other_tokenizer' / 'tokenizer'}" in err


@pytest.mark.parametrize("init_from, extra, fragments", [
    ("{tmp}/nothing", [], ["init_from='{tmp}/nothing' does not exist", "meshtrain.convert from-hf"]),
    ("{tmp}", [], ["holds no complete checkpoint"]),
    ("{source}/checkpoints/7", [], ["has no complete checkpoint at step 7; it has steps 2"]),
    ("{source}", ["--config.model.d_model=32", "--config.model.rope_theta=500000"],
     ["is another model: model.d_model: init_from 64, this run 32; model.rope_theta",
      "--config.model.d_model=64 --config.model.rope_theta=10000.0"]),
])
def test_init_from_refusals(source, tmp_path, capsys, init_from, extra, fragments):
  fill = lambda s: s.format(tmp=tmp_path, source=source)
  assert run(tmp_path / "tune", "--config.steps=1", f"--config.init_from={fill(init_from)}", *extra) == 2
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1, err
  for fragment in fragments:
    assert fill(fragment) in err
  assert not (tmp_path / "tune" / "checkpoints").exists() or not any((tmp_path / "tune" / "checkpoints").iterdir())


@pytest.mark.parametrize("overrides, fragment", [
    (["--config.data.format=text"], "python_stdlib_sft holds prompt/completion pairs"),
    (["--config.data.tokenizer=bpe:512"], "use the tokenizer of the model in init_from"),
    (["--config.data.format=dialogue"], "choose one of text, prompt_completion, chat"),
    (["--config.data.format=chat"], "data.format=chat renders each conversation with the tokenizer's chat template"),
    (["--config.data.completion_key=prompt"], "must name two different features"),
    (["--config.data.name=synthetic"], "synthetic has none"),
])
def test_data_format_refusals(overrides, fragment):
  with pytest.raises(UserError, match=fragment):
    config_lib.load("configs/sft_tiny.py", overrides)
