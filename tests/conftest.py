"""Every test runs on 8 simulated CPU devices, so meshes, collectives and sharded checkpoints are real."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile many small programs and run each a few times: LLVM's expensive passes cost more time than they
# save (~15% of the suite). Numerics still follow XLA's HLO, so the tolerances and bitwise checks are unchanged.
os.environ["XLA_FLAGS"] = " ".join(filter(None, (os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0",
                                                 "--xla_llvm_disable_expensive_passes=true")))
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
