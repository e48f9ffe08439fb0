"""CI-sized: a 1M-parameter LLaMA-style model on the local Python-stdlib corpus, 8 simulated CPU devices.

  python -m meshtrain.train --config configs/tiny.py --workdir runs/tiny

Expect about 2 minutes on a 2-core CPU; the loss falls from ~6.0 (uniform over 384 ids) to ~2.
Change the layout without touching the model, e.g. FSDP x tensor:
  python -m meshtrain.train --config configs/tiny.py --workdir runs/tiny_fsdp_tp \
      --config.mesh.data=1 --config.mesh.fsdp=4 --config.mesh.tensor=2
"""
from meshtrain.config import base_config


def get_config():
  c = base_config()  # every field and its meaning: meshtrain/config.py
  c.steps = 200
  c.batch_size = 16
  c.seq_len = 128
  c.log_every = 10
  c.eval_every = 100
  c.checkpoint_every = 100
  c.mesh.data = -1
  c.sharding.rules = "fsdp_tp"
  return c
