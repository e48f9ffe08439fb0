"""Where a server's warm-up goes (issue 47): each program of `Engine.programs()`, its compile (tracing, lowering and
XLA) and its first run, timed one by one in one process, as `python -m meshtrain.serve` would build the engine.

  .venv/bin/python experiments/serve_warm_profile.py --workdir runs/tiny [--slots 8] [--max-len N] [--config.KEY=V]

Arguments are the server's (meshtrain/cli/serve.py); it serves nothing, and compiles with the persistent cache off
(a program read back from it would time the cache, not the compiler). Prints a line per program, then the totals.
"""
import collections
import sys
import time

import numpy as np


def main(argv: list[str]) -> None:
  from meshtrain.cli import serve as serve_cli
  args, cfg, workdir, _ = serve_cli.parse_args(["--config.compilation_cache_dir=", *argv, "--lazy"])
  if args.task != "lm":
    raise SystemExit("error: serve_warm_profile times a language model's server programs")
  from meshtrain.inference import serving
  from meshtrain.runtime import startup
  startup.start(cfg)
  engine = serving.language_engine(workdir, cfg, args)
  programs = engine.programs()
  print(f"{len(programs)} programs: prefill rows {engine.prefill_rows}, decode rows {engine.row_counts}, "
        f"spans {engine.attends}", flush=True)
  totals = collections.defaultdict(float)
  for kind, *key in programs:
    t0 = time.perf_counter()
    if kind == "prefill":
      engine.prefills[tuple(key)] = engine._compile_prefill(*key)
      compiled = time.perf_counter()
      engine._prefill_rows(key[0], [], key[2], key[1])
    else:
      call = engine._decode(1, *key)
      compiled = time.perf_counter()
      engine.state, out = call(engine.params, engine.state)
      np.asarray(out["token"])
    ran = time.perf_counter()
    totals[f"{kind} compile"] += compiled - t0
    totals[f"{kind} first run"] += ran - compiled
    print(f"{kind} {tuple(key)}: compile {compiled - t0:.2f} s, first run {ran - compiled:.3f} s", flush=True)
  print("totals: " + ", ".join(f"{k} {v:.1f} s" for k, v in totals.items()))


if __name__ == "__main__":
  main(sys.argv[1:])
