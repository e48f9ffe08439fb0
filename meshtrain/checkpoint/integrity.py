"""Checksums of checkpoints: the bytes a restore takes values from, and those that locate them, are verified as read.

- Array data: each chunk carries a checksum that TensorStore writes and verifies itself as it decodes the chunk:
  zstd's frame content checksum (XXH64 of the chunk, computed while compressing), or with ARRAY_CHECKSUM="crc32c"
  the Zarr v3 `crc32c` codec. A mismatch is a TensorStore error naming the array and chunk.
- The OCDBT manifests and B+tree nodes (which hold each array's `zarr.json`): TensorStore's own CRC-32C.
- The `meta` item: a SHA-256 of its content (`digest`), stored in it under `integrity` and verified by
  `verified_meta`.
Orbax's own JSON files (`state/_METADATA`: the tree structure; `_sharding`; `_CHECKPOINT_METADATA`) carry none: a
flipped bit there either fails the restore (reported as damage) or changes nothing restored; a sweep of random
flips found no third outcome. Orbax has no option for the array checksums; `enable_array_checksums` adds the
codec to the Zarr v3 metadata Orbax builds. Checkpoints written before checksums (Zarr v2, no `integrity` in
meta) still restore, with a note that they are unverified.
"""
import functools
import hashlib
import json
import pathlib
import re
import sys

import jax
import orbax.checkpoint as ocp

try:  # Orbax's own (private) module that builds each array's codecs: what enable_array_checksums wraps
  from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
except ImportError:  # another Orbax: no array checksums, and enable_array_checksums says so
  ts_utils = None

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


def verified_meta(meta) -> tuple[dict, dict | None]:
  """(meta without its integrity record, the record or None); CheckpointDamaged when its checksum fails."""
  if not isinstance(meta, dict):
    raise CheckpointDamaged(f"its meta item is not a JSON object but {type(meta).__name__}")
  integrity = meta.pop(INTEGRITY_KEY, None)
  if integrity is not None:
    stored = integrity.get("meta_sha256") if isinstance(integrity, dict) else None
    if stored != digest(meta):
      raise CheckpointDamaged(f"its meta item fails its checksum (meta/metadata: stored sha256 {str(stored)[:16]}..., "
                              f"content {digest(meta)[:16]}...)")
  return meta, integrity


def digest(meta: dict) -> str:
  return hashlib.sha256(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# TensorStore names the array (Orbax's key) and chunk it failed to decode, e.g. `DATA_LOSS: Error reading shard
# entry {0, 0}/{1, 1} in "opt_state.1.0.mu.embedding/c/0/0" in OCDBT database at local file ".../state/": Digest
# mismatch, stored digest is 0x... but computed digest is 0x...` (crc32c), or `...: ZSTD_decompressStream()
# failed: Restored data doesn't match checksum` (zstd's checksum).
_CHUNK_FAILURE = re.compile(r'in "([^"]+?)/(c/[0-9/]+)" in OCDBT database at local file "[^"]*": (.*)')


def restore_problem(error: BaseException, step_dir: pathlib.Path) -> str:
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


def chunk_codecs(metadata: dict) -> list:
  """The codecs each chunk goes through: inside Orbax's `sharding_indexed` codec (one chunk per shard)."""
  codecs = metadata["codecs"]
  if codecs and codecs[0].get("name") == "sharding_indexed":
    return codecs[0]["configuration"]["codecs"]
  return codecs


def checksum_of(codecs: list) -> str | None:
  """Which checksum the chunk codecs carry: "crc32c", "zstd" (zstd's content checksum) or None."""
  if any(c.get("name") == "crc32c" for c in codecs):
    return "crc32c"
  if any(c.get("name") == "zstd" and c.get("configuration", {}).get("checksum") for c in codecs):
    return "zstd"
  return None


# Where Orbax builds an array's Zarr metadata (in tensorstore_utils), by version: 0.12.8 (the newest this was
# checked on), a private function for Zarr v3 alone; 0.12.4 (what the GPU machine has), one public function for v2
# and v3. Each is called by its module-level name, so replacing the module attribute reaches every array.
# (function name, a probe that builds a small array's Zarr v3 metadata with it)
BUILDERS = (
    ("_build_zarr3_metadata", lambda: ts_utils._build_zarr_shard_and_chunk_metadata(
        global_shape=(4,), shard_shape=(4,), use_zarr3=True, chunk_shape=(4,))[0]),
    ("build_zarr_shard_and_chunk_metadata", lambda: ts_utils.build_zarr_shard_and_chunk_metadata(
        global_shape=(4,), shard_shape=(4,), use_zarr3=True, chunk_shape=(4,))),
)


def enable_array_checksums() -> str | None:
  """Makes every Zarr v3 array Orbax writes carry a checksum on each chunk (ARRAY_CHECKSUM); returns which, or None.

  TensorStore computes it when it encodes a chunk and checks it when it decodes one (a mismatch is a DATA_LOSS
  error naming the array), and Orbax reads the codecs from each array's stored `zarr.json`, so restoring needs
  nothing. Orbax builds the codec list in one function without an option for it (BUILDERS): this wraps that
  function (once per process; it also sets the zstd level, see ZSTD_LEVEL) and checks the result. An Orbax with
  neither function gets no array checksums and a warning.
  """
  name, probe = next(((n, p) for n, p in BUILDERS if hasattr(ts_utils, n)), (None, None))
  build = getattr(ts_utils, name) if name else None
  if build is not None and not getattr(build, "meshtrain_checksum", False):
    @functools.wraps(build)
    def with_checksum(*args, **kwargs):
      metadata = build(*args, **kwargs)
      if "codecs" not in metadata:  # Zarr v2 (the older function builds both): no codec list to extend
        return metadata
      codecs = chunk_codecs(metadata)
      zstd = next((c for c in codecs if c.get("name") == "zstd"), None)
      if zstd is not None:  # Orbax's Zarr v2 arrays used level 1; its v3 default, 3, costs more CPU
        zstd.setdefault("configuration", {})["level"] = ZSTD_LEVEL
      kind = ARRAY_CHECKSUM if ARRAY_CHECKSUM != "zstd" or zstd is not None else "crc32c"  # no zstd: crc32c
      if kind == "zstd":
        zstd["configuration"]["checksum"] = True
      elif kind == "crc32c" and checksum_of(codecs) != "crc32c":
        codecs.append({"name": "crc32c"})  # last: over the compressed bytes, as they are on disk
      return metadata
    with_checksum.meshtrain_checksum = True
    setattr(ts_utils, name, with_checksum)
  try:
    kind = checksum_of(chunk_codecs(probe()))
  except Exception:
    kind = None
  if kind is None and jax.process_index() == 0:
    print(f"warning: checkpoint arrays are written without checksums: meshtrain could not add them to the Zarr v3 "
          f"metadata of this Orbax ({ocp.__version__}; it hooks tensorstore_utils."
          f"{' or '.join(n for n, _ in BUILDERS)}). The meta item is still checksummed", file=sys.stderr, flush=True)
  return kind
