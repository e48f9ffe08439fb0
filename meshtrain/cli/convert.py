"""Hugging Face checkpoints in and out: Llama (3.x rotary scalings included), Mistral, Qwen2/2.5, Qwen3, Mixtral;
and diffusers' Flux.1 pipelines (dev, schnell).

  python -m meshtrain.convert from-hf HF_DIR --workdir W     # a model of those families -> meshtrain workdir (step 0)
  python -m meshtrain.convert to-hf --workdir W [--step N] --out HF_DIR
  python -m meshtrain.convert from-diffusers SRC --workdir W [--pipeline BASE] [--image-size PX]
      [--max-sequence-length L]                              # a Flux.1 pipeline (or a lone transformer) -> workdir
  python -m meshtrain.convert to-diffusers --workdir W [--step N] --out DIR   # FluxPipeline.from_pretrained(DIR)

from-hf writes W/checkpoints/0 (parameters only, meta `params_only`), W/config.json (the matching meshtrain
config) and W/tokenizer/ (the model's tokenizer files), so `python -m meshtrain.generate --workdir W` and
`train --config.init_from=W` work on it. to-hf writes safetensors, config.json (the family's architecture) and the
tokenizer, loadable by transformers' AutoModelForCausalLM and AutoTokenizer. from-diffusers writes the transformer
as W/checkpoints/0 and copies the frozen components (VAE, text encoders, tokenizers, scheduler) into W/pipeline/;
to-diffusers gives them back with the transformer of a step. All stream (a model larger than the free memory
converts) and leave nothing behind when they fail: meshtrain/interop/hf.py and diffusers_pipeline.py do the work.

Exit codes: 0 done, 2 a user mistake (a family or field that does not convert, weights that do not match their
config.json, an output that exists, a model the other format cannot hold, too little disk space for the output,
checked before writing) or a write the operating system refused, one `error:` line; 130 interrupted (Ctrl-C,
SIGTERM or SIGHUP, acted on between tensors: the output is removed, nothing is left behind; what a SIGKILL leaves
is removed by the next conversion).
"""
import sys

from meshtrain import cli
from meshtrain.errors import ArgumentParser, UserError
from meshtrain.interop import diffusers_pipeline, hf


@cli.command
def main(argv: list[str]) -> int:
  parser = ArgumentParser(prog="python -m meshtrain.convert", description=__doc__.split("\n\n")[0])
  commands = parser.add_subparsers(dest="command", required=True,
                                   metavar="{from-hf,to-hf,from-diffusers,to-diffusers}")
  p = commands.add_parser("from-hf", help="Hugging Face model directory (llama, mistral, qwen2, qwen3, mixtral) -> "
                                          "meshtrain workdir")
  p.add_argument("hf_dir", metavar="HF_DIR")
  p.add_argument("--workdir", required=True, help="new (or empty) directory for the converted model")
  p = commands.add_parser("to-hf", help="meshtrain workdir -> Hugging Face model directory (the family holding its "
                                        "features)")
  p.add_argument("--workdir", required=True)
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
  p.add_argument("--out", required=True, help="new (or empty) directory for the Hugging Face files")
  p = commands.add_parser("from-diffusers", help="diffusers Flux.1 pipeline directory (or a lone transformer with "
                                                 "--pipeline) -> meshtrain workdir")
  p.add_argument("src", metavar="SRC")
  p.add_argument("--workdir", required=True, help="new (or empty) directory for the converted pipeline")
  p.add_argument("--pipeline", default=None, help="for a lone transformer SRC: the Flux.1 pipeline whose VAE, text "
                                                  "encoders, tokenizers and scheduler it uses")
  p.add_argument("--image-size", type=int, default=diffusers_pipeline.DEFAULT_IMAGE_SIZE,
                 help="the pictures' side in pixels the model trains and samples at by default (default: 1024)")
  p.add_argument("--max-sequence-length", type=int, default=diffusers_pipeline.DEFAULT_TEXT_LEN,
                 help="T5's prompt length, FluxPipeline's max_sequence_length (default: 512)")
  p = commands.add_parser("to-diffusers", help="meshtrain workdir of a Flux.1 pipeline -> diffusers pipeline "
                                               "directory")
  p.add_argument("--workdir", required=True)
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
  p.add_argument("--out", required=True, help="new (or empty) directory for the pipeline")
  args = parser.parse_args(argv)
  try:
    with hf.Interrupts.deferred():
      return convert(args)
  except KeyboardInterrupt:
    print(f"interrupted: nothing was written ({args.workdir if args.command.startswith('from-') else args.out} was "
          "left as it was)", file=sys.stderr)
    return 130
  except OSError as e:  # the machine, not the input: a disk that filled up meanwhile, a file system that refuses
    raise UserError(f"{args.command} failed writing {e.filename or 'its output'}: {e.strerror or e}; nothing was "
                    "written (the partial output was removed)") from None


def convert(args) -> int:
  if args.command == "from-diffusers":
    target = diffusers_pipeline.from_diffusers(args.src, args.workdir, args.pipeline, args.image_size,
                                               args.max_sequence_length)
    print(f"converted {args.src} -> {target} (the transformer as step 0, the other components in "
          f"{target / diffusers_pipeline.PIPELINE_DIR}); sample with python -m meshtrain.sample --workdir {target}")
    return 0
  if args.command == "to-diffusers":
    target = diffusers_pipeline.to_diffusers(args.workdir, args.step, args.out)
    print(f"exported {args.workdir} -> {target}; load with diffusers.FluxPipeline.from_pretrained({str(target)!r})")
    return 0
  if args.command == "from-hf":
    target = hf.from_hf(args.hf_dir, args.workdir)
    print(f"converted {args.hf_dir} -> {target} (step 0, parameters only); generate with "
          f"python -m meshtrain.generate --workdir {target}, fine-tune with --config.init_from={target}")
  else:
    target, notes = hf.to_hf(args.workdir, args.step, args.out)
    for note in notes:
      print(f"note: {note}")
    print(f"exported {args.workdir} -> {target}; load with transformers.AutoModelForCausalLM.from_pretrained"
          f"({str(target)!r}) and AutoTokenizer.from_pretrained")
  return 0
