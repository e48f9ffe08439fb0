"""diffusers' FluxTransformer2DModel <-> meshtrain's Flux (meshtrain/interop/diffusers_flux.py): on tiny random
transformers built here (nothing from a hub), the converted model's velocity equals diffusers' on the same packed
latents, prompt features, timesteps and guidance; written back, diffusers loads every tensor bitwise; what does not
match is refused with one clear error."""
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import FluxTransformer2DModel
from safetensors.numpy import load_file, save_file

from meshtrain.errors import UserError
from meshtrain.interop import diffusers_flux
from meshtrain.models.flux import Flux

SMALL = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
             num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=20, axes_dims_rope=(4, 6, 6))
H, W, S = 8, 6, 5  # latent rows and columns (not square: positions follow the input), prompt tokens
# float32 on both sides; the differences are summation order (our einsums vs torch's Linear) and diffusers' RoPE
# tables computed in float64 against ours in float32: measured 2.4e-6 (dev) and 4.8e-7 (schnell) on outputs of
# magnitude ~2.
TOLERANCE = 2e-5


def transformer_dir(tmp_path: pathlib.Path, name: str, guidance: bool, dtype=torch.float32) -> pathlib.Path:
  torch.manual_seed(0)
  model = FluxTransformer2DModel(**SMALL, guidance_embeds=guidance).to(dtype)
  path = tmp_path / name
  model.save_pretrained(path, safe_serialization=True)
  return path


