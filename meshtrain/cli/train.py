"""Train a model (any task: meshtrain/families) over a device mesh.

  python -m meshtrain.train --config configs/tiny.py --workdir runs/tiny [--config.KEY=VALUE ...]

Re-running the same command with the same workdir resumes from the latest checkpoint, on whatever mesh and
process count the new command has; one run at a time holds a workdir. Exit codes: 0 done or preempted
(checkpoint saved), 2 a user mistake or a refusal (reported before the first step), 3 stopped to protect
results (non-finite loss, a checkpoint that could not be written), 4 hang watchdog, 128 + N signal N during
start-up (130 Ctrl-C, 143 SIGTERM; nothing written).
"""
import os
import pathlib

from meshtrain import cli, config as config_lib
from meshtrain.errors import ArgumentParser, UserError
from meshtrain.runtime import host
from meshtrain.runtime.preemption import PreemptionNotice


def parse_args(argv: list[str]):
  parser = ArgumentParser(prog="python -m meshtrain.train", description=__doc__.split("\n\n")[0],
                          epilog="Any config field can be overridden: --config.model.num_layers=8")
  parser.add_argument("--config", required=True, help="Python config file with get_config(), e.g. configs/tiny.py")
  parser.add_argument("--workdir", required=True, help="checkpoints, metrics and logs go here; reuse it to resume")
  args, overrides = parser.parse_known_args(argv)
  cfg = config_lib.load(args.config, overrides)
  workdir = check_workdir(args.workdir)
  host.check_batch_memory(cfg)  # before JAX: a batch that cannot be allocated is refused in a second
  return cfg, workdir


def check_workdir(path: str) -> pathlib.Path:
  """`path` as the run's directory: not empty, and it or its nearest existing parent a writable directory."""
  if not path.strip():
    raise UserError("--workdir is empty, which would put checkpoints, metrics and logs in the current directory; "
                    "pass a directory for this run, e.g. --workdir runs/tiny (created if missing)")
  workdir = pathlib.Path(path).expanduser()
  existing = config_lib.check_directory("--workdir", str(workdir))
  if not os.access(existing, os.W_OK | os.X_OK):
    raise UserError(f"--workdir {path!r} cannot be written: {str(existing)!r} is not writable by this user; pass a "
                    "directory on a writable file system")
  return workdir


@cli.command
def main(argv: list[str]) -> int:
  cfg, workdir = parse_args(argv)
  # Signal handling from the first moment: a signal during start-up ends the process at once with a message
  # (nothing to save yet); once the loop runs, it stops after the current step with a checkpoint.
  with PreemptionNotice() as preemption:
    from meshtrain import loop  # JAX loads only now: a config mistake is refused in a fraction of a second
    try:
      loop.run(cfg, workdir, preemption=preemption)
    except MemoryError as e:  # a host-side array of the model or batch (numpy): the sizes asked for are too large
      lm = cfg.task == "lm"
      raise UserError(f"out of host memory for batch_size={cfg.batch_size}" + (f", seq_len={cfg.seq_len}" if lm else "")
                      + f" ({' '.join(str(e).split())[:200] or 'MemoryError'}); lower {'seq_len or ' if lm else ''}"
                      "batch_size, and see what a layout needs per device with python -m meshtrain.inspect") from e
  return 0
