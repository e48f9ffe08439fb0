"""Look at the data a config trains on, before training.

  python -m meshtrain.data stats --config CONFIG --steps N [--json] [--config.KEY=VALUE ...]

reads the first N steps' batches as training would and prints, per source (each of data.mixture, or data.name):
documents, tokens, share of the tokens, loss tokens, padding fraction and bytes per token. --json prints one object
whose "sources" maps each source to {"documents", "tokens", "share", ...}.

  python -m meshtrain.data show --config CONFIG [--rows N] [--json] [--config.KEY=VALUE ...]

prints the first N rows of the first batch decoded, the tokens the loss trains on between ⟦ and ⟧ (all of packed
text; the completion of prompt/completion rows; the assistant's turns of chat rows).

For a text-to-image config (task=t2i), stats reports the captioned pictures instead: pictures per split, the first N
steps' pictures, distinct captions, caption bytes against model.text_len, pixel statistics, and for your own pictures
their original sizes and what was skipped.

Local files (data.name a path or glob) are converted on first use, as training would (meshtrain/data/files.py).
"""
import json

from meshtrain import cli, config as config_lib
from meshtrain.errors import ArgumentParser, UserError


@cli.command
def main(argv: list[str]) -> int:
  parser = ArgumentParser(prog="python -m meshtrain.data", description=__doc__.split("\n\n")[0])
  commands = parser.add_subparsers(dest="command", required=True)
  stats_parser = commands.add_parser("stats", help="per-source statistics of the first steps' batches")
  stats_parser.add_argument("--steps", type=int, default=10, help="how many steps' batches to read (default 10)")
  show_parser = commands.add_parser("show", help="the first rows of the first batch, decoded")
  show_parser.add_argument("--rows", type=int, default=3, help="how many rows to print (default 3)")
  for sub in (stats_parser, show_parser):
    sub.add_argument("--config", required=True, help="Python config file, e.g. configs/tiny.py")
    sub.add_argument("--json", action="store_true", help="print JSON instead of a table / text")
  args, overrides = parser.parse_known_args(argv)
  count = args.steps if args.command == "stats" else args.rows
  if count < 1:
    raise UserError(f"--{'steps' if args.command == 'stats' else 'rows'} {count}: pass a positive number")
  cfg = config_lib.load(args.config, overrides)
  task = cfg.get("task", "lm")
  if task not in ("lm", "t2i") or (task == "t2i" and args.command == "show"):
    raise UserError(f"task={task}: `python -m meshtrain.data {args.command}` reads text data (task=lm)"
                    + (" and, for stats, captioned pictures (task=t2i)" if args.command == "stats" else "")
                    + "; pictures a model draws are shown by python -m meshtrain.sample")
  from meshtrain.data import stats  # TFDS and grain: after the checks
  if task == "t2i":
    result = stats.image_stats(cfg, count)
    print(json.dumps(result) if args.json else stats.format_image_stats(result))
    return 0
  result = stats.stats(cfg, count) if args.command == "stats" else stats.show(cfg, count)
  if args.json:
    print(json.dumps(result, ensure_ascii=False))
  elif args.command == "stats":
    print(stats.format_stats(result))
  else:
    for row in result:
      print(f"--- row {row['row']} ({row['source']}, {row['tokens']} tokens)\n{row['text']}")
  return 0
