"""Orbax checkpoints: async, sharded, resumable onto any mesh, checked before they are trusted.

Each step directory `WORKDIR/checkpoints/<step>` holds two items: `state` (the sharded TrainState) and `meta`
(JSON: the data position and the resolved config). Orbax writes into a temporary directory and renames it
when complete, so a run that dies mid-save leaves no half step, and an earlier checkpoint is never touched.
Orbax does not notice a step directory that lost its commit marker or metadata; `damage()` does.
"""
import contextlib
import gc
import os
import pathlib
import sys
import time

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from meshtrain.errors import RunAborted, UserError

# Files every complete step directory has (local file systems; Orbax writes them last or renames into place).
REQUIRED = ("_CHECKPOINT_METADATA", "commit_success.txt", "state/_METADATA", "state/manifest.ocdbt",
            "state/commit_success.txt", "meta/metadata")
DAMAGED_SUFFIX = ".damaged"  # Orbax only lists integer-named directories, so renamed ones are out of its way
# Orbax splits the saving of a replicated array between its replicas by slicing it on device, one small compiled
# program per shape and replica: for small arrays that costs more than it saves (4 s of the first save of a tiny
# model on 8 CPU devices). Only arrays whose per-replica slice is at least this big are split.
REPLICA_PARALLEL_MIN_SLICE_BYTES = 16 << 20


class Checkpointer:
  def __init__(self, workdir: str | pathlib.Path, keep: int, barrier_timeout_s: int = 1200):
    self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
    _probe_writable(self.directory)
    self._in_flight = None  # the step of the last async save started: the one a late failure belongs to
    ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
        min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_SLICE_BYTES), override=True)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True,
                                             async_options=ocp.AsyncOptions(timeout_secs=barrier_timeout_s)),
        item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def damage(self, step: int) -> str | None:
    """What is missing from the step directory, or None if every marker and metadata file is there."""
    missing = [name for name in REQUIRED if not (self.directory / str(step) / name).is_file()]
    return f"missing {', '.join(missing)}" if missing else None

  def read_meta(self, step: int) -> dict:
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def restore_state(self, step: int, abstract_state):
    """Restores onto the shardings carried by `abstract_state` (ShapeDtypeStructs): any mesh, any device count."""
    return self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))["state"]

  def restore_latest(self, abstract_state, fallback: bool, check_meta) -> tuple[int | None, object, dict | None]:
    """(step, state, meta) of the newest usable checkpoint, or (None, None, None) if there is none.

    A damaged newest checkpoint is an error naming the step and the damage, unless `fallback`: then its
    directory is renamed `<step>.damaged` (kept for inspection, never deleted) and the next older one is tried.
    `check_meta(step, meta)` may refuse a checkpoint (e.g. another model shape) by raising UserError.
    """
    while (step := self.latest_step()) is not None:
      problem = self.damage(step)
      if problem is None:
        try:
          meta = self.read_meta(step)
        except Exception as e:
          meta, problem = None, f"its meta item cannot be read ({type(e).__name__}: {str(e)[:200]})"
      if problem is None:
        check_meta(step, meta)
        log = self.directory.parent / "diagnostics" / f"restore-step{step}-process{jax.process_index()}.log"
        with _stderr_to(log):
          try:
            restored = self.restore_state(step, abstract_state)
          except Exception as e:  # Orbax reports truncated or missing data files in many ways
            problem = (f"restore failed: {str(e).split('. See full TensorStore details')[0].splitlines()[0][:300]}"
                       f" (Orbax's own report: {log})")
          if problem:
            # The failed read leaves sibling reads behind whose errors nobody retrieves: let them finish and be
            # collected now, while their tracebacks still go to the log.
            time.sleep(0.5)
            gc.collect()
        if problem is None:
          log.unlink()
          return step, restored, meta
      where = self.directory / str(step)
      if not fallback:
        raise UserError(f"the checkpoint at step {step} ({where}) is damaged: {problem}. To resume from the previous "
                        f"good checkpoint, rerun with --config.checkpoint_fallback=true (the damaged directory is "
                        f"kept, renamed to {step}{DAMAGED_SUFFIX})")
      if jax.process_index() == 0:
        where.rename(where.with_name(f"{step}{DAMAGED_SUFFIX}"))
        print(f"checkpoint at step {step} is damaged ({problem}); renamed it to {step}{DAMAGED_SUFFIX} and falling "
              f"back to the previous one", flush=True)
      multihost_utils.sync_global_devices(f"meshtrain fallback from {step}")
      self._manager.reload()
    return None, None, None

  def save(self, step: int, state, meta: dict) -> None:
    """Starts an async save; returns once the device arrays are copied out, so training continues meanwhile."""
    try:
      self._manager.wait_until_finished()  # a failure of the previous async save surfaces here, under its step
      self._in_flight = step
      self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                       meta=ocp.args.JsonSave(meta)), force=True)
    except Exception as e:
      raise self._write_error(e) from e

  def wait(self) -> None:
    """Blocks until the save in flight is committed; a write failure becomes a RunAborted naming its step."""
    try:
      self._manager.wait_until_finished()
    except Exception as e:
      raise self._write_error(e) from e

  def _write_error(self, e) -> RunAborted:
    return RunAborted(f"the checkpoint of step {self._in_flight} could not be written to "
                      f"{self.directory}: {type(e).__name__}: {str(e).splitlines()[0][:300]}. The run stopped rather "
                      f"than continue unsaved; earlier checkpoints are intact (latest committed: "
                      f"{self._latest_complete()}). Free space or fix the directory, then rerun to resume")

  def _latest_complete(self) -> str:
    steps = [int(p.name) for p in self.directory.iterdir() if p.name.isdigit() and self.damage(int(p.name)) is None]
    return str(max(steps)) if steps else "none"

  def close(self) -> None:
    self._manager.close()


@contextlib.contextmanager
def _stderr_to(path: pathlib.Path):
  """Sends file descriptor 2 to `path`: a failed Orbax read makes it and TensorStore's threads print tracebacks,
  which belong in a log, not in the one-line error."""
  path.parent.mkdir(parents=True, exist_ok=True)
  sys.stderr.flush()
  saved = os.dup(2)
  with open(path, "w") as f:
    os.dup2(f.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)


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


def check_compatible(saved_config: dict, model_cfg, shape_fields: tuple[str, ...], step: int, directory) -> None:
  """A checkpoint of another model shape cannot be resumed: name every differing field before anything runs."""
  saved_model = saved_config.get("model", {})
  diffs = [f"model.{k}: checkpoint {saved_model.get(k)!r}, this run {model_cfg[k]!r}"
           for k in shape_fields if saved_model.get(k) != model_cfg[k]]
  if diffs:
    raise UserError(f"the checkpoint at step {step} in {directory} was written by a different model shape:\n  "
                    + "\n  ".join(diffs) + "\nuse the same model settings to resume, or a new --workdir to start over")
