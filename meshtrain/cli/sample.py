"""Sample a trained image model: pictures of text prompts (task=t2i), or class-conditional images (task=dit) as a
labelled PNG grid (and the raw samples), scored on digits.

  python -m meshtrain.sample --workdir W --prompt "a green square" [--prompt ...] [--prompts FILE] [--n K]
      --out grid.png [--step N] [--steps S] [--guidance G] [--seed S] [--npy samples.npz]
  python -m meshtrain.sample --workdir W --out grid.png [--step N] [--classes 0,1,...] [--per-class K]
      [--steps S] [--guidance G] [--seed S] [--npy samples.npz]
  either with [--config.mesh.*=... --config.sharding.rules=... --config.cpu_devices=N]
  a Flux.1 workdir (convert from-diffusers) also takes [--size WxH] [--max-sequence-length L] [--latents FILE.npy]

Text-to-image: --prompt (repeatable) or --prompts FILE (a prompt per line) are the grid's rows, --n the pictures per
prompt; picture k starts from the noise of (seed, k), the same alone or beside others.

Only the parameters are restored, into the shardings the run's rules give them on this mesh (any mesh), and
sampled by meshtrain/inference/{t2i,dit}_sampler.py. --n, --per-class, --steps, --guidance and --seed default to the
run's `sample` settings, --classes to all. Outputs: the grid (--out, PNG), optionally the samples (--npy: FILE.npz
with `images` float32[N, H, W, C] in [0, 1] and `labels` int32[N] (the class, or the prompt's number), or FILE.npy
and FILE.labels.npy), and the judge's scores on digits (accuracy, Frechet distance) and shapes (held-out captions).

The run may still be training: a checkpoint its retention deletes while it is read is replaced by the newest one
(the step sampled is the one printed); with --step N, that step or an error.

Exit codes: 0 done, 2 a user mistake (classes outside the model's labels, guidance < 0, a workdir of a language
model, missing checkpoint, a --step deleted while it was read), one `error:` line.
"""
import math
import pathlib

