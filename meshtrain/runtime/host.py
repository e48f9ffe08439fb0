"""What this host has before JAX starts: its memory, and how many processes the config and environment say share the
batch; the check that a batch's input buffers fit in that memory (each task counts the bytes of its rows); whether a
process of this host still runs (what a killed one left behind may then be removed)."""
import os

from meshtrain import config as config_lib


def process_count_hint(cfg) -> int:
  """How many processes share the global batch, as far as the config and the environment tell before JAX starts
  (meshtrain.launch, SLURM, Open MPI); 1 when nothing says."""
  if cfg.distributed.num_processes > 0:
    return cfg.distributed.num_processes
  for name in ("MESHTRAIN_NUM_PROCESSES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    try:
      if int(os.environ.get(name, "")) > 0:
        return int(os.environ[name])
    except ValueError:
      pass
  return 1


def host_memory_bytes() -> int:
  """This host's memory: physical RAM, or the container's cgroup limit when lower."""
  ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
    try:
      with open(path) as f:
        ram = min(ram, int(f.read()))
    except (OSError, ValueError):  # no limit ("max"), or no such cgroup version
      pass
  return ram


def check_batch_memory(cfg, processes: int | None = None, memory: int | None = None) -> None:
  """Refuses a batch whose input-pipeline buffers alone cannot fit in this host's memory (each task counts the bytes
  of its rows), before the model needs anything."""
  processes = process_count_hint(cfg) if processes is None else processes
  memory = host_memory_bytes() if memory is None else memory
  rows = -(-cfg.batch_size // processes)
  per = f"{rows} of the {cfg.batch_size} rows per process ({processes} processes)" if processes > 1 else \
        f"batch_size={cfg.batch_size}"
  config_lib.TASKS[cfg.task].check_batch_memory(cfg, rows, per, memory)


def process_alive(pid) -> bool:
  """Whether process `pid` (an int, or the string a temporary directory's name holds) runs on this host; True when
  that cannot be told (not a pid, or another user's process), so that nothing of a live process is removed."""
  try:
    os.kill(int(pid), 0)
  except ProcessLookupError:
    return False
  except (ValueError, PermissionError):
    return True
  return True
