"""Lowers meshtrain's train step for CUDA on this CPU machine; prints what the GPU program contains, as JSON.

  PYTHONPATH=tests/cuda_standin python tests/lower_for_cuda.py CONFIG [--config.KEY=VALUE ...]

The layout is built for platform "gpu" (so model.attention resolves as on a GPU) on one CPU device, and the step
is lowered with `lowering_platforms=("cuda",)` (public JAX: jax.jit(...).trace(...).lower(...)): the StableHLO a
GPU would compile. Printed: the attention implementation, every custom call's target, and every tensor type
with two trailing dimensions equal to seq_len (attention scores [.., L, L]).
"""
import collections
import json
import os
import re
import sys

os.environ["JAX_PLATFORMS"] = "cpu"

from meshtrain import config as config_lib  # noqa: E402


def main(argv: list[str]) -> int:
  cfg = config_lib.load(argv[0], argv[1:])
  import jax

  from meshtrain import layout as layout_lib, mesh as mesh_lib
  layout = layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices=jax.devices()[:1]), platform="gpu")
  text = layout.lower_train_step(platforms=("cuda",)).as_text()
  L = cfg.seq_len
  scores = re.findall(rf"tensor<(?:\d+x)*{L}x{L}x\w+>", text)
  print(json.dumps({"attention": layout.model.cfg.attention,
                    "custom_calls": collections.Counter(re.findall(r"custom_call @([\w$]+)", text)),
                    "score_tensors": sorted(set(scores))}))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
