"""Sample a trained DiT: class-conditional images as a labelled PNG grid (and the raw samples), scored on digits.

  python -m meshtrain.sample --workdir W --out grid.png [--step N] [--classes 0,1,...] [--per-class K]
      [--steps S] [--guidance G] [--seed S] [--npy samples.npz]
      [--config.mesh.*=... --config.sharding.rules=... --config.cpu_devices=N]

Only the parameters are restored (meshtrain.checkpoint.load_params), straight into the shardings the run's
logical rules give them on this mesh (any mesh, whatever mesh trained them). The whole sampler (noise, `steps`
Euler steps from t = 1 to 0 with classifier-free guidance, meshtrain/tasks/dit.py `sample`) is one compiled device
program whose images are split over the mesh's batch axes. The defaults of --per-class, --steps, --guidance and
--seed are the run's `sample` settings (what the training-time grid used); --classes defaults to every class.

Image k of class c starts from the noise of (seed, c, k): the same image whatever other classes, counts or mesh
are asked for, so this command reproduces the grid the run drew at the same step and settings.

Outputs: the grid (--out, PNG: one row per class, its label on the left, pixels upscaled so 8x8 digits are
visible), optionally the samples (--npy: FILE.npz holds `images` float32[N, H, W, C] in [0, 1] and `labels`
int32[N], in the same order; FILE.npy holds the images, FILE.labels.npy the labels), and on stdout the digits
judge's sample accuracy and Frechet distance (meshtrain/quality.py) when the run trained on digits.

During training the same sampler runs as a hook (`SampleHook`, returned by the DiT task's `hooks`): at eval_every
and at the end it writes WORKDIR/samples/step_N.png, a TensorBoard image and, on digits, sample_accuracy and
sample_frechet into metrics.jsonl.

Exit codes: 0 done, 2 a user mistake (classes outside the model's labels, guidance < 0, a workdir of a language
model, missing checkpoint), one `error:` line.
"""
import math
import pathlib
import sys

import numpy as np

from meshtrain import config as config_lib, hooks
from meshtrain.errors import ArgumentParser, UserError

GRID_CELL_PX = 48  # images are upscaled (nearest neighbour, whole multiples) to at least this many pixels high
GRID_GAP_PX = 2    # between cells, in the background grey
GRID_BACKGROUND = 96  # mid-dark grey: apart from digits' black background and their white strokes
SAMPLES_DIR = "samples"  # under the workdir: the training-time grids, step_N.png


# --- the grid ------------------------------------------------------------------------------------------------


