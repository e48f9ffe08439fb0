"""The `python -m meshtrain.X` commands: argument handling, then calls into the library, nothing else.

Each command is a module here whose `main(argv)` is decorated with `command`; `meshtrain/X.py` (or
`meshtrain/data/__main__.py`) is the few-line alias that `python -m` runs. Commands import JAX (through the
library) only after their arguments and config are checked, so a typo is refused in a fraction of a second.

This module is the one place where errors become exit codes:
  UserError   -> 2, one `error: ...` line (a mistake the user can fix; nothing was written)
  RunAborted  -> 3, one `stopped: ...` line (the run stopped to protect its results)
"""
import functools
import os
import sys
import traceback

from meshtrain import errors
from meshtrain.errors import RunAborted, UserError


def command(body):
  """`main(argv=None) -> int` from `body(argv) -> int | None`: argv defaults to sys.argv[1:], and a UserError or
  RunAborted becomes its one line on stderr and exit code 2 or 3."""

  @functools.wraps(body)
  def main(argv: list[str] | None = None) -> int:
    try:
      return body(sys.argv[1:] if argv is None else argv) or 0
    except UserError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    except RunAborted as e:
      print(f"stopped: {e}", file=sys.stderr)
      return 3

  return main


def _joined_a_distributed_run() -> bool:
  jax = sys.modules.get("jax")  # a command that failed before JAX loaded never joined one
  return jax is not None and jax.distributed.is_initialized()


def run(main) -> None:
  """`sys.exit(main())` for the `__main__` of every command, except that a process of a multi-process run that fails
  (an exit code, or an exception: its traceback is printed) ends at once. At a normal exit jax.distributed waits up
  to 300 s (its shutdown_timeout) for every peer to reach shutdown too, and peers blocked in a collective with the
  failed process never do."""
  try:
    code = main()
  except BaseException as e:
    if not _joined_a_distributed_run():
      raise  # one process: Python's own exit (traceback, Ctrl-C's status)
    if isinstance(e, SystemExit) and isinstance(e.code, int | None):
      code = e.code or 0
    else:
      traceback.print_exc()
      code = 1
  sys.stdout.flush()
  sys.stderr.flush()
  if code in (2, 3):  # a refusal or a stop: its one line is out; late noise of Orbax's threads (and of libraries'
    errors.silence_stderr()  # atexit handlers on a full disk) must not follow it
  if code and _joined_a_distributed_run():
    os._exit(code)
  sys.exit(code)
