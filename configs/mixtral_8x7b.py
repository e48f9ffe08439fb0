"""Mixtral-8x7B (46.7B parameters, 8 experts, top-2), experts x FSDP, bf16, full rematerialization.

  python -m meshtrain.plan --config configs/mixtral_8x7b.py --devices 32 --gpu h100   # layouts ranked by step time
  python -m meshtrain.inspect --config configs/mixtral_8x7b.py   # parameters, shardings, memory (CPU)
  python -m meshtrain.convert from-hf ~/models/Mixtral-8x7B-v0.1 --workdir runs/mixtral_8x7b_hf
  python -m meshtrain.train --config configs/mixtral_8x7b.py --workdir runs/mixtral_8x7b \
      --config.init_from=runs/mixtral_8x7b_hf --config.data.tokenizer=runs/mixtral_8x7b_hf/tokenizer/tokenizer.json

The preset is the published checkpoint's config.json (mistralai/Mixtral-8x7B-v0.1, downloaded to
~/models/Mixtral-8x7B-v0.1 with huggingface-cli download mistralai/Mixtral-8x7B-v0.1 --local-dir
~/models/Mixtral-8x7B-v0.1): from-hf of it gives exactly these model fields, so the last command continues
pre-training it (its router and experts included; training keeps model.capacity_factor=1.25, generation drops no token).
Without init_from it trains the shape from scratch.
"""
from meshtrain.config import base_config
from meshtrain import presets


def get_config():
  c = base_config()
  c.model = presets.model_config("mixtral-8x7b")
  c.model.dtype = "bfloat16"
  c.model.remat = "full"
  c.steps = 10_000
  c.batch_size = 128
  c.seq_len = 4096
  c.log_every = 50
  c.eval_every = 1000
  c.eval_batches = 8
  c.checkpoint_every = 500
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.expert = 8
  c.sharding.rules = "fsdp"
  c.optimizer.learning_rate = 2e-5
  c.optimizer.warmup_steps = 200
  return c
