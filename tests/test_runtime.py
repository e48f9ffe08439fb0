"""Where the process count comes from, the XLA flags meshtrain sets, and the shipped cluster examples."""
import pathlib
import subprocess
import sys

import jaxlib.version
import pytest
import yaml

from meshtrain import config
from meshtrain.errors import UserError
from meshtrain.runtime import cluster, startup

ROOT = pathlib.Path(__file__).parents[1]
CLUSTER_VARS = ("JAX_COORDINATOR_ADDRESS", "MESHTRAIN_NUM_PROCESSES", "MESHTRAIN_PROCESS_ID", "JOB_COMPLETION_INDEX",
                "OMPI_COMM_WORLD_SIZE", "JAX_COORDINATOR_BIND_ADDRESS", "JAX_COORDINATOR_PORT", "JAX_LOCAL_DEVICE_IDS",
                "CUDA_VISIBLE_DEVICES")
# What srun sets in each task of `sbatch -N2 --ntasks-per-node=1` (seen on the local SLURM of cluster/local_slurm.sh;
# the batch script's body and an salloc shell have SLURM_JOB_ID and SLURM_NTASKS but no step variables).
SRUN_TASK = {"SLURM_JOB_ID": "4097", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2",
             "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "gpu[07-08]",
             "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_TASKS_PER_NODE": "1(x2)"}


@pytest.fixture
def clean_env(monkeypatch):
  import os
  for var in [*CLUSTER_VARS, *(v for v in os.environ if v.startswith("SLURM_"))]:
    monkeypatch.delenv(var, raising=False)
  return monkeypatch


def settings(**dist):
  cfg = config.base_config()
  cfg.distributed.update(dist)
  return cluster.distributed_settings(cfg.distributed)


def test_single_process_by_default(clean_env):
  assert settings() is None


def test_launcher_and_kubernetes_environments(clean_env):
  clean_env.setenv("JAX_COORDINATOR_ADDRESS", "host0:1234")
  clean_env.setenv("MESHTRAIN_NUM_PROCESSES", "4")
  clean_env.setenv("JOB_COMPLETION_INDEX", "3")  # an Indexed Job pod
  assert settings() == {"coordinator_address": "host0:1234", "num_processes": 4, "process_id": 3,
                        "local_device_ids": None,  # every device the pod sees
                        "coordinator_bind_address": None,  # host0 does not resolve here: JAX's default
                        "cluster_detection_method": "deactivate"}  # JAX may not narrow the devices to one
  clean_env.setenv("MESHTRAIN_PROCESS_ID", "1")  # the launcher's variable wins
  assert settings()["process_id"] == 1
  assert settings(process_id=2)["process_id"] == 2  # and the config beats both


def test_coordinator_bind_address(clean_env):
  bind = cluster.bind_address
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


def test_open_mpi_is_left_to_jax(clean_env):
  clean_env.setenv("OMPI_COMM_WORLD_SIZE", "2")
  assert settings() == {}


def test_slurm_step_one_task_per_node_drives_every_device(clean_env):
  for var, value in SRUN_TASK.items():
    clean_env.setenv(var, value)
  # Port as JAX's own detection picks it (61440 + job id % 4096), so a requeued job finds the same one.
  assert settings() == {"coordinator_address": "gpu07:61441", "num_processes": 2, "process_id": 1,
                        "local_device_ids": None, "coordinator_bind_address": None,
                        "cluster_detection_method": "deactivate"}
  clean_env.setenv("JAX_COORDINATOR_PORT", "1234")
  assert settings()["coordinator_address"] == "gpu07:1234"
  clean_env.setenv("JAX_LOCAL_DEVICE_IDS", "2,3")  # the user's choice wins
  assert settings()["local_device_ids"] == [2, 3]
  clean_env.setenv("SLURM_STEP_NUM_TASKS", "1")  # a one-task step is a single process
  assert settings() is None


@pytest.mark.parametrize("tasks_per_node, local_id, visible, gpus_on_node, expected", [
    ("2(x2)", "1", "0,1,2,3,4,5,6,7", None, [4, 5, 6, 7]),  # the node's 8 GPUs split between its 2 tasks
    ("8(x2)", "3", "0,1,2,3,4,5,6,7", None, [3]),
    ("4(x2)", "2", None, "8", [4, 5]),                  # no CUDA_VISIBLE_DEVICES: SLURM_GPUS_ON_NODE
    ("8(x2)", "5", "5", None, None),                    # --gpus-per-task: SLURM bound the task to its own GPU
    ("2(x2)", "1", None, None, [1]),                    # no GPU count known: one device per task (JAX's rule)
    ("2,1", "0", "0,1,2,3,4,5,6,7", None, None),        # node 1 of "2,1" holds one task: all its devices
])
def test_slurm_several_tasks_per_node_split_the_devices(clean_env, tasks_per_node, local_id, visible, gpus_on_node,
                                                        expected):
  for var, value in {**SRUN_TASK, "SLURM_STEP_TASKS_PER_NODE": tasks_per_node, "SLURM_LOCALID": local_id}.items():
    clean_env.setenv(var, value)
  for var, value in (("CUDA_VISIBLE_DEVICES", visible), ("SLURM_GPUS_ON_NODE", gpus_on_node)):
    if value is not None:
      clean_env.setenv(var, value)
  assert settings()["local_device_ids"] == expected


