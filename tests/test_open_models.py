"""Today's open-model families against transformers itself: Llama 3.x rotary scalings, Qwen2 biases, Qwen3 q/k norms,
Mistral's sliding window, Mixtral's experts. For each, a model transformers makes with random weights converts in
(logits within TOLERANCE, greedy tokens equal through the KV-cache generator) and back out (the same architecture,
the same tensors, equal logits in transformers).

Needs the `hf` extra, as tests/test_convert.py (whose helpers this file uses).
"""
import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from test_convert import TOKENS, assert_close, hf_greedy, hf_logits, run_convert

from meshtrain import checkpoint
from meshtrain.models.llama import ModelConfig, Transformer

SHAPE = dict(vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
# family variant: (transformers config class, its fields beyond SHAPE). Per family, tied and untied embeddings and a
# head_dim other than hidden_size / num_attention_heads (12 here); SHAPE's 4 heads over 2 kv heads is GQA.
VARIANTS = {
    "llama3": (transformers.LlamaConfig, dict(head_dim=16, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "llama_linear_tied": (transformers.LlamaConfig, dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "linear", "rope_theta": 10_000.0, "factor": 2.0})),
    "llama_yarn": (transformers.LlamaConfig, dict(rope_parameters={
        "rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2_tied": (transformers.Qwen2Config, dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "default", "rope_theta": 1_000_000.0})),
    # Qwen2Config's signature has no head_dim, but it keeps the keyword, writes it to config.json and its attention
    # reads it (transformers 5.x): 16-wide heads here, as the imported head_dim and from-hf's shape check (q_proj
    # [64, 48]) show.
    "qwen2_head16": (transformers.Qwen2Config, dict(head_dim=16)),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16)),
    "qwen3_tied_mha": (transformers.Qwen3Config, dict(head_dim=8, num_key_value_heads=4, tie_word_embeddings=True)),
    "mistral_window": (transformers.MistralConfig, dict(head_dim=16, sliding_window=5)),
    # MistralConfig's default window, 4096 (Mistral-7B-v0.1's), longer than any context here: plain attention.
    "mistral_tied": (transformers.MistralConfig, dict(head_dim=8, tie_word_embeddings=True)),
    "mixtral": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "mixtral_tied": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=3, sliding_window=None,
                                                      head_dim=16, tie_word_embeddings=True)),
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM"}


def make(path, variant, dtype=torch.float32):
  """A random model of `variant` saved by transformers, weights redrawn at 1/sqrt(fan_in), norm scales away from 1
  and biases away from 0, so logits are O(1) and a wrong mapping could not hide under the tolerance."""
  config_class, fields = VARIANTS[variant]
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config_class(**{**SHAPE, **fields}))
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.uniform_(0.5, 1.5)
      elif "embed" in name or p.ndim == 1:
        p.normal_(0, 1)
      else:
        p.normal_(0, p.shape[1] ** -0.5)
  model.to(dtype).save_pretrained(path)
  return path


def no_drop(model: dict) -> ModelConfig:
  """The model as generation runs it: a mixture of experts without capacity drops (as transformers)."""
  c = ModelConfig.from_config(model)
  return dataclasses.replace(c, capacity_factor=c.num_experts / c.experts_per_token) if c.num_experts else c


def logits_of(workdir, tokens=TOKENS):
  params, meta = checkpoint.load_params(workdir)
  return np.asarray(Transformer(no_drop(meta["config"]["model"])).apply({"params": params}, jnp.asarray(tokens)))


def greedy_of(workdir, prompt_BP, new):
  from meshtrain.inference.generator import Generator
  generator = Generator.from_workdir(workdir, num_ids=SHAPE["vocab_size"])
  out = generator.generate([list(map(int, row)) for row in prompt_BP], max_new_tokens=new, stop_at_eos=False)
  return np.asarray(out.token_ids)


# The quick pass (-m "not slow", CI's second Python) converts one model per family; the full suite (CI's first Python)
# all eleven: the other shapes, once in CI.
QUICK = ("llama3", "qwen2_tied", "qwen3", "mistral_window", "mixtral")


@pytest.fixture(scope="module", params=[v if v in QUICK else pytest.param(v, marks=pytest.mark.slow)
                                        for v in VARIANTS])
def converted(request, tmp_path_factory):
  root = tmp_path_factory.mktemp(request.param)
  hf = make(root / "hf", request.param)
  assert run_convert("from-hf", hf, "--workdir", root / "w") == 0
  return request.param, hf, root


