"""Where Orbax's own output goes: logs under WORKDIR/diagnostics/, not the terminal the progress bar shares.

Orbax's save threads, its `absl` records and asyncio's reports of Orbax's unretrieved failures are routed to the
log of the step being saved (`BackgroundOutput`); a restore's file descriptor 2 is sent to a log for its duration
(`stderr_to`). Only the one-line error a user reads reaches the terminal.
"""
import contextlib
import logging
import os
import pathlib
import sys
import threading

import jax


class BackgroundOutput:
  """Routes what Orbax's save threads print to `diagnostics/save-step<N>-process<I>.log`, not the terminal.

  A failed async write makes Orbax's threads log the error with tracebacks, and TensorStore's callbacks print one
  `Event loop is closed` traceback per pending write: hundreds of lines, while training goes on and the progress
  bar shares stderr, so file descriptor 2 cannot simply be redirected as during a restore (`stderr_to`). Writes
  to `sys.stderr` and records of the `absl` logger (Orbax's) from any thread but the main thread and meshtrain's
  own (`meshtrain-*`: the watchdog, the data prefetcher) go to the log of the step being saved; the log file is
  created only when something is written. The main thread's waits for a save use `stderr_to` on the same file.
  """

  def __init__(self, directory: pathlib.Path, kind: str = "save"):
    self.directory = directory
    self.kind = kind  # "save": the trainer's; "read": a reader's, after a failed read (meshtrain/checkpoint/reader.py)
    # Asked now, not when a line is written: asyncio's reports can come at interpreter exit, where jax.process_index()
    # re-initialises a backend and starts a thread, which hangs the exit forever (1 rerun in 4 on a full disk).
    self._process = jax.process_index()
    self.step = None
    self._lock = threading.Lock()
    self._files = {}
    self._router = self._filter = None

  def log_path(self, step) -> pathlib.Path:
    return self.directory / f"{self.kind}-step{step}-process{self._process}.log"

  @staticmethod
  def foreign() -> bool:
    thread = threading.current_thread()
    return thread is not threading.main_thread() and not thread.name.startswith("meshtrain")

  def write(self, text: str) -> int:
    """Best effort: on a full or unwritable disk (the very failure being reported, often), or at interpreter exit
    (builtins already gone), the text is dropped; an exception raised here would land in Orbax's threads and
    asyncio's exception handler instead."""
    with self._lock:
      step = self.step
      try:
        if step not in self._files:
          self.directory.mkdir(parents=True, exist_ok=True)
          self._files[step] = open(self.log_path(step), "a")
        self._files[step].write(text)
        self._files[step].flush()
      except Exception:  # pylint: disable=broad-except
        pass
    return len(text)

  def install(self, own_terminal: bool = True) -> None:
    """own_terminal=False: the main thread writes through the sys.stderr it replaced (wherever descriptor 2 points
    at the time, a `stderr_to` log included), not through a duplicate of the terminal taken now."""
    if self._router is not None:
      return
    self._router = _StderrRouter(sys.stderr, self, own_terminal)
    sys.stderr = self._router
    self._filter = _ForeignRecords(self)
    logging.getLogger("absl").addFilter(self._filter)
    _ASYNCIO_RECORDS.sink = self
    logging.getLogger("asyncio").addFilter(_ASYNCIO_RECORDS)  # once: a filter already there is not added again

  def uninstall(self) -> None:
    if self._router is None:
      return
    logging.getLogger("absl").removeFilter(self._filter)
    if sys.stderr is self._router:
      sys.stderr = self._router.terminal
    self._router.close()
    self._router = self._filter = None
    with self._lock:
      for f in self._files.values():
        try:
          f.close()
        except OSError:  # its last flush, on a full disk
          pass
      self._files.clear()


class _StderrRouter:
  """Stands in for sys.stderr: other threads' writes go to the log, the rest to a duplicate of the terminal's
  descriptor (so the watchdog's message still reaches the terminal while fd 2 is sent to a log)."""

  def __init__(self, stderr, sink: BackgroundOutput, own_terminal: bool = True):
    self.terminal, self._sink, self._own = stderr, sink, None
    if not own_terminal:
      return
    try:
      stderr.flush()
      self._own = os.fdopen(os.dup(stderr.fileno()), "w", buffering=1, encoding=stderr.encoding,
                            errors="backslashreplace")
    except (AttributeError, OSError, ValueError):  # no real descriptor (e.g. captured by a test runner)
      pass

  def write(self, text: str) -> int:
    if self._sink.foreign():
      return self._sink.write(text)
    return (self._own or self.terminal).write(text)

  def flush(self) -> None:
    (self._own or self.terminal).flush()

  def close(self) -> None:
    if self._own is not None:
      self._own.close()
      self._own = None

  def __getattr__(self, name):  # encoding, isatty, fileno, buffer, ...: the terminal's
    return getattr(self.terminal, name)


class _ForeignRecords(logging.Filter):
  """On the `absl` logger: records from Orbax's threads are written to the log and go no further."""

  def __init__(self, sink: BackgroundOutput):
    super().__init__()
    self._sink = sink
    self._format = logging.Formatter("%(asctime)s %(levelname)s [%(threadName)s] %(message)s")

  def filter(self, record) -> bool:
    if not self._sink.foreign():
      return True
    self._sink.write(self._format.format(record) + "\n")
    return False


class _AsyncioRecords(logging.Filter):
  """On the `asyncio` logger from the first save on, for the life of the process: records go to the log of the
  latest Checkpointer's save.

  A failed write leaves Orbax's asyncio tasks and gather futures holding exceptions nobody retrieves; asyncio logs
  each, traceback and all, when garbage collection reaches it: in whichever thread that happens, and often only
  after close() (the save threads' event loops still hold them) or at interpreter exit, when the stderr router is
  long gone. meshtrain does not use asyncio, so its records are Orbax's.
  """

  def __init__(self):
    super().__init__()
    self.sink = None
    self._format = logging.Formatter("%(asctime)s %(levelname)s [%(threadName)s] %(message)s")

  def filter(self, record) -> bool:
    if self.sink is None:
      return True
    self.sink.write(self._format.format(record) + "\n")
    return False


_ASYNCIO_RECORDS = _AsyncioRecords()


@contextlib.contextmanager
def stderr_to(path: pathlib.Path, append: bool = False, keep_empty: bool = True):
  """Sends file descriptor 2 to `path`: a failed Orbax read makes it and TensorStore's threads print tracebacks,
  which belong in a log, not in the one-line error. With keep_empty=False an empty log is removed afterwards."""
  path.parent.mkdir(parents=True, exist_ok=True)
  sys.stderr.flush()
  saved = os.dup(2)
  with open(path, "a" if append else "w") as f:
    os.dup2(f.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
  if not keep_empty:
    with contextlib.suppress(OSError):
      if path.stat().st_size == 0:
        path.unlink()


@contextlib.contextmanager
def quiet_absl():
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)
