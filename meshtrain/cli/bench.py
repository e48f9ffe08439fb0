"""Benchmark the real train step: step time, tokens/s (images/s), model FLOPs, MFU against the device's peak.

  python -m meshtrain.bench --config configs/tiny.py [--config.KEY=VALUE ...] [--steps 10] [--json]

The step is the one `python -m meshtrain.train` runs (same layout, same compiled program), on one batch
loaded once, so data loading is not measured. Warm-up steps are excluded; every timed step is synchronised.
Peaks: a table of dense peaks for known GPUs; on CPU the matmul peak is measured here, in the same run, for the
run's dtype and device count, so MFU compares like with like.

`--loop N` then runs the real train loop (`meshtrain.train`: data loading, prefetch, metrics fetched one step
late) for N steps in a temporary workdir and reports loop efficiency: the loop's wall time per step divided by
the synchronised step time measured above. 1.00 means the host never makes the devices wait.

`--data-only` times the host input pipeline alone (`data.loader.local_batches`: the grain pipeline the loop
reads, whole global batches of this config, no devices) in tokens/s, and, for comparison, how fast the same
tokenizer encodes documents on the fly; then the train step as above (no `--loop`), to print the pipeline's rate
next to what the model consumes: `data_headroom` = pipeline tokens/s / step tokens/s.
"""
import json

from meshtrain import cli, config as config_lib
from meshtrain.errors import ArgumentParser, UserError


@cli.command
def main(argv: list[str]) -> int:
  parser = ArgumentParser(prog="python -m meshtrain.bench", description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--steps", type=int, default=10, help="timed steps")
  parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
  parser.add_argument("--loop", type=int, default=0, metavar="N",
                      help="also run the train loop for N steps and report its wall time / the step time")
  parser.add_argument("--tokens", default="", metavar="FILE.npy",
                      help="train on this fixed [batch_size, seq_len + 1] token batch (a peer's synthetic batch)")
  parser.add_argument("--data-only", action="store_true",
                      help="time the host input pipeline alone (tokens/s), then the step it feeds, for their ratio")
  parser.add_argument("--data-seconds", type=float, default=5.0, help="how long --data-only reads batches")
  parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
  args, overrides = parser.parse_known_args(argv)
  if args.steps < 1 or args.warmup < 0 or args.loop in (1, 2) or args.loop < 0 or not args.data_seconds > 0:
    raise UserError("--steps must be >= 1, --warmup >= 0, --loop 0 (off) or >= 3 and --data-seconds > 0")
  cfg = config_lib.load(args.config, overrides)
  if args.data_only and (args.loop or args.tokens):
    raise UserError("--data-only times the input pipeline and one fixed-batch step; drop --loop / --tokens")
  if cfg.task != "lm" and (args.data_only or args.tokens):
    raise UserError(f"--data-only and --tokens time a text pipeline and take token batches; task={cfg.task} has "
                    "neither: drop them")
  if args.data_only and cfg.data.name == "synthetic":
    raise UserError("--data-only times reading and tokenizing a dataset, and data.name=synthetic has none; use "
                    "a config with a TFDS dataset (e.g. configs/tiny_bpe.py)")
  from meshtrain import loop  # JAX loads only now: an argument mistake is refused in a fraction of a second
  from meshtrain.analysis import throughput  # likewise
  result = throughput.bench(cfg, args.steps, args.warmup, args.tokens, args.data_seconds if args.data_only else 0)
  if args.data_only:
    result["data_headroom"] = result["data_tokens_per_sec"] / result["tokens_per_sec"]
  if args.loop:
    result.update(loop.efficiency(cfg, args.loop, result["step_time_s"]))
  if args.json:
    print(json.dumps(result))
  else:
    for key, value in result.items():
      print(f"{key:>26}: {value:,.4g}" if isinstance(value, float) else f"{key:>26}: {value}")
  return 0
