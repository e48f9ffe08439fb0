"""The one exception type for mistakes a user can fix (bad config, bad mesh, bad data settings).

Entry points turn it into a one-paragraph message and exit code 2, with no traceback. Anything else that
escapes is a bug in meshtrain and is allowed to traceback.
"""
import argparse
import os
import sys


class UserError(Exception):
  """Raised for input a user can correct; the message says what is wrong and how to fix it."""


class RunAborted(Exception):
  """The run stopped on purpose to protect its results (non-finite loss, a checkpoint that could not be written).

  Entry points print the message and exit with code 3, without a traceback: nothing is broken in meshtrain,
  and the last good checkpoint is intact.
  """


class ArgumentParser(argparse.ArgumentParser):
  """argparse whose mistakes are reported the meshtrain way: a UserError (one `error: ...` line, exit code 2 from
  the entry point) instead of argparse's usage block."""

  def error(self, message):
    raise UserError(f"{message}; see {self.prog} --help")


def silence_stderr() -> None:
  """After a command's one error line, while the process ends: what background threads still print (Orbax's event
  loops and TensorStore's, torn down mid-read by the failure: "Event loop is closed" tracebacks) goes nowhere, so
  the error stays the one line. Only for exits whose message is already out."""
  sys.stderr.flush()
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)
  os.close(devnull)
