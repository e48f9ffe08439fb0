"""meshtrain/models/vae.py against diffusers' AutoencoderKL, with weights through meshtrain/interop/diffusers_vae.py:
tiny random VAEs of both forms in use (SD's: 4 latent channels, quant convs; Flux's: 16, none, a shift) saved by
diffusers, read by meshtrain, compared in float32, written back and loaded by diffusers again.

Needs the `hf` extra (torch, diffusers). Without it this module fails to import, so CI cannot pass by skipping it;
MESHTRAIN_SKIP_HF_TESTS=1 skips it on purpose, as tests/test_convert.py.
"""
import copy
import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

try:
  import diffusers
  import torch
except ImportError as e:
  if os.environ.get("MESHTRAIN_SKIP_HF_TESTS") == "1":
    pytest.skip("MESHTRAIN_SKIP_HF_TESTS=1: diffusers VAE tests skipped", allow_module_level=True)
  raise ImportError(f"tests/test_vae.py checks the VAE against diffusers and torch ({e}); install them with "
                    "pip install -e '.[test,hf]', or set MESHTRAIN_SKIP_HF_TESTS=1 to skip these tests "
                    "knowingly") from e

from meshtrain.errors import UserError
from meshtrain.interop import diffusers_vae
from meshtrain.models import vae

# max |difference| in float32. Both sides compute the same float32 arithmetic in other orders (XLA's convolutions
# and reductions against torch's oneDNN): measured 2e-6 to 5e-6 on the encoder's and decoder's outputs (std 0.4-2),
# 1.4e-5 decoding Flux-form latents from the mean (unscaled values up to ~10). 1e-4 leaves 7x of margin for other
# CPUs and summation orders, while a wrong layout, padding side, upsampling, resnet count or attention scale moves
# outputs by 1e-2 or more (each tried: they fail these tests).
TOLERANCE = 1e-4
WEIGHTS = "diffusion_pytorch_model.safetensors"
FORMS = {
    # SD / SDXL: quant_conv and post_quant_conv, no shift.
    "sd": dict(latent_channels=4, norm_num_groups=8, scaling_factor=0.18215),
    # SD3 / Flux: 16 channels, no 1x1 convs, a shift.
    "flux": dict(latent_channels=16, norm_num_groups=32, scaling_factor=0.3611, shift_factor=0.1159,
                 use_quant_conv=False, use_post_quant_conv=False),
}
SIDES = {"sd": 16, "flux": 32}  # image side


def make_vae(path, form: str):
  """A random diffusers AutoencoderKL saved by save_pretrained. Weights are redrawn at 1/sqrt(fan_in), GroupNorm
  scales away from 1 and biases away from 0, so every output is O(1) and no mistake can hide under the tolerance."""
  torch.manual_seed(0)
  model = diffusers.AutoencoderKL(block_out_channels=(32, 64), layers_per_block=1,
                                  down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2, **FORMS[form])
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.ndim > 1:
        p.normal_(0, p[0].numel() ** -0.5)
      elif "norm" in name and name.endswith("weight"):
        p.uniform_(0.5, 1.5)
      else:
        p.uniform_(-0.3, 0.3)
  model.eval().save_pretrained(path)
  return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """form -> (its directory, the diffusers model, meshtrain's config and params read from the directory)."""
  root = tmp_path_factory.mktemp("vae")
  out = {}
  for form in FORMS:
    model = make_vae(root / form, form)
    out[form] = (root / form, model, *diffusers_vae.read(root / form))
  return out


def images(form: str):
  side = SIDES[form]
  return np.random.default_rng(0).uniform(-1, 1, (2, 3, side, side)).astype(np.float32)  # NCHW, diffusers'


def nhwc(t):
  return np.asarray(t).transpose(0, 2, 3, 1)


def assert_close(ours, theirs_NCHW, what: str):
  theirs = nhwc(theirs_NCHW)
  assert ours.shape == theirs.shape, what
  assert np.std(theirs) > 0.1, what  # outputs that carry signal
  diff = float(np.max(np.abs(np.asarray(ours) - theirs)))
  assert diff <= TOLERANCE, f"{what}: max |difference| {diff:.2e} > {TOLERANCE}"


