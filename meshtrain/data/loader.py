"""The train loop's input: global batches of a source laid out on the devices.

`process_rows` says which contiguous rows of a global batch this process's devices hold; `global_batch` loads
just those rows of the batch at a step (the source's `rows`, a pure function of the step) and makes them global
arrays. `Batches` does the same for every step from a start step on, ahead of the loop: grain reads the batches
of the steps ahead on worker threads (`local_batches`, which `python -m meshtrain.bench --data-only` times alone)
and a grain prefetch thread moves them onto the devices, so loading and host-to-device transfer overlap the
training step.

grain is imported only when batches are iterated, so `synthetic` runs where it is not installed (the GPU machines;
there one background thread prefetches).
"""
import concurrent.futures
import sys

import jax
import numpy as np

from meshtrain.data import sources
from meshtrain.errors import UserError

# Batches: grain worker threads building the next steps' rows, and how many batches they may hold ready. Two of
# each keep a step's worth of rows in hand with room to spare (the BPE path builds a tiny-model batch in well under
# a millisecond, README "Tokenizers") without taking cores from XLA on small hosts.
READ_THREADS = 2
READ_AHEAD = 2


def _process_rows(sharding, shape) -> tuple[int, int]:
  spans = set()
  for index in sharding.addressable_devices_indices_map(shape).values():
    first = index[0] if index else slice(None)
    begin, end, _ = first.indices(shape[0])
    spans.add((begin, end))
  if not spans:
    raise ValueError(f"sharding {sharding} has no devices in process {jax.process_index()}")
  ordered = sorted(spans)
  begin, end = ordered[0]
  for b, e in ordered[1:]:
    if b > end:
      raise UserError(
          f"process {jax.process_index()} holds batch rows {ordered} under sharding {sharding}; they are not "
          "contiguous, so it cannot load one slice of the batch. Order the mesh so that each process's devices "
          "are adjacent along the batch axes (as jax.make_mesh does)")
    end = max(end, e)
  return begin, end


def process_rows(sharding, batch_size: int) -> tuple[int, int]:
  """(start, stop): the contiguous rows of a global [batch_size, ...] array this process's devices hold under
  `sharding`, a NamedSharding or a dict {batch key: NamedSharding} (whose shardings must agree on the rows)."""
  if isinstance(sharding, dict):
    spans = {key: process_rows(s, batch_size) for key, s in sharding.items()}
    if len(set(spans.values())) > 1:
      raise ValueError(f"the batch shardings give this process different rows per key ({spans}); every key of a "
                       "batch must be split the same way along its first (batch) axis")
    return next(iter(spans.values()))
  # Which rows are held depends on the batch axis alone; every other axis gets the device count, which each
  # sharding of it divides, and the shape gets as many axes as the sharding's spec names (images: 4).
  rank = max(2, len(getattr(sharding, "spec", ())))
  return _process_rows(sharding, (batch_size,) + (len(sharding.device_set),) * (rank - 1))


def _on_devices(sharding, local: dict[str, np.ndarray], batch_size: int) -> dict[str, jax.Array]:
  """This process's rows of each batch array as global arrays of batch_size rows, each laid out by `sharding` (one
  NamedSharding for every key, or a dict {key: NamedSharding}); an array's other axes are its own."""
  if isinstance(sharding, dict) and set(sharding) != set(local):
    raise ValueError(f"batch keys {sorted(local)} and sharding keys {sorted(sharding)} differ")
  # Full-length rows are always valid local data: a dimension whose local size equals the global one is indexed
  # directly, so this also holds when the length axis (or any other non-batch axis) is sharded.
  return {k: jax.make_array_from_process_local_data(sharding[k] if isinstance(sharding, dict) else sharding, v,
                                                     (batch_size, *v.shape[1:])) for k, v in local.items()}


def global_batch(src, step: int, batch_size: int, sharding) -> dict[str, jax.Array]:
  """The batch at `step` as global arrays laid out by `sharding` (a NamedSharding for all keys, or a dict
  {key: NamedSharding}); this process reads only its own rows. `src`: a token or image source (its `rows`)."""
  start, stop = process_rows(sharding, batch_size)
  return _on_devices(sharding, src.rows(step, batch_size, start, stop), batch_size)


