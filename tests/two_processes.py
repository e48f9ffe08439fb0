"""Two real JAX processes (4 simulated CPU devices each, the distributed runtime on 127.0.0.1) running one script."""
import os
import pathlib
import subprocess
import sys

from meshtrain.runtime.launcher import free_port

# Prepended to every script: the runtime is up and sys.argv[3:] are the caller's arguments.
PREAMBLE = """
import sys
import jax
jax.config.update("jax_num_cpu_devices", 4)
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
"""


def run(script: str, tmp_path: pathlib.Path, *args: str, timeout: float = 120) -> list[str]:
  """Runs `script` in two processes and returns their outputs (stdout and stderr), process 0 first; fails the test
  with a process's output when it exits non-zero."""
  path = tmp_path / "two_processes.py"
  path.write_text(PREAMBLE + script)
  address = f"127.0.0.1:{free_port()}"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(pathlib.Path(__file__).parents[1])}
  procs = [subprocess.Popen([sys.executable, str(path), address, str(i), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for i in range(2)]
  outs = [p.communicate(timeout=timeout)[0] for p in procs]
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{out[-3000:]}"
  return outs
