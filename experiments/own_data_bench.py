"""Own data at scale: the conversion's peak memory against corpus size, and the tokenizing pass in 1 and 2 processes.

  python experiments/own_data_bench.py --out benchmarks/results/own_data_bench.json [--work /tmp/own_data_bench]

1. Writes JSON-lines corpora of the interpreter's standard-library files (each record one file, cycled with a
   counter so no two records are equal) of --small-mb and --large-mb, and converts each in a fresh process
   (meshtrain.data.files.prepare, what `--config.data.name=PATH` runs), reporting the child's peak RSS (ru_maxrss),
   the time and MB/s. Target: peak memory flat in corpus size, under 1 GB.
2. Trains a 4096-id byte-level BPE on a sample, then tokenizes the small corpus's train split with it (the token
   cache a run builds on first use) in 1 process, and in 2 processes on 127.0.0.1 (jax.distributed, each process a
   share of the documents, then joined), each in fresh data dirs holding the same converted dataset; reports the
   time of each and the ratio, and checks the two caches are byte-identical. Twice: with the processes sharing the
   machine's cores ("shared": one process's tokenizer threads already use them all), and with each process pinned
   to one core of its own ("pinned", RAYON_NUM_THREADS=1: one process per host, each with its host's cores).
   And one process with two local worker processes (data.tokenize_workers=2) against one, sharing the cores.
"""
import argparse
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

CONVERT = """
import json, sys, time, resource
from meshtrain import config as config_lib
from meshtrain.data import files
cfg = config_lib.load("configs/tiny.py", [f"--config.data.data_dir={sys.argv[2]}"])
t0 = time.perf_counter()
corpus, manifest = files.prepare(sys.argv[1], cfg.data, cfg.data.eval_fraction)
print(json.dumps({"seconds": time.perf_counter() - t0, "documents": manifest["documents"],
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

TOKENIZE = """
import json, sys, time
import jax
if len(sys.argv) > 5:
  jax.distributed.initialize(coordinator_address=sys.argv[5], num_processes=2, process_id=int(sys.argv[6]))
from meshtrain import config as config_lib
from meshtrain.data import select
cfg = config_lib.load("configs/tiny.py", [f"--config.data.name={sys.argv[1]}", f"--config.data.data_dir={sys.argv[2]}",
                                          f"--config.data.tokenizer={sys.argv[3]}", "--config.model.vocab_size=4096",
                                          f"--config.data.tokenize_workers={sys.argv[4]}"])
t0 = time.perf_counter()
src = select.make_source(cfg, "train", shuffle=True)
print(json.dumps({"seconds": time.perf_counter() - t0, "tokens": src.num_tokens}))
"""


def write_corpus(path: pathlib.Path, megabytes: int) -> int:
  """JSON lines of stdlib sources, `megabytes` MB; returns the record count."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  texts = [p.read_text(errors="replace") for p in sorted(root.rglob("*.py"))
           if "site-packages" not in p.parts][:3000]
  written, count = 0, 0
  with open(path, "w", encoding="utf-8") as f:
    while written < megabytes << 20:
      line = json.dumps({"text": f"# copy {count}\n" + texts[count % len(texts)]}) + "\n"
      f.write(line)
      written += len(line.encode())
      count += 1
  return count


