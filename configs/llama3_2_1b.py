"""Llama-3.2-1B (1.24B parameters, tied embeddings, llama3 rotary scaling x32), FSDP x tensor, bf16.

  python -m meshtrain.plan --config configs/llama3_2_1b.py --devices 8 --gpu h100   # layouts ranked by step time
  python -m meshtrain.inspect --config configs/llama3_2_1b.py   # parameters, shardings, memory (CPU)
  python -m meshtrain.convert from-hf ~/models/Llama-3.2-1B --workdir runs/llama3_2_1b_hf
  python -m meshtrain.train --config configs/llama3_2_1b.py --workdir runs/llama3_2_1b \
      --config.init_from=runs/llama3_2_1b_hf --config.data.tokenizer=runs/llama3_2_1b_hf/tokenizer/tokenizer.json

The preset is the published checkpoint's config.json (meta-llama/Llama-3.2-1B, downloaded to ~/models/Llama-3.2-1B
with huggingface-cli download meta-llama/Llama-3.2-1B --local-dir ~/models/Llama-3.2-1B): from-hf of it gives
exactly these model fields, so the last command continues pre-training it (its llama3 rope scaling and tied head
included). Without init_from it trains the shape from scratch.
"""
from meshtrain.config import base_config
from meshtrain import presets


def get_config():
  c = base_config()
  c.model = presets.model_config("llama-3.2-1b")
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
  c.mesh.tensor = 2
  c.sharding.rules = "fsdp_tp"
  c.optimizer.learning_rate = 1e-4
  c.optimizer.grad_accum_steps = 16  # python -m meshtrain.plan picks 16 x 16 rows on 8 H100s
  c.optimizer.warmup_steps = 200
  return c
