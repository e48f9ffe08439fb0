"""Orbax checkpoints: async, sharded, resumable onto any mesh, checked before they are trusted.

Each step directory `WORKDIR/checkpoints/<step>` holds two items: `state` (the sharded TrainState) and `meta`
(JSON: the data position and the resolved config). Orbax writes into a temporary directory and renames it
when complete, so a run that dies mid-save leaves no half step, and an earlier checkpoint is never touched.
Orbax does not notice a step directory that lost its commit marker or metadata; `damage()` does.

Integrity: the bytes a restore takes values from, and those that locate them, carry checksums verified as read.
- Array data: each chunk carries a checksum that TensorStore writes and verifies itself as it decodes the chunk:
  zstd's frame content checksum (XXH64 of the chunk, computed while compressing), or with ARRAY_CHECKSUM="crc32c"
  the Zarr v3 `crc32c` codec. A mismatch is a TensorStore error naming the array and chunk.
- The OCDBT manifests and B+tree nodes (which hold each array's `zarr.json`): TensorStore's own CRC-32C.
- The `meta` item: a SHA-256 of its content, stored in it under `integrity` and verified by `read_meta`.
Orbax's own JSON files (`state/_METADATA`: the tree structure; `_sharding`; `_CHECKPOINT_METADATA`) carry none: a
flipped bit there either fails the restore (reported as damage) or changes nothing restored; a sweep of random
flips found no third outcome. Orbax has no option for the array checksums; `_enable_array_checksums` adds the
codec to the Zarr v3 metadata Orbax builds. Checkpoints written before checksums (Zarr v2, no `integrity` in
meta) still restore, with a note that they are unverified.
"""
import contextlib
import functools
import gc
import hashlib
import json
import logging
import os
import pathlib
import re
import sys
import threading
import time

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

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
# zstd level of the arrays, as Orbax's Zarr v2 arrays (meshtrain's format before checksums) had it. Orbax's Zarr v3
# default is 3: on float32 weights and Adam moments it compresses no better and costs ~35% more CPU per byte
# (TensorStore writes of 0.4 GB of random float32: 1.10 s CPU at level 3, 0.80 s at level 1, 0.82 s for Zarr v2).
ZSTD_LEVEL = 1
# The checksum of every array chunk, both verified by TensorStore as it decodes the chunk: "zstd" (zstd's frame
# content checksum: the low 32 bits of an XXH64 of the chunk's bytes, computed while compressing; arrays stored
# without zstd get the crc32c) or "crc32c" (the Zarr v3 codec: a CRC-32C of the stored bytes). On the 124M model's
# 1.48 GB state, zstd's costs +1.7% commit and +0.3% restore time over no checksum, crc32c's +8% and +16%
# (experiments/checkpoint_checksum_overhead.py); both caught every flipped bit in array data.
ARRAY_CHECKSUM = "zstd"
INTEGRITY_KEY = "integrity"  # in the meta item: {"meta_sha256": ..., "arrays": ARRAY_CHECKSUM or None}


class CheckpointDamaged(Exception):
  """A checkpoint that fails a check; the message names what is wrong (an array, a checksum, a missing file)."""


