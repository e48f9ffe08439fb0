"""LLaMA-3.2-1B shape (1.2B parameters, tied embeddings), FSDP x tensor, bf16 compute, saved matmuls remat.

  python -m meshtrain.train --config configs/llama1b.py --workdir runs/llama1b

For GPU nodes (8 x 80 GB: fsdp=4 x tensor=2 per node, data parallel across nodes).
"""
from meshtrain.config import base_config
from meshtrain import presets


def get_config():
  c = base_config()
  c.model = presets.model_config("1b")
  c.model.dtype = "bfloat16"
  c.model.remat = "save_dots"
  c.steps = 50_000
  c.batch_size = 256
  c.seq_len = 2048
  c.log_every = 50
  c.eval_every = 2000
  c.eval_batches = 8
  c.checkpoint_every = 1000
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 2
  c.sharding.rules = "fsdp_tp"
  c.optimizer.learning_rate = 3e-4
  c.optimizer.warmup_steps = 2000
  return c
