"""XLA flags for programs that are compiled, run for a few steps and thrown away (most of this suite).

LLVM's expensive passes cost more compile time than they save in so few steps: a 4-process launch of the tiny
model takes 34 s with these flags instead of 62 s, one 16-step process 23 s instead of 37 s. Runs that train for
hundreds of steps (tests/test_slurm.py's time-limit job) are sized from the measured step time. Runs compared bit
for bit must be compiled alike: tests/test_recovery.py and tests/test_faults.py compile every run with these flags.
Numerics follow XLA's HLO either way.
"""
import os

from meshtrain.runtime.startup import CPU_XLA_FLAGS

# The collective timeout (see meshtrain.runtime.startup) matters most here: two pytest workers and their subprocesses
# share 2 cores, and CI once lost a worker (tests/test_context_attention.py) to what looks like XLA's 60 s abort.
FLAGS = " ".join(("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true") + CPU_XLA_FLAGS)


def env() -> dict:
  """The environment for a subprocess whose compile dominates its run."""
  return {**os.environ, "XLA_FLAGS": " ".join(filter(None, (os.environ.get("XLA_FLAGS"), FLAGS)))}