@pytest.mark.parametrize("form", FORMS)
def test_read_gives_the_models_parameter_tree(saved, form):
  _, model, cfg, params = saved[form]
  shapes = lambda tree: jax.tree.map(lambda a: (tuple(a.shape), np.dtype(a.dtype)), tree)
  assert shapes(params) == shapes(vae.param_shapes(cfg))
  assert cfg.latent_channels == model.config.latent_channels and cfg.use_quant_conv == model.config.use_quant_conv
  assert cfg.shift_factor == (model.config.shift_factor or 0.0) and cfg.scaling_factor == model.config.scaling_factor
  kernel = params["encoder"]["down_blocks_0"]["resnets_0"]["conv1"]["kernel"]  # HWIO of torch's OIHW
  assert np.array_equal(kernel, model.encoder.down_blocks[0].resnets[0].conv1.weight.detach().numpy()
                        .transpose(2, 3, 1, 0))


@pytest.mark.parametrize("form", FORMS)
def test_encode_and_decode_equal_diffusers(saved, form):
  _, model, cfg, params = saved[form]
  x = images(form)
  with torch.no_grad():
    posterior = model.encode(torch.tensor(x)).latent_dist
    z = torch.tensor(np.random.default_rng(1).normal(size=posterior.mean.shape).astype(np.float32))
    decoded = model.decode(z).sample
  ours = vae.encode(cfg, params, nhwc(x))
  assert_close(ours.mean, posterior.mean, "mean")
  assert_close(ours.logvar, posterior.logvar, "logvar")
  assert ours.mean.shape == (2, SIDES[form] // 2, SIDES[form] // 2, cfg.latent_channels)
  assert_close(vae.decode(cfg, params, nhwc(z), scaled=False), decoded, "decode")


@pytest.mark.parametrize("form", FORMS)
def test_scaled_latents_follow_diffusers_convention(saved, form):
  """A diffusion model trains on (mean - shift_factor) * scaling_factor, and pipelines decode
  latents / scaling_factor + shift_factor (diffusers' SD3 and Flux pipelines; SD's have no shift)."""
  _, model, cfg, params = saved[form]
  shift, scaling = model.config.shift_factor or 0.0, model.config.scaling_factor
  x = images(form)
  with torch.no_grad():
    mean = model.encode(torch.tensor(x)).latent_dist.mean
    scaled = (mean - shift) * scaling
    decoded = model.decode(scaled / scaling + shift).sample
  z = vae.latents(cfg, params, nhwc(x))
  assert_close(z, scaled, "scaled latents")
  assert_close(vae.decode(cfg, params, z), decoded, "decode of scaled latents")
  # A sample: the mean plus std x normal noise of the key's drawing.
  posterior = vae.encode(cfg, params, nhwc(x))
  sample, other = (vae.latents(cfg, params, nhwc(x), jax.random.key(k)) for k in (3, 4))
  noise = (vae.unscale(cfg, sample) - posterior.mean) / np.exp(0.5 * posterior.logvar)
  assert abs(float(np.mean(noise))) < 0.1 and abs(float(np.std(noise)) - 1) < 0.1
  assert float(np.max(np.abs(sample - other))) > 0.1  # the key decides the draw


def test_logvar_is_clipped_as_diffusers(saved):
  _, model, cfg, params = saved["sd"]
  model, params, L = copy.deepcopy(model), copy.deepcopy(params), cfg.latent_channels
  with torch.no_grad():  # log-variances far beyond [-30, 20] on both sides
    model.quant_conv.bias[L:L + 2] += 100.0
    model.quant_conv.bias[L + 2:] -= 100.0
  params["quant_conv"]["bias"] = model.quant_conv.bias.detach().numpy().copy()
  with torch.no_grad():
    theirs = model.encode(torch.tensor(images("sd"))).latent_dist.logvar
  ours = vae.encode(cfg, params, nhwc(images("sd"))).logvar
  assert float(np.max(ours)) == 20.0 and float(np.min(ours)) == -30.0
  assert np.array_equal(np.asarray(ours), nhwc(theirs))


def test_bfloat16_compute_stays_close(saved):
  _, _, cfg, params = saved["sd"]
  x = nhwc(images("sd"))
  ref, low = (vae.encode(c, params, x).mean for c in (cfg, dataclasses.replace(cfg, dtype="bfloat16")))
  # bfloat16 keeps 8 bits of mantissa (~0.4% per rounding) through about 20 layers: measured 1.4% of the largest
  # |mean|; 5% bounds it, and zero would mean the dtype was not applied.
  assert low.dtype == np.float32 and 0 < float(np.max(np.abs(low - ref))) < 0.05 * float(np.max(np.abs(ref)))


@pytest.mark.parametrize("form", FORMS)
def test_write_loads_in_diffusers_bitwise(saved, tmp_path, form):
  path, model, cfg, params = saved[form]
  assert diffusers_vae.write(tmp_path / "out", cfg, params) == tmp_path / "out"
  assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", WEIGHTS]
  back = diffusers.AutoencoderKL.from_pretrained(tmp_path / "out")
  before, after = model.state_dict(), back.state_dict()
  assert sorted(before) == sorted(after)
  for name, w in before.items():
    assert after[name].dtype == w.dtype and torch.equal(after[name], w), name
  fields = json.loads((path / "config.json").read_text())
  for key, value in fields.items():
    if not key.startswith("_"):
      assert json.loads(json.dumps(back.config[key])) == value, key
  # And read again: the same tree.
  _, again = diffusers_vae.read(tmp_path / "out")
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), again, params)