class Checkpointer:
  def __init__(self, workdir: str | pathlib.Path, keep: int, barrier_timeout_s: int = 1200, checksums: bool = True):
    """`checksums=False` writes checkpoints exactly as meshtrain did before checksums (Zarr v2, no digests): for
    measuring their cost and testing that such checkpoints still restore."""
    self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
    _probe_writable(self.directory)
    self._in_flight = None  # the step of the last async save started: the one a late failure belongs to
    self._checksums = checksums
    self._array_checksums = _enable_array_checksums() if checksums else None  # "crc32c", "zstd" or None
    self._output = _BackgroundOutput(self.directory.parent / "diagnostics")
    ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
        min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_SLICE_BYTES), override=True)
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
    return _verified_meta(meta)

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
        with _stderr_to(log):
          try:
            restored = self.restore_state(step, abstract_state)
          except Exception as e:  # Orbax reports truncated or missing data files in many ways
            problem = f"{_restore_problem(e, self.directory / str(step))} (Orbax's own report: {log})"
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
        meta = {**meta, INTEGRITY_KEY: {"meta_sha256": _digest(meta), "arrays": self._array_checksums}}
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
    with _stderr_to(self._output.log_path(self._in_flight), append=True, keep_empty=False):
      self._manager.wait_until_finished()

  def _write_error(self, e) -> RunAborted:
    log = self._output.log_path(self._in_flight)
    report = f" Orbax's own report: {log}." if self._in_flight is not None and log.is_file() else ""
    return RunAborted(f"the checkpoint of step {self._in_flight} could not be written to "
                      f"{self.directory}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}. The run stopped rather "
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


def _verified_meta(meta) -> tuple[dict, dict | None]:
  """(meta without its integrity record, the record or None); CheckpointDamaged when its checksum fails."""
  if not isinstance(meta, dict):
    raise CheckpointDamaged(f"its meta item is not a JSON object but {type(meta).__name__}")
  integrity = meta.pop(INTEGRITY_KEY, None)
  if integrity is not None:
    stored = integrity.get("meta_sha256") if isinstance(integrity, dict) else None
    if stored != _digest(meta):
      raise CheckpointDamaged(f"its meta item fails its checksum (meta/metadata: stored sha256 {str(stored)[:16]}..., "
                              f"content {_digest(meta)[:16]}...)")
  return meta, integrity


def _digest(meta: dict) -> str:
  return hashlib.sha256(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _unused_name(path: pathlib.Path) -> pathlib.Path:
  """`path`, or `path.2`, `path.3`, ... if a step was damaged before under the same name: nothing is overwritten."""
  candidate, n = path, 1
  while candidate.exists():
    n += 1
    candidate = path.with_name(f"{path.name}.{n}")
  return candidate


# TensorStore names the array (Orbax's key) and chunk it failed to decode, e.g. `DATA_LOSS: Error reading shard
# entry {0, 0}/{1, 1} in "opt_state.1.0.mu.embedding/c/0/0" in OCDBT database at local file ".../state/": Digest
# mismatch, stored digest is 0x... but computed digest is 0x...` (crc32c), or `...: ZSTD_decompressStream()
# failed: Restored data doesn't match checksum` (zstd's checksum).
_CHUNK_FAILURE = re.compile(r'in "([^"]+?)/(c/[0-9/]+)" in OCDBT database at local file "[^"]*": (.*)')


def _restore_problem(error: BaseException, step_dir: pathlib.Path) -> str:
  """One line for a failed restore: which array (or file) fails its checksum, else TensorStore's or Orbax's reason."""
  chain, e = [], error
  while e is not None and e not in chain:
    chain.append(e)
    e = e.__cause__ or e.__context__
  # TensorStore's own status (`DATA_LOSS: ...`) says more than the Orbax exception wrapping it.
  status = next((str(e) for e in chain if re.match(r"[A-Z_]+: ", str(e)) or 'local file "' in str(e)), None)
  if status is None:
    lines = str(error).split(". See full TensorStore details")[0].splitlines()
    return f"restore failed: {type(error).__name__}: {lines[0][:300] if lines else '(no message)'}"
  status = status.split(" [tensorstore_spec=")[0].splitlines()[0]
  if m := _CHUNK_FAILURE.search(status):
    if re.search(r"checksum|digest mismatch", m[3], re.I):
      return f"array {m[1]} fails its checksum (chunk {m[2]}: {m[3][:120]})"
    return f"restore failed: array {m[1]} cannot be read (chunk {m[2]}: {m[3][:120]})"  # e.g. a truncated file
  files = re.findall(r'local file "([^"]+)"', status)
  where = files[-1].replace(f"{step_dir.parent}/", "") if files else "?"
  reason = status.rsplit('": ', 1)[-1][:200]
  if "checksum" in reason.lower():
    return f"{where} fails its checksum ({reason})"
  return f"restore failed: {where}: {reason}"


def _chunk_codecs(metadata: dict) -> list:
  """The codecs each chunk goes through: inside Orbax's `sharding_indexed` codec (one chunk per shard)."""
  codecs = metadata["codecs"]
  if codecs and codecs[0].get("name") == "sharding_indexed":
    return codecs[0]["configuration"]["codecs"]
  return codecs


def _checksum_of(codecs: list) -> str | None:
  """Which checksum the chunk codecs carry: "crc32c", "zstd" (zstd's content checksum) or None."""
  if any(c.get("name") == "crc32c" for c in codecs):
    return "crc32c"
  if any(c.get("name") == "zstd" and c.get("configuration", {}).get("checksum") for c in codecs):
    return "zstd"
  return None


def _enable_array_checksums() -> str | None:
  """Makes every Zarr v3 array Orbax writes carry a checksum on each chunk (ARRAY_CHECKSUM); returns which, or None.

  TensorStore computes it when it encodes a chunk and checks it when it decodes one (a mismatch is a DATA_LOSS
  error naming the array), and Orbax reads the codecs from each array's stored `zarr.json`, so restoring needs
  nothing. Orbax 0.12 builds the codec list in one function without an option for it: this wraps that function
  (once per process; it also sets the zstd level, see ZSTD_LEVEL) and checks the result. Another Orbax without that
  function gets no array checksums and a warning.
  """
  try:
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
    build = ts_utils._build_zarr3_metadata
  except (ImportError, AttributeError):
    build = ts_utils = None
  if build is not None and not getattr(build, "meshtrain_checksum", False):
    @functools.wraps(build)
    def with_checksum(*args, **kwargs):
      metadata = build(*args, **kwargs)
      codecs = _chunk_codecs(metadata)
      zstd = next((c for c in codecs if c.get("name") == "zstd"), None)
      if zstd is not None:  # Orbax's Zarr v2 arrays used level 1; its v3 default, 3, costs more CPU
        zstd.setdefault("configuration", {})["level"] = ZSTD_LEVEL
      kind = ARRAY_CHECKSUM if ARRAY_CHECKSUM != "zstd" or zstd is not None else "crc32c"  # no zstd: crc32c
      if kind == "zstd":
        zstd["configuration"]["checksum"] = True
      elif kind == "crc32c" and _checksum_of(codecs) != "crc32c":
        codecs.append({"name": "crc32c"})  # last: over the compressed bytes, as they are on disk
      return metadata
    with_checksum.meshtrain_checksum = True
    ts_utils._build_zarr3_metadata = with_checksum
  try:
    built = ts_utils._build_zarr_shard_and_chunk_metadata(global_shape=(4,), shard_shape=(4,), use_zarr3=True,
                                                          chunk_shape=(4,))[0]
    kind = _checksum_of(_chunk_codecs(built))
  except Exception:
    kind = None
  if kind is None and jax.process_index() == 0:
    print(f"warning: checkpoint arrays are written without checksums: meshtrain could not add them to the Zarr v3 "
          f"metadata of this Orbax ({ocp.__version__}; it hooks tensorstore_utils._build_zarr3_metadata). The meta "
          "item is still checksummed", file=sys.stderr, flush=True)
  return kind


class _BackgroundOutput:
  """Routes what Orbax's save threads print to `diagnostics/save-step<N>-process<I>.log`, not the terminal.

  A failed async write makes Orbax's threads log the error with tracebacks, and TensorStore's callbacks print one
  `Event loop is closed` traceback per pending write: hundreds of lines, while training goes on and the progress
  bar shares stderr, so file descriptor 2 cannot simply be redirected as during a restore (`_stderr_to`). Writes
  to `sys.stderr` and records of the `absl` logger (Orbax's) from any thread but the main thread and meshtrain's
  own (`meshtrain-*`: the watchdog, the data prefetcher) go to the log of the step being saved; the log file is
  created only when something is written. The main thread's waits for a save use `_stderr_to` on the same file.
  """

  def __init__(self, directory: pathlib.Path):
    self.directory = directory
    self.step = None
    self._lock = threading.Lock()
    self._files = {}
    self._router = self._filter = None

  def log_path(self, step) -> pathlib.Path:
    return self.directory / f"save-step{step}-process{jax.process_index()}.log"

  @staticmethod
  def foreign() -> bool:
    thread = threading.current_thread()
    return thread is not threading.main_thread() and not thread.name.startswith("meshtrain")

  def write(self, text: str) -> int:
    with self._lock:
      step = self.step
      if step not in self._files:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._files[step] = open(self.log_path(step), "a")
      self._files[step].write(text)
      self._files[step].flush()
    return len(text)

  def install(self) -> None:
    if self._router is not None:
      return
    self._router = _StderrRouter(sys.stderr, self)
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
        f.close()
      self._files.clear()


class _StderrRouter:
  """Stands in for sys.stderr: other threads' writes go to the log, the rest to a duplicate of the terminal's
  descriptor (so the watchdog's message still reaches the terminal while fd 2 is sent to a log)."""

  def __init__(self, stderr, sink: _BackgroundOutput):
    self.terminal, self._sink, self._own = stderr, sink, None
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

  def __init__(self, sink: _BackgroundOutput):
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
def _stderr_to(path: pathlib.Path, append: bool = False, keep_empty: bool = True):
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


def checkpoint_steps(workdir) -> list[int]:
  """The complete checkpoint steps under WORKDIR/checkpoints (every marker and metadata file there), oldest first."""
  directory = pathlib.Path(workdir).expanduser().absolute() / "checkpoints"
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir()
                if p.name.isdigit() and all((p / name).is_file() for name in REQUIRED))


def run_meta(workdir_arg: str, step: int | None, what: str) -> tuple[int, dict]:
  """(step, meta item) of the checkpoint at `step` (default: the newest) of the workdir `workdir_arg` names, read as
  plain JSON (no JAX), so an entry point can still set the device count and XLA flags from the run's config.
  `what` completes the message for a workdir without checkpoints ("pass the directory of ...")."""
  workdir = pathlib.Path(workdir_arg).expanduser()
  steps = checkpoint_steps(workdir)
  if not steps:
    raise UserError(f"--workdir {workdir_arg}: " + ("no such directory" if not workdir.is_dir() else
                    "no complete checkpoint in it") + f"; pass the directory of {what}")
  if step is not None and step not in steps:
    raise UserError(f"--step {step}: {workdir_arg} has checkpoints at steps {', '.join(map(str, steps))}")
  step = step if step is not None else steps[-1]
  meta_path = workdir / "checkpoints" / str(step) / "meta" / "metadata"
  try:
    meta = json.loads(meta_path.read_text())
    meta["config"]  # pylint: disable=pointless-statement
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise UserError(f"cannot read the run's config from {meta_path}: {e}") from e
  return step, meta


def task_of(meta: dict) -> str:
  """The task a checkpoint was trained for; checkpoints from before tasks existed are language models."""
  return meta.get("task", meta["config"].get("task", "lm"))


def load_params(workdir, step: int | None = None, mesh=None, shardings=None, rules=None):
  """The parameters saved in `workdir` at `step` (default: the newest), and that checkpoint's meta item.

  Only the `params` subtree of the `state` item is read (a partial restore: no optimizer state is touched), from a
  trained run (a TrainState) or a converted one (`{"params": ...}`, meta `params_only`). With `mesh=None` the
  leaves are numpy arrays on the host; with a mesh they are jax Arrays split by the model's logical rules (`rules`,
  default the `fsdp_tp` preset: whatever fsdp and tensor axes the mesh has split the weights, other axes
  replicate them), or by `shardings`, a tree of Shardings like the params. Any mesh or device count works:
  Orbax is told the target of every array, so it never needs the topology that wrote them (a plain
  `StandardCheckpointer().restore(.../state)` does, and fails on another one with "Topology mismatch").
  Missing checkpoints or a step that is not there: UserError.
  """
  source = _ParamsSource(workdir, step)
  if mesh is None and shardings is None:
    return source.restore(source.stored), source.meta
  if shardings is None:
    shardings = _param_shardings(source.meta, mesh, rules, source.stored, source.workdir, source.step)
  target = jax.tree.map(lambda m, s: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=s), source.stored, shardings)
  return source.restore(target, ocp.checkpoint_utils.construct_restore_args(target)), source.meta


