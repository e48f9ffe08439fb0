"""The text-to-image family's frozen text encoder (meshtrain/families/frozen_text.py): a converted language model's
hidden states equal transformers' own, a split's cached features are the ones a prompt gets when sampled and are
computed once, a run trains on them, resumes bitwise and samples and serves prompts through the language model, and
a wrong encoder is one line with exit 2.

Needs the `hf` extra, as tests/test_open_models.py (whose random Qwen3 this file converts).
"""
import base64
import io
import json
import subprocess
import sys

import jax
import numpy as np
import openai
import pytest
import torch
import transformers
from PIL import Image
from test_convert import REPO, run_convert
from test_open_models import SHAPE, make
from test_serve import start_server

from meshtrain import checkpoint, config as config_lib, presets
from meshtrain.data import text_features as frozen_text
from meshtrain.interop import hf_tokenizer

WIDTH = SHAPE["hidden_size"]
TEXT_LEN = 16  # tokens: the byte tokenizer's BOS and 15 bytes, so the longer caption below is cut
CAPTIONS = ["a red circle", "a blue square on the left of a green triangle", "x"]


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
  """(the transformers model's directory, the meshtrain workdir it converts to): a random Qwen3 with q/k norms and
  GQA, and a byte-level tokenizer with a BOS."""
  root = tmp_path_factory.mktemp("qwen3")
  hf = make(root / "hf", "qwen3")
  (hf / "tokenizer.json").write_text(hf_tokenizer.byte_tokenizer_json())
  assert run_convert("from-hf", hf, "--workdir", root / "lm") == 0
  return hf, root / "lm"


def model_group(workdir, layer: int = -2):
  m = presets.t2i_model_config("tiny")
  m.text_encoder, m.text_encoder_layer, m.text_width, m.text_len = str(workdir), layer, WIDTH, TEXT_LEN
  return m


@pytest.mark.parametrize("layer", [0, 1, -2, -1])
def test_features_are_transformers_hidden_states(encoder, layer):
  """hidden_states[layer] of transformers' model on the same token ids, at every kept token (a causal model: the
  padding after a caption changes nothing before it); padding's features are 0; a caption is cut at text_len."""
  hf, workdir = encoder
  frozen = frozen_text.FrozenTextEncoder(model_group(workdir, layer))
  ids_NS, keep_NS = frozen.tokens(CAPTIONS)
  assert keep_NS.sum(axis=1).tolist() == [1 + len("a red circle"), TEXT_LEN, 2]
  model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
  with torch.no_grad():
    hidden = model(torch.tensor(ids_NS, dtype=torch.long), output_hidden_states=True).hidden_states[layer].numpy()
  got = frozen(CAPTIONS)
  np.testing.assert_array_equal(got["text_keep"], keep_NS)
  np.testing.assert_allclose(got["text_features"], hidden * keep_NS[..., None], rtol=1e-4, atol=1e-4)
  assert float(np.abs(hidden[keep_NS]).max()) > 0.5  # numbers that a wrong layer or norm could not match by chance


def test_the_cache_is_what_a_prompt_gets_and_is_computed_once(encoder, tmp_path, monkeypatch):
  _, workdir = encoder
  cfg = config_lib.load("configs/t2i_tiny.py", [f"--config.data.data_dir={tmp_path}"])
  cfg.model = model_group(workdir)
  dataset = {"name": "test", "split": "train"}
  captions = [*CAPTIONS, CAPTIONS[0]]  # repeated: one row per distinct caption
  cache = frozen_text.cached(cfg, dataset, lambda: captions)
  assert len(cache.keep) == 3
  rows = [cache.row(c) for c in captions]
  live = frozen_text.FrozenTextEncoder(cfg.model)(captions)
  taken = cache.take(rows)
  np.testing.assert_array_equal(taken["text_features"], live["text_features"])
  np.testing.assert_array_equal(taken["text_keep"], live["text_keep"])
  # A second source of the same split reads the cache; the language model is not run again.
  monkeypatch.setattr(frozen_text, "FrozenTextEncoder", None)
  again = frozen_text.cached(cfg, dataset, lambda: captions)
  np.testing.assert_array_equal(again.take(rows)["text_features"], taken["text_features"])
  # The same hidden states named from the start (1 of 2 blocks) are the same cache; another layer is another one.
  cfg.model.text_encoder_layer = 1
  frozen_text.cached(cfg, dataset, lambda: captions)
  cfg.model.text_encoder_layer = 0
  with pytest.raises(TypeError):  # it would have to run the (stubbed out) encoder
    frozen_text.cached(cfg, dataset, lambda: captions)


