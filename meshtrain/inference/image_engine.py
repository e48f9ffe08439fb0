"""Image generation behind the server (POST /v1/images/generations): a text-to-image run's pictures of prompts
(`PromptEngine`), or a trained DiT's class-conditional samples (`ImageEngine`).

Prompts: every request waiting when the engine is free (up to MAX_BATCH pictures, those asking for the same number
of Euler steps) is sampled as one batch by meshtrain/inference/t2i_sampler.py's compiled sampler, each request with
its own guidance; picture k of a request with seed s starts from the noise of (s, k), so a seed gives the same
picture alone or in a batch, as `python -m meshtrain.sample --prompt ... --seed s` draws it.

Requests wait in a bounded queue; the engine thread samples them one at a time with meshtrain/inference/
dit_sampler.py's compiled sampler (the run's `sample.steps` Euler steps and guidance, the images split over the
mesh's batch axes). A request's n images are padded to a power of two (so that at most log2(max n) + 1 programs are
ever compiled), and image k of class c starts from the noise of (seed, c, k): the same pictures as
`python -m meshtrain.sample --classes c --per-class n --seed S` draws.

Serving a run that is still training (`live`, meshtrain/inference/live.py, as for language models), the engine looks
for a newer checkpoint between batches and swaps its parameters in, placed as the served ones: nothing is compiled
again, and each answer names the step that drew it.
"""
import collections
import dataclasses
import functools
import io
import math
import re
import secrets
import sys
import threading
import time

import numpy as np
from PIL import Image

from meshtrain import checkpoint, layout as layout_lib, mesh as mesh_lib
from meshtrain.data import digits, images as images_lib
from meshtrain.errors import UserError
from meshtrain.inference import dit_request, dit_sampler, flux_pipeline, t2i_sampler
from meshtrain.inference.engine import QueueFull
from meshtrain.inference.live import LiveCheckpoints


MAX_STEPS = dit_request.MAX_STEPS  # a request's own Euler steps at most
MAX_BATCH = 32  # pictures sampled in one program: the requests that arrive together, up to this many


@dataclasses.dataclass(eq=False)
class ImageRequest:
  """`n` images of `condition` (a class label, or a prompt's text condition: PromptEngine.condition_of);
  `on_done(request)` is called on the engine thread when `pngs` is set. `steps` and `guidance`: the request's own
  (prompts only), else the run's."""
  condition: object
  n: int = 1
  seed: int | None = None
  steps: int | None = None
  guidance: float | None = None
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


class ServedParams:
  """The served parameters as LiveCheckpoints loads a newer step onto them: in the layout's shardings of the
  parameters (what every compiled sampler was compiled for)."""

  def __init__(self, layout, params):
    """`layout` None: the parameters are served from the host as read (a Flux.1 pipeline's, on one device)."""
    self.params, self.shardings = params, None if layout is None else layout.state_sharding.params

  def load_step(self, workdir, step: int):
    """The parameters (or their average) of `workdir`'s checkpoint at `step`, in the served shardings."""
    return checkpoint.load_params(workdir, step, shardings=self.shardings)[0]


