"""What JAX asks the CUDA plugin while lowering cuDNN attention, answered without a GPU or cuDNN installed.

`jax.nn.dot_product_attention(implementation="cudnn")` calls the plugin's `cudnn_get_version()` while tracing
(jax/_src/cudnn/fused_attention_stablehlo.py, `check_cudnn_version`, JAX 0.10-0.12), and JAX finds the plugin by
importing `jax_cuda13_plugin._versions` (then 12's). The real plugin wheel (jax-cuda13-plugin, 7 MB) answers only
with cuDNN's library loaded, which is a 492 MB wheel: too much for CI to fetch for one number. This module is
that number and nothing else; it is on the path only of the subprocess that lowers for CUDA
(tests/lower_for_cuda.py), never of a run. JAX's other checks still run: the dtype, head-dim and layout
conditions, and the compute capability, which on a CPU backend counts as pre-Hopper (head dim <= 128).
The real cuDNN on the GPU is checked by experiments/gpu_bench.py's smoke test.
"""

# The oldest cuDNN jax-cuda13-plugin 0.10-0.11 accepts (its requirement nvidia-cudnn-cu13>=9.12), as cuDNN
# encodes it: major * 10000 + minor * 100 + patch.
CUDNN_VERSION = 91200


def cudnn_get_version() -> int:
  return CUDNN_VERSION