def param_reader(workdir, step: int | None = None):
  """(meta, stored, read) for reading parameters one at a time, as load_params reads them all (same checks, same
  errors): `stored` is the params' tree of Orbax metadata (`.shape`, `.dtype` per leaf) and `read(path)` restores
  the one parameter at `path` (a tuple of keys) as a numpy array. A model larger than memory can be exported
  this way holding one array at a time."""
  source = _ParamsSource(workdir, step)

  def read(path: tuple):
    leaf = source.stored
    for key in path:
      leaf = leaf[key]
    for key in reversed(path):  # the subtree holding only `leaf`: Orbax restores nothing else (partial restore)
      leaf = {key: leaf}
    node = source.restore(leaf)
    for key in path:
      node = node[key]
    return node

  return source.meta, source.stored, read


class _ParamsSource:
  """The checkpoint load_params and param_reader read: step directory, verified meta item, and the metadata of
  the stored params (found before any array is read, so a wrong workdir or step costs no restore)."""

  def __init__(self, workdir, step: int | None):
    workdir = pathlib.Path(workdir).expanduser().absolute()
    steps = checkpoint_steps(workdir)
    if not steps:
      what = "no such directory" if not workdir.is_dir() else "no complete checkpoint in its checkpoints/ directory"
      raise UserError(f"cannot load parameters from {workdir}: {what}; pass the --workdir of a training run (or of "
                      "python -m meshtrain.convert from-hf)")
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise UserError(f"{workdir} has no complete checkpoint at step {step}; it has steps "
                      f"{', '.join(map(str, steps))}")
    step_dir = workdir / "checkpoints" / str(step)
    try:
      meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(step_dir / "meta")
      meta, _ = _verified_meta(meta)
    except CheckpointDamaged as e:
      raise UserError(f"the checkpoint at step {step} ({step_dir}) is damaged: {e}") from e
    if meta.get("layer_order", "sequential") != "sequential":
      raise UserError(f"the checkpoint at step {step} in {workdir} stores its layers in {meta['layer_order']} "
                      "order (a circular pipeline's); load it in a run with the same pipeline settings instead")
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    try:
      with _quiet_absl():  # reading an item on its own, Orbax warns that the step's own metadata file is not its
        stored = checkpointer.metadata(step_dir / "state").item_metadata.tree
    finally:
      checkpointer.close()
    if not isinstance(stored, dict) or "params" not in stored:
      raise UserError(f"the checkpoint at step {step} in {workdir} holds no params (its state has "
                      f"{sorted(stored) if isinstance(stored, dict) else type(stored).__name__})")
    self.workdir, self.step, self.step_dir, self.meta, self.stored = workdir, step, step_dir, meta, stored["params"]

  def restore(self, target, restore_args=None):
    """The params in `target` (a subtree of `stored`, or ShapeDtypeStructs with shardings and their
    `restore_args`); numpy arrays on the host when no restore_args are given."""
    import numpy as np
    if restore_args is None:
      restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
      target = jax.tree.map(lambda m: np.empty(m.shape, m.dtype), target)  # never touched: no memory
    log = self.workdir / "diagnostics" / f"load-params-step{self.step}-process{jax.process_index()}.log"
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    try:
      with _stderr_to(log, keep_empty=False), _quiet_absl():
        restored = checkpointer.restore(self.step_dir / "state", args=ocp.args.PyTreeRestore(
            {"params": target}, restore_args={"params": restore_args}, partial_restore=True))
    except Exception as e:
      raise UserError(f"the checkpoint at step {self.step} ({self.step_dir}) cannot be read: "
                      f"{_restore_problem(e, self.step_dir)} (Orbax's own report: {log})") from e
    finally:
      checkpointer.close()
    return restored["params"]


