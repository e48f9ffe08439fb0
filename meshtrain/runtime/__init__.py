"""The process around the loop: start-up, the cluster it belongs to, signals, hangs, the workdir lock.

  host        this host's memory and process count before JAX starts; whether a batch's buffers fit
  startup     XLA flags, simulated CPU devices, the distributed runtime (`start`), `barrier` (imports JAX)
  cluster     which processes make up the run: config, launcher, Kubernetes, SLURM (srun), Open MPI
  preemption  SIGTERM / SIGINT: at once during start-up, together after a step with a checkpoint later
  watchdog    a process that makes no progress writes its stacks and exits with code 4
  workdir     one run per workdir: the OS lock process 0 holds
  launcher    N local processes standing in for N hosts (`python -m meshtrain.launch`)

`host`, `cluster`, `preemption`, `watchdog`, `workdir` and `launcher` import no JAX: the commands use them
while they check their arguments. `startup.start(cfg)` sets XLA_FLAGS and the CPU device count before JAX
initialises its backends (importing JAX does not initialise them).
"""
