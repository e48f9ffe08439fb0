"""Process start-up: XLA flags, simulated CPU devices and the JAX distributed runtime, in the order JAX needs.

Everything here must happen before JAX initialises its backends, so entry points call `start(cfg)` first.

Where the process count comes from, first match wins:
  1. the config (`distributed.coordinator_address`, `num_processes`, `process_id`);
  2. meshtrain's launcher or a Kubernetes indexed Job: JAX_COORDINATOR_ADDRESS with MESHTRAIN_NUM_PROCESSES and
     MESHTRAIN_PROCESS_ID (or JOB_COMPLETION_INDEX);
  3. SLURM (srun) or Open MPI (mpirun), detected by JAX itself.
One process with none of these set runs alone, without the distributed runtime.
"""
import ipaddress
import os
import socket
import sys
import threading

from meshtrain.errors import UserError

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


def xla_flags(extra: str, environment: str) -> str:
  """meshtrain's defaults, then the user's XLA_FLAGS, then the config's `xla_flags`: later flags win."""
  return " ".join(part for part in (" ".join(GPU_XLA_FLAGS + CPU_XLA_FLAGS), environment, extra) if part)


def _cluster_settings(dist_cfg) -> dict | None:
  """Arguments for jax.distributed.initialize, or None for a single process."""
  env = os.environ
  address = dist_cfg.coordinator_address or env.get("JAX_COORDINATOR_ADDRESS", "")
  count = dist_cfg.num_processes if dist_cfg.num_processes > 0 else int(env.get("MESHTRAIN_NUM_PROCESSES", -1))
  index = dist_cfg.process_id if dist_cfg.process_id >= 0 else int(
      env.get("MESHTRAIN_PROCESS_ID", env.get("JOB_COMPLETION_INDEX", -1)))
  if address and count > 0 and index >= 0:
    if count == 1:
      return None
    if index >= count:
      raise UserError(f"process id {index} is out of range for {count} processes; ids run 0..{count - 1}")
    return {"coordinator_address": address, "num_processes": count, "process_id": index,
            "coordinator_bind_address": bind_address(address, dist_cfg.coordinator_bind_address)}
  if int(env.get("SLURM_NTASKS", 1)) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", 1)) > 1:
    return {}  # JAX reads the scheduler's variables itself
  if address or count > 1:
    raise UserError(f"incomplete distributed settings: coordinator {address or '(none)'}, {count} processes, "
                    f"process id {index}; give all three (config distributed.*, or JAX_COORDINATOR_ADDRESS, "
                    "MESHTRAIN_NUM_PROCESSES and MESHTRAIN_PROCESS_ID), or launch with srun / mpirun")
  return None


def bind_address(coordinator: str, configured: str = "") -> str | None:
  """Where process 0's coordinator listens. JAX binds every interface ([::]) unless told; here, in order: the
  config (`distributed.coordinator_bind_address`) or $JAX_COORDINATOR_BIND_ADDRESS; the coordinator address itself
  when it is an IP address (peers connect to exactly that, so nothing else needs to listen; the local launcher's
  127.0.0.1 stays on loopback); `localhost` as 127.0.0.1; a host name that resolves to a non-loopback address
  here, that address. A host name that resolves to loopback only on this node (Debian's `127.0.1.1 hostname`
  line) keeps JAX's default, since the peers reach it by another address: None."""
  if configured or os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
    return configured or os.environ["JAX_COORDINATOR_BIND_ADDRESS"]
  host, _, port = coordinator.rpartition(":")
  host = host.strip("[]")
  try:
    ip = ipaddress.ip_address(host)
  except ValueError:
    if host == "localhost":
      return f"127.0.0.1:{port}"
    try:
      resolved = {ipaddress.ip_address(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except (OSError, ValueError):
      return None
    routable = sorted((a for a in resolved if not a.is_loopback), key=lambda a: (a.version, str(a)))
    if not routable:
      return None
    ip = routable[0]
  return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def start(cfg) -> None:
  """XLA flags, simulated CPU devices, then the distributed runtime; call before any JAX computation."""
  os.environ["XLA_FLAGS"] = xla_flags(cfg.xla_flags, os.environ.get("XLA_FLAGS", ""))
  settings = _cluster_settings(cfg.distributed)
  from meshtrain import mesh  # imports jax: only after XLA_FLAGS is final
  mesh.simulate_cpu_devices(cfg.cpu_devices)
  import jax
  if settings is not None:
    _initialize_distributed(jax, cfg, settings)
  # Restarts after preemption or a crash recompile the same program: fetch it from disk instead. Not on the CPU:
  # there XLA aborts the process on some multi-device programs loaded from the cache ("rendezvous.h: Check failed:
  # id < num_threads (14 vs. 8) ... collective permute ... op_id=1": two collective-permutes of the deserialized
  # program share one rendezvous), e.g. the 4-shard ring attention of tests/test_context_attention.py, every time
  # (tests/test_runtime.py). CI, whose cache outlives a run, lost a worker to it. jax/jaxlib 0.10.2; GPUs run
  # collectives through NCCL, not this code.
  if cfg.compilation_cache_dir and jax.default_backend() != "cpu":
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cfg.compilation_cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _initialize_distributed(jax, cfg, settings: dict) -> None:
  timeout = cfg.distributed.init_timeout_s
  where = settings.get("coordinator_address", "the coordinator found by SLURM / Open MPI")
  message = (f"the JAX distributed runtime did not start: not all {settings.get('num_processes', '')} processes "
             f"reached coordinator {where} within distributed.init_timeout_s={timeout} s. Check that every process "
             "was started with the same address and process count, and that the port is reachable")
  # A missing peer makes the runtime abort the process from C++ (no Python exception, a fatal-error dump);
  # this timer fires first and ends the process with the message instead.
  timer = threading.Timer(timeout, _exit_with, args=(message,))
  timer.daemon = True
  timer.start()
  try:
    jax.distributed.initialize(**settings, initialization_timeout=timeout + 30,
                               heartbeat_timeout_seconds=cfg.distributed.heartbeat_timeout_s)
  except Exception as e:
    raise UserError(f"{message} ({type(e).__name__}: {str(e).splitlines()[0][:300]})") from e
  finally:
    timer.cancel()


def _exit_with(message: str) -> None:
  print(f"error: {message}", file=sys.stderr, flush=True)
  os._exit(2)
