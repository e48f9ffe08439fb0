"""Performance arithmetic shared by the train loop and the benchmark: model FLOPs, device peaks, MFU.

Both report MFU from the same three numbers (model FLOPs per token, tokens per second, peak FLOP/s per device),
so a number in metrics.jsonl and one printed by `python -m meshtrain.bench` mean the same thing.
"""
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class Gpu:
  """What the step-time and memory arithmetic needs to know about one accelerator model."""
  name: str
  hbm_bytes: float          # memory per device
  peaks: dict[str, float]   # dense peak FLOP/s per device by compute dtype (datasheet, no sparsity)
  node_bw: float            # bytes/s per device, one direction, to devices in the same node (NVLink)
  network_bw: float         # bytes/s per device, one direction, to other nodes (one 400 / 200 Gb/s NIC per GPU)
  compute_capability: str | None = None  # CUDA's, e.g. "9.0": which attention kernels run (models/attention.py)
  per_node: int = 8         # devices in one node (NVLink domain): HGX/DGX H100, H200 and A100 hold 8


# SXM parts. NVLink: H100/H200 900 GB/s and A100 600 GB/s bidirectional per GPU; networks: NDR (400 Gb/s) and
# HDR (200 Gb/s) InfiniBand, one NIC per GPU as in DGX/HGX nodes.
GPUS = {
    "h100": Gpu("H100 SXM 80GB", 80e9, {"bfloat16": 989.4e12, "float32": 66.9e12}, 450e9, 50e9, "9.0"),
    "h200": Gpu("H200 SXM 141GB", 141e9, {"bfloat16": 989.4e12, "float32": 66.9e12}, 450e9, 50e9, "9.0"),
    "a100": Gpu("A100 SXM 80GB", 80e9, {"bfloat16": 312.0e12, "float32": 19.5e12}, 300e9, 25e9, "8.0"),
}
GPU_PEAKS = {name: gpu.peaks for name, gpu in GPUS.items()}


def model_flops_per_token(model_cfg, seq_len: int, matmul_params: float) -> float:
  """6 x (parameters used in matmuls) + attention scores and values, causal attention counted at half.

  Training does 3 matmuls per weight use (forward, two backward) of 2 FLOPs per multiply-add: 6 per parameter
  per token. Attention per layer and token: QK^T and AV over seq_len keys, 2 x 2 x seq_len x heads x head_dim
  forward, x3 for training, x1/2 because a causal token sees on average half the keys.
  """
  m = model_cfg
  attention = 6 * m.num_layers * seq_len * m.num_heads * m.head_dim
  return 6 * matmul_params + attention


def matmul_params(table, tied: bool, experts_per_token: int = 0, num_experts: int = 0) -> float:
  """Parameters a token multiplies by: norm scales and lookups excluded, only its routed share of the experts.

  An untied embedding is a lookup (no FLOPs); tied, it is also the output head. A mixture-of-experts weight
  (a row with an `expert` axis) is used by a token only for the experts_per_token of num_experts it is routed to.
  """
  count = 0.0
  for row in table:
    if "norm" in row.path or (row.path == "embedding" and not tied):
      continue
    share = experts_per_token / num_experts if "expert" in row.logical else 1.0
    count += row.size * share
  return count


def gpu_peak(device_kind: str, dtype: str) -> float | None:
  kind = device_kind.lower()
  for name, peaks in GPU_PEAKS.items():
    if name in kind:
      return peaks[dtype]
  return None


def measure_cpu_peak(mesh, dtype: str, size: int = 512, repeats: int = 5) -> float:
  """Per-device matmul FLOP/s, with every device of the mesh multiplying at once (as in training). ~0.3 s."""
  n = mesh.size
  sharding = NamedSharding(mesh, P(mesh.axis_names))  # one [size, size] block per device
  a = jax.jit(lambda: jnp.ones((n, size, size), dtype), out_shardings=sharding)()  # works across processes too
  f = jax.jit(lambda x: jnp.einsum("nij,njk->nik", x, x), out_shardings=sharding)
  f(a).block_until_ready()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    f(a).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 2 * size ** 3 / min(times)


def device_peak(mesh, dtype: str) -> tuple[float, str]:
  """(peak FLOP/s per device, where it came from): the datasheet for a known GPU, else measured here."""
  device = mesh.devices.flat[0]
  peak = gpu_peak(device.device_kind, dtype) if device.platform == "gpu" else None
  if peak is not None:
    return peak, "datasheet"
  return measure_cpu_peak(mesh, dtype), "measured matmul"


def seconds_since_process_start() -> float | None:
  """Wall time since this process was created (Linux), so start-up counts interpreter and import time too."""
  try:
    with open("/proc/self/stat") as f:
      start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, counted after the command name
    with open("/proc/uptime") as f:
      uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
  except (OSError, ValueError, IndexError):
    return None


def model_flops(cfg, table) -> float:
  """Model FLOPs per token for a config and its parameter table."""
  m = cfg.model
  return model_flops_per_token(m, cfg.seq_len, matmul_params(table, m.tie_embeddings, m.get("experts_per_token", 0),
                                                             m.get("num_experts", 0)))