def test_bfloat16_write(saved, tmp_path):
  _, model, cfg, params = saved["sd"]
  diffusers_vae.write(tmp_path / "out", cfg, params, dtype="bfloat16")
  back = diffusers.AutoencoderKL.from_pretrained(tmp_path / "out", torch_dtype=torch.bfloat16)
  for name, w in model.state_dict().items():
    assert torch.equal(back.state_dict()[name], w.to(torch.bfloat16)), name


def test_shards_and_old_attention_names_are_read(saved, tmp_path):
  path, _, cfg, params = saved["sd"]
  tensors = load_file(path / WEIGHTS)
  names = sorted(tensors)
  old = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
  renamed = {}
  for name in names:  # the mid blocks' attention under the names of older diffusers checkpoints
    head, sep, tail = name.partition(".attentions.0.")
    new = old.get(tail.rpartition(".")[0])
    renamed[name] = f"{head}{sep}{new}.{tail.rpartition('.')[2]}" if sep and new else name
  assert sum(a != b for a, b in renamed.items()) == 16
  shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[:len(names) // 2],
            "diffusion_pytorch_model-00002-of-00002.safetensors": names[len(names) // 2:]}
  (tmp_path / "in").mkdir()
  shutil.copy(path / "config.json", tmp_path / "in")
  for file, part in shards.items():
    save_file({renamed[n]: tensors[n] for n in part}, tmp_path / "in" / file, metadata={"format": "pt"})
  (tmp_path / "in" / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(
      {"metadata": {}, "weight_map": {renamed[n]: f for f, part in shards.items() for n in part}}))
  read_cfg, read_params = diffusers_vae.read(tmp_path / "in")
  assert read_cfg == cfg
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), read_params, params)


# ------------------------------------------------------------------------------------------------------------------
# Input that is not understood: one UserError naming the problem, and no output directory.

def set_config(**changes):
  def edit(d):
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, **changes}))
  return edit


def set_tensors(change):
  def edit(d):
    tensors = load_file(d / WEIGHTS)
    change(tensors)
    save_file(tensors, d / WEIGHTS, metadata={"format": "pt"})
  return edit


