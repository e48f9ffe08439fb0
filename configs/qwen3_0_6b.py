"""Qwen3-0.6B (596M parameters, per-head q/k RMSNorm, head_dim 128, tied embeddings), FSDP, bf16.

  python -m meshtrain.plan --config configs/qwen3_0_6b.py --devices 8 --gpu h100   # layouts ranked by step time
  python -m meshtrain.inspect --config configs/qwen3_0_6b.py   # parameters, shardings, memory (CPU)
  python -m meshtrain.convert from-hf ~/models/Qwen3-0.6B --workdir runs/qwen3_0_6b_hf
  python -m meshtrain.train --config configs/qwen3_0_6b.py --workdir runs/qwen3_0_6b \
      --config.init_from=runs/qwen3_0_6b_hf --config.data.tokenizer=runs/qwen3_0_6b_hf/tokenizer/tokenizer.json

The preset is the published checkpoint's config.json (Qwen/Qwen3-0.6B, downloaded to ~/models/Qwen3-0.6B with
huggingface-cli download Qwen/Qwen3-0.6B --local-dir ~/models/Qwen3-0.6B): from-hf of it gives exactly these model
fields, so the last command continues pre-training it (its q/k norms included). Without init_from it trains the
shape from scratch.
"""
from meshtrain.config import base_config
from meshtrain import presets


def get_config():
  c = base_config()
  c.model = presets.model_config("qwen3-0.6b")
  c.model.dtype = "bfloat16"
  c.model.remat = "save_dots"
  c.steps = 10_000
  c.batch_size = 256
  c.seq_len = 2048
  c.log_every = 50
  c.eval_every = 1000
  c.eval_batches = 8
  c.checkpoint_every = 500
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.sharding.rules = "fsdp"
  c.optimizer.learning_rate = 1e-4
  c.optimizer.grad_accum_steps = 16  # python -m meshtrain.plan picks 16 x 16 rows on 8 H100s
  c.optimizer.warmup_steps = 200
  return c
