"""Serving benchmark (issue 27): vLLM's definitions, for (a) one request at a time through the server, (b) static
batches through generate.Generator (the ceiling), (c) the server with Poisson arrivals at several rates and all at
once.

  python experiments/serve_bench.py --workdir runs/tiny [--requests 32] [--max-tokens 32] [--slots 8]
      [--rates 2,8] [--out experiments/serve_bench.json]

Per request: TTFT (send to first token), TPOT ((last - first) / (tokens - 1)), ITL (every gap between streamed
chunks), e2e (send to last token); per run: p50 and p99 of each, requests/s and output tokens/s over the run's wall
time. The server runs in a subprocess (`python -m meshtrain.serve --port 0`); the requests are streamed
completions through the openai client, greedy, with prompts of 4-40 random byte ids. Run it on an otherwise idle
machine: the client shares the cores with the server.
"""
import argparse
import concurrent.futures
import json
import pathlib
import re
import subprocess
import sys
import threading
import time

import numpy as np
import openai


def start_server(workdir: str, slots: int):
  proc = subprocess.Popen([sys.executable, "-m", "meshtrain.serve", "--workdir", workdir, "--port", "0", "--slots",
                           str(slots), "--max-queue", "1024", "--warm"], stderr=subprocess.PIPE, text=True)
  for line in proc.stderr:
    if match := re.search(r"serving \S+ on (http://\S+/v1)", line):
      threading.Thread(target=proc.stderr.read, daemon=True).start()
      return proc, match.group(1)
  raise SystemExit(f"the server did not start (exit {proc.wait()})")


def one(client, ids, max_tokens):
  t0 = time.perf_counter()
  times, tokens = [], 0
  for chunk in client.completions.create(model=None, prompt=ids, max_tokens=max_tokens, temperature=0, stream=True,
                                         stream_options={"include_usage": True}):
    if chunk.choices and chunk.choices[0].text:
      times.append(time.perf_counter())
    if chunk.usage:
      tokens = chunk.usage.completion_tokens
  end = time.perf_counter()
  first = times[0] if times else end
  return {"ttft": first - t0, "e2e": end - t0, "tokens": tokens,
          "tpot": (end - first) / (tokens - 1) if tokens > 1 else 0.0, "itl": list(np.diff(times))}


def summary(results, wall):
  pct = lambda key: {f"{key}_p50": float(np.percentile([r[key] for r in results], 50)),
                     f"{key}_p99": float(np.percentile([r[key] for r in results], 99))}
  itl = [x for r in results for x in r["itl"]] or [0.0]
  out = {**pct("ttft"), **pct("tpot"), **pct("e2e"), "itl_p50": float(np.percentile(itl, 50)),
         "itl_p99": float(np.percentile(itl, 99)), "requests_per_s": len(results) / wall,
         "output_tokens_per_s": sum(r["tokens"] for r in results) / wall, "wall_s": wall}
  return {k: round(v, 4) for k, v in out.items()}


def server_run(client, prompts, max_tokens, rate):
  """Requests sent with Poisson arrivals at `rate` per second (inf: all at once)."""
  rng = np.random.default_rng(1)
  gaps = np.zeros(len(prompts)) if rate == float("inf") else rng.exponential(1 / rate, len(prompts))
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
    futures = []
    for ids, gap in zip(prompts, gaps):
      time.sleep(gap)
      futures.append(pool.submit(one, client, ids, max_tokens))
    results = [f.result() for f in futures]
  return summary(results, time.perf_counter() - t0)


def static_batches(workdir, prompts, max_tokens, batch):
  """(b): Generator.generate on batches of `batch` prompts, one after another (every row runs to its limit)."""
  from meshtrain import config as config_lib, runtime
  cfg = config_lib.base_config()
  cfg.cpu_devices = 1
  runtime.start(cfg)
  from meshtrain.inference.generator import Generator
  gen = Generator.from_workdir(workdir)
  gen.generate(prompts[:batch], max_tokens, stop_at_eos=False)  # compile
  t0 = time.perf_counter()
  tokens = 0
  for i in range(0, len(prompts), batch):
    out = gen.generate(prompts[i:i + batch], max_tokens, stop_at_eos=False)
    tokens += sum(len(x) for x in out.token_ids)
  wall = time.perf_counter() - t0
  return {"requests_per_s": round(len(prompts) / wall, 4), "output_tokens_per_s": round(tokens / wall, 4),
          "wall_s": round(wall, 4)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--requests", type=int, default=32)
  parser.add_argument("--max-tokens", type=int, default=32)
  parser.add_argument("--slots", type=int, default=8)
  parser.add_argument("--rates", default="2,8")
  parser.add_argument("--out", default="experiments/serve_bench.json")
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  prompts = [rng.integers(32, 127, int(n)).tolist() for n in rng.integers(4, 41, args.requests)]
  results = {"requests": args.requests, "max_tokens": args.max_tokens, "slots": args.slots}
  proc, url = start_server(args.workdir, args.slots)
  try:
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    one(client, prompts[0], 4)  # warm-up
    t0 = time.perf_counter()
    results["one_at_a_time"] = summary([one(client, ids, args.max_tokens) for ids in prompts[:8]],
                                       time.perf_counter() - t0)
    for rate in [float(r) for r in args.rates.split(",")] + [float("inf")]:
      results[f"server_rate_{rate:g}"] = server_run(client, prompts, args.max_tokens, rate)
      print(f"rate {rate:g}: {results[f'server_rate_{rate:g}']}", file=sys.stderr)
  finally:
    proc.terminate()
    proc.wait()
  results["static_batches"] = static_batches(args.workdir, prompts, args.max_tokens, args.slots)
  pathlib.Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
  print(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