class ImageEngine:
  """Samples ImageRequests with `sampler` (a dit_sampler.Sampler) and the run's `params`; `class_names` (one per
  label, or None) lets a prompt name a class; `live` (LiveCheckpoints, with `served`: ServedParams) swaps in newer
  checkpoints of a training run."""

  slots = 1      # one request sampled at a time (its n images in one program)
  leader = True  # served by one process

  def __init__(self, sampler, params, num_classes: int, image_shape: tuple[int, int, int], step: int,
               class_names: list[str] | None = None, max_queue: int = 64, max_n: int = 8,
               live: LiveCheckpoints | None = None, served: ServedParams | None = None, warm_first: bool = False):
    self.sampler, self.params, self.num_classes = sampler, params, num_classes
    self.image_shape, self.step_served, self.class_names = tuple(image_shape), step, class_names
    self.max_queue, self.max_n = max_queue, max_n
    self.live, self.served = live, served
    self.queue: collections.deque[ImageRequest] = collections.deque()
    self.lock = threading.Condition()
    self.running: ImageRequest | None = None
    # As the language engine's: with `warm_first`, `warm()` samples once with every program a request can need
    # before the first request; `compiled` holds the programs sampled with so far (one compile each).
    self.compiled: set[tuple] = set()
    self.ready, self.warmed = not warm_first, 0
    self.to_warm = len(self.programs())

  @property
  def compiled_programs(self) -> int:
    return len(self.compiled)

  def programs(self) -> list[tuple]:
    """Every program a request can need: its n images padded to a power of two, 1 .. max_n's."""
    return [("images", 1 << k) for k in range((self.max_n - 1).bit_length() + 1)]

  def warm(self, stop: threading.Event | None = None) -> None:
    """Samples once with each of `programs()` (noise of seed 0, pictures thrown away), counting them in `warmed`;
    returns early, `ready` still False, once `stop` is set."""
    self.warmed = 0
    for program in self.programs():
      if stop is not None and stop.is_set():
        return
      self._sample_with(*program)
      self.warmed += 1
    self.ready = True

  def _sample_with(self, kind: str, padded: int, steps: int | None = None) -> None:
    del kind, steps
    self._images(np.zeros(padded, np.int32), 0)

  def _images(self, labels_N, seed: int) -> np.ndarray:
    self.compiled.add(("images", len(labels_N)))
    return self.sampler(self.params, labels_N, np.arange(len(labels_N), dtype=np.int32), seed)

  def swap(self) -> None:
    """Serves a newer checkpoint of the live run when one is there (on the engine thread, between batches)."""
    if self.live is None or (step := self.live.newer()) is None:
      return
    params = self.live.load(self.served, step)
    if params is not None:
      self.served.params = self.params = params
      self.step_served = step
      print(f"serving step {step} of {self.live.workdir} (nothing compiled again)", file=sys.stderr, flush=True)

  @property
  def queued(self) -> int:
    return len(self.queue)

  @property
  def busy(self) -> int:
    return int(self.running is not None)

  def condition_of(self, prompt) -> int:
    """The class a prompt names: its id (an integer or its digits) or, when the run's classes have names, a name
    (any case). UserError listing the classes otherwise."""
    text = str(prompt).strip()
    names = self.class_names or []
    # ASCII digits only, and few: str.isdigit() takes "²" and "٣", which int() refuses or reads as 3.
    if re.fullmatch(r"[0-9]{1,9}", text) and int(text) < self.num_classes:
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
    self.swap()
    with self.lock:
      if not self.queue:
        return False
      request = self.running = self.queue.popleft()
    try:
      if request.cancelled:
        return True
      padded = 1 << (request.n - 1).bit_length()  # a power of two: few programs compiled
      images = self._images(np.full(padded, request.condition, np.int32), request.seed)[:request.n]
      request.pngs, request.step = pngs(images), self.step_served
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


def pngs(images01_NHWC) -> list[bytes]:
  out = []
  for image in np.round(np.clip(images01_NHWC, 0, 1) * 255).astype(np.uint8):
    buffer = io.BytesIO()
    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(buffer, format="PNG")
    out.append(buffer.getvalue())
  return out


class PromptEngine(ImageEngine):
  """Samples ImageRequests of prompts in batches: every waiting request of the oldest one's step count, up to
  MAX_BATCH pictures, in one program of `samplers(steps)` (a t2i_sampler.Sampler per step count, made on first
  use); guidance per request. The batch is padded to a power of two: few programs are ever compiled."""

  def __init__(self, samplers, params, captions: images_lib.Captions, image_shape, step: int, steps: int,
               guidance: float, max_queue: int = 64, max_n: int = 8, live: LiveCheckpoints | None = None,
               served: ServedParams | None = None, warm_first: bool = False):
    """captions: turns a prompt into what the sampler takes (the own encoder's ids, or a frozen encoder's
    features)."""
    self.samplers, self.captions, self.steps, self.guidance = samplers, captions, steps, guidance
    super().__init__(None, params, 0, image_shape, step, None, max_queue, max_n, live, served, warm_first)

  def programs(self) -> list[tuple]:
    """Every program a request of the run's step count can need: batches of pictures padded to a power of two,
    1 .. MAX_BATCH. A request asking for other steps compiles its own on first use (steps are compiled in)."""
    return [("pictures", 1 << k, self.steps) for k in range((MAX_BATCH - 1).bit_length() + 1)]

  def _sample_with(self, kind: str, padded: int, steps: int | None = None) -> None:
    del kind
    self._pictures(steps, self.captions.blank(padded), np.zeros(padded, np.uint32),
                   np.arange(padded, dtype=np.int32), np.full(padded, self.guidance, np.float32))

  def _pictures(self, steps: int, texts: dict, seeds_N, index_N, guidance_N) -> np.ndarray:
    self.compiled.add(("pictures", len(seeds_N), steps))
    return self.samplers(steps)(self.params, texts, seeds_N, index_N, guidance_N)

  def condition_of(self, prompt) -> dict:
    """The prompt's text condition, one row of each of `captions`' arrays."""
    if not isinstance(prompt, str) or not prompt.strip():
      raise UserError("prompt must be the text of the picture to draw (a non-empty string)")
    return self.captions([prompt])

  def step(self) -> bool:
    self.swap()
    with self.lock:
      if not self.queue:
        return False
      steps = self.queue[0].steps or self.steps
      batch, total = [], 0
      for request in list(self.queue):
        if (request.steps or self.steps) == steps and total + request.n <= MAX_BATCH:
          self.queue.remove(request)
          batch.append(request)
          total += request.n
      self.running = batch[0]
    try:
      live = [r for r in batch if not r.cancelled]
      if live:
        texts = {k: np.concatenate([np.repeat(r.condition[k], r.n, axis=0) for r in live]) for k in live[0].condition}
        seeds = np.concatenate([np.full(r.n, r.seed, np.uint32) for r in live])
        index = np.concatenate([np.arange(r.n, dtype=np.int32) for r in live])
        guidance = np.concatenate([np.full(r.n, self.guidance if r.guidance is None else r.guidance, np.float32)
                                   for r in live])
        padded = 1 << (len(seeds) - 1).bit_length()
        extra = padded - len(seeds)
        blank = self.captions.blank(extra)
        pictures = self._pictures(steps, {k: np.concatenate([a, blank[k]]) for k, a in texts.items()},
                                  np.concatenate([seeds, np.zeros(extra, np.uint32)]),
                                  np.concatenate([index, np.zeros(extra, np.int32)]),
                                  np.concatenate([guidance, np.zeros(extra, np.float32)]))
        start = 0
        for r in live:
          r.pngs, r.step = pngs(pictures[start:start + r.n]), self.step_served
          start += r.n
    finally:
      self.running = None
      for r in batch:
        r.finished_at = time.perf_counter()
        if r.on_done is not None:
          r.on_done(r)
    return True


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


