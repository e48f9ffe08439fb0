"""Generate text from a trained (or converted) model: a compiled prefill, then a KV-cache decode loop on the device.

  python -m meshtrain.generate --workdir W [--step N]
      (--prompt TEXT ... | --prompt-file F | --prompt-ids 1,2,3 | --messages CHAT.json)
      [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--max-len N] [--json]
      [--config.mesh.*=... --config.sharding.rules=... --config.cpu_devices=N]

Only the parameters are restored (meshtrain.checkpoint.load_params), straight into the shardings the logical rules
give them on this mesh: any mesh, whatever mesh trained them. The work is meshtrain/inference/generator.py's
Generator; this command prints its completions as they arrive (--json: one JSON object at the end).

Several processes (hosts): every process runs this same command (python -m meshtrain.launch --module
meshtrain.generate, srun, ...; meshtrain.runtime starts the distributed runtime as for train), the mesh spans every
process's devices, the parameters are restored sharded over it, and each process reads the same prompts. The
generated ids are gathered onto every process; process 0 alone prints them.

--messages: a conversation (a JSON list of {"role", "content"}) rendered by the run's chat template as transformers
renders it (meshtrain/data/chat.py), with the assistant's generation prompt.

Exit codes: 0 done, 2 a user mistake (bad prompt, length, sampling setting, missing checkpoint), one `error:` line
(from every process, before anything is compiled), 3 a process that never reached a barrier.
"""
import json
import pathlib

from meshtrain import cli, config as config_lib
from meshtrain.data import chat
from meshtrain.errors import ArgumentParser, UserError
from meshtrain.inference.sampling import Sampling
from meshtrain.runtime import startup

STREAM_EVERY = 16  # tokens per decode call when streaming: one host round trip per 16 tokens costs ~nothing


def parse_args(argv: list[str]):
  parser = ArgumentParser(prog="python -m meshtrain.generate", description=__doc__.split("\n\n")[0],
                          epilog="Mesh and sharding as for train: --config.mesh.tensor=8 --config.cpu_devices=8")
  parser.add_argument("--workdir", required=True, help="a training run's (or a converted model's) directory")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--prompt", nargs="+", action="extend", metavar="TEXT", help="one or more prompts")
  source.add_argument("--prompt-file", action="append", metavar="FILE",
                      help="a file whose text is one prompt (repeatable)")
  source.add_argument("--prompt-ids", action="append", metavar="IDS",
                      help="token ids of one prompt, e.g. 1,2,3 (repeatable)")
  source.add_argument("--messages", action="append", metavar="FILE", help='a conversation, a JSON list of {"role": '
                      '..., "content": ...}, rendered by the run\'s chat template (repeatable)')
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
  parser.add_argument("--top-k", type=int, default=0, help="sample from the K most likely ids (0: all)")
  parser.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of probability >= P")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--max-len", type=int, default=None,
                      help="longest prompt + completion in tokens (default: the run's seq_len, its trained context)")
  parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
  args, overrides = parser.parse_known_args(argv)
  if args.max_new_tokens <= 0:
    raise UserError(f"--max-new-tokens {args.max_new_tokens} must be at least 1")
  if args.max_len is not None and args.max_len < 2:
    raise UserError(f"--max-len {args.max_len} must be at least 2 (one prompt token and one new token)")
  Sampling(args.temperature, args.top_k, args.top_p).check(vocab_size=None)
  workdir = pathlib.Path(args.workdir).expanduser()
  from meshtrain import checkpoint  # Orbax (and JAX): only once the arguments are checked
  # The run's config (model shape, seq_len) from the checkpoint's meta item, before JAX starts.
  _, meta = checkpoint.run_meta(args.workdir, args.step, "a training run or of a converted model")
  saved = meta["config"]
  if (task := checkpoint.task_of(meta)) != "lm":
    raise UserError(f"{args.workdir} was trained with task={task}; generate needs a language model (task=lm); for a "
                    "diffusion transformer use python -m meshtrain.sample --workdir W --out FILE.png")
  cfg, args.dtype = config_lib.inference_config(overrides, "generation")
  prompts = read_prompts(args)
  return args, cfg, saved, workdir, prompts


def read_prompts(args) -> list:
  if args.prompt is not None:
    return list(args.prompt)
  if args.messages is not None:
    return chat.conversation_prompts(args.workdir, args.messages)
  if args.prompt_file is not None:
    prompts = []
    for path in args.prompt_file:
      try:
        prompts.append(pathlib.Path(path).expanduser().read_text(errors="surrogateescape"))
      except OSError as e:
        raise UserError(f"--prompt-file {path}: {e.strerror or e}") from e
    return prompts
  prompts = []
  for text in args.prompt_ids:
    parts = text.replace(" ", "").split(",") if text.strip() else []  # "": an empty prompt
    if not all(x.isdigit() and x.isascii() for x in parts):  # "1,,2", "1,-2", "1;2": refused, not guessed at
      raise UserError(f"--prompt-ids {text!r} must be comma-separated non-negative integers, e.g. 1,2,3")
    prompts.append([int(x) for x in parts])
  return prompts


@cli.command
def main(argv: list[str]) -> int:
  args, cfg, saved, workdir, prompts = parse_args(argv)
  from meshtrain.inference import generator, stream as stream_lib  # JAX: once the arguments are checked
  startup.start(cfg)  # XLA flags, CPU devices, the distributed runtime when several processes run: as train
  # Every process runs the same generation (same calls, same collectives); process 0 alone prints.
  results = stream_lib.results_stream(startup.is_main())
  gen = generator.Generator.from_config(cfg, workdir, args.step, max_len=args.max_len, dtype=args.dtype)
  sampling = Sampling(args.temperature, args.top_k, args.top_p)
  if args.json:
    output = gen.generate(prompts, args.max_new_tokens, sampling, args.seed)
    results.write(json.dumps(output.to_json()) + "\n")
    results.flush()
  else:
    stream = stream_lib.TextStream(gen, len(prompts), out=results, summary=startup.is_main())
    output = gen.generate(prompts, args.max_new_tokens, sampling, args.seed, stream_every=STREAM_EVERY,
                          on_tokens=stream)
    stream.close(output)
  return 0
