"""A text-to-image model of 2.3M parameters (Flux's architecture, its own byte-level text encoder) on the
locally drawn `shapes` dataset ("a red circle", 32x32), 2 simulated CPU devices.

  python -m meshtrain.train --config configs/t2i_tiny.py --workdir runs/t2i

About 12 minutes on an idle 2-core CPU (121 images/s, its stacks of 2 blocks unrolled): held-out captions (pairs of
words never seen together) get their colour right about half the time and both colour and shape one time in five, seen
ones colour always and shape half the time, by the shapes judge (benchmarks/2026-12-07-t2i-unroll.md;
--config.steps=1500 learns the shapes: 0.92 on seen).

Your own captioned pictures instead (a folder with metadata.jsonl / metadata.csv, or class subfolders; see
docs/image-generation.md), resized to model.image_size:
  python -m meshtrain.train --config configs/t2i_tiny.py --workdir runs/mine --config.data.name=pictures/
Sample from the run:
  python -m meshtrain.sample --workdir runs/t2i --prompt "a green square" --n 8 --out green_square.png
"""
from meshtrain import presets
from meshtrain.config import base_config


def get_config():
  c = base_config()  # every field and its meaning: meshtrain/config.py
  c.task = "t2i"
  c.model = presets.t2i_model_config("tiny")  # 32 px, patch 4 (64 image tokens), 32 caption bytes, d_model 128
  c.steps = 1200
  c.batch_size = 64
  c.log_every = 25
  c.eval_every = 400          # validation loss at 8 fixed t, and a sample grid of sample.prompts in TensorBoard
  c.eval_batches = 2
  c.checkpoint_every = 400
  c.optimizer.learning_rate = 1e-3
  c.optimizer.warmup_steps = 100
  c.optimizer.min_lr_ratio = 0.1
  c.optimizer.b2 = 0.99       # diffusion losses are noisy (random t and noise per image)
  c.optimizer.weight_decay = 0.0
  c.data.name = "shapes"      # drawn locally on first use (meshtrain/data/shapes.py)
  c.data.train_split = "train"
  c.data.eval_split = "validation"
  # Two devices: the per-device batch of 32 makes the CPU's matmuls 20% faster per image than 8 devices of 8 rows
  # (python -m meshtrain.bench, benchmarks/2026-12-05-t2i-quality.md); 2.3M parameters need no splitting.
  c.cpu_devices = 2
  c.mesh.data = -1
  c.sharding.rules = "dp"
  c.sample.steps = 20
  c.sample.guidance = 3.0
  c.sample.per_prompt = 4
  # Two pairs the training captions never name together (meshtrain/data/shapes.py HELDOUT), two they do.
  c.sample.prompts = "a green square;a blue triangle;a red circle;a white square"
  return c
