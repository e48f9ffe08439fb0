"""Process start-up: XLA flags, simulated CPU devices and the JAX distributed runtime, in the order JAX needs.

Everything here must happen before JAX initialises its backends, so entry points call `start(cfg)` first.

Where the process count comes from, first match wins:
  1. the config (`distributed.coordinator_address`, `num_processes`, `process_id`);
  2. meshtrain's launcher or a Kubernetes indexed Job: JAX_COORDINATOR_ADDRESS with MESHTRAIN_NUM_PROCESSES and
     MESHTRAIN_PROCESS_ID (or JOB_COMPLETION_INDEX);
  3. a SLURM job step (srun), read here (`slurm_settings`): JAX's own SLURM detection would give every process
     only the device numbered SLURM_LOCALID, one GPU of eight with one task per node (jax-ml/jax#16788);
  4. Open MPI (mpirun), detected by JAX.
One process with none of these set runs alone, without the distributed runtime; so does a process inside a SLURM
allocation but outside srun (the batch script's body, an salloc shell), with a note saying so.
"""
import ipaddress
import os
import re
import socket
import sys
import threading

from meshtrain.errors import RunAborted, UserError

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
    ids = env.get("JAX_LOCAL_DEVICE_IDS")
    # Every device the process sees, or $JAX_LOCAL_DEVICE_IDS; JAX's detection is off so that it cannot narrow them
    # to one (it would under srun: the launcher or these variables inside a SLURM step).
    return {"coordinator_address": address, "num_processes": count, "process_id": index,
            "local_device_ids": [int(i) for i in ids.split(",")] if ids else None,
            "coordinator_bind_address": bind_address(address, dist_cfg.coordinator_bind_address),
            "cluster_detection_method": "deactivate"}
  if "SLURM_JOB_ID" in env:
    slurm = slurm_settings(env)
    if slurm is not None or "SLURM_STEP_ID" in env or int(env.get("SLURM_NTASKS", 1)) <= 1:
      return slurm
    # The batch script's body or an salloc shell: the job's task count is set, but no task of it is this process.
    print(f"note: inside SLURM job {env['SLURM_JOB_ID']} ({env['SLURM_NTASKS']} tasks) but not under srun: running "
          "as one process on this node; start every task with srun to run them all", file=sys.stderr, flush=True)
    return None
  if int(env.get("OMPI_COMM_WORLD_SIZE", 1)) > 1:
    return {}  # JAX reads Open MPI's variables itself
  if address or count > 1:
    raise UserError(f"incomplete distributed settings: coordinator {address or '(none)'}, {count} processes, "
                    f"process id {index}; give all three (config distributed.*, or JAX_COORDINATOR_ADDRESS, "
                    "MESHTRAIN_NUM_PROCESSES and MESHTRAIN_PROCESS_ID), or launch with srun / mpirun")
  return None


def slurm_settings(env) -> dict | None:
  """jax.distributed.initialize's arguments for a task of a SLURM job step (srun) of several tasks, else None.

  The coordinator is the step's first node, on the port JAX's own SLURM detection uses (61440 + job id % 4096,
  or $JAX_COORDINATOR_PORT), so a requeued job finds it where its first attempt did. Which devices the process
  drives: see `slurm_local_devices`."""
  if "SLURM_STEP_ID" not in env:  # srun sets it; the batch step and an salloc shell have none (verified here)
    return None
  tasks = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", 1)))
  if tasks <= 1:
    return None
  port = env.get("JAX_COORDINATOR_PORT") or str(61440 + int(env["SLURM_JOB_ID"]) % 4096)
  address = f"{first_host(env.get('SLURM_STEP_NODELIST') or env['SLURM_JOB_NODELIST'])}:{port}"
  return {"coordinator_address": address, "num_processes": tasks, "process_id": int(env["SLURM_PROCID"]),
          "local_device_ids": slurm_local_devices(env), "coordinator_bind_address": bind_address(address),
          # With local_device_ids None (all devices), JAX would otherwise fill in [SLURM_LOCALID] itself.
          "cluster_detection_method": "deactivate"}


