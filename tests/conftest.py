"""Every test runs on 8 simulated CPU devices, so meshes, collectives and sharded checkpoints are real."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import xla_fast  # noqa: E402

# In-process tests compile many small programs and run each a few times (see xla_fast; the flags are read once,
# when the backend starts below). Subprocesses get the environment back unchanged, with optimised code, unless
# they ask for xla_fast.env().
_saved = os.environ.get("XLA_FLAGS")
os.environ["XLA_FLAGS"] = xla_fast.env()["XLA_FLAGS"]
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.devices()  # start the CPU backend now, with the flags above
if _saved is None:
  del os.environ["XLA_FLAGS"]
else:
  os.environ["XLA_FLAGS"] = _saved
