"""The first GPU call: meshtrain's benchmark of the LLaMA-3.2-1B and LLaMA-3-8B shapes on one GPU, bf16, synthetic data.

  python3 experiments/gpu_bench.py --wheels   # here, with internet: what the GPU machine lacks -> experiments/wheels
  python3 experiments/gpu_bench.py            # on the GPU machine, from the repository root (docs/development.md,
                                              # "The first GPU call")
  python3 experiments/gpu_bench.py --dry-run  # on a CPU: each step below at tiny shapes (CI, experiments/gpu_dryrun.sh)

One call, in order; each step that imports JAX is its own process, so only one holds the GPU at a time:
1. Set-up: the carried wheels (`WHEELS`) into a private folder with `pip install --target` (the machine's Python
   may not be writable), put on PYTHONPATH for every later step; then the imports the benchmark needs.
2. Smoke test (`--smoke`): jax.print_environment_info(); JAX started with every XLA flag meshtrain sets (an
   unknown flag aborts XLA); cuDNN attention, forward and backward, at both models' head shapes against XLA's.
   If cuDNN fails or disagrees, both models run with model.attention=xla and the summary says so.
3. llama1b (4 x 4,096 tokens, float32 parameters, bf16 compute), then llama8b (2 x 4,096 tokens, bf16 parameters
   and Adam moments: 8.0B x 6 bytes = 48 GB), each `python -m meshtrain.bench --json` with save_dots remat
   (`--remat none` or `full` to start elsewhere). At most one retry per model: with the next remat policy
   (none -> save_dots -> full) after an out-of-memory error, with XLA's attention after an error
   naming cuDNN; any other failure is deterministic and is not retried (another compile would fail the same
   way). Every attempt has its own log.
4. Results in $OUT (the device tool's folder that comes back; else runs/gpu_bench): gpu_bench.jsonl (one line per
   attempt), console.log (this output), setup.log (set-up and smoke test), NAME.REMAT.ATTENTION.log per attempt;
   at most 7 files, within the tool's 8.
The call ends within --budget seconds (default 540, under the tool's 600 s per command), whatever fails.

Through the device tool (docs/development.md, "The first GPU call"): run(carry=["experiments/wheels"], command="python3
experiments/gpu_bench.py", timeout_s=600), after `--wheels` here.
"""
import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
WHEEL_DIR = ROOT / "experiments" / "wheels"
# What `python -m meshtrain.bench` imports and the GPU machine lacks (Python 3.12, jax 0.11 + CUDA 13 plugin,
# flax, optax, orbax-checkpoint, chex, absl-py, tensorstore, numpy); its needs, absl-py and PyYAML, come with flax.
WHEELS = ("ml_collections==1.1.0",)
# JAX preallocates 75% of GPU memory by default; the 8B save_dots step is estimated at 95-103 GB of the H200's 141.
MEM_FRACTION = "0.95"
BENCH = {"--steps": "10", "--warmup": "3"}
COMMON = {"data.name": "synthetic", "model.dtype": "bfloat16", "mesh.data": "1", "mesh.fsdp": "1",
          "mesh.tensor": "1", "mesh.nodes.data": "1", "seq_len": "4096"}
MODELS = {  # name: (config file, overrides, seconds at most for one attempt)
    "llama1b": ("configs/llama1b.py", {"batch_size": "4"}, 210),
    "llama8b": ("configs/llama8b.py", {"batch_size": "2", "model.param_dtype": "bfloat16"}, 270),
}
REMATS = ("none", "save_dots", "full")  # each falls back to the next after running out of memory
MAX_ATTEMPTS = 2  # per model: time for one more compile, and at most 7 files in $OUT
# --dry-run: the same commands at shapes a CPU compiles in seconds, on one simulated device.
TINY_BENCH = {"--steps": "2", "--warmup": "1"}
TINY = {"seq_len": "128", "cpu_devices": "1", "model.num_layers": "2", "model.d_model": "128", "model.num_heads": "4",
        "model.num_kv_heads": "2", "model.head_dim": "32", "model.mlp_dim": "256", "model.vocab_size": "512"}
