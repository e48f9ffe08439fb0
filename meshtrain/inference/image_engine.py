"""Image generation behind the server: a trained DiT's class-conditional samples (POST /v1/images/generations).

Requests wait in a bounded queue; the engine thread samples them one at a time with meshtrain/inference/
dit_sampler.py's compiled sampler (the run's `sample.steps` Euler steps and guidance, the images split over the
mesh's batch axes). A request's n images are padded to a power of two (so that at most log2(max n) + 1 programs are
ever compiled), and image k of class c starts from the noise of (seed, c, k): the same pictures as
`python -m meshtrain.sample --classes c --per-class n --seed S` draws. JAX is imported inside the functions, after
meshtrain.runtime.start.
"""
import collections
import dataclasses
import io
import math
import secrets
import threading
import time

import numpy as np

from meshtrain import checkpoint, layout as layout_lib, mesh as mesh_lib
from meshtrain.data import digits
from meshtrain.errors import UserError
from meshtrain.inference import dit_sampler
from meshtrain.inference.engine import QueueFull


@dataclasses.dataclass(eq=False)
class ImageRequest:
  """`n` images of class `label`; `on_done(request)` is called on the engine thread when `pngs` is set."""
  label: int
  n: int = 1
  seed: int | None = None
  on_done: object = None
  pngs: list[bytes] = dataclasses.field(default_factory=list)
  submitted_at: float = 0.0
  finished_at: float | None = None
  step: int | None = None
  cancelled: bool = False

  def cancel(self) -> None:
    self.cancelled = True

  @property
  def done(self) -> bool:
    return self.finished_at is not None


class ImageEngine:
  """Samples ImageRequests with `sampler` (a dit_sampler.Sampler) and the run's `params`; `class_names` (one per
  label, or None) lets a prompt name a class."""

  slots = 1      # one request sampled at a time (its n images in one program)
  leader = True  # served by one process

  def __init__(self, sampler, params, num_classes: int, image_shape: tuple[int, int, int], step: int,
               class_names: list[str] | None = None, max_queue: int = 64, max_n: int = 8):
    self.sampler, self.params, self.num_classes = sampler, params, num_classes
    self.image_shape, self.step_served, self.class_names = tuple(image_shape), step, class_names
    self.max_queue, self.max_n = max_queue, max_n
    self.queue: collections.deque[ImageRequest] = collections.deque()
    self.lock = threading.Condition()
    self.running: ImageRequest | None = None

  @property
  def queued(self) -> int:
    return len(self.queue)

  @property
  def busy(self) -> int:
    return int(self.running is not None)

  def label_of(self, prompt) -> int:
    """The class a prompt names: its id (an integer or its digits) or, when the run's classes have names, a name
    (any case). UserError listing the classes otherwise."""
    text = str(prompt).strip()
    names = self.class_names or []
    if text.lstrip("-").isdigit() and int(text) in range(self.num_classes):
      return int(text)
    lowered = [n.lower() for n in names]
    if text.lower() in lowered:
      return lowered.index(text.lower())
    shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
    raise UserError(f"the prompt {prompt!r} names no class of this model: give a class id 0..{self.num_classes - 1}"
                    + (f" or a name ({shown})" if names else ""))

  def submit(self, request: ImageRequest) -> ImageRequest:
    if not 1 <= request.n <= self.max_n:
      raise UserError(f"n {request.n} must be between 1 and {self.max_n}")
    if request.seed is None:
      request.seed = secrets.randbits(32)
    if not 0 <= request.seed < 2**32:
      raise UserError(f"seed {request.seed} must be in 0 .. {2**32 - 1}")
    request.submitted_at = time.perf_counter()
    with self.lock:
      if len(self.queue) >= self.max_queue:
        raise QueueFull(f"{len(self.queue)} image requests are waiting")
      self.queue.append(request)
      self.lock.notify()
    return request

  def step(self) -> bool:
    """Samples the oldest waiting request (False when none waits)."""
    with self.lock:
      if not self.queue:
        return False
      request = self.running = self.queue.popleft()
    try:
      if request.cancelled:
        return True
      padded = 1 << (request.n - 1).bit_length()  # a power of two: few programs compiled
      labels = np.full(padded, request.label, np.int32)
      images = self.sampler(self.params, labels, np.arange(padded, dtype=np.int32), request.seed)[:request.n]
      from PIL import Image  # Pillow only where images are served: the GPU machines carry none
      for image in np.round(np.clip(images, 0, 1) * 255).astype(np.uint8):
        out = io.BytesIO()
        Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(out, format="PNG")
        request.pngs.append(out.getvalue())
      request.step = self.step_served
    finally:
      self.running = None
      request.finished_at = time.perf_counter()
      if request.on_done is not None:
        request.on_done(request)
    return True

  def run(self, stop: threading.Event, idle_wait_s: float = 0.5) -> None:
    while not stop.is_set():
      if not self.step():
        with self.lock:
          if not self.queue and not stop.is_set():
            self.lock.wait(idle_wait_s)


def class_names(cfg) -> list[str] | None:
  """The names of the run's classes, from its TFDS dataset's label feature where this machine has the dataset's
  metadata; None for digits (its names are its ids), synthetic data, or a dataset not here (ids still work)."""
  if cfg.data.name in (digits.NAME, "synthetic"):
    return None
  try:
    import tensorflow_datasets as tfds  # TFDS only for a run's class names: GPU machines carry none
    info = tfds.builder(cfg.data.name, data_dir=cfg.data.data_dir or None).info
    return [str(n) for n in info.features[cfg.data.label_key].names]
  except Exception:  # optional: a server whose host lacks the dataset serves the classes by id
    return None


def from_workdir(workdir, step: int, cfg, max_queue: int = 64, max_n: int = 8, asked: bool = True) -> ImageEngine:
  """An ImageEngine of the DiT run in `workdir` at `step`, with `cfg` from dit_request.run_config (its mesh and
  rules), as `python -m meshtrain.sample` builds its sampler. Unless the user `asked` for that step, the newest
  there is when a live run's retention deletes it first (the engine's `step` says which)."""
  mesh = mesh_lib.make_mesh(cfg.mesh)
  ways = math.prod(mesh.shape[a] for a in mesh_lib.BATCH_AXES)
  cfg.batch_size = ways  # the layout checks its batch against the mesh; the sampler pads each request's images
  layout = layout_lib.build(cfg, mesh)
  params, _, step = checkpoint.read_params(workdir, step, asked, mesh=mesh, shardings=layout.state_sharding.params)
  m = cfg.model
  return ImageEngine(dit_sampler.Sampler(layout, cfg.sample.steps, cfg.sample.guidance), params, m.num_classes,
                     (m.image_size, m.image_size, m.channels), step, class_names(cfg), max_queue, max_n)
