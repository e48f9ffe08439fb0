"""124M parameters (GPT-2-small width and depth, LLaMA blocks), FSDP over every device, bf16 compute.

  python -m meshtrain.train --config configs/base125m.py --workdir runs/125m

Sized for one GPU node (8 GPUs: 8 x 32 sequences of 1,024 tokens). On the 2-core CPU it runs too, slowly
(minutes per step); try it there with --config.batch_size=8 --config.seq_len=256 --config.steps=2.
"""
from meshtrain.config import base_config
from meshtrain import presets


def get_config():
  c = base_config()
  c.model = presets.model_config("125m")
  c.model.dtype = "bfloat16"
  c.model.remat = "save_dots"
  c.steps = 20_000
  c.batch_size = 256
  c.seq_len = 1024
  c.log_every = 50
  c.eval_every = 1000
  c.eval_batches = 8
  c.checkpoint_every = 1000
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.sharding.rules = "fsdp"
  c.optimizer.learning_rate = 6e-4
  c.optimizer.warmup_steps = 1000
  return c
