"""A 1.3M-parameter class-conditional DiT (rectified flow) on scikit-learn's 8x8 digits, 8 simulated CPU devices.

  python -m meshtrain.train --config configs/dit_digits.py --workdir runs/dit

Expect about 3.5 minutes on an idle 2-core CPU (3 min 30 s measured; 6.6 min while two other jobs shared the
cores; compile ~15 s, 560-700 images/s): the loss falls from ~1.74 (v = 0 at init: E(eps - x0)^2 per pixel) to
eval_loss ~0.41, and the 100 samples drawn at eval_every (20 Euler steps, guidance 2) are labelled as their class
by the digits classifier (sample_accuracy in metrics.jsonl) 94% of the time at step 400, 99-100% at steps 600-800
(sample_frechet ~2).
experiments/dit_tune.py and benchmarks/2026-12-01-dit-tuning.md hold the tuning runs behind these settings. Sample a
grid from the run:
  python -m meshtrain.sample --workdir runs/dit --out digits.png
The layout changes without touching the model, e.g. FSDP x tensor:
  python -m meshtrain.train --config configs/dit_digits.py --workdir runs/dit_fsdp_tp \
      --config.sharding.rules=fsdp_tp --config.mesh.data=2 --config.mesh.fsdp=2 --config.mesh.tensor=2
"""
from meshtrain.config import base_config
from meshtrain import presets


def get_config():
  c = base_config()  # every field and its meaning: meshtrain/config.py
  c.task = "dit"
  c.model = presets.dit_model_config("digits")  # d_model 128, 4 blocks, 4 heads, patch 2 (16 tokens)
  c.steps = 800
  c.batch_size = 128          # 16 images per device on 8 devices; 1,433 train images: ~71 epochs
  c.log_every = 20
  c.eval_every = 200          # eval loss on the test split, a sample grid and its quality
  c.eval_batches = 2          # 256 test images (the split has 364)
  c.checkpoint_every = 400
  c.optimizer.learning_rate = 1e-3
  c.optimizer.warmup_steps = 50
  c.optimizer.min_lr_ratio = 0.1
  c.optimizer.b2 = 0.99       # diffusion losses are noisy (random t and eps per image): a longer second-moment memory
  c.optimizer.weight_decay = 0.0
  c.data.name = "digits"      # built locally from scikit-learn's copy on first use (meshtrain/data/digits.py)
  c.data.train_split = "train"
  c.data.eval_split = "test"
  c.mesh.data = -1            # all devices data-parallel: 1.3M parameters need no splitting
  c.sharding.rules = "dp"
  c.sample.steps = 20         # Euler steps from t = 1 to 0
  c.sample.guidance = 2.0     # classifier-free guidance scale (1: conditional only, 0: unconditional)
  c.sample.per_class = 10     # images per class in the grid and the quality check at eval_every
  c.sample.seed = 0
  return c
