"""Flux's text encoders against transformers: CLIPTextModel and T5EncoderModel directories read by
meshtrain/interop/text_encoders.py, run by meshtrain/models/clip_text.py and meshtrain/models/t5.py, written back.

Needs the `hf` extra (torch, transformers), as tests/test_convert.py does; MESHTRAIN_SKIP_HF_TESTS=1 skips it.
"""
import json
import os
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

try:
  import torch
  import transformers
except ImportError as e:
  if os.environ.get("MESHTRAIN_SKIP_HF_TESTS") == "1":
    pytest.skip("MESHTRAIN_SKIP_HF_TESTS=1: Hugging Face text-encoder tests skipped", allow_module_level=True)
  raise ImportError(f"tests/test_text_encoders.py checks against transformers and torch ({e}); install them "
                    "with pip install -e '.[test,hf]', or set MESHTRAIN_SKIP_HF_TESTS=1 to skip these tests "
                    "knowingly") from e

from safetensors.numpy import load_file, save_file

from meshtrain import mesh as mesh_lib, sharding
from meshtrain.errors import UserError
from meshtrain.interop import text_encoders
from meshtrain.models import clip_text, t5

# max |difference| of outputs of unit scale (after the final norm), float32: both sides compute the same float32
# operations in another order (torch's sdpa scales q and k by sqrt of the scale each, XLA fuses differently), which
# costs a few ulps (~1e-7) per operation; 1e-5 leaves room for that through two layers, while any layout or formula
# mistake moves outputs by 1e-2 or more.
TOLERANCE = 1e-5
PAD_T5 = 0
RNG = np.random.default_rng(0)


