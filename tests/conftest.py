"""Every test runs on 8 simulated CPU devices, so meshes, collectives and sharded checkpoints are real."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
