"""The peer benchmark's shape (experiments/peer_maxtext): MaxText's tiny decoder, on synthetic data.

  python -m meshtrain.bench --config configs/maxtext_tiny.py

Embedding 256, 4 layers, 4 heads of 64, MLP 1024, vocabulary 256, sequence 256, 4 sequences (1,024 tokens) per
step, AdamW. Initialisation: MaxText's (model.init="fan_in"), because the peer benchmark compares loss curves on
the same batch and the init decides them: with it the curves agree within 1.3% while the loss is above 0.1 (two
meshtrain seeds differ by up to 7% there); with normal(0.0625) only the first loss agrees (step 6: 0.70 vs
MaxText's 2.18). Everything else is meshtrain's default (float32 compute on CPU, no rematerialization, scanned
layers). On 8 devices a 4-sequence batch cannot be split 8 ways, so the default layout is FSDP over 4 devices x
context parallelism over 2 (each device holds half of a sequence); on 1 or 2 devices pass
--config.cpu_devices=N --config.mesh.sequence=1 (fsdp fills the rest).
"""
from meshtrain.config import base_config


def get_config():
  c = base_config()
  c.model.update(d_model=256, num_layers=4, num_heads=4, num_kv_heads=4, head_dim=64, mlp_dim=1024, vocab_size=256,
                 tie_embeddings=False, preset="maxtext_tiny")
  # MaxText 0.2.5's per-weight initialisers (mapping in meshtrain/models/llama.py), so the peer benchmark compares
  # the two systems from the same starting distribution rather than two different initialisations.
  c.model.init = "fan_in"
  c.data.name = "synthetic"
  c.batch_size = 4
  c.seq_len = 256
  c.steps = 200
  c.eval_every = 0
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.sequence = 2
  c.sharding.rules = "fsdp"
  return c
