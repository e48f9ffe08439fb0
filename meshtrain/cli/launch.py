"""Start N real training processes on this machine, standing in for N hosts.

  python -m meshtrain.launch --processes 2 --devices-per-process 4 -- --config configs/tiny.py --workdir runs/x

Each process runs `python -m meshtrain.train <train args> --config.cpu_devices=M` with the JAX distributed
runtime on 127.0.0.1 (gloo collectives between CPU processes). Output lines are prefixed `[pN]`. SIGTERM and
SIGINT are passed on to every process (they checkpoint and stop together). When one process fails, the others
are stopped and the launcher exits with the failed process's code.

`--module meshtrain.generate` runs generation instead (every process the same command; process 0 prints):

  python -m meshtrain.launch --processes 2 --devices-per-process 4 --module meshtrain.generate -- --workdir runs/x \
      --prompt "def main(" --config.mesh.tensor=4 --config.mesh.nodes.tensor=2

and `--module meshtrain.serve` one model's server (process 0 serves HTTP, every process runs the engine's steps;
docs/serving.md).
"""

from meshtrain import cli
from meshtrain.config import MAX_CPU_DEVICES
from meshtrain.errors import ArgumentParser, UserError
from meshtrain.runtime.host import host_memory_bytes
from meshtrain.runtime.launcher import launch

# Entry points that start the distributed runtime from the launcher's variables (meshtrain/runtime/startup.py) and
# take --config.cpu_devices.
MODULES = ("meshtrain.train", "meshtrain.generate", "meshtrain.serve")
# Resident memory of one training process once JAX has started, before any compile (158 MB measured on the CI
# machine with 8 simulated devices): a floor, so more processes than memory / this cannot all start.
PROCESS_BYTES = 150_000_000


@cli.command
def main(argv: list[str]) -> int:
  split = argv.index("--") if "--" in argv else len(argv)
  parser = ArgumentParser(
      prog="python -m meshtrain.launch", description=__doc__.split("\n\n")[0],
      usage="python -m meshtrain.launch --processes N --devices-per-process M [--module M] -- TRAIN_ARGS...",
      epilog="TRAIN_ARGS, after --, are python -m meshtrain.train's own arguments (--config, --workdir, "
             "--config.KEY=VALUE ...), or --module's; each process gets them with --config.cpu_devices=M added. "
             "Example: python -m meshtrain.launch --processes 2 --devices-per-process 4 -- --config "
             "configs/tiny.py --workdir runs/x")
  parser.add_argument("--processes", type=int, required=True, help="processes to start (stand-ins for hosts)")
  parser.add_argument("--devices-per-process", type=int, required=True, help="simulated CPU devices per process")
  parser.add_argument("--module", default="meshtrain.train", choices=MODULES,
                      help="what every process runs (default meshtrain.train; the arguments after -- are its own)")
  args = parser.parse_args(argv[:split])  # --help prints the help and exits 0 here
  if args.processes < 1 or args.devices_per_process < 1:
    raise UserError(f"--processes {args.processes} and --devices-per-process {args.devices_per_process} must "
                    "be at least 1")
  if args.processes * args.devices_per_process > MAX_CPU_DEVICES:
    raise UserError(f"--processes {args.processes} x --devices-per-process {args.devices_per_process} = "
                    f"{args.processes * args.devices_per_process} simulated devices, more than the "
                    f"{MAX_CPU_DEVICES} meshtrain simulates on one machine; use fewer")
  if args.processes * PROCESS_BYTES > (memory := host_memory_bytes()):
    raise UserError(f"--processes {args.processes}: each is a Python process with its own JAX runtime (at least "
                    f"{PROCESS_BYTES / 1e6:.0f} MB before it compiles anything), more than this host's "
                    f"{memory / 1e9:.1f} GB in all; start at most {memory // PROCESS_BYTES}")
  if split == len(argv):
    raise UserError("put the training arguments after --, e.g. python -m meshtrain.launch --processes 2 "
                    "--devices-per-process 4 -- --config configs/tiny.py --workdir runs/x")
  if split == len(argv) - 1:
    raise UserError("no training arguments after --; give python -m meshtrain.train's, e.g. -- --config "
                    "configs/tiny.py --workdir runs/x")
  code = launch(args.processes, args.devices_per_process, argv[split + 1:], module=args.module)
  return code if code >= 0 else 128 - code  # killed by signal N: report 128 + N, as shells do