OUT_OF_MEMORY = re.compile(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|OOM when allocating")
JAX_OK = "smoke: jax ok"  # printed by the smoke test once JAX has started with meshtrain's flags
SMOKE_HEADS = ((32, 8, 64), (32, 8, 128))  # (H, K, E) of llama1b and llama8b


def bench_command(name: str, remat: str, attention: str, dry_run: bool) -> list[str]:
  config_file, overrides, _ = MODELS[name]
  options = {**BENCH, **(TINY_BENCH if dry_run else {})}
  settings = {**COMMON, **overrides, "model.remat": remat, "model.attention": attention, **(TINY if dry_run else {})}
  return [sys.executable, "-m", "meshtrain.bench", "--json", "--config", config_file,
          *(x for kv in options.items() for x in kv), *(f"--config.{k}={v}" for k, v in settings.items())]


def next_attempt(remat: str, attention: str, rc: int, log: str) -> tuple[str, str] | None:
  """(remat, attention) to try after a failed attempt, or None: full remat after running out of memory; XLA's
  attention after an error naming cuDNN (the smoke test passed, but these shapes failed); nothing after any other
  error, which would only recur after another compile, nor after running out of time."""
  if rc in (0, 124):
    return None
  if OUT_OF_MEMORY.search(log) and remat != REMATS[-1]:
    return REMATS[REMATS.index(remat) + 1], attention
  if attention == "auto" and re.search("cudnn", "\n".join(log.splitlines()[-40:]), re.IGNORECASE):
    return remat, "xla"
  return None


def summarize(rows: list[dict], attention_note: str) -> str:
  """The table to record (docs/development.md, "The first GPU call"); never fails, whatever succeeded."""
  lines = [f"attention: {attention_note}"]
  ok = [r for r in rows if r.get("ok")]
  for r in ok:
    x = r["result"]
    peak = x.get("device_peak_bytes_in_use")
    mem = x.get("memory_per_device_bytes", {})
    xla_gb = (mem.get("arguments", 0) + mem.get("temporaries", 0)) / 1e9
    lines.append(f"{r['name']:8} remat={r['remat']:9} attention={x.get('attention', '?'):6} "
                 f"{x.get('device_kind', '?')}: "
                 f"{x['tokens_per_sec']:,.0f} tokens/s, step {x['step_time_s'] * 1e3:.1f} ms, "
                 f"MFU {100 * x['mfu']:.1f}% of {x['peak_flops'] / 1e12:.4g} TFLOP/s, "
                 f"peak memory {'?' if peak is None else f'{peak / 1e9:.1f}'} GB (XLA: {xla_gb:.1f} GB arguments + "
                 f"temporaries), compile {x['compile_time_s']:.1f} s, loss {x['losses'][0]:.3f} -> {x['loss']:.3f}")
  for r in rows:
    if not r.get("ok"):
      lines.append(f"{r['name']:8} remat={r['remat']:9} FAILED ({r.get('error', '?')}); log: {r.get('log') or '-'}")
  if not ok:
    lines.append("no run succeeded: see the logs above")
  return "\n".join(lines)


class Call:
  """One GPU call's state: where results go, the time left, what is printed."""

  def __init__(self, results: pathlib.Path, budget_s: float, dry_run: bool, site: pathlib.Path):
    self.results, self.dry_run, self.site = results, dry_run, site
    self.deadline = time.monotonic() + budget_s
    results.mkdir(parents=True, exist_ok=True)
    self.console = open(results / "console.log", "w")
    self.env = {**os.environ, "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, (str(site), str(ROOT), os.environ.get("PYTHONPATH"))))}
    self.env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION)
    if dry_run:
      self.env["JAX_PLATFORMS"] = "cpu"

  def say(self, line: str) -> None:
    print(line, flush=True)
    self.console.write(line + "\n")
    self.console.flush()

  def left(self) -> float:
    return self.deadline - time.monotonic()

  def run(self, cmd: list[str], log: pathlib.Path, limit_s: float, mode: str = "w") -> tuple[int, str, str]:
    """Runs cmd with stderr (and stdout) in `log`; (exit code, stdout, log text). 124 when it ran out of time."""
    with open(log, mode) as f:
      f.write("$ " + " ".join(cmd) + "\n")
      f.flush()
      try:
        proc = subprocess.run(cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=f, text=True,
                              timeout=max(limit_s, 1))
        rc, out = proc.returncode, proc.stdout
      except subprocess.TimeoutExpired as e:
        rc, out = 124, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        f.write(f"\n[gpu_bench] stopped after {limit_s:.0f} s\n")
      f.write(out)
    return rc, out, log.read_text(errors="replace")


def setup(call: Call) -> bool:
  log = call.results / "setup.log"
  wheels = [w for name, version in (spec.split("==") for spec in WHEELS)
            for w in sorted(WHEEL_DIR.glob(f"{name.replace('-', '_')}-{version}-*.whl"))]
  if len(wheels) == len(WHEELS):
    rc, _, text = call.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                            "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(call.site),
                            *map(str, wheels)], log, 120)
    if rc:
      call.say(f"error: installing the carried wheels failed (rc {rc}); see {log}:\n{text[-1500:]}")
      return False
    call.say(f"set-up: {', '.join(w.name for w in wheels)} installed into {call.site}")
  else:
    call.say(f"set-up: no wheels for {', '.join(WHEELS)} in {WHEEL_DIR} (carry experiments/wheels); trying without")
  rc, _, text = call.run([sys.executable, "-c", "import meshtrain.bench, meshtrain.config, meshtrain.layout, "
                          "meshtrain.data, meshtrain.runtime"], log, 120, mode="a")
  if rc:
    call.say(f"error: meshtrain's benchmark cannot be imported here:\n{text[-1500:]}\nrun "
             "'python3 experiments/gpu_bench.py --wheels' where there is internet and carry experiments/wheels")
    return False
  return True