def redraw(model):
  """Weights at 1/sqrt(fan_in) (T5's q also / sqrt(d_kv), as T5 initialises it), embeddings and T5's position-bias
  table at unit scale, norm scales away from 1 and biases away from 0: outputs of unit scale, where a wrong layout
  (a transpose, swapped heads) could not hide."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name and name.endswith("weight"):
        p.uniform_(0.5, 1.5)
      elif name.endswith("bias") or "embed" in name or "shared" in name or "relative_attention_bias" in name:
        p.normal_(0, 0.3 if name.endswith("bias") and "relative" not in name else 1.0)
      elif name.endswith("SelfAttention.q.weight"):  # T5 folds the 1/sqrt(d_kv) it never applies into q's init
        p.normal_(0, (p.shape[1] * model.config.d_kv) ** -0.5)
      else:
        p.normal_(0, p.shape[1] ** -0.5)
  return model


def make_clip(path, eos=2, act="quick_gelu"):
  cfg = transformers.CLIPTextConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=37, max_position_embeddings=77, hidden_act=act,
                                    eos_token_id=eos, bos_token_id=0, pad_token_id=1)
  torch.manual_seed(0)
  redraw(transformers.CLIPTextModel(cfg)).save_pretrained(path)
  return path


def make_t5(path, proj="gated-gelu", dtype=torch.float32):
  cfg = transformers.T5Config(vocab_size=99, d_model=32, d_kv=8, num_heads=4, d_ff=37, num_layers=2,
                              feed_forward_proj=proj, relative_attention_num_buckets=32,
                              relative_attention_max_distance=128)
  torch.manual_seed(1)
  redraw(transformers.T5EncoderModel(cfg)).to(dtype).save_pretrained(path)
  return path


def clip_ids(eos: int):
  """Three prompts padded to 77 tokens as FluxPipeline._get_clip_prompt_embeds pads them (padding="max_length").
  eos 2 (the legacy config, CLIP-L's): the end-of-text token is the largest id (98) and pads, as CLIP-L's
  tokenizer does; else eos ends each prompt and pad id 1 follows, the last prompt truncated before its eos."""
  ids = np.full((3, 77), 98 if eos == 2 else 1, np.int64)
  for row, n in enumerate((5, 30, 76)):
    words = RNG.integers(3, 98, size=n)
    words[words == eos] = 3
    ids[row, 0] = 0  # bos
    ids[row, 1:n + 1] = words[:76]
    if eos != 2 and n < 76:
      ids[row, n + 1] = eos
  keep = np.arange(77)[None] <= np.array([6, 31, 76])[:, None]
  return ids, keep


def max_diff(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  assert a.shape == b.shape and np.std(b) > 0.1
  return float(np.max(np.abs(a - b)))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("hf")
  return {"clip2": make_clip(root / "clip2"), "clip97": make_clip(root / "clip97", eos=97, act="gelu"),
          "t5_relu": make_t5(root / "t5_relu", "relu"), "t5_gated": make_t5(root / "t5_gated"),
          "t5_bf16": make_t5(root / "t5_bf16", dtype=torch.bfloat16)}  # as Flux's text_encoder_2 is stored


@pytest.mark.parametrize("variant,eos", [("clip2", 2), ("clip97", 97)])
def test_clip_equals_transformers(hf_dirs, variant, eos):
  c, params = text_encoders.read_clip_text(hf_dirs[variant])
  assert c.eos_token_id == eos and c.param_dtype == "float32"
  ids, keep = clip_ids(eos)
  theirs = transformers.CLIPTextModel.from_pretrained(hf_dirs[variant], dtype=torch.float32)
  model = clip_text.ClipText(c)
  outputs = []
  for mask in (None, keep):  # Flux's call (no mask), then transformers' causal and padding mask together
    with torch.no_grad():
      want = theirs(torch.tensor(ids), attention_mask=None if mask is None else torch.tensor(mask),
                    output_hidden_states=True)
    last, pooled, hidden = jax.jit(lambda p, i, k: model.apply({"params": p}, i, k, hidden_layer=-2))(
        params, ids, mask)
    diffs = [max_diff(last, want.last_hidden_state), max_diff(pooled, want.pooler_output),
             max_diff(hidden, want.hidden_states[-2])]
    print(f"{variant} mask={mask is not None}: max |diff| last, pooled, hidden[-2] = {diffs}")
    assert max(diffs) <= TOLERANCE
    outputs.append(np.asarray(last))
  assert max_diff(*outputs) > 0.1  # the mask changes the padded positions: the comparison covers both calls
  # Where it pools: the first eos (for eos 2 the first largest id); position 0 for the prompt that has none.
  want_pos = [6, 31, 0] if eos != 2 else [6, 31, int(np.argmax(ids[2]))]
  assert np.asarray(clip_text.pooled_positions(jnp.asarray(ids), eos)).tolist() == want_pos


@pytest.mark.parametrize("variant", ["t5_relu", "t5_gated"])
def test_t5_equals_transformers(hf_dirs, variant):
  c, params = text_encoders.read_t5_encoder(hf_dirs[variant])
  assert c.gated == (variant == "t5_gated") and c.activation == ("gelu_new" if c.gated else "relu")
  lengths = np.array([3, 40, 64])
  ids = np.where(np.arange(64)[None] < lengths[:, None], RNG.integers(1, 99, size=(3, 64)), PAD_T5)
  keep = ids != PAD_T5
  theirs = transformers.T5EncoderModel.from_pretrained(hf_dirs[variant], dtype=torch.float32)
  model = t5.T5Encoder(c)
  outputs = []
  for mask in (keep, None):  # padded keys masked, then Flux's call (no mask)
    with torch.no_grad():
      want = theirs(torch.tensor(ids), attention_mask=None if mask is None else torch.tensor(mask, dtype=torch.long))
    got = jax.jit(lambda p, i, k: model.apply({"params": p}, i, k))(params, ids, mask)
    diff = max_diff(got, want.last_hidden_state)
    print(f"{variant} mask={mask is not None}: max |diff| last = {diff:.2e}")
    assert diff <= TOLERANCE
    outputs.append(np.asarray(got))
  assert max_diff(*outputs) > 0.1  # the mask changes every token of the padded prompts


@pytest.mark.parametrize("buckets,distance", [(32, 128), (16, 40)])
def test_relative_buckets_equal_transformers(buckets, distance):
  relative = torch.arange(-600, 600)
  want = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket(
      relative, bidirectional=True, num_buckets=buckets, max_distance=distance)
  got = t5.relative_buckets(601, 1200, buckets, distance)[600]  # query 600: k - q = -600 .. 599
  np.testing.assert_array_equal(got, want.numpy())


@pytest.mark.parametrize("variant", ["clip2", "t5_relu", "t5_bf16"])
def test_write_back_loads_in_transformers_bit_for_bit(hf_dirs, tmp_path, variant):
  kind = transformers.CLIPTextModel if variant.startswith("clip") else transformers.T5EncoderModel
  read, write = ((text_encoders.read_clip_text, text_encoders.write_clip_text) if variant.startswith("clip") else
                 (text_encoders.read_t5_encoder, text_encoders.write_t5_encoder))
  c, params = read(hf_dirs[variant])
  assert c.param_dtype == ("bfloat16" if variant == "t5_bf16" else "float32")
  assert {str(a.dtype) for a in jax.tree.leaves(params)} == {c.param_dtype}
  assert write(tmp_path / "back", c, params) == tmp_path / "back"
  back, info = kind.from_pretrained(tmp_path / "back", output_loading_info=True)
  assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
  before = kind.from_pretrained(hf_dirs[variant]).state_dict()
  after = back.state_dict()
  assert sorted(before) == sorted(after)
  for name, w in before.items():
    assert after[name].dtype == w.dtype and torch.equal(after[name], w), name
  # Read again from what was written: the same config (feed_forward_proj "gated-gelu" again gelu_new) and tree.
  c2, params2 = read(tmp_path / "back")
  assert c2 == c
  jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_tied_embedding_names_and_pipeline_folders_are_read(hf_dirs, tmp_path):
  """transformers 4 saved T5's table as shared.weight and encoder.embed_tokens.weight, CLIP with a text_model.
  prefix and a position_ids buffer; a Flux pipeline's root finds text_encoder/ and text_encoder_2/."""
  pipe = tmp_path / "pipe"
  shutil.copytree(hf_dirs["t5_gated"], pipe / "text_encoder_2")
  tensors = load_file(pipe / "text_encoder_2" / "model.safetensors")
  tensors["encoder.embed_tokens.weight"] = tensors["shared.weight"]
  save_file(tensors, pipe / "text_encoder_2" / "model.safetensors", metadata={"format": "pt"})
  shutil.copytree(hf_dirs["clip2"], pipe / "text_encoder")
  tensors = {f"text_model.{k}": v for k, v in load_file(pipe / "text_encoder" / "model.safetensors").items()}
  tensors["text_model.embeddings.position_ids"] = np.arange(77, dtype=np.int64)[None]
  save_file(tensors, pipe / "text_encoder" / "model.safetensors", metadata={"format": "pt"})
  (pipe / "model_index.json").write_text("{}")
  for read, name in ((text_encoders.read_t5_encoder, "t5_gated"), (text_encoders.read_clip_text, "clip2")):
    want = read(hf_dirs[name])[1]
    jax.tree.map(np.testing.assert_array_equal, read(pipe)[1], want)
  # Only encoder.embed_tokens.weight stored: read from it.
  only = edited(pipe / "text_encoder_2", tmp_path / "only_embed_tokens", tensors={"shared.weight": None})
  np.testing.assert_array_equal(text_encoders.read_t5_encoder(only)[1]["embedding"],
                                text_encoders.read_t5_encoder(hf_dirs["t5_gated"])[1]["embedding"])


def edited(src, dst, config=None, tensors=None):
  """A copy of the model directory `src` with config.json fields changed and tensors changed (None: removed)."""
  shutil.copytree(src, dst)
  if config:
    (dst / "config.json").write_text(json.dumps({**json.loads((dst / "config.json").read_text()), **config}))
  if tensors:
    stored = load_file(dst / "model.safetensors")
    for name, value in tensors.items():
      if value is None:
        del stored[name]
      else:
        stored[name] = value
    save_file(stored, dst / "model.safetensors", metadata={"format": "pt"})
  return dst


def test_bad_directories_are_refused(hf_dirs, tmp_path):
  clip, t5_dir = hf_dirs["clip2"], hf_dirs["t5_gated"]
  (tmp_path / "empty").mkdir()
  (tmp_path / "no_weights").mkdir()
  shutil.copy(clip / "config.json", tmp_path / "no_weights")
  cases = [
      (text_encoders.read_clip_text, tmp_path / "absent", "is not a directory"),
      (text_encoders.read_clip_text, tmp_path / "empty", "has no config.json"),
      (text_encoders.read_clip_text, tmp_path / "no_weights", "no *.safetensors"),
      (text_encoders.read_clip_text, t5_dir, "holds a T5EncoderModel"),
      (text_encoders.read_t5_encoder, edited(t5_dir, tmp_path / "t5full", {"architectures": [
          "T5ForConditionalGeneration"]}), "holds a T5ForConditionalGeneration"),
      (text_encoders.read_clip_text, edited(clip, tmp_path / "no_width", {"hidden_size": None}), "hidden_size is null"),
      (text_encoders.read_clip_text, edited(clip, tmp_path / "act", {"hidden_act": "swish"}), 'hidden_act "swish"'),
      (text_encoders.read_t5_encoder, edited(t5_dir, tmp_path / "t5act", {"feed_forward_proj": "gated-tanh"}),
       "uses 'tanh'"),
      (text_encoders.read_clip_text, edited(clip, tmp_path / "missing", tensors={
          "encoder.layers.1.mlp.fc2.bias": None}), "lacks 1 tensor(s) its config.json implies, e.g. "
       "'encoder.layers.1.mlp.fc2.bias'"),
      (text_encoders.read_clip_text, edited(clip, tmp_path / "extra", tensors={
          "text_projection.weight": np.zeros((32, 32), np.float32)}), "holds 1 tensor(s) a CLIPTextModel with "
       "this config.json has not, e.g. 'text_projection.weight'"),
      (text_encoders.read_clip_text, edited(clip, tmp_path / "shape", {"intermediate_size": 40}),
       "encoder.layers.0.mlp.fc1.weight has shape [37, 32], config.json implies [40, 32]"),
      (text_encoders.read_t5_encoder, edited(t5_dir, tmp_path / "t5_layers", {"num_layers": 3}),
       "e.g. 'encoder.block.2.layer.0.layer_norm.weight'"),
      (text_encoders.read_t5_encoder, edited(t5_dir, tmp_path / "t5_tied", tensors={
          "encoder.embed_tokens.weight": np.zeros((98, 32), np.float32)}),
       "encoder.embed_tokens.weight has shape [98, 32], config.json implies [99, 32]"),
  ]
  for read, path, needle in cases:
    with pytest.raises(UserError) as e:
      read(path)
    assert needle in str(e.value) and "\n" not in str(e.value), (path.name, str(e.value))


def test_bad_trees_are_refused_before_writing(hf_dirs, tmp_path):
  c, params = text_encoders.read_clip_text(hf_dirs["clip2"])
  out = tmp_path / "out"
  bigger = clip_text.ClipTextConfig(**{**c.__dict__, "mlp_dim": 40})
  with pytest.raises(UserError, match=r"layers/mlp/up has shape \[2, 32, 37\], its config implies \[2, 32, 40\]"):
    text_encoders.write_clip_text(out, bigger, params)
  without = {k: v for k, v in params.items() if k != "final_norm_bias"}
  with pytest.raises(UserError, match="missing final_norm_bias"):
    text_encoders.write_clip_text(out, c, without)
  with pytest.raises(UserError, match="activation 'swish'"):
    text_encoders.write_clip_text(out, clip_text.ClipTextConfig(**{**c.__dict__, "activation": "swish"}), params)
  tc, tparams = text_encoders.read_t5_encoder(hf_dirs["t5_gated"])
  with pytest.raises(UserError, match="unexpected layers/mlp/gate"):
    text_encoders.write_t5_encoder(out, t5.T5EncoderConfig(**{**tc.__dict__, "gated": False}), tparams)
  with pytest.raises(UserError, match="gelu_new"):
    text_encoders.write_t5_encoder(out, t5.T5EncoderConfig(**{**tc.__dict__, "activation": "gelu"}), tparams)
  assert not out.exists() and not list(tmp_path.glob(".out*"))
  (tmp_path / "full").mkdir()
  (tmp_path / "full" / "keep.txt").write_text("mine")
  with pytest.raises(UserError, match="not empty"):
    text_encoders.write_clip_text(tmp_path / "full", c, params)
  assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]


