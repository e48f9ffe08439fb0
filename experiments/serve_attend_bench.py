"""The engine's decode over the cache slots in use against the whole row (issue 27): the server's engine alone
(no HTTP) on a context longer than the requests use, every request at once, with the attention spans of
`Engine.attends` (64, 96, 128, 192, ...), with spans doubling from 128 (the engine's first ladder) and with the row
only; static batching through `Generator.generate` as the reference; and the engine's decode program alone, called
back to back with no host work between calls (what the program allows: the engine's gap below it is its
scheduling). Rounds alternate them (this machine's speed drifts between minutes); the
median round's ratios are reported. The tokens of the three engines are asserted equal on the CPU (bitwise
there); elsewhere the count of requests with equal tokens is reported (on a GPU another attention shape can flip a
near-tied bf16 argmax).

  python experiments/serve_attend_bench.py --workdir runs/bench_tiny --max-len 1024 [--requests 64]
      [--max-tokens 64] [--slots 8] [--rounds 3] [--out benchmarks/results/serve_attend_bench.json]

Prompts of 4-40 random byte ids, greedy, every request to its max_tokens: the rows use at most 48 + 64 slots of
their 1,000-odd.
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
  parser.add_argument("--requests", type=int, default=64)
  parser.add_argument("--max-tokens", type=int, default=64)
  parser.add_argument("--slots", type=int, default=8)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", default="benchmarks/results/serve_attend_bench.json")
  args = parser.parse_args()
  from meshtrain import config as config_lib
  from meshtrain.runtime import startup
  cfg = config_lib.base_config()
  cfg.cpu_devices = 1
  startup.start(cfg)
  import jax

  from meshtrain.inference.engine import Engine, Request
  from meshtrain.inference.generator import Generator, bucket
  prompts = make_prompts(args.requests)  # serve_bench.py's
  gen = Generator.from_workdir(args.workdir, max_len=args.max_len)
  spans, doubling, whole = (Engine(gen, slots=args.slots, max_queue=len(prompts)) for _ in range(3))
  # The engine's first spans doubled from 128 up to half the row (benchmarks/2026-12-04-serve-6.md).
  doubling.attends = [n for n in (128 << i for i in range(32)) if 2 * n <= doubling.cache_len] + [doubling.cache_len]
  whole.attends = [whole.cache_len]  # every call over the whole row, as before the spans
  for engine in (spans, doubling, whole):
    # The spans compared on the same rows: every call decodes all the slots (as before Engine.row_counts; the busy
    # rows are measured by serve_bench.py and decode_step_bench.py): a third of the programs to compile, which on a
    # GPU is most of this script's time.
    engine.row_counts = [engine.slots]
    engine.warm(max(len(p) for p in prompts))

  def engine_alone(engine):
    requests = [engine.submit(Request(prompt_ids=p, max_tokens=args.max_tokens)) for p in prompts]
    t0 = time.perf_counter()
    while not all(r.done for r in requests):
      engine.step()
    wall = time.perf_counter() - t0
    return round(sum(len(r.token_ids) for r in requests) / wall, 1), [r.token_ids for r in requests]

  def static():
    t0, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), args.slots):
      tokens += sum(len(x) for x in gen.generate(prompts[i:i + args.slots], args.max_tokens,
                                                  stop_at_eos=False).token_ids)
    return round(tokens / (time.perf_counter() - t0), 1)

  def program():
    """The spans engine's decode program alone, back to back with no host work between calls (as many steps as
    the engine runs, no prefills): tokens/s the decode program allows. Below static batching, the gap is in the
    program (per-row cache writes, per-row sampling); between it and the engine's, in the host's scheduling."""
    reach = max(bucket(len(p)) for p in prompts) + args.max_tokens
    call = spans._decode(spans.chunk, next(n for n in spans.attends if n >= reach), spans.slots)
    calls = -(-len(prompts) // args.slots) * -(-args.max_tokens // spans.chunk)
    t0 = time.perf_counter()
    for _ in range(calls):
      spans.state, out = call(spans.params, spans.state)
      tokens_KB = out["token"]
    tokens_KB.block_until_ready()
    return round(calls * spans.chunk * args.slots / (time.perf_counter() - t0), 1)

  static(), engine_alone(spans), engine_alone(doubling), engine_alone(whole), program()  # every program run once
  rounds = []
  for _ in range(args.rounds):
    (a, tokens_a), (c, tokens_c), (b, tokens_b) = engine_alone(spans), engine_alone(doubling), engine_alone(whole)
    s, d = static(), program()
    same = sum(a_ == b_ == c_ for a_, b_, c_ in zip(tokens_a, tokens_b, tokens_c))
    # Bitwise on the CPU (float32, tested); on a GPU the sliced attention is another kernel shape, whose bf16
    # rounding can flip a near-tied greedy choice, so there the share of identical requests is reported.
    assert same == len(prompts) or jax.default_backend() != "cpu", "the spans changed a token"
    rounds.append({"spans_tokens_per_s": a, "doubling_tokens_per_s": c, "whole_row_tokens_per_s": b,
                   "static_tokens_per_s": s, "spans_vs_whole_row": round(a / b, 3), "spans_vs_static": round(a / s, 3),
                   "doubling_vs_static": round(c / s, 3), "whole_row_vs_static": round(b / s, 3),
                   "requests_with_equal_tokens": same,
                   "decode_program_tokens_per_s": d, "decode_program_vs_static": round(d / s, 3)})
    print(rounds[-1], flush=True)
  median = sorted(rounds, key=lambda r: r["spans_vs_whole_row"])[len(rounds) // 2]
  out = {"device": jax.devices()[0].device_kind, "max_len": args.max_len, "cache_len": spans.cache_len,
         "attends": spans.attends, "doubling_attends": doubling.attends, "slots": spans.slots,
         "requests": args.requests, "max_tokens": args.max_tokens, "rounds": rounds, "median": median}
  pathlib.Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
  print(json.dumps(out["median"]))


if __name__ == "__main__":
  main()