def smoke(dry_run: bool) -> int:
  """Runs in its own process: JAX with meshtrain's flags, then cuDNN attention vs XLA's. Exit 0: cuDNN works."""
  from meshtrain.runtime import startup
  os.environ["XLA_FLAGS"] = startup.xla_flags("", os.environ.get("XLA_FLAGS", ""))  # exactly what bench sets
  print("XLA_FLAGS:", os.environ["XLA_FLAGS"], flush=True)
  import jax
  import jax.numpy as jnp
  import numpy as np
  jax.print_environment_info()
  device = jax.devices()[0]
  print(f"device: {device.platform} {device.device_kind}, compute capability "
        f"{getattr(device, 'compute_capability', None)}, memory {device.memory_stats()}", flush=True)
  float(jnp.ones(8).sum())  # the backend is up, so XLA accepted every flag
  print(JAX_OK, flush=True)
  if not dry_run and device.platform != "gpu":
    print(f"error: JAX sees no GPU here ({jax.devices()}); this call benchmarks one GPU", flush=True)
    return 2
  from meshtrain.models import attention
  L = 128 if dry_run else 4096  # the benchmark's sequence length (one sequence: the XLA reference's scores are 2 GB)
  for H, K, E in SMOKE_HEADS:
    keys = jax.random.split(jax.random.key(E), 4)
    q = jax.random.normal(keys[0], (1, L, H, E), jnp.bfloat16)
    k, v = (jax.random.normal(key, (1, L, K, E), jnp.bfloat16) for key in keys[1:3])
    ct = jax.random.normal(keys[3], (1, L, H, E), jnp.float32)

    def loss_and_grads(impl):
      f = lambda q, k, v: jnp.sum(attention.causal_attention(q, k, v, impl).astype(jnp.float32) * ct)
      return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)

    try:
      got = jax.block_until_ready(loss_and_grads("cudnn"))
    except Exception as e:  # the reason is what the summary needs; the run goes on with XLA's attention
      print(f"smoke: cudnn unavailable at H={H} K={K} E={E}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
      return 3
    want = loss_and_grads("xla")
    for name, a, b in zip(("loss", "dq", "dk", "dv"), jax.tree.leaves(got), jax.tree.leaves(want)):
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      err = float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))
      print(f"smoke: cudnn vs xla at H={H} K={K} E={E}: {name} max error {err:.2e} of the largest value")
      if err > 5e-2:  # both bf16 in, float32 inside: XLA bf16 vs float32 differs by <= 0.5% (measured on CPU)
        print("smoke: cudnn disagrees with xla")
        return 3
  print("smoke: cudnn ok", flush=True)
  return 0


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--wheels", action="store_true", help="download the wheels to carry (needs internet)")
  parser.add_argument("--dry-run", action="store_true", help="on a CPU, tiny shapes: the same steps")
  parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--budget", type=float, default=540, help="seconds the whole call may take")
  parser.add_argument("--results", default="", help="results folder (default: $OUT, else runs/gpu_bench)")
  parser.add_argument("--site", default="", help="folder for the carried wheels (default: a temporary one)")
  parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, in order")
  parser.add_argument("--remat", default="save_dots", choices=REMATS,
                      help="the remat policy tried first (out of memory: the next of none, save_dots, full)")
  args = parser.parse_args(argv)
  if args.wheels:
    return subprocess.call([sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-deps",
                            "--python-version", "3.12", "-d", str(WHEEL_DIR), *WHEELS])
  if args.smoke:
    return smoke(args.dry_run)
  unknown = set(args.models.split(",")) - set(MODELS)
  if unknown:
    print(f"error: --models {args.models}: unknown {sorted(unknown)}; choose from {', '.join(MODELS)}", file=sys.stderr)
    return 2
  results = pathlib.Path(args.results or os.environ.get("OUT") or ROOT / "runs" / "gpu_bench")
  with tempfile.TemporaryDirectory(prefix="meshtrain-site-") as temporary:
    return benchmark(args, results, pathlib.Path(args.site or temporary))