# ---------------------------------------------------------------------------------------------------------------
# Sharded: the same outputs with the weights split over fsdp x tensor (8 simulated devices) as on one device.

def sharded_and_single(model, args):
  """model.init's parameters applied on one device, then on fsdp=2 x tensor=4 under the fsdp_tp rules (embed over
  fsdp; heads, mlp and vocab over tensor; the batch over fsdp): both outputs and the sharded parameters."""
  params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), *args)["params"])
  want = jax.jit(lambda p, *a: model.apply({"params": p}, *a))(params, *args)
  mesh = mesh_lib.make_mesh({"fsdp": 2, "tensor": 4})
  rules = sharding.for_mesh(sharding.rules_for("fsdp_tp"), mesh)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    abstract = jax.eval_shape(model.init, jax.random.key(0), *args)["params"]
    shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
    p_sharded = jax.device_put(params, shardings)
    batch = NamedSharding(mesh, sharding.logical_to_spec(("act_batch", "act_len"), rules))
    a_sharded = [jax.device_put(a, batch) for a in args]
    got = jax.jit(lambda p, *a: model.apply({"params": p}, *a))(p_sharded, *a_sharded)
  return want, got, p_sharded


def test_sharded_equals_one_device():
  ids = jnp.asarray(RNG.integers(1, 104, size=(4, 16)), jnp.int32)
  keep = jnp.arange(16)[None] < jnp.array([[4], [16], [9], [12]])
  clip_cfg = clip_text.ClipTextConfig(vocab_size=104, d_model=32, num_layers=2, num_heads=4, mlp_dim=48,
                                      max_positions=77, eos_token_id=103, init_std=0.3)
  t5_cfg = t5.T5EncoderConfig(vocab_size=104, d_model=32, num_layers=2, num_heads=4, head_dim=8, mlp_dim=48,
                              activation="gelu_new", gated=True, init_std=0.15)
  for model in (clip_text.ClipText(clip_cfg), t5.T5Encoder(t5_cfg)):
    want, got, params = sharded_and_single(model, (ids, keep))
    q = params["layers"]["attn"]["q"]
    assert q.sharding.spec[1:] == ("fsdp", "tensor", None) and q.addressable_shards[0].data.shape == (2, 16, 1, 8)
    diffs = [max_diff(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
    print(f"{type(model).__name__} fsdp=2 x tensor=4 vs one device: max |diff| = {diffs}")
    assert max(diffs) <= TOLERANCE
