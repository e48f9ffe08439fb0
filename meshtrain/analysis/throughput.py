"""Benchmark the real train step (the library of `python -m meshtrain.bench`): step time, tokens/s (images/s),
model FLOPs, MFU against the device's peak; the loop's efficiency; the host input pipeline's rate.

The step is the one `python -m meshtrain.train` runs (same layout, same compiled program), on one batch loaded once,
so data loading is not measured. Warm-up steps are excluded; every timed step is synchronised. Peaks: a table of
dense peaks for known GPUs; on CPU the matmul peak is measured here, in the same run, for the run's dtype and device
count, so MFU compares like with like. The modules that import JAX are imported inside the functions, after
runtime.start has set the XLA flags and device count.
"""
import statistics
import time

import jax
import numpy as np

from meshtrain import data, layout as layout_lib, mesh as mesh_lib
from meshtrain.costs import perf
from meshtrain.data import loader, packing, select
from meshtrain.errors import UserError
from meshtrain.runtime import startup


def fixed_batch(path: str, cfg, sharding):
  """A [batch_size, seq_len + 1] token array from a .npy file as the global batch (one process)."""
  try:
    tokens = np.load(path)
  except (OSError, ValueError) as e:
    raise UserError(f"--tokens {path}: cannot read a .npy array ({e})") from e
  want = (cfg.batch_size, cfg.seq_len + 1)
  if tokens.shape != want or tokens.dtype.kind not in "iu" or tokens.min() < 0 or tokens.max() >= cfg.model.vocab_size:
    raise UserError(f"--tokens {path}: need integer ids in [0, {cfg.model.vocab_size}) of shape {want} "
                    f"(batch_size, seq_len + 1); got {tokens.dtype} {tokens.shape}")
  tokens = tokens.astype(np.int32)
  return jax.device_put({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, sharding)


def bench(cfg, steps: int, warmup: int, tokens_path: str = "", data_seconds: float = 0.0) -> dict:
  """The train step's throughput, MFU, compile time and memory on `cfg`'s mesh; with `data_seconds`, the host
  pipeline's alone first (`data_throughput`), once the runtime is started: reading data starts JAX's backends."""
  startup.start(cfg)
  data_result = data_throughput(cfg, data_seconds) if data_seconds else {}
  mesh = mesh_lib.make_mesh(cfg.mesh)
  layout = layout_lib.build(cfg, mesh)
  task = layout.task
  src = data.make_source(cfg, cfg.data.train_split, shuffle=True)
  t0 = time.perf_counter()
  step_fn = layout.compile_train_step()
  compile_s = time.perf_counter() - t0
  state = layout.init(cfg.seed)
  if tokens_path:
    batch = fixed_batch(tokens_path, cfg, layout.batch_sharding)
  else:
    batch = data.global_batch(src, 0, cfg.batch_size, layout.batch_sharding)
  losses = []  # one fixed batch, so this is a memorisation curve: comparable with a peer's on the same batch
  for _ in range(warmup):
    state, metrics = step_fn(state, batch)
    losses.append(float(metrics["loss"]))
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, metrics = step_fn(state, batch)
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - t0)  # the loss is read after the clock stops
    losses.append(float(metrics["loss"]))
  step_s = statistics.median(times)
  units = cfg.batch_size * task.units_per_example  # tokens (LM) or images (DiT) per step
  unit = task.throughput_key.removesuffix("_per_sec").removesuffix("s")  # "token", "image"
  flops_per_example = task.flops_per_example(layout.table)
  peak, peak_source = perf.device_peak(mesh, cfg.model.dtype)
  mem = step_fn.memory_analysis()
  # What the device's allocator saw (GPU: peak_bytes_in_use, bytes_limit); None on the CPU, which keeps no stats.
  device_mem = mesh.devices.flat[0].memory_stats()
  achieved = flops_per_example * cfg.batch_size / step_s
  shape = ({"attention": layout.model.cfg.attention, "seq_len": cfg.seq_len} if cfg.task == "lm" else
           {k: cfg.model[k] for k in ("image_size", "channels", "patch_size")})
  return {
      **data_result, task.throughput_key: units / step_s, "step_time_s": step_s, "step_time_min_s": min(times),
      "step_time_max_s": max(times), "mfu": achieved / (peak * mesh.size), "peak_flops": peak,
      "peak_source": peak_source, "achieved_flops": achieved, f"model_flops_per_{unit}": flops_per_example /
      task.units_per_example, "model_flops_per_example": flops_per_example, "task": cfg.task,
      "compile_time_s": compile_s, "devices": mesh.size, "device_kind": mesh.devices.flat[0].device_kind,
      "mesh": dict(mesh.shape), "memory_per_device_bytes": {
          "arguments": mem.argument_size_in_bytes, "outputs": mem.output_size_in_bytes,
          "temporaries": mem.temp_size_in_bytes},
      "device_peak_bytes_in_use": (device_mem or {}).get("peak_bytes_in_use"),
      "device_bytes_limit": (device_mem or {}).get("bytes_limit"),
      "remat": cfg.model.remat, "dtype": cfg.model.dtype, "param_dtype": cfg.model.param_dtype,
      "batch_size": cfg.batch_size, **shape, "jax_version": jax.__version__,
      "loss": losses[-1], "losses": losses,
  }


def data_throughput(cfg, seconds: float) -> dict:
  """Tokens/s of the host pipeline alone (train split, shuffled, whole global batches, the loop's threads and
  read-ahead) over about `seconds`, after one warm-up batch; and of tokenizing documents on the fly."""
  t0 = time.perf_counter()
  tok = select.tokenizer_for_config(cfg)
  src = select.make_source(cfg, cfg.data.train_split, shuffle=True, tok=tok)
  setup_s = time.perf_counter() - t0
  batches = iter(loader.local_batches(src, 0, cfg.batch_size, 0, cfg.batch_size))
  next(batches)  # threads started, first documents read
  count, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    next(batches)
    count += 1
  elapsed = time.perf_counter() - t0
  batches.close()
  result = {"data_tokens_per_sec": count * cfg.batch_size * cfg.seq_len / elapsed, "data_batches": count,
            "data_setup_s": setup_s, "tokenizer": f"{tok.kind} ({tok.vocab_size} ids)"}
  if isinstance(src, packing.TfdsSource) and src.encode_seconds is not None:
    result["data_tokenize_split_tokens_per_sec"] = src.num_tokens / src.encode_seconds  # this run built the cache
  if isinstance(src, packing.TfdsSource):
    # Encoding documents of the split on the fly (tokenizer threads on batches of them), the alternative to the
    # token cache: ~2 s of the split's first documents.
    texts, n_tokens, n_bytes, t0 = iter(packing.train_texts(cfg)[0]), 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < min(seconds, 2.0):
      batch = [text for _, text in zip(range(packing.ENCODE_BATCH), texts)]
      if not batch:
        break
      n_tokens += sum(len(ids) for ids in tok.encode_batch(batch))
      n_bytes += sum(len(text.encode()) for text in batch)
    result["encode_on_the_fly_tokens_per_sec"] = n_tokens / (time.perf_counter() - t0)
    result["bytes_per_token"] = n_bytes / max(n_tokens, 1)
  return result