def from_workdir(workdir, step: int, cfg, max_queue: int = 64, max_n: int = 8, asked: bool = True,
                 follow_s: float = 0.0, warm_first: bool = False) -> ImageEngine:
  """`prompt_engine` for a text-to-image run, else `class_engine`; with `follow_s` > 0 (and no step `asked` for),
  following the run's newer checkpoints, looked for every follow_s seconds; `warm_first`: every program sampled
  with once before the first request (`ImageEngine.warm`)."""
  make = (flux_engine if cfg.model.get("pipeline") else prompt_engine) if cfg.task == "t2i" else class_engine
  engine = make(workdir, step, cfg, max_queue, max_n, asked, warm_first)
  if follow_s > 0 and not asked:
    engine.live = LiveCheckpoints(workdir, engine.step_served, follow_s)
  return engine


def prompt_engine(workdir, step: int, cfg, max_queue: int, max_n: int, asked: bool,
                  warm_first: bool = False) -> PromptEngine:
  """A PromptEngine of the t2i run in `workdir` at `step` on cfg's mesh (as from_workdir's class engine)."""
  mesh = mesh_lib.make_mesh(cfg.mesh)
  cfg.batch_size = math.prod(mesh.shape[a] for a in mesh_lib.BATCH_AXES)
  layout = layout_lib.build(cfg, mesh)
  params, _, step = checkpoint.read_params(workdir, step, asked, mesh=mesh, shardings=layout.state_sharding.params)
  m, s = cfg.model, cfg.sample
  samplers = functools.cache(lambda steps: t2i_sampler.Sampler(layout, steps, s.guidance))
  return PromptEngine(samplers, params, images_lib.Captions(m), (m.image_size, m.image_size, m.channels), step, s.steps,
                      s.guidance, max_queue, max_n, served=ServedParams(layout, params), warm_first=warm_first)


def flux_engine(workdir, step: int, cfg, max_queue: int, max_n: int, asked: bool,
                warm_first: bool = False) -> PromptEngine:
  """A PromptEngine of a Flux.1 pipeline's workdir (convert from-diffusers, or a run fine-tuned from one) at
  `step`: pictures of the run's size, sampled as diffusers' FluxPipeline samples them, on one device."""
  pipeline, step = flux_pipeline.Pipeline.from_workdir(workdir, step if asked else None)
  side = cfg.model.image_size * pipeline.vae[0].downsample
  samplers = functools.cache(lambda steps: flux_pipeline.Sampler(pipeline, steps, side))
  params = pipeline.transformer[1]
  return PromptEngine(samplers, params, flux_pipeline.PromptFeatures(pipeline, cfg.model.text_len), (side, side, 3),
                      step, cfg.sample.steps, cfg.sample.guidance, max_queue, max_n, served=ServedParams(None, params),
                      warm_first=warm_first)


def class_engine(workdir, step: int, cfg, max_queue: int, max_n: int, asked: bool,
                 warm_first: bool = False) -> ImageEngine:
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
                     (m.image_size, m.image_size, m.channels), step, class_names(cfg), max_queue, max_n,
                     served=ServedParams(layout, params), warm_first=warm_first)
