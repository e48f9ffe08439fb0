""".venv/bin/python experiments/peer_maxtext/compare.py [--devices 1 2 8] [--steps 30] [--warmup 3] [--rounds 2]

Peer benchmark: meshtrain vs MaxText training the same model shape (configs/maxtext_tiny.py) on N simulated CPU
devices, on the same data: MaxText's synthetic batch (one fixed random batch, repeated), which this script
recreates bit for bit and hands to `meshtrain.bench --tokens`. For each device count, round-robin `--rounds`
times: (a) MaxText's own trainer (experiments/peer_maxtext/.venv, made by setup.sh) as a subprocess, tokens/s
from the median of its per-step seconds after `--warmup` steps; (b) `python -m meshtrain.bench`, likewise.
Writes a table to stdout, and results.json, tokens_per_sec.png and loss.png to benchmarks/results/peer_maxtext/;
raw logs go to logs/ next to this file (git-ignored).
See README.md.
"""
import argparse
import datetime
import json
import math
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
MAXTEXT_PY = HERE / ".venv" / "bin" / "python"
MARKER = HERE / ".venv" / ".peer_maxtext_installed"  # written by setup.sh when the install finished
MESHTRAIN_PY = pathlib.Path(sys.executable)
LOGS = HERE / "logs"
RESULTS = REPO / "benchmarks" / "results" / "peer_maxtext"

TARGET_CONFIG = "configs/maxtext_tiny.py"  # the lead engineer's config with exactly the MaxText shape
FALLBACK_CONFIG = "configs/tiny.py"
# Until configs/maxtext_tiny.py exists: tiny.py turned into the same shape. bfloat16 compute because it is
# MaxText's default `dtype` (parameters stay float32 in both, MaxText's `weight_dtype` default).
FALLBACK_OVERRIDES = [
    "--config.data.name=synthetic", "--config.model.d_model=256", "--config.model.num_layers=4",
    "--config.model.num_heads=4", "--config.model.num_kv_heads=4", "--config.model.head_dim=64",
    "--config.model.mlp_dim=1024", "--config.model.vocab_size=256", "--config.seq_len=256", "--config.batch_size=4",
    "--config.mesh.data=1", "--config.mesh.fsdp=-1", "--config.sharding.rules=fsdp", "--config.model.dtype=bfloat16",
]
# MaxText settings whose effective value (after its own defaults and derivations) is recorded from its log.
MAXTEXT_KEYS_OF_INTEREST = (
    "dtype", "weight_dtype", "grad_dtype", "mu_dtype", "matmul_precision", "remat_policy", "scan_layers",
    "param_scan_axis", "attention", "attention_type", "decoder_block", "mlp_activations", "logits_via_embedding",
    "cast_logits_to_fp32", "fused_qkv", "fused_mlp", "packing", "shardy", "opt_type", "learning_rate",
    "per_device_batch_size", "global_batch_size_to_train_on", "global_batch_size_to_load", "ici_fsdp_parallelism",
    "num_vocab_tiling", "gradient_accumulation_steps", "enable_dropout", "dropout_rate", "init_weights_seed",
    "emb_dim", "num_decoder_layers", "num_query_heads", "num_kv_heads", "head_dim", "mlp_dim", "vocab_size",
    "max_target_length", "hardware", "enable_checkpointing", "jax_cache_dir",
)
STEP_RE = re.compile(r"completed step: (\d+), seconds: ([0-9.]+),.*?total_weights: ([0-9.]+), loss: ([^,\s]+)")
PARAM_RE = re.compile(r"Config param (\w+): (.*)$")


def die(msg: str) -> None:
  print(msg, file=sys.stderr)
  sys.exit(2)


def run_logged(cmd: list[str], log_path: pathlib.Path, env: dict, cwd, timeout_s: float) -> tuple[int, float, int]:
  """Runs cmd with stdout+stderr into log_path; returns (exit code, wall seconds, peak RSS in bytes)."""
  log_path.parent.mkdir(parents=True, exist_ok=True)
  t0 = time.perf_counter()
  with open(log_path, "w") as log:
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    while True:  # os.wait4, not proc.wait: it also returns the child's peak RSS
      pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
      if pid:
        proc.returncode = os.waitstatus_to_exitcode(status)
        break
      if time.perf_counter() - t0 > timeout_s:
        proc.kill()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = -9
        break
      time.sleep(0.5)
  return proc.returncode, time.perf_counter() - t0, usage.ru_maxrss * 1024


