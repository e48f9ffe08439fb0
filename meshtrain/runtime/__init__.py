"""The process around the loop: start-up, the cluster it belongs to, signals, hangs, the workdir lock.

  host        this host's memory and process count before JAX starts; whether a batch's buffers fit
  startup     XLA flags, simulated CPU devices, the distributed runtime (`start`), `run_main`, `barrier`
  cluster     which processes make up the run: config, launcher, Kubernetes, SLURM (srun), Open MPI
  preemption  SIGTERM / SIGINT: at once during start-up, together after a step with a checkpoint later
  watchdog    a process that makes no progress writes its stacks and exits with code 4
  workdir     one run per workdir: the OS lock process 0 holds
  launcher    N local processes standing in for N hosts (`python -m meshtrain.launch`)

Nothing here imports JAX when imported: entry points import this package, then call `start(cfg)`, which sets
XLA_FLAGS before JAX initialises.
"""
from meshtrain.runtime.startup import barrier, run_main, start

__all__ = ["barrier", "run_main", "start"]