def test_imports_with_transformers_logits(converted):
  variant, hf, root = converted
  model = checkpoint.load_params(root / "w")[1]["config"]["model"]
  family = json.loads((hf / "config.json").read_text())["model_type"]
  assert model["hf_model_type"] == family
  assert model["attention_bias"] == (family == "qwen2") and model["qk_norm"] == (family == "qwen3")
  assert model["num_experts"] == (4 if family == "mixtral" else 0)
  fields = VARIANTS[variant][1]  # the shape asked for is the shape made (a config class could drop a field)
  assert model["head_dim"] == fields.get("head_dim", SHAPE["hidden_size"] // SHAPE["num_attention_heads"])
  assert model["num_kv_heads"] == fields.get("num_key_value_heads", SHAPE["num_key_value_heads"])
  assert model["tie_embeddings"] == fields.get("tie_word_embeddings", False)
  if family == "mixtral":
    assert model["experts_per_token"] == fields["num_experts_per_tok"]
  assert model["rope_type"] == VARIANTS[variant][1].get("rope_parameters", {}).get("rope_type", "default")
  # Mistral's and Mixtral's window as config.json gives it (null: none); Qwen's applies only with use_sliding_window
  window = json.loads((hf / "config.json").read_text()).get("sliding_window") if family in ("mistral", "mixtral") else 0
  assert model["sliding_window"] == (window or 0)
  assert variant != "mistral_window" or window == 5
  ours = logits_of(root / "w")
  assert_close(ours, hf_logits(hf))
  if variant == "mistral_window":  # the window is at work on these 12 tokens: without it the logits differ
    params, meta = checkpoint.load_params(root / "w")
    unwindowed = dataclasses.replace(no_drop(meta["config"]["model"]), sliding_window=0)
    plain = np.asarray(Transformer(unwindowed).apply({"params": params}, jnp.asarray(TOKENS)))
    assert np.max(np.abs(plain - ours)) > 1e-2


def test_generates_transformers_greedy_tokens(converted):
  _, hf, root = converted
  prompt = TOKENS[:, :5]  # 5 + 10 tokens: past mistral_window's window of 5, and past yarn/llama3's original 16
  np.testing.assert_array_equal(greedy_of(root / "w", prompt, 14), hf_greedy(hf, prompt, 14))


def test_exports_the_same_architecture_and_tensors(converted):
  variant, hf, root = converted
  assert run_convert("to-hf", "--workdir", root / "w", "--out", root / "back") == 0
  before, after = (json.loads((d / "config.json").read_text()) for d in (hf, root / "back"))
  assert after["architectures"] == before["architectures"] == [ARCHITECTURES[before["model_type"]]]
  rope = after["rope_parameters"]  # transformers' defaults (yarn's beta_fast, beta_slow) may be written out
  assert {k: rope[k] for k in before["rope_parameters"]} == before["rope_parameters"]
  for key in ("sliding_window", "num_local_experts", "num_experts_per_tok",
              "tie_word_embeddings", "num_key_value_heads"):
    assert after.get(key) == before.get(key), (key, after.get(key), before.get(key))
  assert after["head_dim"] == (before.get("head_dim") or before["hidden_size"] // before["num_attention_heads"])
  from safetensors.numpy import load_file
  theirs, ours = load_file(hf / "model.safetensors"), load_file(root / "back" / "model.safetensors")
  assert sorted(theirs) == sorted(ours)
  for name, w in theirs.items():
    assert np.array_equal(ours[name], w), name
  assert_close(hf_logits(root / "back"), hf_logits(hf))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["mixtral", "qwen2_tied"])
def test_bfloat16_sharded_round_trip_is_exact(variant, tmp_path, monkeypatch):
  """bfloat16 weights in several safetensors shards (save_pretrained's index) in, several shards out: every tensor
  bit-equal and still bfloat16."""
  from safetensors import safe_open

  from meshtrain.interop import weights
  config_class, fields = VARIANTS[variant]
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config_class(**{**SHAPE, **fields})).to(torch.bfloat16)
  model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
  assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
  assert run_convert("from-hf", tmp_path / "hf", "--workdir", tmp_path / "w") == 0
  assert checkpoint.load_params(tmp_path / "w")[1]["config"]["model"]["param_dtype"] == "bfloat16"
  monkeypatch.setattr(weights, "SHARD_BYTES", 40_000)
  assert run_convert("to-hf", "--workdir", tmp_path / "w", "--out", tmp_path / "back") == 0

  def tensors(d):
    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, file in index.items():
      with safe_open(str(d / file), "pt") as f:
        out[name] = f.get_tensor(name)
    return out
  theirs, ours = tensors(tmp_path / "hf"), tensors(tmp_path / "back")
  index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())["weight_map"]
  assert len(set(index.values())) > 1
  assert sorted(theirs) == sorted(ours)
  for name, w in theirs.items():
    assert ours[name].dtype == torch.bfloat16 and torch.equal(ours[name], w), name