def tail(path: pathlib.Path, lines: int = 15) -> str:
  text = path.read_text(errors="replace").splitlines()
  return "\n".join(text[-lines:])


def clean_env() -> dict:
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # each side gets its device count explicitly
  env.pop("JAX_NUM_CPU_DEVICES", None)
  env.pop("PYTHONPATH", None)
  return env


# ---------------------------------------------------------------- meshtrain config (read, to mirror in MaxText)

def meshtrain_args(config: str, overrides: list[str], devices: int) -> list[str]:
  return ["--config", config, *overrides, f"--config.cpu_devices={devices}"]


def load_meshtrain_config(config: str, overrides: list[str]):
  sys.path.insert(0, str(REPO))
  from meshtrain import config as config_lib  # ml_collections only; no JAX import
  return config_lib.load(str(REPO / config), overrides)


def fallback_layout(cfg, devices: int) -> list[str]:
  """The layout for `devices`: FSDP over all of them when the batch splits that many ways, as MaxText does.
  A 4-sequence batch cannot be split over 8 devices (MaxText loads 8 rows and trains on 4), so there meshtrain
  splits the batch over the largest divisor that divides it and the sequence over the rest (context parallelism)."""
  fsdp = max(d for d in range(1, devices + 1) if devices % d == 0 and cfg.batch_size % d == 0)
  return ["--config.mesh.data=1", f"--config.mesh.fsdp={fsdp}", f"--config.mesh.sequence={devices // fsdp}",
          "--config.mesh.tensor=1"]


# ---------------------------------------------------------------- MaxText

def maxtext_command(cfg, devices: int, total_steps: int, out_dir: str) -> list[str]:
  """MaxText's train on `devices` CPU devices, the model shape and optimizer of meshtrain's config `cfg`."""
  base_yml = maxtext_base_yml()
  m, o = cfg.model, cfg.optimizer
  per_device = cfg.batch_size / devices
  schedule_steps = max(total_steps, o.warmup_steps + 1)
  keys = {
      # where and how to run
      "run_name": f"peer_{devices}dev", "base_output_directory": out_dir,
      "hardware": "cpu",                    # CPU backend; autoselected attention becomes dot_product on CPU
      "skip_jax_distributed_system": "true",  # one process: hardware=cpu otherwise expects an XPK multi-process job
      "enable_checkpointing": "false", "enable_tensorboard": "false",
      "dataset_type": "synthetic", "steps": total_steps,
      # layout: FSDP over every device, the global batch split across them (fractional per-device batch allowed)
      "ici_fsdp_parallelism": devices, "per_device_batch_size": f"{per_device:g}",
      # model shape (decoder_block llama2 is the default: RMSNorm, RoPE, SwiGLU mlp_activations [silu, linear])
      "base_emb_dim": m.d_model, "base_num_decoder_layers": m.num_layers, "base_num_query_heads": m.num_heads,
      "base_num_kv_heads": m.num_kv_heads, "head_dim": m.head_dim, "base_mlp_dim": m.mlp_dim,
      "vocab_size": m.vocab_size, "max_target_length": cfg.seq_len,
      "logits_via_embedding": str(bool(m.tie_embeddings)).lower(), "rope_max_timescale": int(m.rope_theta),
      "normalization_layer_epsilon": m.norm_eps,
      # optimizer = meshtrain's (speed-neutral; makes the loss curves comparable). MaxText's own default lr is 3e-5.
      # Schedule as meshtrain's optax.warmup_cosine_decay_schedule(decay_steps=max(steps, warmup + 1)): MaxText
      # warms up for int(schedule_steps * fraction) steps (+0.5: float rounding must not lose one), then cosine.
      "opt_type": "adamw", "learning_rate": o.learning_rate, "learning_rate_schedule_steps": schedule_steps,
      "warmup_steps_fraction": f"{(o.warmup_steps + 0.5) / schedule_steps:.6g}" if o.warmup_steps else 0,
      "learning_rate_final_fraction": o.min_lr_ratio, "adam_b1": o.b1, "adam_b2": o.b2, "adam_eps": o.eps,
      "adam_weight_decay": o.weight_decay, "gradient_clipping_threshold": o.grad_clip,
      # everything else (dtype bf16, weight_dtype f32, remat_policy full, scan_layers, ...) stays MaxText's default
  }
  return [str(MAXTEXT_PY), "-m", "maxtext.trainers.pre_train.train", base_yml,
          *[f"{k}={v}" for k, v in keys.items()]]