def slurm_local_devices(env) -> list[int] | None:
  """The accelerators this task drives, as ids among those the process sees; None for all of them.

  - $JAX_LOCAL_DEVICE_IDS: the user's choice;
  - one task on this node: every device the node gives the job (JAX would pick device SLURM_LOCALID only);
  - several tasks on this node: an equal block each, in SLURM_LOCALID order, out of the devices the tasks share
    ($CUDA_VISIBLE_DEVICES as SLURM's GPU allocation sets it, else $SLURM_GPUS_ON_NODE). A task that already sees
    fewer devices than there are tasks here was bound to its own by SLURM (--gpus-per-task, --gpu-bind): all of
    them. With no GPU count at all, one device per task, numbered by SLURM_LOCALID (JAX's default)."""
  if ids := env.get("JAX_LOCAL_DEVICE_IDS"):
    return [int(i) for i in ids.split(",")]
  here = tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "1"),
                       int(env.get("SLURM_NODEID", 0)))
  if here <= 1:
    return None
  local = int(env.get("SLURM_LOCALID", 0))
  visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
  count = len(visible) or int(env.get("SLURM_GPUS_ON_NODE", 0))
  if visible and len(visible) < here:
    return None
  if not count or count % here:
    return [local]
  block = count // here
  return list(range(local * block, (local + 1) * block))


def tasks_on_node(tasks_per_node: str, node: int) -> int:
  """SLURM's compressed task counts, e.g. "2(x3),1": the count of the node-th node of the step."""
  counts = []
  for part in tasks_per_node.split(","):
    n, _, repeat = part.partition("(x")
    counts += [int(n)] * (int(repeat.rstrip(")")) if repeat else 1)
  return counts[min(node, len(counts) - 1)]


def first_host(nodelist: str) -> str:
  """The first host of a SLURM host list: "gpu-[003-010,12]-ib,cpu1" -> "gpu-003-ib" (zero padding kept)."""
  host, i = "", 0
  while i < len(nodelist) and nodelist[i] != ",":
    if nodelist[i] == "[":
      end = nodelist.index("]", i)
      host += re.split(r"[-,]", nodelist[i + 1:end])[0]
      i = end + 1
    else:
      host += nodelist[i]
      i += 1
  return host


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


_distributed = False  # this process joined a multi-process run (jax.distributed.initialize returned)


def run_main(main) -> None:
  """`sys.exit(main())` for the `__main__` of every command that starts the runtime (train, generate, sample, bench,
  inspect, plan), except that a process of a multi-process run that fails (an exit code, or an exception: its
  traceback is printed) ends at once. At a normal exit jax.distributed waits up to 300 s
  (its shutdown_timeout) for every peer to reach shutdown too, and peers blocked in a collective with the failed
  process never do: the launcher, srun --kill-on-bad-exit or a test saw the failure only 5 minutes later (a CI run's
  4-process test timed out so: three processes waited in a collective, the fourth in jax.distributed's shutdown)."""
  import traceback
  try:
    code = main()
  except BaseException as e:
    if not _distributed:
      raise  # one process: Python's own exit (traceback, Ctrl-C's status)
    if isinstance(e, SystemExit) and isinstance(e.code, int | None):
      code = e.code or 0
    else:
      traceback.print_exc()
      code = 1
  sys.stdout.flush()
  sys.stderr.flush()
  if code and _distributed:
    os._exit(code)
  sys.exit(code)


def _initialize_distributed(jax, cfg, settings: dict) -> None:
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
    global _distributed
    _distributed = True
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
  import jax
  if jax.process_count() == 1:
    return
  from orbax.checkpoint import multihost
  try:
    multihost.get_barrier_sync_fn()(key=f"meshtrain: {name}", timeout_ms=timeout_s * 1000)
  except Exception as e:
    raise RunAborted(f"not every process reached {name} within distributed.barrier_timeout_s={timeout_s} s; see the "
                     f"other processes' output for the one that is late or failed ({str(e).splitlines()[0][:200]})") \
        from e


def _exit_with(message: str) -> None:
  print(f"error: {message}", file=sys.stderr, flush=True)
  os._exit(2)