# ---------------------------------------------------------------------------------------------------------------
# Models meshtrain made, out to the architecture that holds their features.

SCRATCH = {  # the features of a meshtrain model -> the architecture to-hf picks for it
    "llama": ({"rope_type": "llama3", "rope_factor": 8.0, "rope_original_max_len": 16}, "LlamaForCausalLM"),
    "qwen2": ({"attention_bias": True, "rope_type": "yarn", "rope_factor": 4.0, "rope_original_max_len": 16,
               "tie_embeddings": True}, "Qwen2ForCausalLM"),
    "qwen3": ({"qk_norm": True, "rope_type": "linear", "rope_factor": 2.0}, "Qwen3ForCausalLM"),
    "mistral": ({"sliding_window": 6}, "MistralForCausalLM"),
    "mixtral": ({"num_experts": 4, "sliding_window": 6}, "MixtralForCausalLM"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRATCH)
def test_meshtrain_model_exports_to_the_matching_architecture(name, tmp_path):
  """Random parameters of a model with these features (every parameter drawn away from its init, so a wrong
  mapping shows), saved as a checkpoint, exported: transformers computes the same logits."""
  import jax

  from meshtrain import config as config_lib
  features, architecture = SCRATCH[name]
  cfg = config_lib.base_config()
  cfg.model.update(vocab_size=300, num_layers=2, d_model=48, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=80,
                   **features)
  model_cfg = ModelConfig.from_config(cfg.model)
  shapes = jax.eval_shape(lambda: Transformer(model_cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: (rng.standard_normal(s.shape) * (0.5 if len(s.shape) < 3 else 0.3)
                                   + (1.0 if len(s.shape) == 2 and s.shape[-1] == 48 else 0.0)).astype(np.float32),
                        shapes["params"])
  params = jax.tree.map(lambda x: x.unbox() if hasattr(x, "unbox") else x, params,
                        is_leaf=lambda x: hasattr(x, "unbox"))
  ckpt = checkpoint.Checkpointer(tmp_path / "w", keep=1)
  ckpt.save(0, {"params": params}, {"config": cfg.to_dict(), "params_only": True})
  ckpt.wait()
  ckpt.close()
  assert run_convert("to-hf", "--workdir", tmp_path / "w", "--out", tmp_path / "hf") == 0
  assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [architecture]
  assert_close(logits_of(tmp_path / "w"), hf_logits(tmp_path / "hf"))


@pytest.mark.slow
def test_finetune_config_trains_a_converted_model_and_exports_it(tmp_path):
  """configs/finetune_hf.py on a converted Qwen2 (its model fields and tokenizer from init_from alone), a few steps of
  python_stdlib_sft, then to-hf: a Qwen2ForCausalLM whose logits in transformers equal the fine-tuned ones."""
  import subprocess
  import sys

  from test_convert import REPO

  from meshtrain.interop import hf_tokenizer
  hf = make(tmp_path / "hf", "qwen2_tied")
  (hf / "tokenizer.json").write_text(hf_tokenizer.byte_tokenizer_json())
  assert run_convert("from-hf", hf, "--workdir", tmp_path / "w") == 0
  done = subprocess.run([sys.executable, "-m", "meshtrain.train", "--config", "configs/finetune_hf.py",
                         f"--config.init_from={tmp_path / 'w'}", "--workdir", str(tmp_path / "sft"),
                         "--config.steps=3", "--config.seq_len=64", "--config.batch_size=8", "--config.eval_every=0",
                         "--config.checkpoint_every=3", "--config.optimizer.warmup_steps=1",
                         "--config.optimizer.learning_rate=1e-3"], cwd=REPO, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-3000:]
  params, meta = checkpoint.load_params(tmp_path / "sft")
  assert meta["config"]["model"]["attention_bias"] and meta["config"]["data"]["tokenizer"].endswith("tokenizer.json")
  before = checkpoint.load_params(tmp_path / "w")[0]
  assert not np.array_equal(params["layers"]["attn"]["q_bias"], before["layers"]["attn"]["q_bias"])  # it trained
  assert run_convert("to-hf", "--workdir", tmp_path / "sft", "--out", tmp_path / "back") == 0
  assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
  assert_close(logits_of(tmp_path / "sft"), hf_logits(tmp_path / "back"))


# ---------------------------------------------------------------------------------------------------------------
# The hub's files as published, and what generation does with them.

# config.json of each preset's model as published on the hub (written by transformers 4.x: rope_theta and
# rope_scaling, no rope_parameters), the fields that matter for the computation.
PUBLISHED = {
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-05, rope_theta=500000.0, tie_word_embeddings=True,
        attention_bias=False, mlp_bias=False, hidden_act="silu", pretraining_tp=1, torch_dtype="bfloat16",
        rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-05, rope_theta=500000.0, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, hidden_act="silu", pretraining_tp=1, torch_dtype="bfloat16",
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, rms_norm_eps=1e-06, rope_theta=1000000.0, tie_word_embeddings=True,
        hidden_act="silu", use_sliding_window=False, sliding_window=32768, max_window_layers=24, rope_scaling=None,
        torch_dtype="bfloat16"),
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, rms_norm_eps=1e-06, rope_theta=1000000, tie_word_embeddings=True,
        attention_bias=False, hidden_act="silu", use_sliding_window=False, sliding_window=None, max_window_layers=28,
        rope_scaling=None, torch_dtype="bfloat16"),
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=32768, rms_norm_eps=1e-05, rope_theta=1e6, tie_word_embeddings=False,
        hidden_act="silu", num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.02,
        sliding_window=None, torch_dtype="bfloat16"),
}


