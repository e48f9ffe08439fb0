"""Llama-3.1-8B (8.0B parameters, llama3 rotary scaling x8), FSDP, bf16, full rematerialization.

  python -m meshtrain.plan --config configs/llama3_1_8b.py --devices 32 --gpu h100   # layouts ranked by step time
  python -m meshtrain.inspect --config configs/llama3_1_8b.py   # parameters, shardings, memory (CPU)
  python -m meshtrain.convert from-hf ~/models/Llama-3.1-8B --workdir runs/llama3_1_8b_hf
  python -m meshtrain.train --config configs/llama3_1_8b.py --workdir runs/llama3_1_8b \
      --config.init_from=runs/llama3_1_8b_hf --config.data.tokenizer=runs/llama3_1_8b_hf/tokenizer/tokenizer.json

The preset is the published checkpoint's config.json (meta-llama/Llama-3.1-8B, downloaded to ~/models/Llama-3.1-8B
with huggingface-cli download meta-llama/Llama-3.1-8B --local-dir ~/models/Llama-3.1-8B): from-hf of it gives
exactly these model fields, so the last command continues pre-training it (its llama3 rope scaling included).
Without init_from it trains the shape from scratch.
"""
from meshtrain.config import base_config
from meshtrain import presets


def get_config():
  c = base_config()
  c.model = presets.model_config("llama-3.1-8b")
  c.model.dtype = "bfloat16"
  c.model.remat = "full"
  c.steps = 10_000
  c.batch_size = 256
  c.seq_len = 4096
  c.log_every = 50
  c.eval_every = 1000
  c.eval_batches = 8
  c.checkpoint_every = 500
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.sharding.rules = "fsdp"
  c.optimizer.learning_rate = 5e-5
  c.optimizer.warmup_steps = 200
  return c
