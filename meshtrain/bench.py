"""Benchmark the real train step: step time, tokens/s, model FLOPs, MFU against the device's peak.

  python -m meshtrain.bench --config configs/tiny.py [--config.KEY=VALUE ...] [--steps 10] [--json]

The step is the one `python -m meshtrain.train` runs (same layout, same compiled program), on one batch
loaded once, so data loading is not measured. Warm-up steps are excluded; every timed step is synchronised.
Peaks: a table of dense peaks for known GPUs; on CPU the matmul peak is measured here, in the same run, for the
run's dtype and device count, so MFU compares like with like.
"""
import argparse
import json
import statistics
import sys
import time

from meshtrain import config as config_lib
from meshtrain.errors import UserError

# Dense peak FLOP/s per device (vendor datasheets, SXM parts, no sparsity).
GPU_PEAKS = {
    "h100": {"bfloat16": 989.4e12, "float32": 66.9e12},
    "h200": {"bfloat16": 989.4e12, "float32": 66.9e12},
    "a100": {"bfloat16": 312.0e12, "float32": 19.5e12},
}


def model_flops_per_token(model_cfg, seq_len: int, matmul_params: int) -> float:
  """6 x (parameters used in matmuls) + attention scores and values, causal attention counted at half.

  Training does 3 matmuls per weight use (forward, two backward) of 2 FLOPs per multiply-add: 6 per parameter
  per token. Attention per layer and token: QK^T and AV over seq_len keys, 2 x 2 x seq_len x heads x head_dim
  forward, x3 for training, x1/2 because a causal token sees on average half the keys.
  """
  m = model_cfg
  attention = 6 * m.num_layers * seq_len * m.num_heads * m.head_dim
  return 6 * matmul_params + attention


def matmul_params(table, tied: bool) -> int:
  """Parameters that enter a matmul: everything but norm scales, and the embedding only when it is the head."""
  count = 0
  for row in table:
    if "norm" in row.path or (row.path == "embedding" and not tied):
      continue  # a norm scales; an untied embedding is a lookup
    count += row.size
  return count


def gpu_peak(device_kind: str, dtype: str) -> float | None:
  kind = device_kind.lower()
  for name, peaks in GPU_PEAKS.items():
    if name in kind:
      return peaks[dtype]
  return None


def measure_cpu_peak(mesh, dtype: str, size: int = 1024, repeats: int = 5) -> float:
  """Per-device matmul FLOP/s, with every device of the mesh multiplying at once (as in training)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  n = mesh.size
  sharding = NamedSharding(mesh, P(mesh.axis_names))  # one [size, size] block per device
  a = jax.device_put(jnp.ones((n, size, size), dtype), sharding)
  f = jax.jit(lambda x: jnp.einsum("nij,njk->nik", x, x), out_shardings=sharding)
  f(a).block_until_ready()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    f(a).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 2 * size ** 3 / min(times)


def bench(cfg, steps: int, warmup: int) -> dict:
  from meshtrain import runtime
  runtime.start(cfg)
  import jax
  from meshtrain import data, layout as layout_lib, mesh as mesh_lib
  mesh = mesh_lib.make_mesh(cfg.mesh)
  layout = layout_lib.build(cfg, mesh, data.PAD_ID)
  src = data.make_source(cfg, cfg.data.train_split, shuffle=True)
  t0 = time.perf_counter()
  step_fn = layout.compile_train_step()
  compile_s = time.perf_counter() - t0
  state = layout.init(cfg.seed)
  batch = data.global_batch(src, 0, cfg.batch_size, layout.batch_sharding)
  for _ in range(warmup):
    state, metrics = step_fn(state, batch)
  jax.block_until_ready(state)
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, metrics = step_fn(state, batch)
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - t0)
  step_s = statistics.median(times)
  tokens = cfg.batch_size * cfg.seq_len
  flops_per_token = model_flops_per_token(cfg.model, cfg.seq_len, matmul_params(layout.table, cfg.model.tie_embeddings))
  device = jax.devices()[0]
  peak = gpu_peak(device.device_kind, cfg.model.dtype) if device.platform == "gpu" else None
  peak_source = "datasheet" if peak else "measured matmul"
  if peak is None:
    peak = measure_cpu_peak(mesh, cfg.model.dtype)
  mem = step_fn.memory_analysis()
  achieved = flops_per_token * tokens / step_s
  return {
      "tokens_per_sec": tokens / step_s, "step_time_s": step_s, "step_time_min_s": min(times),
      "step_time_max_s": max(times), "mfu": achieved / (peak * mesh.size), "peak_flops": peak,
      "peak_source": peak_source, "achieved_flops": achieved, "model_flops_per_token": flops_per_token,
      "compile_time_s": compile_s, "devices": mesh.size, "device_kind": device.device_kind,
      "mesh": dict(mesh.shape), "memory_per_device_bytes": {
          "arguments": mem.argument_size_in_bytes, "outputs": mem.output_size_in_bytes,
          "temporaries": mem.temp_size_in_bytes},
      "loss": float(metrics["loss"]),
  }


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m meshtrain.bench", description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--steps", type=int, default=10, help="timed steps")
  parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
  parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
  try:
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.steps < 1 or args.warmup < 0:
      raise UserError("--steps must be >= 1 and --warmup >= 0")
    result = bench(config_lib.load(args.config, overrides), args.steps, args.warmup)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps(result))
  else:
    for key, value in result.items():
      print(f"{key:>26}: {value:,.4g}" if isinstance(value, float) else f"{key:>26}: {value}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
