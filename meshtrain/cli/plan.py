"""Pick the layout for a cluster: every valid way to split a model over it, ranked by predicted step time.

  python -m meshtrain.plan --config configs/llama8b.py --devices 64 --gpu h100 [--gpus-per-node 8] [--json]

Works for every task (the language model, the DiT). Estimates each layout's memory and step time from shapes alone,
drops layouts that do not fit, prints the ranked table and the config overrides of the winner; the best K
(`--verify K`, default 3) are then compiled for simulated devices (cached on disk) and the winner is picked by step
times redone with the collectives XLA actually compiled. `--gpu cpu` plans for this machine's simulated devices,
with peak FLOP/s and collective bandwidth measured here. The library is meshtrain/analysis/planner.py.
"""
import json
import math
import os
import pathlib

from meshtrain import cli, config as config_lib
from meshtrain.analysis import planner as plan_lib
from meshtrain.costs import perf
from meshtrain.errors import ArgumentParser, UserError
from meshtrain.runtime import startup


def parse_args(argv: list[str]):
  parser = ArgumentParser(prog="python -m meshtrain.plan", description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--devices", type=int, required=True, help="devices in the cluster")
  parser.add_argument("--gpu", required=True, choices=[*perf.GPUS, "cpu"])
  parser.add_argument("--nodes", type=int, default=0,
                      help="nodes the devices are spread over, in equal shares (default: --devices / --gpus-per-node)")
  parser.add_argument("--gpus-per-node", type=int, default=0, metavar="N",
                      help="devices in one node, one NVLink domain (default: 8 for the GPUs listed; cpu: all of them)")
  parser.add_argument("--hbm", type=float, default=0, metavar="GB", help="memory per device (default: the GPU's)")
  parser.add_argument("--node-bw", type=float, default=0, metavar="GB/s", help="per-device bandwidth inside a node")
  parser.add_argument("--network-bw", type=float, default=0, metavar="GB/s", help="per-device bandwidth across nodes")
  parser.add_argument("--top", type=int, default=10, help="rows to print")
  parser.add_argument("--no-overlap", action="store_true",
                      help="rank by compute + every collective in sequence (an upper bound) instead of overlapping "
                           "data/fsdp traffic with compute")
  parser.add_argument("--verify", type=int, default=3, metavar="K",
                      help="compile the best K predicted layouts and pick the winner by their compiled collectives "
                           "(default 3; 0: arithmetic only)")
  parser.add_argument("--cache", default="~/.cache/meshtrain/inspect", help="where compiled reports are kept")
  parser.add_argument("--json", action="store_true")
  return parser.parse_known_args(argv)


def check_args(args) -> None:
  if args.devices > config_lib.MAX_CPU_DEVICES:
    raise UserError(f"--devices {args.devices} is more than the {config_lib.MAX_CPU_DEVICES} devices plan can "
                    "simulate to compile and check its layouts; plan for at most that many")
  for flag, value in (("--hbm", args.hbm), ("--node-bw", args.node_bw), ("--network-bw", args.network_bw)):
    if not (math.isfinite(value) and value >= 0):
      raise UserError(f"{flag} {value:g} must be a positive number (0 or omitted: the GPU's own figure)")
  if args.top < 1 or args.verify < 0:
    raise UserError(f"--top must be >= 1 (rows to print) and --verify >= 0 (layouts to compile; 0: none); got "
                    f"--top {args.top} --verify {args.verify}")


@cli.command
def main(argv: list[str]) -> int:
  args, overrides = parse_args(argv)
  nodes, nodes_from = plan_lib.nodes_of(args.devices, args.gpu, args.nodes, args.gpus_per_node)
  check_args(args)
  cfg = config_lib.load(args.config, [*overrides, f"--config.cpu_devices={args.devices}"])
  os.environ["JAX_PLATFORMS"] = "cpu"  # shapes and simulated devices only, whatever this machine has
  startup.start(cfg)
  gb = plan_lib.GB
  p = plan_lib.plan(cfg, args.devices, nodes, nodes_from, args.gpu, args.hbm * gb, args.node_bw * gb,
                    args.network_bw * gb, not args.no_overlap, args.verify,
                    pathlib.Path(os.path.expanduser(args.cache)))
  print(json.dumps(p.to_json()) if args.json else plan_lib.format_plan(p, cfg, args.config, args.top,
                                                                        not args.no_overlap))
  return 0