@pytest.mark.parametrize("where", ["batch script body", "salloc shell"])
def test_slurm_allocation_outside_srun_runs_one_process(clean_env, capsys, where):
  env = {"SLURM_JOB_ID": "12", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "1(x2)"}
  if where == "batch script body":  # the batch step has these, but no step id or step node list
    env |= {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}
  for var, value in env.items():
    clean_env.setenv(var, value)
  assert settings() is None
  assert capsys.readouterr().err == ("note: inside SLURM job 12 (2 tasks) but not under srun: running as one process "
                                     "on this node; start every task with srun to run them all\n")


def test_slurm_host_lists_and_task_counts():
  assert cluster.first_host("n1") == "n1"
  assert cluster.first_host("n[1-2]") == "n1"
  assert cluster.first_host("gpu-[003-010,012]-ib,cpu1") == "gpu-003-ib"  # zero padding and a suffix kept
  assert cluster.first_host("a[7,9],b[1-4]") == "a7"
  assert cluster.first_host("rack[2-3]-gpu[05-06]") == "rack2-gpu05"
  assert [cluster.tasks_on_node("2(x3),1", n) for n in range(4)] == [2, 2, 2, 1]
  assert cluster.tasks_on_node("8", 0) == 8


# runtime.start under srun with jax.distributed.initialize replaced: what meshtrain hands it, as JSON.
INITIALIZE_ARGS = """
import json, sys
import jax
def capture(**kwargs):
  print(json.dumps(kwargs)); sys.exit(0)
jax.distributed.initialize = capture
from meshtrain import config
from meshtrain.runtime import startup
startup.start(config.base_config())
"""


def test_runtime_hands_jax_the_slurm_settings(clean_env):
  import os
  env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in CLUSTER_VARS}
  env |= {**SRUN_TASK, "SLURM_STEP_NODELIST": "localhost", "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-c", INITIALIZE_ARGS], env=env, cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  import json
  got = json.loads(proc.stdout.splitlines()[-1])
  assert got == {"coordinator_address": "localhost:61441", "num_processes": 2, "process_id": 1,
                 "local_device_ids": None, "coordinator_bind_address": "127.0.0.1:61441",
                 "cluster_detection_method": "deactivate", "initialization_timeout": 330,
                 "heartbeat_timeout_seconds": 100}


class _Jax:
  """Stands in for the jax module in _initialize_distributed: its initialize raises what the runtime raised."""

  def __init__(self, error):
    def initialize(**_):
      raise error
    self.distributed = type("distributed", (), {"initialize": staticmethod(initialize)})


def test_initialisation_errors_say_what_failed(monkeypatch):
  cfg = config.base_config()
  settings = {"coordinator_address": "n1:61441", "num_processes": 2, "process_id": 1}
  # A late peer (the runtime's own deadline) is reported as one; anything else with the runtime's own words.
  with pytest.raises(UserError, match=r"not all processes reached the coordinator within distributed\.init_timeout_s="
                                      r"300 s \(2 processes, coordinator n1:61441, this one is process 1\)"):
    monkeypatch.setattr(startup, "jax", _Jax(RuntimeError("DEADLINE_EXCEEDED: Barrier timed out")))
    startup._initialize_distributed(cfg, settings)
  with pytest.raises(UserError) as e:
    monkeypatch.setattr(startup, "jax", _Jax(ValueError("coordinator_address should be defined.")))
    startup._initialize_distributed(cfg, {})
  assert str(e.value) == ("the JAX distributed runtime did not start (processes and coordinator from Open MPI's "
                          "variables): ValueError: coordinator_address should be defined.")


def test_incomplete_or_inconsistent_settings(clean_env):
  with pytest.raises(UserError, match="incomplete distributed settings: coordinator h:1, -1 processes"):
    settings(coordinator_address="h:1")
  with pytest.raises(UserError, match="process id 4 is out of range for 4 processes"):
    settings(coordinator_address="h:1", num_processes=4, process_id=4)