def pack(x_BHWC: np.ndarray) -> np.ndarray:
  """FluxPipeline._pack_latents of the NCHW form of x: [B, (H/2)(W/2), C*4], (c, row, col) per patch."""
  B, h, w, C = x_BHWC.shape
  x = x_BHWC.transpose(0, 3, 1, 2).reshape(B, C, h // 2, 2, w // 2, 2).transpose(0, 2, 4, 1, 3, 5)
  return x.reshape(B, (h // 2) * (w // 2), C * 4)


def inputs(c, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((2, H, W, c.channels)).astype(np.float32)
  text = {"text_features": rng.standard_normal((2, S, c.text_width)).astype(np.float32),
          "text_keep": np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool),  # ignored: Flux attends over padding
          "text_pooled": rng.standard_normal((2, c.pooled_width)).astype(np.float32)}
  return x, np.array([0.3, 0.85], np.float32), text, np.array([3.5, 1.0], np.float32)


def diffusers_velocity(model, x, t, text, guidance):
  ids = np.zeros((H // 2, W // 2, 3), np.float32)
  ids[..., 1], ids[..., 2] = np.arange(H // 2)[:, None], np.arange(W // 2)[None, :]
  with torch.no_grad():
    out = model(hidden_states=torch.from_numpy(pack(x)), encoder_hidden_states=torch.from_numpy(text["text_features"]),
                pooled_projections=torch.from_numpy(text["text_pooled"]), timestep=torch.from_numpy(t),
                img_ids=torch.from_numpy(ids.reshape(-1, 3)), txt_ids=torch.zeros(S, 3),
                guidance=None if guidance is None else torch.from_numpy(guidance))
  return out.sample.numpy()


@pytest.mark.parametrize("guidance", [True, False], ids=["dev (guidance embedding)", "schnell"])
def test_the_converted_transformer_equals_diffusers(tmp_path, guidance):
  src = transformer_dir(tmp_path, "transformer", guidance)
  c, params = diffusers_flux.read_transformer(src, image_size=H, text_len=S, text_encoder="diffusers")
  assert (c.channels, c.patch_size, c.d_model, c.mlp_dim, c.guidance_embed) == (4, 2, 32, 128, guidance)
  x, t, text, g = inputs(c)
  g = g if guidance else None
  ours = jax.jit(lambda p, *a: Flux(c).apply({"params": p}, *a))(params, jnp.asarray(x), t, text, g)
  theirs = diffusers_velocity(FluxTransformer2DModel.from_pretrained(src).eval(), x, t, text, g)
  assert np.abs(pack(np.asarray(ours)) - theirs).max() < TOLERANCE
  # The padding mask is not applied (Flux attends over its padded T5 prompt): another mask, the same velocity.
  other = dict(text, text_keep=np.ones_like(text["text_keep"]))
  again = jax.jit(lambda p, *a: Flux(c).apply({"params": p}, *a))(params, jnp.asarray(x), t, other, g)
  np.testing.assert_array_equal(np.asarray(again), np.asarray(ours))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_written_back_diffusers_loads_every_tensor_bitwise(tmp_path, dtype):
  src = transformer_dir(tmp_path, "transformer", guidance=True, dtype=dtype)
  c, params = diffusers_flux.read_transformer(src, image_size=H, text_len=S, text_encoder="diffusers")
  assert c.param_dtype == ("bfloat16" if dtype == torch.bfloat16 else "float32")
  out = tmp_path / "out"
  diffusers_flux.write_transformer(out, c, params)
  assert json.loads((out / "config.json").read_text())["_class_name"] == "FluxTransformer2DModel"
  original = FluxTransformer2DModel.from_pretrained(src, torch_dtype=dtype).state_dict()
  back = FluxTransformer2DModel.from_pretrained(out, torch_dtype=dtype).state_dict()
  assert back.keys() == original.keys()
  for name, w in original.items():
    assert back[name].dtype == w.dtype and torch.equal(back[name], w), name
  with pytest.raises(UserError, match="not empty"):  # nothing overwritten
    diffusers_flux.write_transformer(out, c, params)


def edit(src: pathlib.Path, config=None, tensors=None) -> pathlib.Path:
  if config:
    path = src / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
  if tensors:
    file = src / "diffusion_pytorch_model.safetensors"
    save_file(tensors(load_file(str(file))), str(file))
  return src


BAD = {
    "another class": (dict(config={"_class_name": "SD3Transformer2DModel"}), "not a FluxTransformer2DModel"),
    "a key not modelled": (dict(config={"out_channels": 16, "use_new_thing": True}), "use_new_thing"),
    "packed patches": (dict(config={"patch_size": 2}), "patch_size=2"),
    "a missing tensor": (dict(tensors=lambda t: {k: v for k, v in t.items() if k != "proj_out.bias"}),
                         "lacks 1 tensor.*proj_out.bias"),
    "an extra tensor": (dict(tensors=lambda t: {**t, "lora.weight": np.zeros(2, np.float32)}), "lora.weight"),
    "a shape that disagrees": (dict(config={"joint_attention_dim": 32}), "context_embedder.weight has shape"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_clear_error(tmp_path, case):
  change, message = BAD[case]
  src = edit(transformer_dir(tmp_path, "transformer", guidance=False), **change)
  with pytest.raises(UserError, match=message):
    diffusers_flux.read_transformer(src, image_size=H, text_len=S, text_encoder="diffusers")


# Flux.1-dev's scheduler_config.json (schnell's turns use_dynamic_shifting off, with shift 1.0).
SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                 num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)


@pytest.mark.parametrize("guidance", [True, False], ids=["dev (guidance embedding)", "schnell"])
def test_denoising_equals_flux_pipeline_given_the_same_latents(tmp_path, guidance):
  """meshtrain's Euler loop (families/t2i.py `denoise`) against FluxPipeline with the same packed starting latents
  and prompt embeddings, output_type="latent" (the VAE and text encoders are the other components' tests)."""
  from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
  from meshtrain.families import t2i
  src = transformer_dir(tmp_path, "transformer", guidance)
  c, params = diffusers_flux.read_transformer(src, image_size=H, text_len=S, text_encoder="diffusers")
  x, _, text, _ = inputs(c, seed=1)
  steps, scale = 4, 3.5
  pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=None, text_encoder=None,
                      tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                      transformer=FluxTransformer2DModel.from_pretrained(src).eval())
  theirs = pipe(prompt_embeds=torch.from_numpy(text["text_features"]),
                pooled_prompt_embeds=torch.from_numpy(text["text_pooled"]), latents=torch.from_numpy(pack(x)),
                height=H * 8, width=W * 8, num_inference_steps=steps, guidance_scale=scale,
                output_type="latent").images.numpy()
  s = t2i.resolution_shift((H // 2) * (W // 2), ((SCHEDULER["base_image_seq_len"], SCHEDULER["max_image_seq_len"]),
                                                (SCHEDULER["base_shift"], SCHEDULER["max_shift"])))
  # schnell has no guidance embedding, and FluxPipeline then guides nothing: None, one unguided pass per step.
  ours = jax.jit(lambda p, n: t2i.denoise(Flux(c), p, text, n, steps, scale if guidance else None, s))(params, x)
  assert np.abs(pack(np.asarray(ours)) - theirs).max() < TOLERANCE  # measured 3.0e-6 (dev), 9.5e-7 (schnell)
