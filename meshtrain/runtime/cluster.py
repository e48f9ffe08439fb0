"""Which processes make up the run: the arguments of jax.distributed.initialize, from the config or the cluster.

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

from meshtrain.errors import UserError


def distributed_settings(dist_cfg) -> dict | None:
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

