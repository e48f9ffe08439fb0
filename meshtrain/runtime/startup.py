"""Process start-up: XLA flags, simulated CPU devices and the JAX distributed runtime, in the order JAX needs.

Everything here must happen before JAX initialises its backends, so entry points call `start(cfg)` first. Which
processes make up the run: meshtrain/runtime/cluster.py.
"""
import os
import sys
import threading

import jax
import jaxlib.version
from orbax.checkpoint import multihost

from meshtrain import mesh
from meshtrain.errors import RunAborted, UserError
from meshtrain.runtime import cluster

# GPU flags that matter for multi-device training (ignored by the CPU backend). The latency-hiding scheduler
# overlaps collectives with compute; combining small collectives into large ones amortises NCCL launch cost;
# pipelined FSDP collectives start the next layer's all-gather during this layer's compute.
GPU_XLA_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
)
# Simulated CPU devices are threads of one process sharing the host's cores. XLA aborts the process (SIGABRT) when
# a device has waited 60 s for the others at a collective (a 20 s warning, then 40 s more; checked here with one
# device held in a callback for 130 s); on a busy 2-core host a device thread can be starved that long (seen once
# with 60 steps queued, and a CI worker died that way). A real hang is still caught, by the watchdog or this limit.
CPU_XLA_FLAGS = ("--xla_cpu_collective_call_terminate_timeout_seconds=600",)
# The first jaxlib whose CPU runtime runs multi-device programs loaded from the persistent compilation cache
# (tests/test_runtime.py's ring attention, twice against one cache): 0.10.2 and 0.11.2 abort on them.
CPU_CACHE_SINCE = (0, 12, 1)


def xla_flags(extra: str, environment: str) -> str:
  """meshtrain's defaults, then the user's XLA_FLAGS, then the config's `xla_flags`: later flags win."""
  return " ".join(part for part in (" ".join(GPU_XLA_FLAGS + CPU_XLA_FLAGS), environment, extra) if part)


def start(cfg) -> None:
  """XLA flags, simulated CPU devices, then the distributed runtime; call before any JAX computation."""
  os.environ["XLA_FLAGS"] = xla_flags(cfg.xla_flags, os.environ.get("XLA_FLAGS", ""))
  settings = cluster.distributed_settings(cfg.distributed)
  mesh.simulate_cpu_devices(cfg.cpu_devices)
  if settings is not None:
    _initialize_distributed(cfg, settings)
  # Restarts after preemption or a crash, and a server's restarts, recompile the same programs: fetch them from disk
  # instead. On the CPU only in one process, and before jaxlib CPU_CACHE_SINCE only with one device: before it XLA
  # aborts the process on some multi-device programs loaded from the cache, and with several processes a cached
  # train step hangs in its first all-reduce (docs/training.md#the-compilation-cache-on-the-cpu).
  if cfg.compilation_cache_dir and cpu_cache_works():
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cfg.compilation_cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def cpu_cache_works() -> bool:
  """Whether compiled programs may come from the persistent cache on this backend: always on GPUs and TPUs (their
  collectives are not the CPU runtime's); on the CPU in a single process, from jaxlib CPU_CACHE_SINCE on, and before
  it where the process has one device, so that every program it compiles is a single-device one (what aborted
  were multi-device programs; call after the distributed runtime started)."""
  if jax.default_backend() != "cpu":
    return True
  return jax.process_count() == 1 and (jaxlib.version.__version_info__ >= CPU_CACHE_SINCE or jax.device_count() == 1)


def is_main() -> bool:
  """Whether this is process 0 (of one or several): the one that prints and writes."""
  return jax.process_index() == 0


def _initialize_distributed(cfg, settings: dict) -> None:
  timeout = cfg.distributed.init_timeout_s
  if "coordinator_address" in settings:
    who = (f"{settings['num_processes']} processes, coordinator {settings['coordinator_address']}, this one is "
           f"process {settings['process_id']}")
  else:
    who = "processes and coordinator from Open MPI's variables"
  late = (f"the JAX distributed runtime did not start: not all processes reached the coordinator within "
          f"distributed.init_timeout_s={timeout} s ({who}). Check that every process was started with the same "
          "address and process count, and that the port is reachable")
  # A missing peer makes the runtime abort the process from C++ (no Python exception, a fatal-error dump);
  # this timer fires first and ends the process with the message instead.
  timer = threading.Timer(timeout, _exit_with, args=(late,))
  timer.daemon = True
  timer.start()
  try:
    jax.distributed.initialize(**settings, initialization_timeout=timeout + 30,
                               heartbeat_timeout_seconds=cfg.distributed.heartbeat_timeout_s)
  except Exception as e:
    first = str(e).splitlines()[0][:300] if str(e) else ""
    if "DEADLINE_EXCEEDED" in first:  # the runtime's own time limit, just after the timer's
      raise UserError(f"{late} ({first})") from e
    # Anything else is not a late peer: say what was asked for and what the runtime answered.
    raise UserError(f"the JAX distributed runtime did not start ({who}): {type(e).__name__}: {first}") from e
  finally:
    timer.cancel()


def barrier(name: str, timeout_s: int) -> None:
  """Waits until every process is here, through the coordination service (not a collective), for up to timeout_s.

  Why: the CPU backend's collectives (gloo) connect each group of devices on its first collective and give the
  peers 30 s to arrive, a limit no setting reaches ("Gloo context initialization failed: DEADLINE_EXCEEDED:
  GetKeyValue() timed out ... 30 s"); a process that starts, restores or compiles 30 s later than another (a busy
  host, a slower file system) ended the run. Waiting here first, before the collective, starts everyone together.
  """
  if jax.process_count() == 1:
    return
  try:
    multihost.get_barrier_sync_fn()(key=f"meshtrain: {name}", timeout_ms=timeout_s * 1000)
  except Exception as e:
    raise RunAborted(f"not every process reached {name} within distributed.barrier_timeout_s={timeout_s} s; see the "
                     f"other processes' output for the one that is late or failed ({str(e).splitlines()[0][:200]})") \
        from e


def _exit_with(message: str) -> None:
  print(f"error: {message}", file=sys.stderr, flush=True)
  os._exit(2)