@pytest.mark.parametrize("preset", PUBLISHED)
def test_published_configs_read_as_the_presets(preset, tmp_path):
  """The presets (configs/*.py for plan and inspect) are the models from-hf makes of the published config.json."""
  from meshtrain import presets
  from meshtrain.interop import hf_config
  (tmp_path / "config.json").write_text(json.dumps(PUBLISHED[preset]))
  read = hf_config.read(tmp_path)
  ours = presets.model_config(preset).to_dict()
  assert ours["hf_model_type"] == read.pop("family")
  read.pop("max_position_embeddings")
  assert {k: ours[k] for k in read} == read


def test_a_transformers_4_config_converts(tmp_path):
  """The llama3 variant's config.json rewritten as transformers 4.x writes it (rope_theta and rope_scaling, as
  Llama 3.x's files on the hub are): the same model in, transformers' logits and greedy tokens."""
  hf = make(tmp_path / "hf", "llama3")
  config = json.loads((hf / "config.json").read_text())
  rope = config.pop("rope_parameters")
  config["rope_theta"] = rope.pop("rope_theta")
  config["rope_scaling"] = rope
  (hf / "config.json").write_text(json.dumps(config))
  assert run_convert("from-hf", hf, "--workdir", tmp_path / "w") == 0
  model = checkpoint.load_params(tmp_path / "w")[1]["config"]["model"]
  assert (model["rope_type"], model["rope_factor"], model["rope_theta"]) == ("llama3", 8.0, 500_000.0)
  assert_close(logits_of(tmp_path / "w"), hf_logits(hf))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
  root = tmp_path_factory.mktemp("mixtral_gen")
  hf = make(root / "hf", "mixtral")
  assert run_convert("from-hf", hf, "--workdir", root / "w") == 0
  return hf, root / "w"


def test_generation_never_drops_tokens_at_an_expert(mixtral):
  """Generation routes every token to its experts whatever capacity factor the model trained with (transformers
  has none): at capacity_factor 0.1, under which the forward pass drops most assignments and its logits move, the
  generator still gives transformers' greedy tokens."""
  from meshtrain.inference.generator import Generator
  hf, workdir = mixtral
  params, meta = checkpoint.load_params(workdir)
  starved = dataclasses.replace(ModelConfig.from_config(meta["config"]["model"]), capacity_factor=0.1)
  dropped = np.asarray(Transformer(starved).apply({"params": params}, jnp.asarray(TOKENS)))
  assert np.max(np.abs(dropped - hf_logits(hf))) > 0.1  # the capacity bites in training's forward
  generator = Generator(params, starved, num_ids=SHAPE["vocab_size"])
  prompt = TOKENS[:, :5]
  out = generator.generate([list(map(int, row)) for row in prompt], max_new_tokens=10, stop_at_eos=False)
  np.testing.assert_array_equal(np.asarray(out.token_ids), hf_greedy(hf, prompt, 10))


def test_generation_draws_only_the_tokenizers_ids(mixtral):
  """A model whose vocabulary is larger than its tokenizer's (padded embeddings, as many hub models have) never
  generates an id the tokenizer cannot decode: greedy takes the best id below num_ids even where a padding id
  scores higher."""
  from meshtrain.inference.generator import Generator
  _, workdir = mixtral
  logits = logits_of(workdir)[:, 4]  # the next token after the 5-token prompt, for each row
  best = int(logits[0].argmax())
  assert best > 0
  generator = Generator.from_workdir(workdir, num_ids=best)  # the best id of row 0 is now past the tokenizer
  prompt = [list(map(int, row)) for row in TOKENS[:, :5]]
  first = np.asarray(generator.generate(prompt, max_new_tokens=4, stop_at_eos=False).token_ids)
  assert (first < best).all()
  np.testing.assert_array_equal(first[:, 0], logits[:, :best].argmax(-1))
