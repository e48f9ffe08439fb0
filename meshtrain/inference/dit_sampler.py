"""A trained DiT's samples: the compiled sampler, the labelled PNG grid and the raw samples.
`python -m meshtrain.sample` is the command.

The whole sampler (noise, `steps` Euler steps from t = 1 to 0 with classifier-free guidance, meshtrain/families/dit.py
`sample`) is one compiled device program whose images are split over the mesh's batch axes. Image k of class c
starts from the noise of (seed, c, k): the same image whatever other classes, counts or mesh are asked for, so the
command reproduces the grid the run drew at the same step and settings.

During training the same sampler runs as a hook (meshtrain/hooks.py `SampleHook`): at eval_every and at the end it
writes WORKDIR/samples/step_N.png, a TensorBoard image and, on digits, sample_accuracy and sample_frechet into
metrics.jsonl.

Pillow is imported where a grid is drawn: the GPU machines carry none, and a run there trains without pictures.
What a request may ask is checked before JAX loads, in meshtrain/inference/dit_request.py.
"""
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain import checkpoint, layout as layout_lib, mesh as mesh_lib, sharding
from meshtrain.data import digits
from meshtrain.inference import quality  # imports scikit-learn only when a judge is made

GRID_CELL_PX = 48  # images are upscaled (nearest neighbour, whole multiples) to at least this many pixels high
GRID_GAP_PX = 2    # between cells, in the background grey
GRID_BACKGROUND = 96  # mid-dark grey: apart from digits' black background and their white strokes
SAMPLES_DIR = "samples"  # under the workdir: the training-time grids, step_N.png


# --- the grid ------------------------------------------------------------------------------------------------