def grid_image(images01_NHWC, labels_N) -> np.ndarray:
  """uint8[H', W', C]: one row per class (ascending), its label in a square on the left, then that class's images
  in their order, each upscaled by a whole factor to >= GRID_CELL_PX pixels; C is the images' (1 or 3)."""
  from PIL import Image, ImageDraw, ImageFont  # pylint: disable=g-import-not-at-top
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
  from PIL import Image  # pylint: disable=g-import-not-at-top
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

  One jitted program: per-image noise from (seed, label, k), then meshtrain/tasks/dit.py `sample` (Euler steps with
  classifier-free guidance), its rows split over the mesh's batch axes (the count is padded to a multiple of
  them); labels go in and images come out replicated, so every process of a multi-process run holds them all.
  """

  def __init__(self, layout, steps: int, guidance: float):
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
    from meshtrain import mesh as mesh_lib, sharding  # pylint: disable=g-import-not-at-top
    from meshtrain.tasks import dit  # pylint: disable=g-import-not-at-top
    self.layout, self.steps, self.guidance = layout, int(steps), float(guidance)
    mc = layout.cfg.model
    shape = (mc.image_size, mc.image_size, mc.channels)
    mesh, model = layout.mesh, layout.model
    self.ways = math.prod(mesh.shape[a] for a in mesh_lib.BATCH_AXES)
    rows = NamedSharding(mesh, sharding.logical_to_spec(("act_batch", None, None, None), layout.rules))
    replicated = NamedSharding(mesh, P())

    def images(params, labels_N, index_N, seed):
      key = jax.random.key(seed)
      noise_NHWC = jax.vmap(lambda c, k: jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, c), k), shape,
                                                            jnp.float32))(labels_N, index_N)
      noise_NHWC = jax.lax.with_sharding_constraint(noise_NHWC, rows)
      out_NHWC = dit.sample(model, params, labels_N, noise_NHWC, self.steps, self.guidance)
      return jnp.clip((out_NHWC.astype(jnp.float32) + 1) / 2, 0, 1)

    self._images = jax.jit(images, in_shardings=(layout.state_sharding.params, replicated, replicated, replicated),
                           out_shardings=replicated)

  def __call__(self, params, labels_N, index_N, seed: int) -> np.ndarray:
    import jax  # pylint: disable=g-import-not-at-top
    n = len(labels_N)
    padded = -(-n // self.ways) * self.ways
    pad = lambda a: np.concatenate([np.asarray(a, np.int32), np.zeros(padded - n, np.int32)])
    with self.layout.context():  # the model's activation constraints resolve against this mesh and its rules
      out = self._images(params, pad(labels_N), pad(index_N), np.uint32(seed))
    return np.asarray(jax.device_get(out))[:n]


def judge_for(data_name: str, image_shape):
  """The digits judge (meshtrain/quality.py) for a run on digits, else None: it knows no other dataset's classes."""
  from meshtrain.data import digits  # pylint: disable=g-import-not-at-top
  if data_name != digits.NAME or tuple(image_shape) != digits.IMAGE_SHAPE:
    return None
  from meshtrain import quality  # pylint: disable=g-import-not-at-top
  return quality.judge()


class SampleHook(hooks.Periodic):
  """At eval_every and at the end of a DiT run: sample.per_class images of every class with the run's `sample`
  settings, write WORKDIR/samples/step_N.png and the TensorBoard image `samples`, and on digits log sample_accuracy
  and sample_frechet (meshtrain/quality.py) to metrics.jsonl. The DiT task returns it from `hooks(run)`."""

  def __init__(self, cfg):
    super().__init__(cfg.eval_every)
    self._sampler = None
    self._judge = None
    self._warned = False

  def run_at(self, step: int, run) -> None:
    import jax  # pylint: disable=g-import-not-at-top
    cfg, s = run.cfg, run.cfg.sample
    run.beat(step, "sampling images")
    if self._sampler is None:
      self._sampler = Sampler(run.layout, s.steps, s.guidance)
    labels, index = class_labels(range(cfg.model.num_classes), s.per_class)
    images = self._sampler(run.params, labels, index, s.seed)  # every process: one program over the whole mesh
    if jax.process_index() != 0:
      return
    path = pathlib.Path(run.workdir) / SAMPLES_DIR / f"step_{step}.png"
    try:
      grid = save_grid(path, images, labels)
      run.writer.image("samples", grid, step)
    except ImportError as e:  # e.g. the GPU machines carry no pillow: the run goes on without pictures
      if not self._warned:
        run.writer.print(f"step {step}: no sample grid ({e}); pip install pillow to get one")
      self._warned, path = True, None
    if self._judge is None:
      self._judge = judge_for(cfg.data.name, images.shape[1:]) or False
    if self._judge:
      scores = self._judge.score(images, labels)
      run.writer.write({"step": step, **scores})
      run.writer.print(f"step {step}: sample accuracy {scores['sample_accuracy']:.3f}, Frechet distance "
                       f"{scores['sample_frechet']:.2f}" + (f" ({path})" if path else ""))
    elif path:
      run.writer.print(f"step {step}: samples in {path}")


# --- command line --------------------------------------------------------------------------------------------