BAD_DIRECTORIES = {
    "another class": (set_config(_class_name="UNet2DModel"), r"describes a UNet2DModel, not an AutoencoderKL"),
    "no config": (lambda d: (d / "config.json").unlink(), r"has no config\.json"),
    "config not JSON": (lambda d: (d / "config.json").write_text("{"), r"config\.json' is not JSON"),
    "no weights": (lambda d: (d / WEIGHTS).unlink(), r"has no diffusion_pytorch_model\.safetensors"),
    "missing tensor": (set_tensors(lambda t: t.pop("decoder.conv_out.bias")),
                       r"lacks 1 tensor\(s\) its config\.json implies, e\.g\. 'decoder\.conv_out\.bias'"),
    "extra tensor": (set_tensors(lambda t: t.update({"encoder.down_blocks.2.conv.weight": np.zeros(3, np.float32)})),
                     r"holds 1 tensor\(s\) an AutoencoderKL .* e\.g\. 'encoder\.down_blocks\.2\.conv\.weight'"),
    "tensor shape": (set_tensors(lambda t: t.update({"decoder.conv_out.bias": np.zeros(4, np.float32)})),
                     r"decoder\.conv_out\.bias has shape \[4\], config\.json implies \[3\]"),
    "config shape": (set_config(latent_channels=8),
                     r"decoder\.conv_in\.weight has shape \[64, 4, 3, 3\], config\.json implies \[64, 8, 3, 3\]"),
    "tensor dtype": (set_tensors(lambda t: t.update({"decoder.conv_out.bias": np.zeros(3, np.int32)})),
                     r"decoder\.conv_out\.bias is I32"),
    "block type": (set_config(up_block_types=["UpDecoderBlock2D", "AttnUpDecoderBlock2D"]),
                   r"up_block_types has AttnUpDecoderBlock2D, a block type other than UpDecoderBlock2D"),
    "block count": (set_config(down_block_types=["DownEncoderBlock2D"]),
                    r"down_block_types is \['DownEncoderBlock2D'\]: one block per entry of block_out_channels"),
    "activation": (set_config(act_fn="gelu"), r"act_fn is 'gelu', not silu"),
    "groups": (set_config(norm_num_groups=48), r"norm_num_groups 48 does not divide block_out_channels"),
}


@pytest.mark.parametrize("case", BAD_DIRECTORIES)
def test_bad_directories_are_refused(saved, tmp_path, case):
  edit, message = BAD_DIRECTORIES[case]
  shutil.copytree(saved["sd"][0], tmp_path / "in")
  edit(tmp_path / "in")
  with pytest.raises(UserError, match=message):
    diffusers_vae.write(tmp_path / "out", *diffusers_vae.read(tmp_path / "in"))
  assert not (tmp_path / "out").exists()


def test_a_pipeline_directory_is_pointed_to_its_vae(tmp_path):
  (tmp_path / "pipe" / "vae").mkdir(parents=True)
  (tmp_path / "pipe" / "model_index.json").write_text("{}")
  with pytest.raises(UserError, match=r"pass its vae/ folder"):
    diffusers_vae.read(tmp_path / "pipe")


def drop(tree):
  tree["decoder"]["conv_out"].pop("bias")


BAD_TREES = {
    "missing parameter": (drop, {}, r"lacks 1 parameter\(s\) this config implies, e\.g\. decoder/conv_out/bias"),
    "extra parameter": (lambda t: t["decoder"].update({"extra": {"kernel": np.zeros(3)}}), {},
                        r"has 1 parameter\(s\) an AutoencoderKL with this config has not, e\.g\. decoder/extra/kernel"),
    "parameter shape": (lambda t: t["decoder"]["conv_out"].update({"bias": np.zeros(4)}), {},
                        r"decoder/conv_out/bias has shape \[4\], this config implies \[3\]"),
    "collection": (None, {}, r"pass params\['params'\]"),
    "dtype": (lambda t: None, {"dtype": "int8"}, r"dtype 'int8' is not one diffusers' weights are stored in"),
}


@pytest.mark.parametrize("case", BAD_TREES)
def test_bad_trees_are_refused_before_writing(saved, tmp_path, case):
  edit, kwargs, message = BAD_TREES[case]
  _, _, cfg, params = saved["sd"]
  params = copy.deepcopy(params)
  if edit is None:
    params = {"params": params}
  else:
    edit(params)
  with pytest.raises(UserError, match=message):
    diffusers_vae.write(tmp_path / "out", cfg, params, **kwargs)
  assert not (tmp_path / "out").exists()


def test_write_refuses_a_non_empty_directory_and_cleans_up_a_failure(saved, tmp_path, monkeypatch):
  _, _, cfg, params = saved["sd"]
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "keep.txt").write_text("mine")
  with pytest.raises(UserError, match=r"exists and is not empty"):
    diffusers_vae.write(tmp_path / "out", cfg, params)
  assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]

  def full_disk(*args, **kwargs):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(diffusers_vae.weights, "write_safetensors", full_disk)
  with pytest.raises(OSError):
    diffusers_vae.write(tmp_path / "new", cfg, params)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # neither the output nor its staging directory