def benchmark(args, results: pathlib.Path, site: pathlib.Path) -> int:
  call = Call(results, args.budget, args.dry_run, site)
  call.say(f"gpu_bench: {'dry run, tiny shapes' if args.dry_run else 'GPU'}; results in {results}; "
           f"budget {args.budget:.0f} s")
  if not setup(call):
    return 2
  t0 = time.monotonic()
  rc, _, text = call.run([sys.executable, __file__, "--smoke", *(["--dry-run"] if args.dry_run else [])],
                         results / "setup.log", min(120, call.left()), mode="a")
  call.say("\n".join(line for line in text.splitlines() if line.startswith(("smoke:", "device:", "error:", "jax"))))
  if JAX_OK not in text:
    call.say(f"error: JAX did not start with meshtrain's XLA flags or sees no GPU (rc {rc}); benchmarks not run. "
             f"See {results / 'setup.log'}")
    return 2
  attention = "auto" if rc == 0 else "xla"
  note = ("auto (cuDNN where its conditions hold; smoke test passed)" if rc == 0 else
          "xla: the cuDNN smoke test failed (see setup.log), so both models use XLA's attention")
  call.say(f"smoke test: {time.monotonic() - t0:.0f} s; attention {note}")
  rows = []
  with open(results / "gpu_bench.jsonl", "w") as jsonl:
    for name in args.models.split(","):
      attempt = (args.remat, attention)
      for _ in range(MAX_ATTEMPTS):
        if attempt is None:
          break
        remat, attention_now = attempt
        limit = min(MODELS[name][2] * (4 if args.dry_run else 1), call.left() - 10)
        if limit < 30:
          rows.append({"name": name, "remat": remat, "ok": False, "error": "skipped: the call's time budget is spent",
                       "log": ""})
          jsonl.write(json.dumps(rows[-1]) + "\n")
          break
        log = results / f"{name}.{remat}.{attention_now}.log"
        t0 = time.monotonic()
        rc, out, text = call.run(bench_command(name, remat, attention_now, args.dry_run), log, limit)
        row = {"name": name, "remat": remat, "attention_requested": attention_now, "rc": rc,
               "seconds": round(time.monotonic() - t0, 1), "log": log.name, "ok": False}
        try:
          result = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
          result = None
        if rc == 0 and isinstance(result, dict):
          row.update(ok=True, result=result)
        else:
          tail = [line for line in text.splitlines() if line.strip()][-1:] or ["(no output)"]
          row["error"] = "timed out" if rc == 124 else f"rc {rc}: {tail[0][:300]}"
        rows.append(row)
        jsonl.write(json.dumps(row) + "\n")
        jsonl.flush()
        call.say(f"{name} remat={remat} attention={attention_now}: {'ok' if row['ok'] else row['error']} "
                 f"in {row['seconds']:.0f} s")
        attempt = None if row["ok"] else next_attempt(remat, attention_now, rc, text)
  call.say("\n" + summarize(rows, note))
  return 0 if all(any(r["ok"] for r in rows if r["name"] == name) for name in args.models.split(",")) else 1


if __name__ == "__main__":
  sys.exit(main())