@contextlib.contextmanager
def _quiet_absl():
  logger = logging.getLogger("absl")
  level = logger.level
  logger.setLevel(logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


def _param_shardings(meta: dict, mesh, rules, stored, workdir, step):
  """NamedShardings of the checkpoint's params on `mesh`, from the model's logical axis names and the rules."""
  import flax.linen as nn
  import jax.numpy as jnp
  from meshtrain import sharding
  from meshtrain.models.llama import ModelConfig, Transformer
  model_cfg = ModelConfig.from_config(meta["config"]["model"])
  boxed = jax.eval_shape(Transformer(model_cfg).init, jax.random.key(0), jax.ShapeDtypeStruct((1, 1), jnp.int32))
  boxed = boxed["params"]
  expected = {jax.tree_util.keystr(p): tuple(a.shape) for p, a in jax.tree_util.tree_leaves_with_path(
      nn.meta.unbox(boxed))}
  found = {jax.tree_util.keystr(p): tuple(m.shape) for p, m in jax.tree_util.tree_leaves_with_path(stored)}
  if expected != found:
    diff = sorted(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
    raise UserError(f"the params at step {step} in {workdir} do not match the model in its own config: "
                    + "; ".join(f"{k}: config {expected.get(k)}, stored {found.get(k)}" for k in diff[:4]))
  rules = sharding.for_mesh(rules or sharding.rules_for("fsdp_tp"), mesh)
  sharding.param_table(boxed, mesh, rules)  # a dimension the mesh cannot split evenly is named (UserError)
  return sharding.shardings_of(boxed, mesh, rules)
