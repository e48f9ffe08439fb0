"""A text-to-image run's samples: the compiled prompt sampler and the captioned PNG grid.
`python -m meshtrain.sample --prompt ...` and the training-time grid (meshtrain/hooks.py `PromptSampleHook`) use it.

The whole sampler (noise, Euler steps along the shifted schedule with classifier-free guidance against the empty
caption, meshtrain/families/t2i.py `sample`) is one compiled device program whose images are split over the mesh's
batch axes. Image i starts from the noise of (seeds[i], index[i]): the same picture whatever else shares its batch,
so a seed reproduces a picture alone, in a grid, or in a server batch.
"""
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from PIL import Image, ImageDraw, ImageFont

from meshtrain import checkpoint, layout as layout_lib, mesh as mesh_lib, sharding
from meshtrain.data import images as images_lib
from meshtrain.errors import UserError
from meshtrain.inference import dit_sampler, flux_pipeline, shapes_judge

GRID_CELL_PX = 96   # images are upscaled (nearest neighbour, whole multiples) to at least this many pixels
GRID_GAP_PX = 4
GRID_TEXT_PX = 18   # the band above each row holding its prompt
GRID_BACKGROUND = 255


def prompt_texts(captions: images_lib.Captions, prompts: list[str], per_prompt: int) -> tuple[dict, np.ndarray]:
  """(the text condition of N pictures as `captions` gives it, index int32[N]): each prompt `per_prompt` times, in
  order, and each image's rank within its prompt (with the seed, its noise)."""
  texts = {k: np.repeat(a, per_prompt, axis=0) for k, a in captions(prompts).items()}
  return texts, np.tile(np.arange(per_prompt, dtype=np.int32), len(prompts))