def run(script: str, *args: str) -> dict:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
  out = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env=env, capture_output=True, text=True,
                       check=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def digest(data_dir: pathlib.Path) -> list[str]:
  return [hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(data_dir.rglob("*.tok-*"))
          if not p.name.startswith(".")]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "own_data_bench.json"))
  parser.add_argument("--work", default="/tmp/own_data_bench")
  parser.add_argument("--small-mb", type=int, default=200)
  parser.add_argument("--large-mb", type=int, default=2048)
  args = parser.parse_args()
  work = pathlib.Path(args.work)
  shutil.rmtree(work, ignore_errors=True)
  work.mkdir(parents=True)
  results = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "conversion": [], "tokenizing": {}}

  for mb in (args.small_mb, args.large_mb) if args.large_mb else (args.small_mb,):  # --large-mb 0: skip it
    corpus = work / f"corpus_{mb}mb.jsonl"
    records = write_corpus(corpus, mb)
    r = run(CONVERT, str(corpus), str(work / f"tfds_{mb}"))
    r.update(corpus_mb=mb, records=records, mb_per_s=round(mb / r["seconds"], 1))
    results["conversion"].append(r)
    print(f"conversion of {mb} MB ({records} records): {r['seconds']:.1f} s ({r['mb_per_s']} MB/s), peak RSS "
          f"{r['peak_rss_mb']:.0f} MB", flush=True)
    if mb == args.large_mb:
      shutil.rmtree(work / f"tfds_{mb}")
      corpus.unlink()

  # The BPE, trained on a sample (what `python -m meshtrain.tokenizer train` does on a dataset).
  sys.path.insert(0, str(REPO))
  from meshtrain.data import tokenization as tokenizer  # pylint: disable=g-import-not-at-top
  sample = [json.loads(line)["text"] for _, line in zip(range(2000), open(work / f"corpus_{args.small_mb}mb.jsonl"))]
  tokenizer.train_bpe(sample, 4096, work / "bpe")
  corpus = str(work / f"corpus_{args.small_mb}mb.jsonl")
  from meshtrain.runtime.launcher import free_port  # pylint: disable=g-import-not-at-top
  # "shared": the processes share this machine's cores (the tokenizer's threads use them all in one process);
  # "pinned": each process on one core of its own, as one process per host would have its host's cores.
  for mode in ("shared", "pinned"):
    dirs = {n: work / f"{mode}_{n}" for n in ("one", "two")}
    for d in dirs.values():  # the same converted dataset in each, so only the tokenizing differs
      shutil.copytree(work / f"tfds_{args.small_mb}", d)
      for p in list(d.rglob("meshtrain_index")):
        shutil.rmtree(p)
    pin = (lambda i: ["taskset", "-c", str(i)]) if mode == "pinned" else (lambda i: [])
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    if mode == "pinned":
      env["RAYON_NUM_THREADS"] = "1"
    def start(i, data_dir, *extra, workers=1):
      return subprocess.Popen([*pin(i), sys.executable, "-c", TOKENIZE, corpus, str(data_dir), str(work / "bpe"),
                               str(workers), *extra], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    [one] = [json.loads(start(0, dirs["one"]).communicate()[0].strip().splitlines()[-1])]
    address = f"127.0.0.1:{free_port()}"
    procs = [start(i, dirs["two"], address, str(i)) for i in range(2)]
    outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    two = {"seconds": max(o["seconds"] for o in outs), "tokens": outs[0]["tokens"]}
    identical = digest(dirs["one"]) == digest(dirs["two"])
    results["tokenizing"][mode] = {"corpus_mb": args.small_mb, "one_process": one, "two_processes": two,
                                   "speedup": round(one["seconds"] / two["seconds"], 2), "identical_cache": identical}
    print(f"tokenizing {args.small_mb} MB ({one['tokens']:,} tokens), {mode} cores: 1 process {one['seconds']:.1f} s, "
          f"2 processes {two['seconds']:.1f} s: {results['tokenizing'][mode]['speedup']}x; caches identical: "
          f"{identical}", flush=True)
    if mode == "shared":  # one process with two local worker processes (data.tokenize_workers=2), same cores
      workers_dir = work / "shared_workers"
      shutil.copytree(dirs["one"], workers_dir)
      for p in list(workers_dir.rglob("meshtrain_index")):
        shutil.rmtree(p)
      local = json.loads(start(0, workers_dir, workers=2).communicate()[0].strip().splitlines()[-1])
      same = digest(workers_dir) == digest(dirs["one"])
      results["tokenizing"]["local_workers"] = {"one_process_one_worker": one, "one_process_two_workers": local,
                                                "speedup": round(one["seconds"] / local["seconds"], 2),
                                                "identical_cache": same}
      print(f"tokenizing {args.small_mb} MB, 1 process: 1 worker {one['seconds']:.1f} s, 2 local workers "
            f"{local['seconds']:.1f} s: {results['tokenizing']['local_workers']['speedup']}x; caches identical: "
            f"{same}", flush=True)
  pathlib.Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
  shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  main()
