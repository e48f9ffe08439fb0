"""A 1.27B-parameter text-to-image model (Flux's architecture at a quarter of its depth: 8 double- and 16
single-stream blocks, d_model 1536; 256 px in pixel space at patch 8, 1,024 image tokens; its own 4-layer byte-level
text encoder over 128 caption bytes), bfloat16 compute, 256 images per step, for one node of 8 x H100 80 GB:

  python -m meshtrain.train --config configs/t2i_1b.py --workdir runs/t2i_1b --config.data.name=pictures/

(`pictures/`: a folder of captioned pictures, docs/image-generation.md; without the flag it trains on noise images
and random captions, for speed and memory.) The layout is what the planner ranks first (docs/inspect-and-plan.md):

  python -m meshtrain.plan --config configs/t2i_1b.py --devices 8 --gpu h100 --verify 1
    best: data=8, no remat, grad_accum_steps=8 (8 micro-steps of 4 images per GPU): 55.4 GB per GPU predicted,
    0.171 s per step of compute at H100 peak with the 40.7 GB of gradient all-reduces hidden behind it, 187
    images/s per GPU at 100% MFU (kernels at peak: an upper bound). Compiled for 8 simulated devices: parameters
    and optimizer state 15.25 GB per device and collective bytes as predicted (74.7 GB of memory there: the CPU
    keeps the bfloat16 residuals as float32).
  python -m meshtrain.plan --config configs/t2i_1b.py --devices 64 --gpu h100 --verify 1
    best: data=16 x tensor=4 (data across the 8 nodes), no remat, no accumulation: 47.8 GB per GPU, 0.116 s per
    step (21 ms compute, 88 ms of gradient all-reduce over the network, 28 ms of exposed tensor all-reduces), 34
    images/s per GPU at 18.4% MFU: 4 images per GPU are too few to hide the network. Its overrides:
      --config.mesh.data=2 --config.mesh.tensor=4 --config.mesh.nodes.data=8 --config.sharding.rules=tp
      --config.optimizer.grad_accum_steps=1
"""
from meshtrain import presets
from meshtrain.config import base_config


def get_config():
  c = base_config()  # every field and its meaning: meshtrain/config.py
  c.task = "t2i"
  c.model = presets.t2i_model_config("1b")
  c.model.dtype = "bfloat16"
  c.steps = 100_000
  c.batch_size = 256
  c.log_every = 50
  c.eval_every = 2000
  c.eval_batches = 4
  c.checkpoint_every = 1000
  c.optimizer.learning_rate = 1e-4
  c.optimizer.warmup_steps = 1000
  c.optimizer.b2 = 0.99       # diffusion losses are noisy (random t and noise per image)
  c.optimizer.weight_decay = 0.0
  # Noise images and random captions (no files: measures speed and memory); train on your captioned pictures with
  # --config.data.name=pictures/ (a folder, docs/image-generation.md), resized to 256 px.
  c.data.name = "synthetic"
  # One node of 8 x H100 80 GB, as `python -m meshtrain.plan` ranks it (above): data parallel, 8 micro-steps of 4
  # images per GPU.
  c.mesh.data = -1
  c.sharding.rules = "dp"
  c.model.remat = "none"
  c.optimizer.grad_accum_steps = 8
  c.sample.steps = 30
  c.sample.guidance = 3.0
  c.sample.per_prompt = 4
  return c
