"""Which attention spans the engine's decode programs should have (issue 27): the engine alone (no HTTP) with the
spans of `Engine.attends` (64, 96, 128, 192, ...) against spans doubling from 128 (what it had before) and from 64,
static batching through `Generator.generate` as the reference, in alternating rounds; the same tokens asserted.

  python experiments/serve_span_ladder.py --workdir runs/bench_tiny --max-len 1024 [--rounds 3]
      [--out experiments/serve_span_ladder.json]

serve_bench.py's 64 prompts (4-40 random byte ids), 64 greedy tokens each, 8 slots: the rows use at most 112 slots.
"""
import argparse
import json
import pathlib
import time

from serve_bench import make_prompts


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--max-len", type=int, default=1024)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", default="experiments/serve_span_ladder.json")
  args = parser.parse_args()
  from meshtrain import config as config_lib, runtime
  cfg = config_lib.base_config()
  cfg.cpu_devices = 1
  runtime.start(cfg)
  from meshtrain.inference.engine import Engine, Request
  from meshtrain.inference.generator import Generator
  prompts = make_prompts(64)
  gen = Generator.from_workdir(args.workdir, max_len=args.max_len)
  engines = {}
  for name, first in (("engine", None), ("doubling_from_128", 128), ("doubling_from_64", 64)):
    engine = Engine(gen, slots=8, max_queue=len(prompts))
    if first:
      engine.attends = [n for n in (first << i for i in range(32)) if 2 * n <= engine.cache_len] + [engine.cache_len]
    engine.warm(max(len(p) for p in prompts))
    engines[name] = engine

  def alone(engine):
    requests = [engine.submit(Request(prompt_ids=p, max_tokens=64)) for p in prompts]
    t0 = time.perf_counter()
    while not all(r.done for r in requests):
      engine.step()
    return sum(len(r.token_ids) for r in requests) / (time.perf_counter() - t0), [r.token_ids for r in requests]

  def static():
    t0, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), 8):
      tokens += sum(len(x) for x in gen.generate(prompts[i:i + 8], 64, stop_at_eos=False).token_ids)
    return tokens / (time.perf_counter() - t0)

  static(), [alone(e) for e in engines.values()]  # every program run once
  rounds = []
  for _ in range(args.rounds):
    s = static()
    results = {name: alone(e) for name, e in engines.items()}
    assert all(tokens == results["engine"][1] for _, tokens in results.values()), "a span changed a token"
    rounds.append({"static_tokens_per_s": round(s, 1),
                   **{f"{name}_vs_static": round(tps / s, 3) for name, (tps, _) in results.items()}})
    print(rounds[-1], flush=True)
  out = {"max_len": args.max_len, "attends": {n: e.attends for n, e in engines.items()}, "rounds": rounds}
  pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
  main()