def train(workdir, encoder_dir, data_dir, *flags):
  return subprocess.run([sys.executable, "-m", "meshtrain.train", "--config", "configs/t2i_tiny.py",
                         "--workdir", str(workdir), f"--config.model.text_encoder={encoder_dir}",
                         f"--config.model.text_width={WIDTH}", f"--config.model.text_len={TEXT_LEN}",
                         f"--config.data.data_dir={data_dir}", "--config.batch_size=8", "--config.eval_every=2",
                         "--config.eval_batches=1", "--config.checkpoint_every=2", "--config.log_every=1",
                         "--config.sample.steps=2", "--config.sample.per_prompt=1", *flags],
                        cwd=REPO, capture_output=True, text=True)


@pytest.mark.slow
def test_a_run_trains_on_cached_features_resumes_bitwise_samples_and_serves(encoder, tmp_path):
  _, lm = encoder
  data = tmp_path / "data"
  straight = train(tmp_path / "straight", lm, data, "--config.steps=4")
  assert straight.returncode == 0, straight.stderr[-3000:]
  assert "cached the text features" in straight.stdout + straight.stderr
  caches = [p for p in (data / frozen_text.CACHE_DIR).iterdir() if not p.name.startswith(".")]  # not the locks
  assert len(caches) == 2  # the train and validation splits
  # Resumed without evaluation (its programs are the straight run's to test): the same parameters all the same.
  first = train(tmp_path / "resumed", lm, data, "--config.steps=2", "--config.eval_every=0")
  assert first.returncode == 0, first.stderr[-3000:]
  assert "cached the text features" not in first.stdout + first.stderr  # read, not computed again
  resumed = train(tmp_path / "resumed", lm, data, "--config.steps=4", "--config.eval_every=0")
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  a, b = (checkpoint.load_params(tmp_path / w, 4)[0] for w in ("straight", "resumed"))
  jax.tree.map(np.testing.assert_array_equal, a, b)
  assert "text_norm" in a and "text" not in a  # the frozen path: no own encoder's weights
  losses = [json.loads(line)["loss"] for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]
  assert losses and all(np.isfinite(losses))
  # A prompt through the language model, as the cache computed the training captions' features: `sample`, and the
  # server (the same pictures for the same seed).
  out = subprocess.run([sys.executable, "-m", "meshtrain.sample", "--workdir", str(tmp_path / "straight"),
                        "--prompt", "a red circle", "--n", "2", "--steps", "2", "--seed", "3",
                        "--out", str(tmp_path / "g.png"), "--npy", str(tmp_path / "g.npz")],
                       cwd=REPO, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-3000:]
  pictures = np.round(np.load(tmp_path / "g.npz")["images"] * 255).astype(np.uint8)
  assert pictures.shape == (2, 32, 32, 3) and len(np.unique(pictures)) > 10
  proc, url = start_server(tmp_path / "straight", "--lazy")
  try:
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
    served = client.images.generate(model=None, prompt="a red circle", n=2, response_format="b64_json",
                                    extra_body={"seed": 3, "steps": 2})
    np.testing.assert_array_equal(
        np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(d.b64_json)))) for d in served.data]), pictures)
  finally:
    proc.kill()


@pytest.mark.parametrize("flags, message", [
    (["--config.model.text_encoder=/nonexistent"], "model.text_encoder='/nonexistent'"),
    (["--config.model.text_width=64"], f"set --config.model.text_width={WIDTH}"),
    (["--config.model.text_encoder_layer=5"], "has 2 blocks"),
])
def test_a_wrong_encoder_is_one_line_and_exit_2(encoder, tmp_path, flags, message):
  _, lm = encoder
  done = subprocess.run([sys.executable, "-m", "meshtrain.train", "--config", "configs/t2i_tiny.py", "--workdir",
                         str(tmp_path / "w"), f"--config.model.text_encoder={lm}",
                         f"--config.model.text_width={WIDTH}", *flags], cwd=REPO, capture_output=True, text=True)
  assert done.returncode == 2, done.stderr[-2000:]
  assert message in done.stderr and "Traceback" not in done.stderr
  assert not (tmp_path / "w").exists() or not list((tmp_path / "w").glob("checkpoints/*"))
