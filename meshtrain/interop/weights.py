"""Hugging Face weights on disk, one tensor at a time: safetensors read and written through their numpy API (no
torch), and a parameter tree written as a meshtrain checkpoint without a second copy in memory. The conversions of
meshtrain/interop/hf.py stream through these, so that a model larger than the free memory converts.

Orbax (JAX with it) is imported inside save_params: `python -m meshtrain.convert` refuses a bad argument before
loading it.
"""
import asyncio
import contextlib
import json
import logging
import os
import pathlib

import numpy as np
import orbax.checkpoint as ocp
from safetensors import safe_open
from safetensors.numpy import save_file

from meshtrain import checkpoint
from meshtrain.errors import RunAborted, UserError

# safetensors dtype -> the meshtrain param_dtype holding it exactly. float16 widens to float32 (meshtrain stores
# float32 or bfloat16 only; float16 -> float32 is exact).
PARAM_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float32"}
# to-hf output shards: each is built in memory before safetensors writes it (transposed tensors are new arrays),
# so this bounds what to-hf holds beyond the parameters themselves. A tensor larger than this gets its own shard.
SHARD_BYTES = 1 << 30


def weight_files(hf_dir: pathlib.Path) -> dict:
  """HF tensor name -> safetensors file holding it (from the shard index save_pretrained writes,
  model.safetensors.index.json or diffusers' diffusion_pytorch_model.safetensors.index.json, else every
  *.safetensors)."""
  indexes = sorted(hf_dir.glob("*.safetensors.index.json"))
  if len(indexes) > 1:
    raise UserError(f"{str(hf_dir)!r} holds {len(indexes)} shard indexes ({', '.join(i.name for i in indexes)}); "
                    "keep the one save_pretrained wrote")
  if indexes:
    index = indexes[0]
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
      raise UserError(f"{str(index)!r} is not a safetensors index (no weight_map: {e}); fix or remove it") from None
    files = {name: hf_dir / file for name, file in weight_map.items()}
    absent = sorted({str(f) for f in files.values() if not f.is_file()})
    if absent:
      raise UserError(f"{str(index)!r} names {len(absent)} missing shard(s), e.g. {absent[0]!r}; copy every shard")
    return files
  shards = sorted(hf_dir.glob("*.safetensors"))
  if not shards:
    others = sorted(p.name for p in hf_dir.glob("*.bin")) + sorted(p.name for p in hf_dir.glob("*.pth"))
    hint = (f" (it has {', '.join(others[:3])}: PyTorch pickles, which meshtrain does not read because that needs "
            "torch; re-save with save_pretrained(..., safe_serialization=True))") if others else ""
    raise UserError(f"{str(hf_dir)!r} has no *.safetensors weights{hint}; pass a directory save_pretrained wrote")
  files = {}
  for shard in shards:
    with open_safetensors(shard) as f:
      files.update({name: shard for name in f.keys()})
  return files


def open_safetensors(path: pathlib.Path):
  """`path` opened for reading tensor by tensor (numpy), or a UserError saying why it cannot be read."""
  try:
    return safe_open(str(path), framework="np")
  except Exception as e:  # SafetensorError: a header that does not parse, a file shorter than its header says
    raise UserError(f"{str(path)!r} is not a readable safetensors file ({' '.join(str(e).split())[:200]}); "
                    "re-download or re-save it") from None


