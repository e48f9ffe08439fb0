"""Train a model (any task: meshtrain/tasks) over a device mesh.

  python -m meshtrain.train --config configs/tiny.py --workdir runs/tiny [--config.KEY=VALUE ...]

Re-running the same command with the same workdir resumes from the latest checkpoint, on whatever mesh and
process count the new command has; one run at a time holds a workdir. Exit codes: 0 done or preempted
(checkpoint saved), 2 a user mistake or a refusal (reported before the first step), 3 stopped to protect
results (non-finite loss, a checkpoint that could not be written), 4 hang watchdog, 128 + N signal N during
start-up (130 Ctrl-C, 143 SIGTERM; nothing written).
"""
import os
import pathlib
import sys
import time

from meshtrain import config as config_lib, runtime
from meshtrain.analysis import perf
from meshtrain.errors import ArgumentParser, RunAborted, UserError
from meshtrain.runtime import host, workdir as workdir_lib
from meshtrain.runtime.preemption import PreemptionNotice

_IMPORTED = time.perf_counter()  # start-up fallback where the process start time is unknown


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


def main(argv: list[str] | None = None) -> int:
  cfg = None
  try:
    cfg, workdir = parse_args(sys.argv[1:] if argv is None else argv)
    train(cfg, workdir)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except RunAborted as e:
    print(f"stopped: {e}", file=sys.stderr)
    return 3
  except MemoryError as e:  # a host-side array of the model or batch (numpy): the sizes asked for are too large
    lm = cfg is None or cfg.task == "lm"
    sizes = "" if cfg is None else f" for batch_size={cfg.batch_size}" + (f", seq_len={cfg.seq_len}" if lm else "")
    print(f"error: out of host memory{sizes} ({' '.join(str(e).split())[:200] or 'MemoryError'}); lower "
          f"{'seq_len or ' if lm else ''}batch_size, and see what a layout needs per device with python -m "
          "meshtrain.inspect", file=sys.stderr)
    return 2
  return 0


def train(cfg, workdir: pathlib.Path, hooks=()) -> dict:
  """Trains to cfg.steps (resuming from workdir) and returns timing: compile and start-up seconds.

  `hooks` (meshtrain/hooks.py) are called after the loop's own (metrics, eval, checkpoint, the task's), e.g.
  bench's loop clock."""
  # Signal handling from the first moment: a signal during start-up ends the process at once with a message
  # (nothing to save yet); once the loop runs, it stops after the current step with a checkpoint.
  with PreemptionNotice() as preemption:
    runtime.start(cfg)  # XLA flags, CPU devices, distributed runtime: before JAX initialises its backends
    # Heavy imports after argument checks and runtime.start: a typo is reported in a fraction of a second.
    import jax
    from meshtrain import loop
    from meshtrain.checkpoint import resume
    resume.refuse_converted(workdir)  # before the lock: a refused run writes nothing there
    # Before anything reads or writes the workdir: a second run there is refused, the first one is left alone.
    with workdir_lib.exclusive(workdir, jax.process_index(), jax.process_count(), cfg.distributed.barrier_timeout_s):
      return loop.train(cfg, workdir, preemption, hooks, startup_clock)


def startup_clock() -> float:
  """Seconds since this process started (or, where unknown, since this module was imported)."""
  since_start = perf.seconds_since_process_start()
  return since_start if since_start is not None else time.perf_counter() - _IMPORTED


if __name__ == "__main__":
  runtime.run_main(main)
