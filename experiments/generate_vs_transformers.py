"""meshtrain.generate against transformers' generate, side by side in one process: same weights, same prompts,
greedy, 128 new tokens, batch 1 and 8, on the CPU; prefill and decode timed separately.

  python experiments/generate_vs_transformers.py [--shapes tiny,125m] [--batches 1,8] [--new-tokens 128]
      [--prompt-len 32] [--rounds 3] [--torch-threads N] [--json benchmarks/results/generate_vs_transformers.json]

Weights: meshtrain's random init (model.init=normal, float32) of each preset shape, saved as a params-only workdir
(the format `convert from-hf` writes) and exported with `meshtrain.convert to-hf`, which transformers loads with
LlamaForCausalLM.from_pretrained: both sides run exactly the same numbers. Prompts: byte tokens of the first
`prompt-len` bytes of 8 standard-library source files (one per row), the same ids to both.

meshtrain: `Generator.from_workdir` on one CPU device (stop_at_eos=False: every row makes all its tokens).
  prefill = the compiled prefill call (prompt -> cache + first token), decode = the on-device loop for the other
  new tokens; decode tokens/s = batch x (new tokens - 1) / decode time.
transformers: torch on the CPU, `model.generate(do_sample=False, use_cache=True, min_new_tokens=max_new_tokens)`
  (no EOS stop either). Its prefill = one forward of the prompt with use_cache=True, timed on its own; its decode
  = generate's total - that prefill, for the same batch x (new tokens - 1) tokens.
Each configuration: one warm-up of each (meshtrain compiles there), then `rounds` rounds, each timing meshtrain then
transformers back to back (interleaved, so both see the same machine: on a shared VM the speed of either drifts
by 20% or more over minutes); reported: the medians, and the decode speedup as the median of the per-round ratios.
The greedy tokens of the two are compared (how many of the new tokens agree before the first difference):
random weights give near-uniform logits, so a late divergence from float rounding is possible and reported.

Memory-bandwidth bound (125m, batch 1): one decode token reads every parameter once (the tied embedding as the
output projection; its lookup is one row) and the filled KV cache; the bound is measured bandwidth / those bytes.
The bandwidth is measured here: the best of a large numpy copy (one thread) and a large torch copy (all threads),
counting bytes read + written.
"""
import argparse
import json
import os
import pathlib
import statistics
import sys
import sysconfig
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 1)
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from meshtrain import (  # noqa: E402
  checkpoint,
  config as config_lib,
  presets,  # noqa: E402
)
from meshtrain.inference import generator  # noqa: E402
from meshtrain.interop import hf as hf_interop  # noqa: E402
from meshtrain.models.llama import ModelConfig, Transformer  # noqa: E402

SHAPES = {"tiny": "tiny", "125m": "125m"}


def prompts(count: int, length: int) -> list[list[int]]:
  """Byte ids of the first `length` bytes of `count` standard-library files (deterministic: sorted names)."""
  lib = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = sorted(p for p in lib.glob("*.py") if p.stat().st_size > length)[:count]
  return [list(p.read_bytes()[:length]) for p in files]


def make_workdir(shape: str, root: pathlib.Path, seq_len: int) -> tuple[pathlib.Path, pathlib.Path, dict]:
  """A params-only workdir of the random-init preset `shape` and its Hugging Face export."""
  import flax.linen as nn
  import jax.numpy as jnp
  cfg = config_lib.base_config()
  cfg.model = presets.model_config(shape)
  cfg.seq_len = seq_len
  model = Transformer(ModelConfig.from_config(cfg.model))
  params = jax.jit(lambda key: nn.meta.unbox(model.init(key, jnp.zeros((1, 1), jnp.int32))["params"]))(
      jax.random.key(0))
  workdir, hf_dir = root / f"{shape}_meshtrain", root / f"{shape}_hf"
  ckpt = checkpoint.Checkpointer(workdir, keep=1)
  try:
    ckpt.save(0, {"params": params}, {"config": cfg.to_dict(), "params_only": True,
                                      "tokenizer": {"kind": "byte", "fingerprint": "byte"},
                                      "source": "experiments/generate_vs_transformers.py random init"})
    ckpt.wait()
  finally:
    ckpt.close()
  hf_interop.to_hf(str(workdir), None, str(hf_dir))
  sizes = {"params": sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params)),
           "param_bytes": sum(a.nbytes for a in jax.tree.leaves(params))}
  return workdir, hf_dir, {**sizes, **cfg.model.to_dict()}


def run_meshtrain(gen, ids, new_tokens: int) -> dict:
  out = gen.generate(ids, new_tokens, stop_at_eos=False)
  return {"prefill_s": out.prefill_s, "decode_s": out.decode_s, "tokens": out.token_ids}


def run_transformers(model, ids, new_tokens: int) -> dict:
  """One prefill (a forward of the prompt with use_cache=True, timed on its own) and one generate; its decode time
  is generate's total minus that prefill."""
  import torch
  x = torch.tensor(ids, dtype=torch.long)
  kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                attention_mask=torch.ones_like(x), pad_token_id=0)
  with torch.inference_mode():
    t0 = time.perf_counter()
    model(x, use_cache=True)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = model.generate(x, **kwargs)
    total = time.perf_counter() - t0
  return {"prefill_s": prefill, "decode_s": total - prefill, "tokens": out[:, x.shape[1]:].tolist()}


