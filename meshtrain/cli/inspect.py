"""Compile the train step ahead of time for N devices and report what it costs each device, before any launch.

  python -m meshtrain.inspect --config configs/llama8b.py --devices 64 --hbm 80 [--config.KEY=VALUE ...] [--json]

The N devices are simulated CPU devices and no array is allocated: XLA compiles the real train step (the one
`python -m meshtrain.train` runs, same shardings) from shapes, so a 64-device layout of an 8B model is checked
on a laptop in under a minute. Reported per device: parameter, optimizer-state, gradient and temporary bytes,
the total against --hbm, FLOPs per step and every collective (kind, mesh axes, count and bytes per step), each
next to the analytic expectation of meshtrain/analysis/estimate.py (for any task: the task's cost model says what is
model-specific) and the ratio measured / expected.

What compiling on the CPU cannot show: GPU kernels (cuDNN fused attention keeps no [L, L] scores, so GPU
temporaries are lower for long sequences) and GPU collective choices (the CPU backend all-reduces where GPUs
reduce-scatter). Parameter, optimizer and collective-count figures do not depend on the backend.
"""
import json
import math
import os

from meshtrain import cli, config as config_lib
from meshtrain.analysis import compiled as inspect_lib
from meshtrain.errors import ArgumentParser, UserError


@cli.command
def main(argv: list[str]) -> int:
  parser = ArgumentParser(prog="python -m meshtrain.inspect", description=__doc__.split("\n\n")[0],
                          epilog="Mesh sizes are config fields: --config.mesh.fsdp=8 --config.mesh.tensor=8")
  parser.add_argument("--config", required=True)
  parser.add_argument("--devices", type=int, default=None,
                      help=f"devices to compile for, 1 to {config_lib.MAX_CPU_DEVICES} (default: cpu_devices)")
  parser.add_argument("--hbm", type=float, default=80.0, metavar="GB", help="memory per device (default 80)")
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  args, overrides = parser.parse_known_args(argv)
  if args.devices is not None and not 1 <= args.devices <= config_lib.MAX_CPU_DEVICES:
    raise UserError(f"--devices {args.devices} is out of range; compile for 1 to {config_lib.MAX_CPU_DEVICES} "
                    "devices (omit it to use the config's cpu_devices)")
  if not (math.isfinite(args.hbm) and args.hbm > 0):
    raise UserError(f"--hbm {args.hbm:g} must be a positive number of GB per device (e.g. 80 for an H100)")
  if args.devices is not None:
    overrides = [f"--config.cpu_devices={args.devices}", *overrides]
  cfg = config_lib.load(args.config, overrides)
  os.environ["JAX_PLATFORMS"] = "cpu"  # simulated devices, whatever accelerators this machine has
  try:
    report = inspect_lib.inspect(cfg)
  except MemoryError as e:  # a host-side array built while tracing (numpy): the sizes asked for are too large
    raise UserError(f"out of host memory while tracing the step for batch_size={cfg.batch_size}, "
                    f"seq_len={cfg.seq_len} ({' '.join(str(e).split())[:200]}); lower seq_len or batch_size") from e
  hbm = args.hbm * inspect_lib.GB
  print(json.dumps(report.to_json(hbm)) if args.json else inspect_lib.format_report(report, hbm))
  if cfg.model.dtype == "bfloat16" and not args.json:
    print("note: XLA's CPU backend has no bfloat16 matmul: it keeps the layers' bfloat16 residuals as float32, and its "
          "attention materialises [L, L] scores; a GPU (bfloat16 matmuls, fused attention) needs fewer temporaries, "
          "closer to the expectation")
  return 0