_BASE_YML = None


def maxtext_base_yml() -> str:
  global _BASE_YML
  if _BASE_YML is None:
    out = subprocess.run([str(MAXTEXT_PY), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    _BASE_YML = str(pathlib.Path(out.stdout.strip()) / "maxtext" / "configs" / "base.yml")
  return _BASE_YML


def maxtext_env(devices: int) -> dict:
  env = clean_env()
  env.update(DECOUPLE_GCLOUD="TRUE",    # MaxText's no-Google-Cloud mode: GCS, Vertex, goodput become stubs
             JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             TF_CPP_MIN_LOG_LEVEL="2")
  return env


def parse_maxtext_log(path: pathlib.Path) -> dict:
  steps, params = {}, {}
  for line in path.read_text(errors="replace").splitlines():
    if (m := STEP_RE.search(line)):
      steps[int(m.group(1))] = {"seconds": float(m.group(2)), "tokens": float(m.group(3)), "loss": float(m.group(4))}
    elif (m := PARAM_RE.search(line)) and m.group(1) in MAXTEXT_KEYS_OF_INTEREST:
      params[m.group(1)] = m.group(2).strip()
  return {"steps": [dict(step=k, **v) for k, v in sorted(steps.items())], "config": params}


def run_maxtext(cfg, devices, args, tag) -> dict:
  total = args.warmup + args.steps
  log = LOGS / f"maxtext_{devices}dev_{tag}.log"
  with tempfile.TemporaryDirectory(prefix="peer_maxtext_") as tmp:
    cmd = maxtext_command(cfg, devices, total, tmp)
    rc, wall, rss = run_logged(cmd, log, maxtext_env(devices), cwd=tmp, timeout_s=args.timeout)
  parsed = parse_maxtext_log(log)
  result = {"command": cmd_str(cmd, maxtext_env(devices)), "log": str(log.relative_to(REPO)), "rc": rc,
            "wall_s": wall, "peak_rss_bytes": rss, "losses": [s["loss"] for s in parsed["steps"]],
            "config": parsed["config"]}
  timed = [s for s in parsed["steps"] if s["step"] >= args.warmup]
  if rc != 0 or len(timed) < args.steps:
    result["error"] = f"MaxText exited {rc} after {len(parsed['steps'])} steps; see {log}:\n{tail(log)}"
    return result
  tokens = timed[0]["tokens"]  # total_weights: non-padding target tokens of the step (batch x seq here)
  step_s = statistics.median(s["seconds"] for s in timed)
  result.update(tokens_per_step=tokens, step_time_s=step_s, tokens_per_sec=tokens / step_s,
                step_times_s=[s["seconds"] for s in timed])
  return result


# ---------------------------------------------------------------- meshtrain

def maxtext_batch(cfg, devices: int) -> pathlib.Path:
  """The exact token batch MaxText trains on, saved for `meshtrain.bench --tokens`.

  MaxText's synthetic iterator draws jax.random.randint(PRNGKey(0), (rows loaded, L + 1), 0, V) once and repeats
  it every step; with per_device_batch_size < 1 it loads one row per device and its loss_fn keeps the first
  `batch` rows. Same PRNG (threefry, partitionable) in both venvs, so the arrays are identical.
  """
  import jax
  import numpy as np
  rows = max(devices, cfg.batch_size) if cfg.batch_size < devices else cfg.batch_size
  tokens = jax.random.randint(jax.random.PRNGKey(0), (rows, cfg.seq_len + 1), 0, cfg.model.vocab_size, dtype="int32")
  path = LOGS / f"maxtext_batch_{devices}dev.npy"
  LOGS.mkdir(parents=True, exist_ok=True)
  np.save(path, np.asarray(tokens)[:cfg.batch_size])
  return path


def run_meshtrain_bench(mt_args, devices, args, tag, tokens: pathlib.Path) -> dict:
  total = args.warmup + args.steps
  log = LOGS / f"meshtrain_bench_{devices}dev_{tag}.log"
  # --config.steps=total: the learning-rate schedule of a `total`-step run, as MaxText and meshtrain.train get.
  cmd = [str(MESHTRAIN_PY), "-m", "meshtrain.bench", *mt_args, f"--config.steps={total}", "--json",
         "--steps", str(args.steps), "--warmup", str(args.warmup), "--tokens", str(tokens)]
  rc, wall, rss = run_logged(cmd, log, clean_env(), cwd=REPO, timeout_s=args.timeout)
  result = {"command": cmd_str(cmd), "log": str(log.relative_to(REPO)), "rc": rc, "wall_s": wall,
            "peak_rss_bytes": rss}
  found = None
  for line in log.read_text(errors="replace").splitlines():
    if line.startswith("{"):
      try:
        found = json.loads(line)
      except json.JSONDecodeError:
        pass
  if rc != 0 or found is None:
    result["error"] = f"meshtrain.bench exited {rc}; see {log}:\n{tail(log)}"
  else:
    result.update(found)
  return result


def run_meshtrain_train(mt_args, devices, args) -> dict:
  total = args.warmup + args.steps
  log = LOGS / f"meshtrain_train_{devices}dev.log"
  with tempfile.TemporaryDirectory(prefix="peer_meshtrain_") as workdir:
    cmd = [str(MESHTRAIN_PY), "-m", "meshtrain.train", *mt_args, "--workdir", workdir, f"--config.steps={total}",
           "--config.log_every=1", "--config.eval_every=0", "--config.checkpoint_every=0"]
    rc, wall, rss = run_logged(cmd, log, clean_env(), cwd=REPO, timeout_s=args.timeout)
    metrics = pathlib.Path(workdir) / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line] if metrics.exists() else []
  cmd[cmd.index("--workdir") + 1] = "<tmpdir>"
  result = {"command": cmd_str(cmd), "log": str(log.relative_to(REPO)), "rc": rc, "wall_s": wall,
            "peak_rss_bytes": rss}
  train = sorted((r for r in records if "loss" in r), key=lambda r: r["step"])
  # record "step" k is the loss of the k-th update, computed before it is applied: MaxText's "completed step k-1"
  result["losses"] = [r["loss"] for r in train]
  timed = [r["tokens_per_sec"] for r in train if r["step"] > args.warmup]
  if timed:
    result["train_loop_tokens_per_sec"] = statistics.median(timed)
  if rc != 0 or len(train) < total:
    result["error"] = f"meshtrain.train exited {rc} with {len(train)} of {total} losses; see {log}:\n{tail(log)}"
  return result


def cmd_str(cmd: list[str], env: dict | None = None) -> str:
  prefix = ""
  if env:
    prefix = " ".join(f"{k}={env[k]}" for k in ("DECOUPLE_GCLOUD", "JAX_PLATFORMS", "XLA_FLAGS") if k in env) + " "
  text = " ".join(cmd)
  for path, short in ((str(MAXTEXT_PY), "experiments/peer_maxtext/.venv/bin/python"),
                      (str(MESHTRAIN_PY), ".venv/bin/python"), (str(REPO) + "/", "")):
    text = text.replace(path, short)
  return prefix + re.sub(r"base_output_directory=\S+", "base_output_directory=<tmpdir>", text)


# ---------------------------------------------------------------- report

def summarize(devices_list, runs, train_runs, args) -> list[dict]:
  rows = []
  for n in devices_list:
    mx = [r for r in runs[n]["maxtext"] if "tokens_per_sec" in r]
    mt = [r for r in runs[n]["meshtrain"] if "tokens_per_sec" in r]
    row = {"devices": n, "maxtext_tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in mx) if mx else None,
           "maxtext_rounds": [r["tokens_per_sec"] for r in mx],
           "meshtrain_tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in mt) if mt else None,
           "meshtrain_rounds": [r["tokens_per_sec"] for r in mt],
           "meshtrain_layout": runs[n]["meshtrain_layout"],
           "maxtext_peak_rss_gb": max((r["peak_rss_bytes"] for r in mx), default=0) / 1e9 or None,
           "meshtrain_peak_rss_gb": max((r["peak_rss_bytes"] for r in mt), default=0) / 1e9 or None,
           "meshtrain_mfu": statistics.median(r["mfu"] for r in mt) if mt else None}
    row["ratio_meshtrain_over_maxtext"] = (row["meshtrain_tokens_per_sec"] / row["maxtext_tokens_per_sec"]
                                           if mx and mt else None)
    mx_losses = next((r["losses"] for r in runs[n]["maxtext"] if r.get("losses")), [])
    mt_losses = train_runs[n].get("losses", []) if train_runs.get(n) else []
    bench_losses = [r["loss"] for r in mt]
    last = args.warmup + args.steps - 1
    row["loss"] = {
        "maxtext_first": mx_losses[0] if mx_losses else None,
        "maxtext_last": mx_losses[-1] if mx_losses else None,
        "meshtrain_train_first": mt_losses[0] if mt_losses else None,
        "meshtrain_train_last": mt_losses[-1] if mt_losses else None,
        # bench trains on ONE batch over and over, like MaxText's synthetic iterator: the like-for-like final loss
        f"meshtrain_bench_step{last}": statistics.median(bench_losses) if bench_losses else None,
    }
    rows.append(row)
  return rows


def fmt(x, spec=",.0f"):
  return "n/a" if x is None else format(x, spec)


def print_table(rows, args, vocab, batch, seq):
  last = args.warmup + args.steps - 1
  print(f"\nTokens/s (global batch {batch} x {seq} = {batch * seq:,} tokens/step; median per-step time of "
        f"{args.steps} steps after {args.warmup} warm-up; median over {args.rounds} round(s))")
  print(f"{'devices':>7} | {'MaxText tok/s':>13} | {'meshtrain tok/s':>15} | {'ratio mt/MX':>11} | "
        f"{'MX RSS GB':>9} | {'mt RSS GB':>9} | meshtrain layout")
  for r in rows:
    print(f"{r['devices']:>7} | {fmt(r['maxtext_tokens_per_sec']):>13} | {fmt(r['meshtrain_tokens_per_sec']):>15} | "
          f"{fmt(r['ratio_meshtrain_over_maxtext'], '.2f'):>11} | {fmt(r['maxtext_peak_rss_gb'], '.2f'):>9} | "
          f"{fmt(r['meshtrain_peak_rss_gb'], '.2f'):>9} | {r['meshtrain_layout']}")
  print(f"\nLoss (ln V = {math.log(vocab):.3f} is the uniform-guess loss). MaxText: one fixed random batch repeated "
        f"every step; meshtrain.train: a fresh uniform-random batch each step (cannot go below ln V);\n"
        f"meshtrain.bench: one batch repeated, like MaxText (its loss at step {last} is the like-for-like number).")
  print(f"{'devices':>7} | {'MX first':>8} | {'MX last':>8} | {'mt-train first':>14} | {'mt-train last':>13} | "
        f"{'mt-bench last':>13}")
  for r in rows:
    l = r["loss"]
    print(f"{r['devices']:>7} | {fmt(l['maxtext_first'], '.3f'):>8} | {fmt(l['maxtext_last'], '.3f'):>8} | "
          f"{fmt(l['meshtrain_train_first'], '.3f'):>14} | {fmt(l['meshtrain_train_last'], '.3f'):>13} | "
          f"{fmt(l[f'meshtrain_bench_step{last}'], '.3f'):>13}")


def plot(rows, runs, train_runs, args, vocab):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  x = np.arange(len(rows))
  width = 0.38
  fig, ax = plt.subplots(figsize=(7, 4.2))
  for i, (name, key, color) in enumerate((("MaxText 0.2.5", "maxtext", "tab:orange"),
                                          ("meshtrain", "meshtrain", "tab:blue"))):
    med = [r[f"{key}_tokens_per_sec"] or 0 for r in rows]
    lo = [m - min(r[f"{key}_rounds"], default=m) for m, r in zip(med, rows)]
    hi = [max(r[f"{key}_rounds"], default=m) - m for m, r in zip(med, rows)]
    bars = ax.bar(x + (i - 0.5) * width, med, width, yerr=[lo, hi], capsize=3, label=name, color=color)
    ax.bar_label(bars, labels=[f"{m:,.0f}" if m else "n/a" for m in med], fontsize=8, padding=2)
  ax.set_xticks(x, [f"{r['devices']} device{'s' * (r['devices'] > 1)}" for r in rows])
  ax.set_ylabel("tokens / s (higher is better)")
  ax.set_title(f"Same 4-layer d=256 model, global batch 1,024 tokens, FSDP, CPU\n"
               f"median of {args.steps} steps x {args.rounds} round(s); whiskers: min/max over rounds", fontsize=9)
  ax.legend()
  fig.tight_layout()
  fig.savefig(RESULTS / "tokens_per_sec.png", dpi=120)
  plt.close(fig)

  fig, axes = plt.subplots(1, len(rows), figsize=(4.2 * len(rows), 3.6), squeeze=False, sharey=True)
  last = args.warmup + args.steps - 1
  for ax, r in zip(axes[0], rows):
    n = r["devices"]
    mx = next((m["losses"] for m in runs[n]["maxtext"] if m.get("losses")), [])
    mt = train_runs[n].get("losses", []) if train_runs.get(n) else []
    ax.plot(range(len(mx)), mx, color="tab:orange", label="MaxText (one batch, repeated)")
    ax.plot(range(len(mt)), mt, color="tab:blue", label="meshtrain.train (fresh batches)")
    curve = next((b["losses"] for b in runs[n]["meshtrain"] if b.get("losses")), None)
    if curve:  # a meshtrain.bench that reports its per-step losses (warm-up + timed steps): the like-for-like curve
      ax.plot(range(len(curve)), curve, color="tab:blue", ls="--", label="meshtrain.bench (one batch, repeated)")
    bench = r["loss"][f"meshtrain_bench_step{last}"]
    if bench is not None:
      ax.plot([last], [bench], "o", color="tab:blue", mfc="none", label="meshtrain.bench (one batch), last step")
    ax.axhline(math.log(vocab), color="gray", ls=":", lw=1, label="ln V (uniform)")
    ax.set_title(f"{n} device{'s' * (n > 1)}", fontsize=10)
    ax.set_xlabel("step")
  axes[0][0].set_ylabel("training loss")
  axes[0][0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(RESULTS / "loss.png", dpi=120)
  plt.close(fig)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].split("\n")[0])
  parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 8])
  parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
  parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile, warm-up)")
  parser.add_argument("--rounds", type=int, default=2, help="alternating MaxText/meshtrain repetitions")
  parser.add_argument("--config", default=None, help=f"meshtrain config (default {TARGET_CONFIG} when it exists, "
                      f"else {FALLBACK_CONFIG} with overrides to the same shape)")
  parser.add_argument("--timeout", type=float, default=1800, help="seconds per subprocess")
  parser.add_argument("--train", action="store_true", help="also run meshtrain.train for a loss curve on fresh "
                      "random batches (not comparable with MaxText's one repeated batch)")
  args, extra = parser.parse_known_args()
  if any(not e.startswith("--config.") for e in extra):
    parser.error(f"unrecognized arguments: {' '.join(e for e in extra if not e.startswith('--config.'))}")
  if not (MAXTEXT_PY.exists() and MARKER.exists()):
    die("error: no MaxText venv at experiments/peer_maxtext/.venv: run experiments/peer_maxtext/setup.sh first")
  if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
    die("error: --steps and --rounds must be >= 1, --warmup >= 0")

  if args.config:
    config, overrides = args.config, list(extra)
  elif (REPO / TARGET_CONFIG).exists():
    config, overrides = TARGET_CONFIG, list(extra)
  else:
    config, overrides = FALLBACK_CONFIG, FALLBACK_OVERRIDES + list(extra)
    print(f"note: {TARGET_CONFIG} does not exist yet; using {FALLBACK_CONFIG} with overrides to the same shape")

  layouts, cfgs, batches = {}, {}, {}
  for n in args.devices:
    cfg = load_meshtrain_config(config, overrides + [f"--config.cpu_devices={n}"])
    layout = fallback_layout(cfg, n)
    layouts[n] = overrides + layout
    cfgs[n] = cfg
    batches[n] = maxtext_batch(cfg, n)
    if "--config.mesh.sequence=1" not in layout:
      print(f"note: a batch of {cfg.batch_size} cannot be split over {n} devices; meshtrain runs "
            f"{' '.join(layout)} (MaxText keeps FSDP={n}, loads {n} rows and trains on {cfg.batch_size})")
  vocab = cfgs[args.devices[0]].model.vocab_size

  started = datetime.datetime.now().isoformat(timespec="seconds")
  load_at_start = os.getloadavg()
  runs = {n: {"maxtext": [], "meshtrain": [],
              "meshtrain_layout": " ".join(layouts[n][len(overrides):])}
          for n in args.devices}
  for rnd in range(args.rounds):
    for n in args.devices:
      # alternate which system goes first, so a drift in machine load does not always favour the same one
      order = ("maxtext", "meshtrain") if (rnd + args.devices.index(n)) % 2 == 0 else ("meshtrain", "maxtext")
      for system in order:
        print(f"[round {rnd + 1}/{args.rounds}] {n} device(s): {system} ...", end=" ", flush=True)
        if system == "maxtext":
          r = run_maxtext(cfgs[n], n, args, f"r{rnd + 1}")
        else:
          r = run_meshtrain_bench(meshtrain_args(config, layouts[n], n), n, args, f"r{rnd + 1}", batches[n])
        runs[n][system].append(r)
        print(f"{r['tokens_per_sec']:,.0f} tokens/s ({r['wall_s']:.0f}s)" if "tokens_per_sec" in r
              else f"FAILED: {r['error'].splitlines()[0]}", flush=True)
  train_runs = {}
  if args.train:
    for n in args.devices:
      print(f"[losses] {n} device(s): meshtrain.train ...", end=" ", flush=True)
      train_runs[n] = run_meshtrain_train(meshtrain_args(config, layouts[n], n), n, args)
      r = train_runs[n]
      print(f"{len(r['losses'])} losses ({r['wall_s']:.0f}s)" if "error" not in r
            else f"FAILED: {r['error'].splitlines()[0]}", flush=True)

  rows = summarize(args.devices, runs, train_runs, args)
  first = cfgs[args.devices[0]]
  print_table(rows, args, vocab, first.batch_size, first.seq_len)
  errors = [f"{n} devices {s}: {r['error']}" for n in args.devices for s in ("maxtext", "meshtrain")
            for r in runs[n][s] if "error" in r]
  errors += [f"{n} devices meshtrain.train: {r['error']}" for n, r in train_runs.items() if "error" in r]
  for e in errors:
    print("\n" + e, file=sys.stderr)
  results = {
      "started": started, "finished": datetime.datetime.now().isoformat(timespec="seconds"),
      "argv": sys.argv[1:], "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
      "meshtrain_config": config, "meshtrain_overrides": overrides,
      "host": {"cpus": os.cpu_count(), "loadavg_at_start": load_at_start, "loadavg_at_end": os.getloadavg()},
      "summary": rows,
      "maxtext_effective_config": {n: next((r["config"] for r in runs[n]["maxtext"] if r.get("config")), {})
                                   for n in args.devices},
      "runs": {n: {"maxtext": [{k: v for k, v in r.items() if k != "config"} for r in runs[n]["maxtext"]],
                   "meshtrain_bench": runs[n]["meshtrain"], "meshtrain_train": train_runs.get(n)}
               for n in args.devices},
  }
  RESULTS.mkdir(parents=True, exist_ok=True)
  (RESULTS / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
  plot(rows, runs, train_runs, args, vocab)
  print(f"\nwrote {RESULTS.relative_to(REPO)}/results.json, tokens_per_sec.png, loss.png; logs in "
        f"{LOGS.relative_to(REPO)}/")
  return 1 if errors else 0


if __name__ == "__main__":
  sys.exit(main())
