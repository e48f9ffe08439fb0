"""Hugging Face checkpoints in and out: Llama (3.x rotary scalings included), Mistral, Qwen2/2.5, Qwen3, Mixtral.

  python -m meshtrain.convert from-hf HF_DIR --workdir W     # a model of those families -> meshtrain workdir (step 0)
  python -m meshtrain.convert to-hf --workdir W [--step N] --out HF_DIR

from-hf writes W/checkpoints/0 (parameters only, meta `params_only`), W/config.json (the matching meshtrain
config) and W/tokenizer/ (the model's tokenizer files), so `python -m meshtrain.generate --workdir W` and
`train --config.init_from=W` work on it. to-hf writes safetensors, config.json (the family's architecture) and the
tokenizer, loadable by transformers' AutoModelForCausalLM and AutoTokenizer. Both stream (a model larger than the
free memory converts) and leave nothing behind when they fail: meshtrain/interop/hf.py, which does the work.

Exit codes: 0 done, 2 a user mistake (a family or field that does not convert, weights that do not match their
config.json, an output that exists, a model the other format cannot hold, too little disk space for the output,
checked before writing) or a write the operating system refused, one `error:` line; 130 interrupted (Ctrl-C,
SIGTERM or SIGHUP, acted on between tensors: the output is removed, nothing is left behind; what a SIGKILL leaves
is removed by the next conversion).
"""
import sys

from meshtrain import cli
from meshtrain.errors import ArgumentParser, UserError
from meshtrain.interop import hf


@cli.command
def main(argv: list[str]) -> int:
  parser = ArgumentParser(prog="python -m meshtrain.convert", description=__doc__.split("\n\n")[0])
  commands = parser.add_subparsers(dest="command", required=True, metavar="{from-hf,to-hf}")
  p = commands.add_parser("from-hf", help="Hugging Face model directory (llama, mistral, qwen2, qwen3, mixtral) -> "
                                          "meshtrain workdir")
  p.add_argument("hf_dir", metavar="HF_DIR")
  p.add_argument("--workdir", required=True, help="new (or empty) directory for the converted model")
  p = commands.add_parser("to-hf", help="meshtrain workdir -> Hugging Face model directory (the family holding its "
                                        "features)")
  p.add_argument("--workdir", required=True)
  p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
  p.add_argument("--out", required=True, help="new (or empty) directory for the Hugging Face files")
  args = parser.parse_args(argv)
  try:
    with hf.Interrupts.deferred():
      return convert(args)
  except KeyboardInterrupt:
    print(f"interrupted: nothing was written ({args.workdir if args.command == 'from-hf' else args.out} was left as "
          "it was)", file=sys.stderr)
    return 130
  except OSError as e:  # the machine, not the input: a disk that filled up meanwhile, a file system that refuses
    raise UserError(f"{args.command} failed writing {e.filename or 'its output'}: {e.strerror or e}; nothing was "
                    "written (the partial output was removed)") from None


def convert(args) -> int:
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
