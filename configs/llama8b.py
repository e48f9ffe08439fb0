"""LLaMA-3-8B shape (8.0B parameters), FSDP, bf16 compute, full rematerialization.

  python -m meshtrain.train --config configs/llama8b.py --workdir runs/llama8b

For several 8-GPU nodes: fsdp=8 inside a node, data parallel across nodes (mesh.nodes.data=-1), full
rematerialization so activations fit at 8 x 4,096 tokens per GPU.
"""
from meshtrain.config import base_config
from meshtrain import presets


def get_config():
  c = base_config()
  c.model = presets.model_config("8b")
  c.model.dtype = "bfloat16"
  c.model.remat = "full"
  c.steps = 100_000
  c.batch_size = 512
  c.seq_len = 4096
  c.log_every = 20
  c.eval_every = 2000
  c.eval_batches = 4
  c.checkpoint_every = 500
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.sharding.rules = "fsdp"
  c.optimizer.learning_rate = 3e-4
  c.optimizer.warmup_steps = 2000
  return c