def grid_image(images01_NHWC, labels_N) -> np.ndarray:
  """uint8[H', W', C]: one row per class (ascending), its label in a square on the left, then that class's images
  in their order, each upscaled by a whole factor to >= GRID_CELL_PX pixels; C is the images' (1 or 3)."""
  from PIL import Image, ImageDraw, ImageFont  # the GPU machines carry no Pillow: a run there trains without grids
  images01_NHWC, labels_N = np.asarray(images01_NHWC, np.float32), np.asarray(labels_N).reshape(-1)
  if images01_NHWC.ndim != 4 or images01_NHWC.shape[-1] not in (1, 3) or len(labels_N) != len(images01_NHWC):
    raise ValueError(f"a grid needs images [N, H, W, 1 or 3] and N labels, got {list(images01_NHWC.shape)} and "
                     f"{len(labels_N)}")
  n, height, width, channels = images01_NHWC.shape
  scale = max(1, math.ceil(GRID_CELL_PX / height))
  cell_h, cell_w = height * scale, width * scale
  classes = sorted(set(labels_N.tolist()))
  rows = [np.flatnonzero(labels_N == c) for c in classes]
  columns = max(len(r) for r in rows)
  grid = np.full((GRID_GAP_PX + len(rows) * (cell_h + GRID_GAP_PX),
                  GRID_GAP_PX + (1 + columns) * (cell_w + GRID_GAP_PX), channels), GRID_BACKGROUND, np.uint8)
  pixels = np.round(np.clip(images01_NHWC, 0, 1) * 255).astype(np.uint8)
  upscaled = pixels.repeat(scale, axis=1).repeat(scale, axis=2)
  for r, members in enumerate(rows):
    top = GRID_GAP_PX + r * (cell_h + GRID_GAP_PX)
    for k, i in enumerate(members):
      left = GRID_GAP_PX + (1 + k) * (cell_w + GRID_GAP_PX)
      grid[top:top + cell_h, left:left + cell_w] = upscaled[i]
  # Labels: white text on black squares in the first column.
  picture = Image.fromarray(grid[..., 0] if channels == 1 else grid)
  draw = ImageDraw.Draw(picture)
  try:
    font = ImageFont.load_default(size=max(10, cell_h // 2))
  except (TypeError, ImportError, OSError):  # Pillow < 10.1 or no FreeType: the fixed bitmap font
    font = ImageFont.load_default()
  white = 255 if channels == 1 else (255, 255, 255)
  for r, c in enumerate(classes):
    top = GRID_GAP_PX + r * (cell_h + GRID_GAP_PX)
    black = 0 if channels == 1 else (0, 0, 0)
    draw.rectangle((GRID_GAP_PX, top, GRID_GAP_PX + cell_w - 1, top + cell_h - 1), fill=black)
    draw.text((GRID_GAP_PX + cell_w // 2, top + cell_h // 2), str(c), fill=white, font=font, anchor="mm")
  out = np.asarray(picture, np.uint8)
  return out[..., None] if out.ndim == 2 else out


def save_grid(path, images01_NHWC, labels_N) -> np.ndarray:
  """Writes the labelled grid of `images01_NHWC` (pixels in [0, 1], one label each) to `path` as a PNG; returns it
  (uint8[H', W', C], what TensorBoard gets)."""
  from PIL import Image  # as grid_image
  grid = grid_image(images01_NHWC, labels_N)
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  Image.fromarray(grid[..., 0] if grid.shape[-1] == 1 else grid).save(tmp, format="PNG")
  tmp.replace(path)  # a reader (or a crash) never sees half a PNG
  return grid


def save_samples(path, images01_NHWC, labels_N) -> list[pathlib.Path]:
  """The raw samples: FILE.npz (`images`, `labels`), or FILE.npy (images) and FILE.labels.npy (labels)."""
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  images = np.asarray(images01_NHWC, np.float32)
  labels = np.asarray(labels_N, np.int32)
  if path.suffix == ".npy":
    labels_path = path.with_suffix(".labels.npy")
    np.save(path, images)
    np.save(labels_path, labels)
    return [path, labels_path]
  with open(path, "wb") as f:  # a file object: np.savez would append .npz to a name without it
    np.savez(f, images=images, labels=labels)
  return [path]


def class_labels(classes, per_class: int) -> tuple[np.ndarray, np.ndarray]:
  """(labels int32[N], index int32[N]): each class `per_class` times, in order, and each image's rank k within its
  class, which with the class and the seed fixes its noise."""
  labels = np.repeat(np.asarray(classes, np.int32), per_class)
  index = np.tile(np.arange(per_class, dtype=np.int32), len(classes))
  return labels, index


# --- the compiled sampler ------------------------------------------------------------------------------------


class Sampler:
  """A DiT's sampler compiled for a layout's mesh: (params, labels, seed) -> images float32[N, H, W, C] in [0, 1].

  One jitted program: per-image noise from (seed, label, k), then the DiT task's `sample` (meshtrain/families/dit.py:
  Euler steps with classifier-free guidance), its rows split over the mesh's batch axes (the count is padded to a
  multiple of them); labels go in and images come out replicated, so every process of a multi-process run holds
  them all.
  """

  def __init__(self, layout, steps: int, guidance: float):
    self.layout, self.steps, self.guidance = layout, int(steps), float(guidance)
    mc = layout.cfg.model
    shape = (mc.image_size, mc.image_size, mc.channels)
    mesh = layout.mesh
    self.ways = math.prod(mesh.shape[a] for a in mesh_lib.BATCH_AXES)
    rows = NamedSharding(mesh, sharding.logical_to_spec(("act_batch", None, None, None), layout.rules))
    replicated = NamedSharding(mesh, P())

    def images(params, labels_N, index_N, seed):
      key = jax.random.key(seed)
      noise_NHWC = jax.vmap(lambda c, k: jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, c), k), shape,
                                                            jnp.float32))(labels_N, index_N)
      noise_NHWC = jax.lax.with_sharding_constraint(noise_NHWC, rows)
      out_NHWC = layout.task.sample(params, labels_N, noise_NHWC, self.steps, self.guidance)
      return jnp.clip((out_NHWC.astype(jnp.float32) + 1) / 2, 0, 1)

    self._images = jax.jit(images, in_shardings=(layout.state_sharding.params, replicated, replicated, replicated),
                           out_shardings=replicated)

  def __call__(self, params, labels_N, index_N, seed: int) -> np.ndarray:
    n = len(labels_N)
    padded = -(-n // self.ways) * self.ways
    pad = lambda a: np.concatenate([np.asarray(a, np.int32), np.zeros(padded - n, np.int32)])
    with self.layout.context():  # the model's activation constraints resolve against this mesh and its rules
      out = self._images(params, pad(labels_N), pad(index_N), np.uint32(seed))
    return np.asarray(jax.device_get(out))[:n]


def judge_for(data_name: str, image_shape):
  """The digits judge (meshtrain/inference/quality.py) for a run on digits, else None: it knows no other dataset's
  classes."""
  if data_name != digits.NAME or tuple(image_shape) != digits.IMAGE_SHAPE:
    return None
  return quality.judge()


def sample_workdir(cfg, workdir, step: int, asked: bool, classes, per_class: int, steps: int, guidance: float,
                   seed: int):
  """(images float32[N, H, W, C], labels int32[N], step): `per_class` samples of each of `classes` from the DiT run
  in `workdir` at `step` (or, unless `asked`, the newest if a live run's retention deleted it), on cfg's mesh."""
  mesh = mesh_lib.make_mesh(cfg.mesh)
  # The layout's batch is the grid, padded to the mesh's batch axes (as the sampler pads it), so layout's batch
  # check holds on any mesh; the training batch size plays no part in sampling.
  ways = math.prod(mesh.shape[a] for a in mesh_lib.BATCH_AXES)
  cfg.batch_size = -(-len(classes) * per_class // ways) * ways
  layout = layout_lib.build(cfg, mesh)
  params, _, step = checkpoint.read_params(workdir, step, asked, mesh=mesh, shardings=layout.state_sharding.params)
  labels, index = class_labels(classes, per_class)
  return Sampler(layout, steps, guidance)(params, labels, index, seed), labels, step