def test_user_flags_come_after_meshtrain_defaults():
  flags = startup.xla_flags("--xla_gpu_enable_latency_hiding_scheduler=false", "--xla_dump_to=/tmp/x").split()
  assert flags[0].startswith("--xla_gpu_enable_latency_hiding_scheduler=true")
  assert flags[-2:] == ["--xla_dump_to=/tmp/x", "--xla_gpu_enable_latency_hiding_scheduler=false"]
  # Simulated CPU devices on a busy host must not hit XLA's 60 s collective abort (see startup.CPU_XLA_FLAGS).
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


# Ring and all-gather attention over 4 sequence shards, outputs and gradients (tests/test_context_attention.py):
# XLA's CPU runtime aborts on this program when it comes from the persistent compilation cache before jaxlib
# startup.CPU_CACHE_SINCE. Prints its outputs' sum and the cache's hits.
RING_FROM_CACHE = """
import sys
from meshtrain import config
from meshtrain.runtime import startup
cfg = config.base_config()
cfg.compilation_cache_dir = sys.argv[1]
startup.start(cfg)
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # cache it however fast it compiles (if on)
hits = []
jax.monitoring.register_event_listener(lambda event, **_: hits.append(event) if event.endswith("cache_hits") else None)
sys.path.insert(0, "tests")
import test_context_attention as t
inputs, perm = t.inputs.__wrapped__(), t._order("contiguous", 4)
out = t._compiled(4, True)(*inputs, jnp.asarray(perm, jnp.int32), jnp.asarray(np.argsort(perm, axis=1), jnp.int32))
print(jax.tree.reduce(lambda a, b: a + float(jnp.abs(b).sum()), out, 0.0), len(hits))
"""


def test_cpu_programs_come_from_the_persistent_cache_where_they_run(tmp_path):
  """A restart loads the ring program from the cache and computes the same numbers where the CPU runtime runs such
  programs (jaxlib >= startup.CPU_CACHE_SINCE); before that the cache stays off, and the second run compiles."""
  import xla_fast
  cache = tmp_path / "cache"
  runs = [subprocess.run([sys.executable, "-c", RING_FROM_CACHE, str(cache)], capture_output=True,
                         text=True, env=xla_fast.env(), cwd=ROOT, timeout=300) for _ in range(2)]
  assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-2000:]
  (first, first_hits), (second, second_hits) = (r.stdout.split() for r in runs)
  assert first == second and first_hits == "0"
  on = jaxlib.version.__version_info__ >= startup.CPU_CACHE_SINCE
  assert (int(second_hits) > 0) == on and (cache.exists() and any(cache.iterdir())) == on


# A process of one CPU device (as `serve` runs a small model): the cache is on for every jaxlib, its programs being
# single-device ones. The engine's sampling (sort, cumsum, a categorical draw, conditionals) in a loop over a matmul.
ONE_DEVICE_FROM_CACHE = """
import sys
from meshtrain import config
from meshtrain.runtime import startup
cfg = config.base_config()
cfg.compilation_cache_dir, cfg.cpu_devices = sys.argv[1], 1
startup.start(cfg)
import jax, jax.numpy as jnp
from meshtrain.inference import engine
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
hits = []
jax.monitoring.register_event_listener(lambda event, **_: hits.append(event) if event.endswith("cache_hits") else None)
B, V = 4, 64
w_VV = jax.random.normal(jax.random.key(0), (V, V)) / 8
def steps(x_BV):
  def step(i, carry):
    x_BV, tokens_B = carry
    keys_B = jax.random.split(jax.random.key(i), B)
    token_B = engine.sample_rows(x_BV, keys_B, jnp.full(B, 0.7), jnp.full(B, 0.9), jnp.full(B, 5, jnp.int32), V)
    return jnp.tanh(x_BV @ w_VV) + jax.nn.one_hot(token_B, V), tokens_B + token_B
  return jax.lax.fori_loop(0, 8, step, (x_BV, jnp.zeros(B, jnp.int32)))
x_BV, tokens_B = jax.jit(steps)(jax.random.normal(jax.random.key(1), (B, V)))
print(jax.device_count(), float(jnp.abs(x_BV).sum()), int(tokens_B.sum()), len(hits))
"""


def test_a_one_device_process_reads_its_programs_from_the_cache_on_every_jaxlib(tmp_path):
  """With one CPU device the cache is on whatever the jaxlib (startup.cpu_cache_works): the restart reads the
  program from it and computes the same numbers (a server of a small model restarts without compiling)."""
  cache = tmp_path / "cache"
  runs = [subprocess.run([sys.executable, "-c", ONE_DEVICE_FROM_CACHE, str(cache)], capture_output=True,
                         text=True, cwd=ROOT, timeout=300) for _ in range(2)]
  assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-2000:]
  (devices, *first, first_hits), (_, *second, second_hits) = (r.stdout.split() for r in runs)
  assert devices == "1" and first == second and first_hits == "0" and int(second_hits) > 0