def write_safetensors(directory: pathlib.Path, tensors, stem: str = "model") -> None:
  """Writes (name, array) pairs, taken one at a time from the iterator `tensors`, as shards of at most SHARD_BYTES
  (one file, model.safetensors, when they all fit), with model.safetensors.index.json when there are several: the
  layout save_pretrained writes (diffusers' models name theirs `stem` diffusion_pytorch_model). Only one shard's
  tensors are held at a time."""
  shards, current, size, total = [], {}, 0, 0
  weight_map = {}

  def flush():
    nonlocal current, size
    if current:
      name = f"shard-{len(shards):05d}.tmp"
      save_file(current, str(directory / name), metadata={"format": "pt"})  # "pt": transformers checks it
      # safetensors creates its files 0600; the other files (and save_pretrained's) follow the umask.
      os.chmod(directory / name, 0o666 & ~_umask())
      shards.append((name, list(current)))
      current, size = {}, 0

  for name, w in tensors:
    if size and size + w.nbytes > SHARD_BYTES:
      flush()
    current[name] = w
    size += w.nbytes
    total += w.nbytes
  flush()
  if len(shards) == 1:
    (directory / shards[0][0]).rename(directory / f"{stem}.safetensors")
    return
  for i, (tmp_name, names) in enumerate(shards):
    final = f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    (directory / tmp_name).rename(directory / final)
    weight_map.update({n: final for n in names})
  (directory / f"{stem}.safetensors.index.json").write_text(json.dumps(
      {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def _umask() -> int:
  mask = os.umask(0)
  os.umask(mask)
  return mask


def save_params(workdir: pathlib.Path, params: dict, meta: dict) -> None:
  """Writes `params` (numpy) as step 0 through meshtrain's Checkpointer, without a second copy in memory."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # host work: never claim an accelerator for it
  previous = ocp.type_handlers.get_type_handler(np.ndarray)
  checkpoint.register_handler(np.ndarray, _one_array_at_a_time(ocp))
  # Orbax's log handlers write into the output's diagnostics/: on a full disk each failed record would print a
  # "--- Logging error ---" report of its own; the error that matters is raised below.
  raise_exceptions, logging.raiseExceptions = logging.raiseExceptions, False
  ckpt = None
  try:
    ckpt = checkpoint.Checkpointer(workdir, keep=1)
    ckpt.save(0, {"params": params}, meta)
    ckpt.wait()
  except RunAborted as e:  # a training run's words ("rerun to resume"); a conversion is refused whole
    cause = e.__cause__ or e
    raise UserError(f"the converted checkpoint could not be written into {workdir}: {type(cause).__name__}: "
                    f"{(str(cause).splitlines() or [''])[0][:300]}; nothing was written (the partial output was "
                    "removed)") from None
  finally:
    if ckpt is not None:
      ckpt.close()
    checkpoint.register_handler(np.ndarray, previous)
    logging.raiseExceptions = raise_exceptions


def _one_array_at_a_time(ocp):
  """Orbax's handler of numpy arrays (np.memmap included: Orbax picks handlers by issubclass), changed in two ways
  that bound the memory of writing a model to about its largest array:
  - no deep copy: Orbax copies numpy arrays before an (async) save in case the caller changes them meanwhile, a
    second full copy of the model. Nothing touches these arrays until the save is committed.
  - one array written at a time: Orbax starts every array's TensorStore write at once, and TensorStore holds each
    array's encoded chunks until its write completes: saving the 1b preset's arrays from memory-mapped files took
    +0.62x the weight bytes with every write at once, +0.30x one at a time (~1.4x the largest array).
  The arrays are stored as Orbax stores numpy arrays (same type name, chunks and metadata): only the order of the
  writes changes."""

  class OneArrayAtATime(ocp.type_handlers.NumpyHandler):
    _lock = None

    async def _open_and_write(self, value, tspec, ts_context):
      if self._lock is None:  # created in the event loop that runs the writes
        self._lock = asyncio.Lock()
      await self._lock.acquire()
      try:
        await super()._open_and_write(value, tspec, ts_context)
      finally:
        # A failed save closes Orbax's event loop with writes still waiting here: releasing then wakes a waiter on a
        # closed loop (RuntimeError, printed as "Exception ignored"); nobody is left to run it.
        with contextlib.suppress(RuntimeError):
          self._lock.release()

  return OneArrayAtATime(deepcopy_host_arrays=False)
