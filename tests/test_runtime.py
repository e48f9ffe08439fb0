"""Where the process count comes from, the XLA flags meshtrain sets, and the shipped cluster examples."""
import pathlib
import subprocess
import sys

import pytest
import yaml

from meshtrain import config, runtime
from meshtrain.errors import UserError

ROOT = pathlib.Path(__file__).parents[1]
CLUSTER_VARS = ("JAX_COORDINATOR_ADDRESS", "MESHTRAIN_NUM_PROCESSES", "MESHTRAIN_PROCESS_ID", "JOB_COMPLETION_INDEX",
                "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_BIND_ADDRESS")


@pytest.fixture
def clean_env(monkeypatch):
  for var in CLUSTER_VARS:
    monkeypatch.delenv(var, raising=False)
  return monkeypatch


def settings(**dist):
  cfg = config.base_config()
  cfg.distributed.update(dist)
  return runtime._cluster_settings(cfg.distributed)


def test_single_process_by_default(clean_env):
  assert settings() is None


def test_launcher_and_kubernetes_environments(clean_env):
  clean_env.setenv("JAX_COORDINATOR_ADDRESS", "host0:1234")
  clean_env.setenv("MESHTRAIN_NUM_PROCESSES", "4")
  clean_env.setenv("JOB_COMPLETION_INDEX", "3")  # an Indexed Job pod
  assert settings() == {"coordinator_address": "host0:1234", "num_processes": 4, "process_id": 3,
                        "coordinator_bind_address": None}  # host0 does not resolve here: JAX's default
  clean_env.setenv("MESHTRAIN_PROCESS_ID", "1")  # the launcher's variable wins
  assert settings()["process_id"] == 1
  assert settings(process_id=2)["process_id"] == 2  # and the config beats both


def test_coordinator_bind_address(clean_env):
  bind = runtime.bind_address
  assert bind("127.0.0.1:1234") == "127.0.0.1:1234"  # the local launcher: loopback only
  assert bind("localhost:1234") == "127.0.0.1:1234"
  assert bind("[::1]:1234") == "[::1]:1234"
  assert bind("10.1.2.3:1234") == "10.1.2.3:1234"  # the interface the peers were told to use, and no other
  assert bind("no-such-host.invalid:1234") is None  # JAX's default ([::]); the runtime then reports the failure
  assert bind("10.1.2.3:1234", "10.9.9.9:4321") == "10.9.9.9:4321"  # the config wins
  clean_env.setenv("JAX_COORDINATOR_BIND_ADDRESS", "0.0.0.0:1234")
  assert bind("10.1.2.3:1234") == "0.0.0.0:1234"
  assert settings(coordinator_address="10.1.2.3:7", num_processes=2, process_id=0)["coordinator_bind_address"] \
      == "0.0.0.0:1234"


def test_schedulers_are_left_to_jax(clean_env):
  clean_env.setenv("SLURM_NTASKS", "16")
  assert settings() == {}
  clean_env.delenv("SLURM_NTASKS")
  clean_env.setenv("OMPI_COMM_WORLD_SIZE", "2")
  assert settings() == {}


def test_incomplete_or_inconsistent_settings(clean_env):
  with pytest.raises(UserError, match="incomplete distributed settings: coordinator h:1, -1 processes"):
    settings(coordinator_address="h:1")
  with pytest.raises(UserError, match="process id 4 is out of range for 4 processes"):
    settings(coordinator_address="h:1", num_processes=4, process_id=4)


def test_user_flags_come_after_meshtrain_defaults():
  flags = runtime.xla_flags("--xla_gpu_enable_latency_hiding_scheduler=false", "--xla_dump_to=/tmp/x").split()
  assert flags[0].startswith("--xla_gpu_enable_latency_hiding_scheduler=true")
  assert flags[-2:] == ["--xla_dump_to=/tmp/x", "--xla_gpu_enable_latency_hiding_scheduler=false"]
  # Simulated CPU devices on a busy host must not hit XLA's 60 s collective abort (see runtime.CPU_XLA_FLAGS).
  assert "--xla_cpu_collective_call_terminate_timeout_seconds=600" in flags


def test_cluster_examples_are_well_formed():
  subprocess.run(["bash", "-n", str(ROOT / "cluster" / "slurm.sbatch")], check=True)
  assert "python -m meshtrain.train" in (ROOT / "cluster" / "slurm.sbatch").read_text()
  service, job = yaml.safe_load_all((ROOT / "cluster" / "indexed-job.yaml").read_text())
  assert service["kind"] == "Service" and job["spec"]["completionMode"] == "Indexed"
  pod = job["spec"]["template"]["spec"]
  env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
  assert env["MESHTRAIN_NUM_PROCESSES"] == str(job["spec"]["completions"])
  assert env["JAX_COORDINATOR_ADDRESS"].startswith(f"{job['metadata']['name']}-0.{pod['subdomain']}:")
  assert pod["containers"][0]["command"][:3] == ["python", "-m", "meshtrain.train"]


# XLA's CPU runtime aborts on this program when it comes from the persistent compilation cache (jax 0.10.2): ring
# and all-gather attention over 4 sequence shards, outputs and gradients (tests/test_context_attention.py).
RING_FROM_CACHE = """
import sys
from meshtrain import config, runtime
cfg = config.base_config()
cfg.compilation_cache_dir = sys.argv[1]
runtime.start(cfg)
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # cache it however fast it compiles (if on)
sys.path.insert(0, "tests")
import test_context_attention as t
inputs, perm = t.inputs.__wrapped__(), t._order("contiguous", 4)
out = t._compiled(4, True)(*inputs, jnp.asarray(perm, jnp.int32), jnp.asarray(np.argsort(perm, axis=1), jnp.int32))
print(jax.tree.reduce(lambda a, b: a + float(jnp.abs(b).sum()), out, 0.0))
"""


def test_cpu_programs_never_come_from_the_persistent_cache(tmp_path):
  """runtime.start leaves the persistent cache off on the CPU: the second run of a ring program would abort."""
  import xla_fast
  runs = [subprocess.run([sys.executable, "-c", RING_FROM_CACHE, str(tmp_path / "cache")], capture_output=True, text=True,
                         env=xla_fast.env(), cwd=ROOT, timeout=300) for _ in range(2)]
  assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-2000:]
  assert runs[0].stdout == runs[1].stdout
