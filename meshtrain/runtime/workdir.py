"""One run per workdir: an exclusive OS lock on `WORKDIR/meshtrain.lock`, held by process 0 for the whole run.

Two runs writing one workdir destroy each other's checkpoints and metrics, and both still report success. The
lock is `flock(2)`, so it belongs to the open file and dies with the process: a run killed with `kill -9` leaves
the file behind but not the lock, and the next run takes it over. The file's content (host, pid, start time)
only names the holder in the refusal; it is never trusted as the lock itself.

On network file systems, Linux turns `flock` into a POSIX byte-range lock that the server arbitrates (NFSv4;
NFSv3 with lockd), so runs on different hosts exclude each other. A file system that refuses locks (Lustre
mounted without `-o flock`, some FUSE mounts) is reported, and the run does not start unprotected.
"""
import contextlib
import datetime
import errno
import fcntl
import os
import pathlib
import socket

import numpy as np
from jax.experimental import multihost_utils

from meshtrain.errors import UserError
from meshtrain.runtime import startup

LOCK_NAME = "meshtrain.lock"
# errno values of file systems that do not implement locking at all (as opposed to a lock held by someone).
NO_LOCKING = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


@contextlib.contextmanager
def exclusive(workdir: pathlib.Path, process_index: int = 0, process_count: int = 1, barrier_timeout_s: int = 1200):
  """Holds the workdir's lock for the duration of the block (process 0 takes it; with several processes all of
  them learn whether it did). Raises UserError at once, touching nothing else in the workdir, when another run
  holds it."""
  fd, problem = None, None
  if process_index == 0:
    try:
      fd = _acquire(pathlib.Path(workdir) / LOCK_NAME)
    except UserError as e:
      problem = e
  if process_count > 1:
    startup.barrier("the workdir lock", barrier_timeout_s)  # the broadcast below is the first collective
    # Every process must stop when process 0 is refused, rather than wait for it at the first collective.
    if not int(multihost_utils.broadcast_one_to_all(np.int32(problem is None))) and problem is None:
      problem = UserError(f"process 0 could not lock {pathlib.Path(workdir) / LOCK_NAME}; see its message")
  if problem:
    raise problem
  try:
    yield
  finally:
    if fd is not None:
      os.close(fd)  # releases the lock; the file stays (removing it would race with a run taking it over)


def _acquire(path: pathlib.Path) -> int:
  """An open descriptor of `path` holding an exclusive flock, with the holder's name written into the file."""
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  except OSError as e:
    raise UserError(f"cannot create the workdir lock {path}: {e.strerror or e}. Choose a --workdir on a writable "
                    "file system") from e
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    # Read through the same descriptor: opening the file a second time is harmless for flock, but not for the
    # POSIX locks NFS turns it into (closing any descriptor of a file drops them).
    held_by = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "a process that has not written its name yet"
    os.close(fd)
    if e.errno in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
      raise UserError(f"another run is using {path.parent}: it holds {path} ({held_by}). Two runs in one workdir "
                      "overwrite each other's checkpoints and metrics; wait for it to finish, stop it, or use "
                      "another --workdir") from None
    if e.errno in NO_LOCKING:
      raise UserError(f"the file system of {path.parent} does not support file locks ({e.strerror}), so meshtrain "
                      "cannot make sure no other run writes this workdir; use a workdir on a local disk or on NFS "
                      "with locking, or mount Lustre with -o flock") from e
    raise
  started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
  os.ftruncate(fd, 0)
  os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, started {started}\n".encode(), 0)
  return fd