class _StepRows:
  """step -> (step, this process's rows of the global batch at that step): the grain map, a class so it pickles."""

  def __init__(self, src: sources.Source, batch_size: int, start: int, stop: int):
    self.src, self.batch_size, self.start, self.stop = src, batch_size, start, stop

  def __call__(self, step: int):
    return step, self.src.rows(step, self.batch_size, self.start, self.stop)


class _ToDevices:
  """(step, local rows) -> (step, global arrays of batch_size rows laid out by `sharding`, as `global_batch`)."""

  def __init__(self, sharding, batch_size: int):
    self.sharding, self.batch_size = sharding, batch_size

  def __call__(self, item):
    step, local = item
    return step, _on_devices(self.sharding, local, self.batch_size)


def local_batches(src: sources.Source, start_step: int, batch_size: int, start: int, stop: int, *,
                  threads: int = READ_THREADS, read_ahead: int = READ_AHEAD):
  """The grain IterDataset of (step, rows [start, stop) of the global batch at step) for step = start_step, ...:
  the host side of `Batches`, which `python -m meshtrain.bench --data-only` times alone."""
  import grain  # pylint: disable=g-import-not-at-top
  steps = grain.MapDataset.range(start_step, sys.maxsize).map(_StepRows(src, batch_size, start, stop))
  return steps.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=read_ahead))


class Batches:
  """Iterates (step, batch) from `start_step` on: the train loop's input.

  `src`: a token or image source (anything with `rows`); `sharding`: a NamedSharding for every key of the batch,
  or a dict {key: NamedSharding} (images are 4-D, their labels 1-D).
  A grain pipeline: the step indices from `start_step` (a MapDataset, so resuming at step k needs no iterator
  state), mapped to this process's rows of each step's global batch on `threads` worker threads that keep
  `read_ahead` batches ready, then moved onto the devices on grain's prefetch thread, so loading and transfer
  overlap the training step. Batch k is the source's pure function of (seed, k) whatever the thread timing. An
  exception while loading is raised by the `next()` that would have returned that batch. Call `close()` (or use
  `with`) to stop the threads. Where grain is not installed (synthetic data on the GPU machines) one thread
  prefetches instead.
  """

  def __init__(self, src: sources.Source, start_step: int, batch_size: int, sharding, *, threads: int = READ_THREADS,
               read_ahead: int = READ_AHEAD):
    if threads < 1 or read_ahead < 1:
      raise ValueError(f"threads and read_ahead must be >= 1, got {threads} and {read_ahead}")
    start, stop = process_rows(sharding, batch_size)
    rows, to_devices = _StepRows(src, batch_size, start, stop), _ToDevices(sharding, batch_size)
    try:
      import grain  # pylint: disable=g-import-not-at-top
    except ImportError:
      self._fallback = _ThreadBatches(start_step, lambda step: to_devices(rows(step)), read_ahead)
      self._iterator = None
      return
    self._fallback = None
    local = local_batches(src, start_step, batch_size, start, stop, threads=threads, read_ahead=read_ahead)
    on_devices = grain.experimental.ThreadPrefetchIterDataset(local.map(to_devices), prefetch_buffer_size=1)
    self._iterator = iter(on_devices)

  def __iter__(self):
    return self

  def __next__(self):
    if self._fallback is not None:
      return next(self._fallback)
    if self._iterator is None:
      raise StopIteration
    return next(self._iterator)

  def close(self) -> None:
    if self._fallback is not None:
      self._fallback.close()
    if self._iterator is not None:
      self._iterator.close()
      self._iterator = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class _ThreadBatches:
  """`load(step)` for step = start, start + 1, ..., `depth` of them ahead on one thread (no grain installed)."""

  def __init__(self, start_step: int, load, depth: int):
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="meshtrain-batches")
    self._load, self._next_step = load, start_step
    self._pending = [self._submit() for _ in range(depth)]

  def _submit(self):
    future = self._pool.submit(self._load, self._next_step)
    self._next_step += 1
    return future

  def __next__(self):
    if not self._pending:
      raise StopIteration
    future = self._pending.pop(0)
    item = future.result()  # re-raises what loading this step raised
    self._pending.append(self._submit())
    return item

  def close(self) -> None:
    for future in self._pending:
      future.cancel()
    self._pending = []
    self._pool.shutdown(wait=True)