# What a sampling command may change: where and how it runs, never the model (that comes from the checkpoint).
OVERRIDABLE = ("mesh.", "sharding.", "cpu_devices", "xla_flags", "compilation_cache_dir")


def parse_classes(text: str, num_classes: int) -> list[int]:
  try:
    classes = [int(x) for x in text.replace(" ", "").split(",") if x]
  except ValueError as e:
    raise UserError(f"--classes {text!r} must be comma-separated class numbers, e.g. 0,1,2") from e
  if not classes:
    raise UserError(f"--classes {text!r} names no class; give e.g. 0,1,2 (or leave it out for all "
                    f"{num_classes})")
  outside = [c for c in classes if not 0 <= c < num_classes]
  if outside:
    raise UserError(f"--classes {text!r}: {', '.join(map(str, outside))} outside the model's labels "
                    f"0..{num_classes - 1} (model.num_classes={num_classes})")
  return list(dict.fromkeys(classes))  # each class once, in the order given


def parse_args(argv: list[str]):
  """(args, cfg, workdir, step): arguments checked, the run's config with this machine's mesh settings."""
  parser = ArgumentParser(prog="python -m meshtrain.sample", description=__doc__.split("\n\n")[0],
                          epilog="Mesh and sharding as for train: --config.mesh.data=8 --config.cpu_devices=8")
  parser.add_argument("--workdir", required=True, help="a DiT training run's directory")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
  parser.add_argument("--classes", default=None, help="comma-separated classes, one grid row each (default: all)")
  parser.add_argument("--per-class", type=int, default=None,
                      help="images per class (default: the run's sample.per_class)")
  parser.add_argument("--steps", type=int, default=None, help="Euler steps (default: the run's sample.steps)")
  parser.add_argument("--guidance", type=float, default=None,
                      help="classifier-free guidance scale >= 0; 0 unconditional, 1 conditional (default: the run's)")
  parser.add_argument("--seed", type=int, default=None, help="noise seed (default: the run's sample.seed)")
  parser.add_argument("--out", required=True, help="the grid, a .png file")
  parser.add_argument("--npy", default=None, help="also write the samples: FILE.npz (images, labels) or FILE.npy")
  args, overrides = parser.parse_known_args(argv)
  if args.per_class is not None and args.per_class < 1:
    raise UserError(f"--per-class {args.per_class} must be at least 1")
  if args.steps is not None and args.steps < 1:
    raise UserError(f"--steps {args.steps} must be at least 1 (Euler steps from noise to an image)")
  if args.guidance is not None and not (args.guidance >= 0 and math.isfinite(args.guidance)):
    raise UserError(f"--guidance {args.guidance} must be a finite number >= 0 (0: unconditional, 1: conditional "
                    "only, above 1: stronger guidance)")
  if args.seed is not None and not 0 <= args.seed < 2**32:
    raise UserError(f"--seed {args.seed} must be in 0 .. {2**32 - 1}")
  if pathlib.Path(args.out).suffix.lower() != ".png":
    raise UserError(f"--out {args.out}: the grid is written as a PNG; name it FILE.png")
  if args.npy is not None and pathlib.Path(args.npy).suffix not in (".npz", ".npy"):
    raise UserError(f"--npy {args.npy}: name it FILE.npz (images and labels in one file) or FILE.npy (images; "
                    "labels in FILE.labels.npy)")
  for flag, value in (("--out", args.out), ("--npy", args.npy)):
    if value is not None and pathlib.Path(value).is_dir():
      raise UserError(f"{flag} {value} is a directory; give a file name")

  workdir = pathlib.Path(args.workdir).expanduser()
  from meshtrain import checkpoint  # pylint: disable=g-import-not-at-top
  # The run's config from the checkpoint's meta item, before JAX starts, so cpu_devices and XLA flags still apply.
  step, meta = checkpoint.run_meta(args.workdir, args.step, "a DiT training run (task=dit)")
  saved = meta["config"]
  if (task := checkpoint.task_of(meta)) != "dit":
    raise UserError(f"{args.workdir} was trained with task={task}; sample needs a DiT run (task=dit); use python -m "
                    "meshtrain.generate for a language model")
  cfg = run_config(saved, overrides)
  num_classes = cfg.model.num_classes
  args.classes = (parse_classes(args.classes, num_classes) if args.classes is not None
                  else list(range(num_classes)))
  s = cfg.sample
  args.per_class = args.per_class if args.per_class is not None else s.per_class
  args.steps = args.steps if args.steps is not None else s.steps
  args.guidance = args.guidance if args.guidance is not None else s.guidance
  args.seed = args.seed if args.seed is not None else s.seed
  return args, cfg, workdir, step