def side_by_side(gen, hf, ids, new_tokens: int, rounds: int) -> tuple[dict, dict, list[float]]:
  """Interleaved rounds of both; (meshtrain medians, transformers medians, per-round decode time ratios)."""
  run_meshtrain(gen, ids, new_tokens)  # compiles, and the first run's one-off costs
  run_transformers(hf, ids, new_tokens)
  pairs = [(run_meshtrain(gen, ids, new_tokens), run_transformers(hf, ids, new_tokens)) for _ in range(rounds)]
  medians = [{"prefill_s": statistics.median(p[i]["prefill_s"] for p in pairs),
              "decode_s": statistics.median(p[i]["decode_s"] for p in pairs), "tokens": pairs[-1][i]["tokens"]}
             for i in (0, 1)]
  return medians[0], medians[1], [t["decode_s"] / m["decode_s"] for m, t in pairs]


def memory_bandwidth() -> dict:
  """Bytes/s of a 512 MiB copy (read + write), best of 5: numpy (one thread) and torch (its thread pool)."""
  import torch
  n = 512 << 20
  src, dst = np.ones(n // 8), np.empty(n // 8)
  best = {}
  for name, copy in (("numpy", lambda: np.copyto(dst, src)),
                     ("torch", lambda: t_dst.copy_(t_src))):
    if name == "torch":
      t_src, t_dst = torch.from_numpy(src), torch.from_numpy(dst)
    times = []
    for _ in range(5):
      t0 = time.perf_counter()
      copy()
      times.append(time.perf_counter() - t0)
    best[name] = 2 * n / min(times)
  return best


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
  """Per row, how many leading tokens agree: 'all' or the smallest prefix."""
  same = [next((i for i, (x, y) in enumerate(zip(r, s)) if x != y), len(r)) for r, s in zip(a, b)]
  return "all" if all(n == len(r) for n, r in zip(same, a)) else f"first {min(same)}"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--shapes", default="tiny,125m")
  parser.add_argument("--batches", default="1,8")
  parser.add_argument("--new-tokens", type=int, default=128)
  parser.add_argument("--prompt-len", type=int, default=32)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--json", default="", help="also write the results here")
  parser.add_argument("--torch-threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
  args = parser.parse_args()
  import torch
  import transformers
  if args.torch_threads:
    torch.set_num_threads(args.torch_threads)
  batches = [int(b) for b in args.batches.split(",")]
  rows, results = [], {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                       "jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                       "runs": []}
  bandwidth = memory_bandwidth()
  results["memory_bandwidth"] = bandwidth
  print(f"memory bandwidth (copy, read + write): numpy {bandwidth['numpy'] / 1e9:.1f} GB/s, "
        f"torch {bandwidth['torch'] / 1e9:.1f} GB/s; {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}",
        flush=True)
  with tempfile.TemporaryDirectory() as tmp:
    for shape in args.shapes.split(","):
      seq_len = args.prompt_len + args.new_tokens
      workdir, hf_dir, info = make_workdir(SHAPES[shape], pathlib.Path(tmp), seq_len)
      gen = generator.Generator.from_workdir(workdir, num_ids=info["vocab_size"])
      hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
      for batch in batches:
        ids = prompts(batch, args.prompt_len)
        mt, tr, ratios = side_by_side(gen, hf, ids, args.new_tokens, args.rounds)
        prompt_tokens, decode_tokens = batch * args.prompt_len, batch * (args.new_tokens - 1)
        run = {"shape": shape, "batch": batch, "params": info["params"], "agree": agreement(mt["tokens"], tr["tokens"])}
        for name, r in (("meshtrain", mt), ("transformers", tr)):
          run[name] = {"prefill_s": r["prefill_s"], "decode_s": r["decode_s"],
                       "prefill_tokens_per_sec": prompt_tokens / r["prefill_s"],
                       "decode_tokens_per_sec": decode_tokens / r["decode_s"]}
        run["decode_speedup"] = statistics.median(ratios)
        run["decode_speedup_rounds"] = ratios
        if batch == 1:
          # Bytes one decode token reads: every parameter, and the KV cache filled so far (on average half way).
          kv_bytes = 4 * 2 * info["num_layers"] * info["num_kv_heads"] * info["head_dim"] * (
              args.prompt_len + args.new_tokens / 2)
          run["bytes_per_token"] = info["param_bytes"] + kv_bytes
          run["bound_tokens_per_sec"] = max(bandwidth.values()) / run["bytes_per_token"]
        results["runs"].append(run)
        print(json.dumps(run), flush=True)
        rows.append(run)
  print()
  header = ("shape", "batch", "", "prefill tok/s", "decode tok/s", "decode ms/token", "greedy tokens agree")
  lines = [header]
  for r in rows:
    for name in ("meshtrain", "transformers"):
      m = r[name]
      lines.append((r["shape"] if name == "meshtrain" else "", str(r["batch"]) if name == "meshtrain" else "", name,
                    f"{m['prefill_tokens_per_sec']:,.0f}", f"{m['decode_tokens_per_sec']:,.0f}",
                    f"{m['decode_s'] / (args.new_tokens - 1) * 1e3:.2f}", r["agree"] if name == "meshtrain" else ""))
    lines.append(("", "", "meshtrain / transformers", "", f"{r['decode_speedup']:.2f}x", "",
                  "rounds " + " ".join(f"{x:.2f}" for x in r["decode_speedup_rounds"])))
    if "bound_tokens_per_sec" in r:
      lines.append(("", "", "memory-bandwidth bound", "", f"{r['bound_tokens_per_sec']:,.0f}", "",
                    f"{r['bytes_per_token'] / 1e6:,.0f} MB/token"))
  widths = [max(len(l[i]) for l in lines) for i in range(len(header))]
  for l in lines:
    print("  ".join(c.ljust(w) for c, w in zip(l, widths)).rstrip())
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
  main()
