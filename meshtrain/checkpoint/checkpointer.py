"""Orbax checkpoints: async, sharded, resumable onto any mesh, checked before they are trusted.

Each step directory `WORKDIR/checkpoints/<step>` holds two items: `state` (the sharded TrainState) and `meta`
(JSON: the data position and the resolved config). Orbax writes into a temporary directory and renames it
when complete, so a run that dies mid-save leaves no half step, and an earlier checkpoint is never touched.
Orbax does not notice a step directory that lost its commit marker or metadata; `damage()` does. The checksums
each checkpoint carries: meshtrain/checkpoint/integrity.py.
"""
import gc
import logging
import os
import pathlib
import re
import time

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from meshtrain.checkpoint.integrity import (
  INTEGRITY_KEY,
  CheckpointDamaged,
  digest,
  enable_array_checksums,
  restore_problem,
  verified_meta,
)
from meshtrain.checkpoint.orbax_output import BackgroundOutput, stderr_to
from meshtrain.errors import RunAborted, UserError

# Files every complete step directory has (local file systems; Orbax writes them last or renames into place).
REQUIRED = ("_CHECKPOINT_METADATA", "commit_success.txt", "state/_METADATA", "state/manifest.ocdbt",
            "state/commit_success.txt", "meta/metadata")
DAMAGED_SUFFIX = ".damaged"  # Orbax only lists integer-named directories, so renamed ones are out of its way
DAMAGED_NAME = re.compile(r"^(\d+)\.damaged(\.\d+)?$")  # `12.damaged`, or `12.damaged.2` when step 12 failed twice
# Orbax splits the saving of a replicated array between its replicas by slicing it on device, one small compiled
# program per shape and replica: for small arrays that costs more than it saves (4 s of the first save of a tiny
# model on 8 CPU devices). Only arrays whose per-replica slice is at least this big are split.
REPLICA_PARALLEL_MIN_SLICE_BYTES = 16 << 20


def register_handler(kind, handler) -> None:
  """Orbax's register_type_handler(override=True), without its warning that it overrides (which is the point), printed
  on every command's terminal otherwise."""
  expected = logging.Filter()
  expected.filter = lambda record: not record.getMessage().startswith("Type handler registry type")
  logger = logging.getLogger("absl")
  logger.addFilter(expected)
  try:
    ocp.type_handlers.register_type_handler(kind, handler, override=True)
  finally:
    logger.removeFilter(expected)