def run_config(saved: dict, overrides: list[str]):
  """The run's config (model, data, sample settings) on this machine: base_config's mesh, sharding and device
  settings (the training mesh may not exist here; one device by default), then --config overrides of those."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  cfg = config_lib.base_config()
  for key in ("task", "seed", "model", "data", "sample"):
    if key in saved:
      value = saved[key]
      cfg[key] = ml_collections.ConfigDict(value) if isinstance(value, dict) else value
  # One device by default on the CPU: simulated devices are threads sharing the same cores. --config.cpu_devices=8
  # with mesh overrides simulates a mesh, as train does.
  cfg.cpu_devices = 1
  for item in overrides:
    key = config_lib.apply_override(cfg, item)
    if not key.startswith(OVERRIDABLE):
      raise UserError(f"--config.{key} cannot be set for sampling (the model comes from the checkpoint); only "
                      "mesh.*, sharding.*, cpu_devices, xla_flags and compilation_cache_dir")
  cfg.optimizer.grad_accum_steps = 1
  return cfg


def main(argv: list[str] | None = None) -> int:
  try:
    args, cfg, workdir, step = parse_args(sys.argv[1:] if argv is None else argv)
    from meshtrain import runtime  # pylint: disable=g-import-not-at-top
    runtime.start(cfg)
    from meshtrain import checkpoint, layout as layout_lib, mesh as mesh_lib  # pylint: disable=g-import-not-at-top
    mesh = mesh_lib.make_mesh(cfg.mesh)
    # The layout's batch is the grid, padded to the mesh's batch axes (as the sampler pads it), so layout's batch
    # check holds on any mesh; the training batch size plays no part in sampling.
    ways = math.prod(mesh.shape[a] for a in mesh_lib.BATCH_AXES)
    cfg.batch_size = -(-len(args.classes) * args.per_class // ways) * ways
    layout = layout_lib.build(cfg, mesh)
    params, _ = checkpoint.load_params(workdir, step, mesh=mesh, shardings=layout.state_sharding.params)
    labels, index = class_labels(args.classes, args.per_class)
    images = Sampler(layout, args.steps, args.guidance)(params, labels, index, args.seed)
    import jax  # pylint: disable=g-import-not-at-top
    if jax.process_index() != 0:
      return 0
    try:
      save_grid(args.out, images, labels)
      written = [pathlib.Path(args.out)] + (save_samples(args.npy, images, labels) if args.npy else [])
    except OSError as e:
      raise UserError(f"cannot write the samples: {e.strerror or e} ({e.filename})") from e
    line = (f"step {step}: {len(images)} samples ({args.per_class} of each of classes "
            f"{','.join(map(str, args.classes))}; {args.steps} steps, guidance {args.guidance:g}, seed {args.seed}) "
            f"-> {', '.join(map(str, written))}")
    judge = judge_for(cfg.data.name, images.shape[1:])
    if judge is not None and len(images) >= 2:
      scores = judge.score(images, labels)
      line += (f"; sample accuracy {scores['sample_accuracy']:.3f}, Frechet distance "
               f"{scores['sample_frechet']:.2f} (digits judge)")
    print(line)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  from meshtrain import runtime
  runtime.run_main(main)