from meshtrain import cli
from meshtrain.errors import ArgumentParser, UserError
from meshtrain.inference import dit_request


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
  parser.add_argument("--prompt", action="append", default=[], help="a text prompt (t2i; repeat for several rows)")
  parser.add_argument("--prompts", default=None, help="a file of prompts, one per line (t2i)")
  parser.add_argument("--n", type=int, default=None, help="pictures per prompt (t2i; default: sample.per_prompt)")
  parser.add_argument("--classes", default=None, help="comma-separated classes, one grid row each (default: all)")
  parser.add_argument("--per-class", type=int, default=None,
                      help="images per class (default: the run's sample.per_class)")
  parser.add_argument("--steps", type=int, default=None, help="Euler steps (default: the run's sample.steps)")
  parser.add_argument("--guidance", type=float, default=None,
                      help="classifier-free guidance scale >= 0; 0 unconditional, 1 conditional (default: the run's)")
  parser.add_argument("--seed", type=int, default=None, help="noise seed (default: the run's sample.seed)")
  parser.add_argument("--out", required=True, help="the grid, a .png file")
  parser.add_argument("--npy", "--out-npy", default=None,
                      help="also write the samples: FILE.npz (images, labels) or FILE.npy")
  dit_request.add_flux_arguments(parser)
  args, overrides = parser.parse_known_args(argv)
  for flag, value in (("--per-class", args.per_class), ("--n", args.n)):
    if value is not None and value < 1:
      raise UserError(f"{flag} {value} must be at least 1")
  args.prompt = dit_request.prompts(args.prompt, args.prompts)
  if args.steps is not None and args.steps < 1:
    raise UserError(f"--steps {args.steps} must be at least 1 (Euler steps from noise to an image)")
  if args.guidance is not None and not (args.guidance >= 0 and math.isfinite(args.guidance)):
    raise UserError(f"--guidance {args.guidance} must be a finite number >= 0 (0: unconditional, 1: conditional "
                    "only, above 1: stronger guidance)")
  if args.seed is not None and not 0 <= args.seed < 2**32:
    raise UserError(f"--seed {args.seed} must be in 0 .. {2**32 - 1}")
  dit_request.check_outputs(args.out, args.npy)

  workdir = pathlib.Path(args.workdir).expanduser()
  from meshtrain import checkpoint  # Orbax (and JAX) only once the arguments are checked
  # The run's config from the checkpoint's meta item, before JAX starts, so cpu_devices and XLA flags still apply.
  step, meta = checkpoint.run_meta(args.workdir, args.step, "an image model's training run (task=t2i or dit)")
  saved = meta["config"]
  if (task := checkpoint.task_of(meta)) not in ("dit", "t2i"):
    raise UserError(f"{args.workdir} was trained with task={task}; sample needs an image model (task=t2i or dit); "
                    "use python -m meshtrain.generate for a language model")
  cfg = dit_request.run_config(saved, overrides)
  dit_request.flux_request(args, cfg.model)
  for name in ("steps", "guidance", "seed"):  # the run's own sample settings unless given
    setattr(args, name, getattr(args, name) if getattr(args, name) is not None else cfg.sample[name])
  if task == "t2i":
    if args.classes is not None or args.per_class is not None:
      raise UserError(f"{args.workdir} is a text-to-image run: give --prompt TEXT (and --n), not --classes or "
                      "--per-class")
    if not args.prompt:
      raise UserError(f"{args.workdir} is a text-to-image run: give --prompt TEXT (repeatable) or --prompts FILE")
    args.n = args.n if args.n is not None else cfg.sample.per_prompt
    dit_request.check_request(cfg, len(args.prompt) * args.n, args.steps)
    return args, cfg, workdir, step
  if args.prompt or args.n is not None:
    raise UserError(f"{args.workdir} is a class-conditional DiT (task=dit): give --classes and --per-class, not "
                    "--prompt or --n")
  num_classes = cfg.model.num_classes
  args.classes = (parse_classes(args.classes, num_classes) if args.classes is not None
                  else list(range(num_classes)))
  args.per_class = args.per_class if args.per_class is not None else cfg.sample.per_class
  dit_request.check_request(cfg, len(args.classes) * args.per_class, args.steps)
  return args, cfg, workdir, step


@cli.command
def main(argv: list[str]) -> int:
  args, cfg, workdir, step = parse_args(argv)
  from meshtrain.inference import dit_sampler, t2i_sampler  # JAX: once the arguments are checked
  from meshtrain.runtime import startup  # likewise
  startup.start(cfg)
  if cfg.task == "t2i":
    pictures, step = t2i_sampler.sample_workdir(cfg, workdir, step, args.step is not None, args.prompt, args.n,
                                                args.steps, args.guidance, args.seed, args)
    if startup.is_main():
      written = t2i_sampler.write(args.out, args.npy, pictures, args.prompt)
      print(t2i_sampler.summary(step, pictures, args.prompt, written, args.steps, args.guidance, args.seed,
                                cfg.data.name))
    return 0
  images, labels, step = dit_sampler.sample_workdir(cfg, workdir, step, args.step is not None, args.classes,
                                                    args.per_class, args.steps, args.guidance, args.seed)
  if not startup.is_main():
    return 0
  try:
    dit_sampler.save_grid(args.out, images, labels)
    written = [pathlib.Path(args.out)] + (dit_sampler.save_samples(args.npy, images, labels) if args.npy else [])
  except OSError as e:
    raise UserError(f"cannot write the samples: {e.strerror or e} ({e.filename})") from e
  line = (f"step {step}: {len(images)} samples ({args.per_class} of each of classes "
          f"{','.join(map(str, args.classes))}; {args.steps} steps, guidance {args.guidance:g}, seed {args.seed}) "
          f"-> {', '.join(map(str, written))}")
  judge = dit_sampler.judge_for(cfg.data.name, images.shape[1:])
  if judge is not None and len(images) >= 2:
    scores = judge.score(images, labels)
    line += (f"; sample accuracy {scores['sample_accuracy']:.3f}, Frechet distance "
             f"{scores['sample_frechet']:.2f} (digits judge)")
  print(line)
  return 0