class Sampler:
  """(params, texts {key: [N, ...]} as images_lib.Captions gives them, seeds [N], index [N], guidance [N] or one) ->
  images float32[N, H, W, C] in [0, 1], `steps` Euler steps compiled for a layout's mesh; rows split over its batch
  axes (N padded to a multiple), inputs and outputs replicated. Guidance is an input, not compiled in: one program
  serves requests of any."""

  def __init__(self, layout, steps: int, guidance: float):
    self.layout, self.steps, self.guidance = layout, int(steps), float(guidance)
    mc = layout.cfg.model
    shape = (mc.image_size, mc.image_size, mc.channels)
    mesh = layout.mesh
    self.ways = math.prod(mesh.shape[a] for a in mesh_lib.BATCH_AXES)
    rows = NamedSharding(mesh, sharding.logical_to_spec(("act_batch", None, None, None), layout.rules))
    replicated = NamedSharding(mesh, P())

    def images(params, texts, seeds_N, index_N, guidance_N):
      noise_NHWC = jax.vmap(lambda s, k: jax.random.normal(jax.random.fold_in(jax.random.key(s), k), shape,
                                                            jnp.float32))(seeds_N, index_N)
      noise_NHWC = jax.lax.with_sharding_constraint(noise_NHWC, rows)
      out_NHWC = layout.task.sample(params, texts, noise_NHWC, self.steps, guidance_N)
      return jnp.clip((out_NHWC.astype(jnp.float32) + 1) / 2, 0, 1)

    self._images = jax.jit(images, in_shardings=(layout.state_sharding.params, *[replicated] * 4),
                           out_shardings=replicated)

  def __call__(self, params, texts: dict, seeds_N, index_N, guidance_N=None) -> np.ndarray:
    n = len(seeds_N)
    padded = -(-n // self.ways) * self.ways
    pad = lambda a, dtype: np.concatenate([np.asarray(a, dtype), np.zeros((padded - n, *np.shape(a)[1:]), dtype)])
    guidance_N = np.full(n, self.guidance) if guidance_N is None else guidance_N
    with self.layout.context():
      out = self._images(params, {k: pad(a, a.dtype) for k, a in texts.items()}, pad(seeds_N, np.uint32),
                         pad(index_N, np.int32),
                         pad(guidance_N, np.float32))
    return np.asarray(jax.device_get(out))[:n]


def grid_image(images01_NHWC, prompts: list[str]) -> np.ndarray:
  """uint8[H', W', 3]: one row per prompt (its images in order, len(images) / len(prompts) each), the prompt
  written in a band above its row."""
  images01_NHWC = np.asarray(images01_NHWC, np.float32)
  n, height, width, _ = images01_NHWC.shape
  per = n // len(prompts)
  scale = max(1, math.ceil(GRID_CELL_PX / height))
  cell_h, cell_w = height * scale, width * scale
  row_h = GRID_TEXT_PX + cell_h + GRID_GAP_PX
  grid = np.full((GRID_GAP_PX + len(prompts) * row_h, GRID_GAP_PX + per * (cell_w + GRID_GAP_PX), 3),
                 GRID_BACKGROUND, np.uint8)
  pixels = np.round(np.clip(images01_NHWC, 0, 1) * 255).astype(np.uint8)
  if pixels.shape[-1] == 1:
    pixels = pixels.repeat(3, axis=-1)
  upscaled = pixels.repeat(scale, axis=1).repeat(scale, axis=2)
  for r in range(len(prompts)):
    top = GRID_GAP_PX + r * row_h + GRID_TEXT_PX
    for k in range(per):
      left = GRID_GAP_PX + k * (cell_w + GRID_GAP_PX)
      grid[top:top + cell_h, left:left + cell_w] = upscaled[r * per + k]
  picture = Image.fromarray(grid)
  draw = ImageDraw.Draw(picture)
  try:
    font = ImageFont.load_default(size=GRID_TEXT_PX - 4)
  except (TypeError, ImportError, OSError):  # Pillow < 10.1 or no FreeType: the fixed bitmap font
    font = ImageFont.load_default()
  for r, prompt in enumerate(prompts):
    draw.text((GRID_GAP_PX, GRID_GAP_PX + r * row_h + 1), prompt, fill=(0, 0, 0), font=font)
  return np.asarray(picture, np.uint8)


def save_grid(path, images01_NHWC, prompts: list[str]) -> np.ndarray:
  """Writes the captioned grid as a PNG (atomically: a reader never sees half of one); returns it."""
  grid = grid_image(images01_NHWC, prompts)
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  Image.fromarray(grid).save(tmp, format="PNG")
  tmp.replace(path)
  return grid


def write(out, npy, pictures, prompts: list[str]) -> list[pathlib.Path]:
  """The grid (`out`, PNG) and, with `npy`, the pictures (FILE.npz: `images` in [0, 1] and `labels`, each
  picture's prompt number; or FILE.npy); the paths written. UserError when they cannot be written."""
  try:
    save_grid(out, pictures, prompts)
    per = len(pictures) // len(prompts)
    return [pathlib.Path(out)] + (dit_sampler.save_samples(npy, pictures, np.repeat(np.arange(len(prompts)), per))
                                  if npy else [])
  except OSError as e:
    raise UserError(f"cannot write the samples: {e.strerror or e} ({e.filename})") from e


def sample_workdir(cfg, workdir, step: int, asked: bool, prompts: list[str], per_prompt: int, steps: int,
                   guidance: float, seed: int, flux=None):
  """(images float32[N, H, W, C], step): `per_prompt` pictures of each prompt from the t2i run in `workdir` at
  `step` (or, unless `asked`, the newest if a live run's retention deleted it), on cfg's mesh. A Flux.1 pipeline's
  workdir (model.pipeline) by its pipeline, with `flux`'s size, max_sequence_length and latents."""
  if cfg.model.pipeline:
    return flux_pipeline.sample_workdir(workdir, step if asked else None, prompts, per_prompt, flux.size, steps,
                                        guidance, seed, flux.max_sequence_length, flux.latents)
  mesh = mesh_lib.make_mesh(cfg.mesh)
  ways = math.prod(mesh.shape[a] for a in mesh_lib.BATCH_AXES)
  cfg.batch_size = -(-len(prompts) * per_prompt // ways) * ways
  layout = layout_lib.build(cfg, mesh)
  params, _, step = checkpoint.read_params(workdir, step, asked, mesh=mesh, shardings=layout.state_sharding.params)
  texts, index = prompt_texts(images_lib.Captions(cfg.model), prompts, per_prompt)
  return Sampler(layout, steps, guidance)(params, texts, np.full(len(index), seed, np.uint32), index), step


def judged(data_name: str, pictures01_NHWC, prompts: list[str]) -> dict[str, float]:
  """On a `shapes` run whose prompts are all the dataset's kind of caption, what the independent judge
  (meshtrain/inference/shapes_judge.py) says of the pictures (`per` of each prompt, in order): accuracy on held-out
  and on seen captions; {} elsewhere."""
  judge = shapes_judge.judge_for(data_name, pictures01_NHWC.shape[1:], prompts)
  if judge is None:
    return {}
  captions = list(np.repeat(prompts, len(pictures01_NHWC) // len(prompts)))
  return judge.report(np.round(np.asarray(pictures01_NHWC) * 255).astype(np.uint8), captions)


def judged_line(scores: dict[str, float]) -> str:
  """The judge's scores in a few words ("" without any)."""
  parts = [f"{group} captions {scores[f'sample_{group}_accuracy']:.3f} (colour "
           f"{scores[f'sample_{group}_colour_accuracy']:.3f}, shape {scores[f'sample_{group}_shape_accuracy']:.3f})"
           for group in ("heldout", "seen") if f"sample_{group}_accuracy" in scores]
  return f"shapes judge: {'; '.join(parts)}" if parts else ""


def summary(step: int, pictures, prompts: list[str], written, steps: int, guidance: float, seed: int,
            data_name: str) -> str:
  """`python -m meshtrain.sample`'s line: what was drawn, where it went, and the judge's scores where it has one."""
  scores = judged_line(judged(data_name, pictures, prompts))
  return (f"step {step}: {len(pictures)} pictures ({len(pictures) // len(prompts)} of each of {len(prompts)} "
          f"prompts; {steps} steps, guidance {guidance:g}, seed {seed}) -> {', '.join(map(str, written))}"
          + (f"; {scores}" if scores else ""))
