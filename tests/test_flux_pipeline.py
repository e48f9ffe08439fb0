"""A whole Flux.1 pipeline run by meshtrain (meshtrain/inference/flux_pipeline.py) against diffusers' FluxPipeline on
the same directory: tiny random components of every kind built here (transformer, VAE, CLIP and T5 with their
tokenizers, the scheduler; nothing from a hub), the same prompts and packed starting latents, pictures equal in
float32."""
import json

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from test_flux_tokenizers import BOS, EOS, clip_vocab, make_clip_dirs, make_t5_dirs
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

from meshtrain.errors import UserError
from meshtrain.inference import flux_pipeline
from meshtrain.interop import diffusers_pipeline

PROMPTS = ["a photo of the red cat", "A DOG sitting on the café chair, 日本!"]
HEIGHT, WIDTH = 32, 48  # pixels: 4 x 6 latents, 2 x 3 packed tokens
DEV_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                     num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True)
SCHNELL_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)


def build(root, guidance: bool):
  torch.manual_seed(0)
  tokenizers = make_clip_dirs(root), make_t5_dirs(root)
  vocab, _ = clip_vocab()
  clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=37,
                                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=77,
                                      hidden_act="quick_gelu", bos_token_id=vocab[BOS], eos_token_id=vocab[EOS],
                                      pad_token_id=vocab[EOS]))
  t5 = T5EncoderModel(T5Config(vocab_size=300, d_model=24, d_kv=8, d_ff=37, num_layers=2, num_heads=3,
                               feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
                               relative_attention_max_distance=128))
  vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
                      up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(16,) * 4, layers_per_block=1,
                      latent_channels=4, norm_num_groups=8, use_quant_conv=False, use_post_quant_conv=False,
                      scaling_factor=0.3611, shift_factor=0.1159)
  transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                       attention_head_dim=16, num_attention_heads=2, joint_attention_dim=24,
                                       pooled_projection_dim=32, guidance_embeds=guidance, axes_dims_rope=(4, 6, 6))
  scheduler = FlowMatchEulerDiscreteScheduler(**(DEV_SCHEDULER if guidance else SCHNELL_SCHEDULER))
  pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip.eval(),
                      tokenizer=CLIPTokenizer.from_pretrained(tokenizers[0]["hub"]), text_encoder_2=t5.eval(),
                      tokenizer_2=T5TokenizerFast.from_pretrained(tokenizers[1]["saved"]),
                      transformer=transformer.eval())
  path = root / ("dev" if guidance else "schnell")
  pipe.save_pretrained(path, safe_serialization=True)
  return pipe, path


@pytest.fixture(scope="module", params=[True, False], ids=["dev", "schnell"])
def pipelines(request, tmp_path_factory):
  return build(tmp_path_factory.mktemp("flux_pipeline"), request.param)


def test_pictures_equal_flux_pipeline_given_the_same_latents(pipelines):
  pipe, path = pipelines
  latents = torch.randn(len(PROMPTS), (HEIGHT // 16) * (WIDTH // 16), 16, generator=torch.Generator().manual_seed(1))
  with torch.no_grad():
    theirs = pipe(prompt=PROMPTS, height=HEIGHT, width=WIDTH, num_inference_steps=3, guidance_scale=3.5,
                  max_sequence_length=16, latents=latents.clone(), output_type="np").images
  ours = flux_pipeline.Pipeline.load(path)(PROMPTS, HEIGHT, WIDTH, steps=3, guidance=3.5, max_sequence_length=16,
                                           latents=latents.numpy())
  assert ours.shape == theirs.shape == (len(PROMPTS), HEIGHT, WIDTH, 3)
  # Measured 1.9e-6 (dev) and 1.7e-6 (schnell) on pictures whose values spread 0.17 (std); the bar is 1e-3.
  assert np.abs(ours - theirs).max() < 1e-4


def test_pack_and_unpack_are_flux_pipelines(pipelines):
  pipe, _ = pipelines
  z = torch.randn(2, 4, 4, 6)  # NCHW, as FluxPipeline holds unpacked latents
  packed = FluxPipeline._pack_latents(z, 2, 4, 4, 6).numpy()
  np.testing.assert_array_equal(flux_pipeline.pack(z.numpy().transpose(0, 2, 3, 1)), packed)
  np.testing.assert_array_equal(flux_pipeline.unpack(packed, 4, 6), z.numpy().transpose(0, 2, 3, 1))


def test_bad_pipelines_and_requests_are_one_clear_error(pipelines, tmp_path):
  _, path = pipelines
  pipeline = flux_pipeline.Pipeline.load(path)
  with pytest.raises(UserError, match="multiples of 16"):
    pipeline(PROMPTS, 40, WIDTH, steps=1, guidance=3.5)
  with pytest.raises(UserError, match=r"--latents has shape \[1, 6, 16\]"):
    pipeline(PROMPTS, HEIGHT, WIDTH, steps=1, guidance=3.5, latents=np.zeros((1, 6, 16), np.float32))
  index = json.loads((path / "model_index.json").read_text())
  cases = {"another pipeline": {**index, "_class_name": "StableDiffusion3Pipeline"},
           "another scheduler": {**index, "scheduler": ["diffusers", "DPMSolverMultistepScheduler"]}}
  for name, spec in cases.items():
    bad = tmp_path / name.replace(" ", "_")
    bad.mkdir()
    for part in diffusers_pipeline.COMPONENTS:
      (bad / part).symlink_to(path / part)
    (bad / "model_index.json").write_text(json.dumps(spec))
    with pytest.raises(UserError, match="StableDiffusion3Pipeline|DPMSolverMultistepScheduler"):
      flux_pipeline.Pipeline.load(bad)
  with pytest.raises(UserError, match="no model_index.json"):
    flux_pipeline.Pipeline.load(tmp_path)
