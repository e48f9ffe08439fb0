"""Every test runs on 8 simulated CPU devices, so meshes, collectives and sharded checkpoints are real."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# In-process tests compile many small programs and run each a few times: LLVM's expensive passes cost more than
# they save (the flags are read once, when the backend starts below). Subprocesses (the train command run for
# tens of steps) get the environment back unchanged, with optimised code. Numerics follow XLA's HLO either way.
_saved = os.environ.get("XLA_FLAGS")
os.environ["XLA_FLAGS"] = " ".join(filter(None, (_saved, "--xla_backend_optimization_level=0",
                                                 "--xla_llvm_disable_expensive_passes=true")))
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.devices()  # start the CPU backend now, with the flags above
if _saved is None:
  del os.environ["XLA_FLAGS"]
else:
  os.environ["XLA_FLAGS"] = _saved
