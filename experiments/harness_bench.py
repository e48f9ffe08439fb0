"""Scoring speed (issue 45): loglikelihood tokens/s of lm-evaluation-harness requests in-process (MeshLM, what
`python -m meshtrain.eval` runs) against a forward-and-loss program of the same model on the same shapes (what the
training eval step computes per batch: the logits and their cross-entropy), and through the server (echo, logprobs,
max_tokens 0, `--concurrency` requests in flight). Side by side in one run, one process each, every program compiled
before it is timed.

  python experiments/harness_bench.py --workdir runs/tiny [--requests 256] [--length 64] [--batch-size 8]
      [--concurrency 8] [--out benchmarks/results/harness_bench.json]

Requests: `requests` (context, continuation) pairs of `length` tokens in all (continuation 8), random ids, the
shapes a multiple-choice task sends. tokens/s counts every scored position (the context's too), as the forward's.
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


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--requests", type=int, default=256)
  parser.add_argument("--length", type=int, default=64)
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--concurrency", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default="benchmarks/results/harness_bench.json")
  args = parser.parse_args()
  import jax
  import jax.numpy as jnp
  import numpy as np
  import openai
  import optax

  from meshtrain.inference import generator, harness
  from meshtrain.inference.generator import place

  gen = generator.Generator.from_workdir(args.workdir, max_len=args.length + 1)
  rng = np.random.default_rng(0)
  ids = rng.integers(0, 256, (args.requests, args.length)).tolist()
  requests = [(None, row[:-8], row[-8:]) for row in ids]
  tokens = args.requests * (args.length - 1)
  lm = harness.MeshLM(gen, args.batch_size)

  def best(fn):
    fn()  # compiles
    times = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      fn()
      times.append(time.perf_counter() - t0)
    return min(times)

  in_process = best(lambda: lm._loglikelihood_tokens(requests))  # pylint: disable=protected-access

  B = lm.batch_size
  batch = np.asarray(ids[:B], np.int32)

  def forward_loss(params, tokens_BL):
    logits = gen.model.apply({"params": params}, tokens_BL[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens_BL[:, 1:]).sum()

  program = jax.jit(forward_loss)
  placed = place(batch, lm.rows_sharding)
  calls = -(-args.requests // B)
  forward = best(lambda: [program(gen.params, placed) for _ in range(calls)][-1].block_until_ready())

  served = None
  proc = subprocess.Popen([sys.executable, "-m", "meshtrain.serve", "--workdir", args.workdir, "--port", "0",
                           "--slots", str(args.concurrency), "--max-len", str(args.length + 1)],
                          stderr=subprocess.PIPE, text=True)
  try:
    for line in proc.stderr:
      if match := re.search(r"serving \S+ on (http://\S+/v1)", line):
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        break
    client = openai.OpenAI(base_url=match.group(1), api_key="none", max_retries=0, timeout=300)
    score = lambda row: client.completions.create(model=None, prompt=row, max_tokens=0, echo=True, logprobs=1)
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
      served = best(lambda: list(pool.map(score, ids)))
  finally:
    proc.terminate()
    proc.wait()

  results = {
      "command": "python experiments/harness_bench.py " + " ".join(sys.argv[1:]),
      "device": str(jax.devices()[0].device_kind), "requests": args.requests, "length": args.length,
      "batch_size": B, "forward_tokens_per_s": round(tokens / forward),
      "in_process_tokens_per_s": round(tokens / in_process),
      "in_process_vs_forward": round(forward / in_process, 3),
      "server_tokens_per_s": round(tokens / served), "server_vs_forward": round(forward / served, 3)}
  print(json.dumps(results, indent=1))
  pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
  main()
