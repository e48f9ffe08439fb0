"""Time to ready of `python -m meshtrain.serve`, and the first burst after it (issue 47), side by side in one run.

  .venv/bin/python experiments/serve_ready_bench.py --workdir runs/tiny [--python .venv-py3.13/bin/python]
      [--baseline-src DIR [--baseline-flags "--warm"]] [--slots 8]

For each server variant it starts the server, times "listening" and "serving" from the process start, reads how
many programs it compiled (/metrics), then sends 8 greedy requests of 56 tokens at once (the first burst) and the
same 8 one at a time. Variants: `--lazy`; the default (everything compiled before serving) with an empty
compilation cache and again with the cache that run filled (on the CPU the cache is on from jaxlib 0.12.1, and
before it for a one-device server, the default);
and, with --baseline-src (a checkout of an earlier commit), that checkout's server with --baseline-flags (`--warm`
for a checkout before serve warmed by default; '' for one after).
"""
import argparse
import concurrent.futures
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import openai


def start(python: str, src: str, workdir: str, args: list[str]):
  t0 = time.perf_counter()
  env = {**os.environ, "PYTHONPATH": src}
  proc = subprocess.Popen([python, "-m", "meshtrain.serve", "--workdir", workdir, "--port", "0", *args],
                          stderr=subprocess.PIPE, text=True, cwd=src, env=env)
  listening = None
  for line in proc.stderr:
    if "listening on" in line and listening is None:
      listening = time.perf_counter() - t0
    if match := re.search(r"serving \S+ on (http://\S+/v1)", line):
      threading.Thread(target=proc.stderr.read, daemon=True).start()
      return proc, match.group(1), listening, time.perf_counter() - t0
  raise SystemExit(f"the server did not start ({args})")


def measure(url: str, tokens: int) -> dict:
  client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
  prompts = [[10 + i, 20 + i, 30 + i] for i in range(8)]
  ask = lambda ids: client.completions.create(model=None, prompt=ids, max_tokens=tokens, temperature=0,
                                              extra_body={"ignore_eos": True})
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    list(pool.map(ask, prompts))
  burst = time.perf_counter() - t0
  t0 = time.perf_counter()
  for ids in prompts:
    ask(ids)
  alone = time.perf_counter() - t0
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    list(pool.map(ask, prompts))
  again = time.perf_counter() - t0
  metrics = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
  programs = re.search(r"^meshtrain_serve_compiled_programs (\S+)$", metrics, re.M)
  return {"first_burst_s": burst, "one_at_a_time_s": alone, "burst_again_s": again,
          "programs": int(float(programs.group(1))) if programs else None}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--python", default=sys.executable)
  ap.add_argument("--baseline-src", default=None, help="an earlier checkout whose warmed server is the baseline")
  ap.add_argument("--baseline-flags", default="--warm", help="the baseline's flags for a warmed server")
  ap.add_argument("--slots", default="8")
  ap.add_argument("--tokens", type=int, default=56)
  args = ap.parse_args()
  src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cache = tempfile.mkdtemp(prefix="xla-cache-")
  variants = [("lazy", src, ["--lazy"]), ("ready, empty cache", src, []), ("ready, cache filled", src, [])]
  if args.baseline_src:
    variants.append((f"baseline {args.baseline_flags or 'default'}", args.baseline_src,
                     shlex.split(args.baseline_flags)))
  rows = []
  for name, where, extra in variants:
    proc, url, listening, ready = start(args.python, where, args.workdir,
                                        ["--slots", args.slots, f"--config.compilation_cache_dir={cache}", *extra])
    try:
      row = {"variant": name, "listening_s": listening, "serving_s": ready, **measure(url, args.tokens)}
    finally:
      proc.kill()
      proc.wait()
    rows.append(row)
    print(json.dumps(row), flush=True)
  print(f"\n{'variant':22s} {'listening':>9s} {'serving':>8s} {'programs':>8s} {'1st burst':>9s} {'1 by 1':>7s} "
        f"{'ratio':>6s} {'again':>6s}")
  for r in rows:
    print(f"{r['variant']:22s} {r['listening_s'] or 0:9.1f} {r['serving_s']:8.1f} {r['programs'] or 0:8d} "
          f"{r['first_burst_s']:9.3f} {r['one_at_a_time_s']:7.3f} {r['one_at_a_time_s'] / r['first_burst_s']:6.2f} "
          f"{r['burst_again_s']:6.3f}")


if __name__ == "__main__":
  main()