class Checkpointer:
  def __init__(self, workdir: str | pathlib.Path, keep: int, barrier_timeout_s: int = 1200, checksums: bool = True):
    """`checksums=False` writes checkpoints exactly as meshtrain did before checksums (Zarr v2, no digests): for
    measuring their cost and testing that such checkpoints still restore."""
    self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
    _probe_writable(self.directory)
    self._in_flight = None  # the step of the last async save started: the one a late failure belongs to
    self._checksums = checksums
    self._array_checksums = enable_array_checksums() if checksums else None  # "crc32c", "zstd" or None
    self._output = BackgroundOutput(self.directory.parent / "diagnostics")
    register_handler(jax.Array, ocp.type_handlers.ArrayHandler(
        min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_SLICE_BYTES))
    # Zarr v3 is what carries the chunk checksums; StandardCheckpointHandler always writes v2. Restoring reads the
    # format from each checkpoint's own metadata, so either handler reads both.
    state_handler = ocp.PyTreeCheckpointHandler(use_zarr3=True) if checksums else ocp.StandardCheckpointHandler()
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True,
                                             async_options=ocp.AsyncOptions(timeout_secs=barrier_timeout_s)),
        item_handlers={"state": state_handler, "meta": ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def damage(self, step: int) -> str | None:
    """What is missing from the step directory, or None if every marker and metadata file is there."""
    missing = [name for name in REQUIRED if not (self.directory / str(step) / name).is_file()]
    return f"missing {', '.join(missing)}" if missing else None

  def damaged_directories(self) -> list[str]:
    """The `<step>.damaged` directories kept from earlier fallbacks, newest step first."""
    found = [p.name for p in self.directory.iterdir() if p.is_dir() and DAMAGED_NAME.match(p.name)]
    return sorted(found, key=lambda name: (-int(DAMAGED_NAME.match(name)[1]), name))

  def read_meta(self, step: int) -> dict:
    """The meta item, checksum verified (CheckpointDamaged on a mismatch); without its `integrity` record."""
    return self._read_meta(step)[0]

  def _read_meta(self, step: int) -> tuple[dict, dict | None]:
    """(meta, integrity record or None for a checkpoint written before checksums)."""
    meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    return verified_meta(meta)

  def restore_state(self, step: int, abstract_state):
    """Restores onto the shardings carried by `abstract_state` (ShapeDtypeStructs): any mesh, any device count."""
    if self._checksums:
      args = ocp.args.PyTreeRestore(abstract_state, restore_args=ocp.checkpoint_utils.construct_restore_args(
          abstract_state))
    else:
      args = ocp.args.StandardRestore(abstract_state)
    return self._manager.restore(step, args=ocp.args.Composite(state=args))["state"]

  def restore_latest(self, abstract_state, fallback: bool, check_meta) -> tuple[int | None, object, dict | None]:
    """(step, state, meta) of the newest usable checkpoint, or (None, None, None) in a workdir without checkpoints.

    A damaged newest checkpoint (a missing file, a checksum that does not match, data Orbax cannot read) is an
    error naming the step and the damage, unless `fallback`: then its directory is renamed `<step>.damaged` (kept
    for inspection, never deleted) and the next older one is tried. A workdir that holds checkpoints of which none
    is usable (all renamed now or by an earlier fallback) is an error too: starting over at step 0 there would
    silently replace the run's history.
    `check_meta(step, meta)` may refuse a checkpoint (e.g. another model shape) by raising UserError.
    """
    renamed = []
    while (step := self.latest_step()) is not None:
      problem, integrity = self.damage(step), None
      if problem is None:
        try:
          meta, integrity = self._read_meta(step)
        except CheckpointDamaged as e:
          problem = str(e)
        except Exception as e:
          meta, problem = None, f"its meta item cannot be read ({type(e).__name__}: {str(e)[:200]})"
      if problem is None:
        check_meta(step, meta)
        log = self.directory.parent / "diagnostics" / f"restore-step{step}-process{jax.process_index()}.log"
        with stderr_to(log):
          try:
            restored = self.restore_state(step, abstract_state)
          except Exception as e:  # Orbax reports truncated or missing data files in many ways
            problem = f"{restore_problem(e, self.directory / str(step))} (Orbax's own report: {log})"
          if problem:
            # The failed read leaves sibling reads behind whose errors nobody retrieves: let them finish and be
            # collected now, while their tracebacks still go to the log.
            time.sleep(0.5)
            gc.collect()
        if problem is None:
          log.unlink()
          if jax.process_index() == 0 and not (integrity or {}).get("arrays"):
            print(f"note: the checkpoint at step {step} has no checksums (written before meshtrain added them"
                  + (")" if integrity is None else ", by an Orbax without the hook for them)")
                  + "; restored unverified", flush=True)
          return step, restored, meta
      where = self.directory / str(step)
      if not fallback:
        raise UserError(f"the checkpoint at step {step} ({where}) is damaged: {problem}. To resume from the previous "
                        f"good checkpoint, rerun with --config.checkpoint_fallback=true (the damaged directory is "
                        f"kept, renamed to {step}{DAMAGED_SUFFIX})")
      if jax.process_index() == 0:
        target = _unused_name(where.with_name(f"{step}{DAMAGED_SUFFIX}"))
        where.rename(target)
        print(f"checkpoint at step {step} is damaged ({problem}); renamed it to {target.name} and falling "
              f"back to the previous one", flush=True)
      renamed.append(step)
      multihost_utils.sync_global_devices(f"meshtrain fallback from {step}")
      self._manager.reload()
    if damaged := self.damaged_directories():
      raise UserError(
          f"no usable checkpoint in {self.directory}: {len(damaged)} damaged ("
          + (f"renamed now: {', '.join(map(str, renamed))}; " if renamed else "")
          + f"kept as {', '.join(damaged)}). Not starting over at step 0, which would replace this run's metrics and "
          f"checkpoints. To start over deliberately, rerun with a new --workdir, or move the .damaged directories out "
          f"of {self.directory} (they are never deleted by meshtrain)")
    return None, None, None

  def save(self, step: int, state, meta: dict) -> None:
    """Starts an async save; returns once the device arrays are copied out, so training continues meanwhile."""
    self._output.install()  # from here on, what Orbax's save threads print goes to diagnostics/, not the terminal
    try:
      self._wait()  # a failure of the previous async save surfaces here, under its step
      self._in_flight = self._output.step = step
      if self._checksums:
        meta = {**meta, INTEGRITY_KEY: {"meta_sha256": digest(meta), "arrays": self._array_checksums}}
      state_args = ocp.args.PyTreeSave(state) if self._checksums else ocp.args.StandardSave(state)
      self._manager.save(step, args=ocp.args.Composite(state=state_args, meta=ocp.args.JsonSave(meta)), force=True)
    except Exception as e:
      raise self._write_error(e) from e

  def wait(self) -> None:
    """Blocks until the save in flight is committed; a write failure becomes a RunAborted naming its step."""
    try:
      self._wait()
    except Exception as e:
      raise self._write_error(e) from e

  def _wait(self) -> None:
    if self._in_flight is None:
      return self._manager.wait_until_finished()
    # Orbax logs a failed save again, traceback and all, from the waiting thread: that goes to the step's log too.
    with stderr_to(self._output.log_path(self._in_flight), append=True, keep_empty=False):
      self._manager.wait_until_finished()

  def _write_error(self, e) -> RunAborted:
    log = self._output.log_path(self._in_flight)
    report = f" Orbax's own report: {log}." if self._in_flight is not None and log.is_file() else ""
    return RunAborted(f"the checkpoint of step {self._in_flight} could not be written to {self.directory}: "
                      f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}. The run stopped rather "
                      f"than continue unsaved; earlier checkpoints are intact (latest committed: "
                      f"{self._latest_complete()}).{report} Free space or fix the directory, then rerun to resume")

  def _latest_complete(self) -> str:
    steps = [int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and self.damage(int(p.name)) is None]
    return str(max(steps)) if steps else "none"

  def close(self) -> None:
    try:
      self._manager.close()
    finally:
      self._output.uninstall()


def _unused_name(path: pathlib.Path) -> pathlib.Path:
  """`path`, or `path.2`, `path.3`, ... if a step was damaged before under the same name: nothing is overwritten."""
  candidate, n = path, 1
  while candidate.exists():
    n += 1
    candidate = path.with_name(f"{path.name}.{n}")
  return candidate


def _probe_writable(directory: pathlib.Path) -> None:
  """Fails at start, not at the first save an hour later, when the checkpoint directory cannot be written."""
  probe = directory / f".write-probe-{jax.process_index()}-{os.getpid()}"
  try:
    directory.mkdir(parents=True, exist_ok=True)
    probe.write_bytes(b"meshtrain")
    probe.unlink()
  except OSError as e:
    raise UserError(f"cannot write checkpoints to {directory}: {e.strerror or e}. Choose a --workdir on a writable "
                    "file system with free space") from e
