"""Fine-tuning Flux.1-dev (Black Forest Labs' 11.9B-parameter transformer: 19 double- and 38 single-stream blocks,
d_model 3072, 24 heads; the guidance embedding of the distilled model) at 1024 px: the VAE's 128 x 128 x 16
latents at patch 2, 4,096 image tokens, beside 512 T5-XXL tokens (width 4096) and CLIP-L's pooled vector (768),
bfloat16 parameters and compute, 64 images per step, for 8 and for 64 x H100 80 GB. The shapes are those
`python -m meshtrain.convert from-diffusers` writes for the real pipeline (meshtrain/interop/diffusers_pipeline.py):

  python -m meshtrain.convert from-diffusers FLUX.1-dev/ --workdir runs/flux_dev --image-size 1024

Training on latents is not built yet (`train` refuses a model.pipeline with that message); `plan` and `inspect`
trace the train step abstractly from the shapes alone (the frozen VAE, T5 and CLIP run outside the step, on cached
latents and text features), so they need no pipeline directory:

  python -m meshtrain.plan --config configs/flux_dev.py --devices 8 --gpu h100 --verify 1
    best: fsdp=8, full remat, grad_accum_steps=8 (8 micro-steps of 1 image per GPU): 21.3 GB per GPU predicted,
    2.406 s per step of compute at H100 peak with the 570 GB of FSDP gathers and gradient reductions hidden behind
    it (1.59 s of NVLink time), 3.3 images/s per GPU at 75.0% MFU (kernels at peak, full remat's recompute
    counted as waste: an upper bound). accum 4 ties at 27.3 GB. Compiled for 8 simulated devices (inspect --devices
    8): parameters 2.98 GB and optimizer state 5.96 GB per device as predicted (11.9B bfloat16 parameters split 8
    ways), 2.38e15 FLOPs per step (2.23e14 model FLOPs per image, x 4/3 for the recompute) as predicted, 35.5 GB
    of memory and twice the predicted collective bytes there: the CPU computes and moves the bfloat16 values in
    float32 (hence its 3.06 s "compiled" step).
  python -m meshtrain.plan --config configs/flux_dev.py --devices 64 --gpu h100 --verify 1
    best: data=16 x tensor=4 (data across the 8 nodes), full remat, no accumulation: 55.3 GB per GPU, 0.584 s per
    step (0.301 s compute, 0.410 s of gradient all-reduce over the network, 0.174 s of exposed tensor
    all-reduces), 1.7 images/s per GPU at 38.6% MFU: 4 images per tensor group are too few to hide the network.
    Compiled for 64 simulated devices: parameters 10.89 GB and optimizer state 21.78 GB per device as predicted
    (the modulations, 3.2B parameters, are not split by tensor), collective counts as predicted (210 tensor and
    58 data all-reduces) at twice the bytes (float32 on the CPU again), 85.2 GB of memory there. Its overrides:
      --config.mesh.data=2 --config.mesh.fsdp=1 --config.mesh.tensor=4 --config.mesh.nodes.data=8
      --config.sharding.rules=tp --config.optimizer.grad_accum_steps=1
"""
from meshtrain import presets
from meshtrain.config import base_config


def get_config():
  c = base_config()  # every field and its meaning: meshtrain/config.py
  c.task = "t2i"
  m = presets.t2i_model_config("tiny")  # then every shape Flux.1-dev's, as convert from-diffusers sets them
  m.preset = "flux-dev"
  m.image_size = 128              # latents: 1024 px / the VAE's 8x
  m.channels = 16                 # the VAE's latent channels
  m.patch_size = 2                # 2x2 latent patches: 64 x 64 = 4,096 image tokens
  m.d_model = 3072
  m.num_heads = 24                # head width 128
  m.mlp_dim = 12288
  m.double_layers = 19
  m.single_layers = 38
  m.axes_dim = (16, 56, 56)
  m.text_len = 512                # T5 tokens (FluxPipeline's max_sequence_length)
  m.text_width = 4096             # T5-XXL's width
  m.pooled_width = 768            # CLIP-L's pooled vector
  m.guidance_embed = True         # dev: the distilled guidance scale enters as a second timestep
  m.text_norm = False             # T5's features enter as they are, padding unmasked (Flux.1's)
  m.text_mask = False
  m.text_encoder = "pipeline"
  # A placeholder: `convert from-diffusers` writes the workdir's real pipeline directory (WORKDIR/pipeline), whose
  # frozen VAE, T5 and CLIP make the cached latents and text features; plan and inspect never open it.
  m.pipeline = "FLUX.1-dev"
  m.caption_dropout = 0.0         # as converted: Flux.1 attends over its padded prompt unmasked
  m.param_dtype = "bfloat16"
  m.dtype = "bfloat16"
  c.model = m
  c.steps = 5_000
  c.batch_size = 64
  c.log_every = 10
  c.eval_every = 500
  c.eval_batches = 2
  c.checkpoint_every = 500
  c.optimizer.learning_rate = 1e-5
  c.optimizer.warmup_steps = 100
  c.optimizer.b2 = 0.99       # diffusion losses are noisy (random t and noise per image)
  c.optimizer.weight_decay = 0.0
  c.data.name = "synthetic"
  # One node of 8 x H100 80 GB, as `python -m meshtrain.plan` ranks it (above): the parameters, gradients and Adam
  # moments split over all 8 (FSDP), every block recomputed in the backward pass, 8 micro-steps of one image per GPU.
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.sharding.rules = "fsdp"
  c.model.remat = "full"
  c.optimizer.grad_accum_steps = 8
  # FluxPipeline's defaults for dev: 28 steps, the guidance scale given to the guidance embedding.
  c.sample.steps = 28
  c.sample.guidance = 3.5
  c.sample.per_prompt = 4
  return c
