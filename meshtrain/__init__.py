"""meshtrain: train large language models and image generators over a named JAX device mesh.

Layers, lowest first: a module imports only from its own layer or the layers before it (tests/test_structure.py
checks every import, those inside functions too, and that there is no cycle):
  errors                          the user-error types
  config, presets, tasks          the config schema and overrides, model presets, the task contract and each
                                  family's config fields: no JAX
  mesh, sharding, runtime         devices, meshes, logical-axis rules; process start-up, the cluster, signals, hangs
  models, parallel, kernels, costs   Flax modules naming logical axes; context and pipeline parallelism; CPU kernels;
                                  FLOPs, peaks and the cost helpers every family's cost model shares
  families                        each model family's model, batch, loss, eval and cost model
  step, optim, layout             the pure train step, the Optax optimizer, a layout's shardings and compiled steps
  data, checkpoint, metrics, profiling   one kind of I/O each
  analysis, inference, interop    inspect, plan and bench; generation, serving, sampling; Hugging Face
  hooks, loop                     the train loop and its periodic work
  cli                             the `python -m meshtrain.X` commands; `meshtrain/X.py` is each one's alias
"""
from meshtrain import tasks  # noqa: F401  registers each task kind's config fields with meshtrain.config (JAX-free)

__version__ = "0.1.0"

LAYERS = (
    ("errors",),
    ("config", "presets", "tasks"),
    ("mesh", "sharding", "runtime"),
    ("models", "parallel", "kernels", "costs"),
    ("families",),
    ("step", "optim", "layout"),
    ("data", "checkpoint", "metrics", "profiling"),
    ("analysis", "inference", "interop"),
    ("hooks", "loop"),
    ("cli",),
)
# The documented commands: `python -m meshtrain.X` runs meshtrain/X.py, an alias of meshtrain/cli/X.py (and
# `python -m meshtrain.data` meshtrain/data/__main__.py, of meshtrain/cli/data_stats.py).
COMMANDS = ("train", "generate", "serve", "eval", "sample", "convert", "bench", "inspect", "plan", "launch",
            "tokenizer")
