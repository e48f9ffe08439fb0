"""meshtrain: train large language models and image generators over a named JAX device mesh.

Layers (each imports only from those above it in this list; tests/test_structure.py checks there is no cycle):
  errors, config        the user-error type; the config schema, loading and overrides (no task, no JAX)
  mesh, sharding        devices, meshes, logical-axis rules, sharding tables (usable on their own)
  models, parallel      Flax modules that name logical axes, never mesh axes; context and pipeline parallelism
  tasks                 one module per model family: model, batch, loss, eval, costs; each checks its own fields
  step, optim, layout   the pure train step, the Optax optimizer, the shardings and compiled steps of a layout
  data, checkpoint, metrics, hooks, runtime   one kind of I/O or one concern each
  analysis, inference, interop, kernels       costs and plans; generation, serving, sampling; Hugging Face; CPU kernels
  train, generate, serve, sample, convert, bench, inspect, plan, launch, tokenizer   the `python -m` commands (thin)
"""

from meshtrain import tasks  # noqa: F401  registers each task kind's config fields with meshtrain.config (JAX-free)

__version__ = "0.1.0"
