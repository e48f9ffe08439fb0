"""meshtrain: train large language models over a named JAX device mesh.

Layers (each imports only from those above it in this list):
  mesh, sharding        devices, meshes, logical-axis rules, sharding tables (usable on their own)
  models                Flax modules that name logical axes, never mesh axes
  step, optim           pure train/eval step functions and the Optax optimizer
  data, checkpoint, metrics   one kind of I/O each
  train                 the loop (`python -m meshtrain.train`)
"""

__version__ = "0.1.0"
