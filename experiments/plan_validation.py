"""Does the planner's arithmetic match the compiled program and the measured step? Tiny model, 8 CPU devices.

  python experiments/plan_validation.py [--steps 8] [--out benchmarks/results/plan_validation.json]

For each layout: the planner's memory per device (meshtrain/analysis/estimate.py) vs the compiled figure (inspect), and
its predicted step time (this machine's matmul peak and all-reduce bandwidth, measured here; the CPU runs
collectives in sequence with compute, so no overlap) vs the step time `python -m meshtrain.bench` measures.
Prints a table and the rank agreement for the pairs whose predicted times differ by more than 1.5x.
"""
import argparse
import itertools
import json
import pathlib
import subprocess
import sys

LAYOUTS = {
    "data=8": ["--config.mesh.data=8"],
    "fsdp=8": ["--config.mesh.data=1", "--config.mesh.fsdp=8", "--config.sharding.rules=fsdp"],
    "data=2 x tensor=4": ["--config.mesh.data=2", "--config.mesh.tensor=4", "--config.sharding.rules=tp"],
    "data=8, full remat": ["--config.mesh.data=8", "--config.model.remat=full"],
    "stage=2 x data=4, 2 micro-batches": ["--config.mesh.data=4", "--config.mesh.stage=2",
                                          "--config.pipeline.microbatches=2"],
    "stage=4 x data=2, 4 micro-batches": ["--config.mesh.data=2", "--config.mesh.stage=4",
                                          "--config.pipeline.microbatches=4"],
    "data=2 x sequence=4": ["--config.mesh.data=2", "--config.mesh.sequence=4"],
}
CONFIG = "configs/tiny.py"


def predict() -> dict:
  from meshtrain import config as config_lib
  from meshtrain.runtime import startup
  cfg = config_lib.load(CONFIG, [])
  startup.start(cfg)
  from meshtrain import mesh as mesh_lib
  from meshtrain.analysis import compiled as inspect, estimate, planner as plan
  hw = plan.hardware("cpu", mesh_lib.make_mesh({"data": -1}), cfg.model.dtype)
  out = {"peak_flops_per_device": hw.peaks[cfg.model.dtype], "allreduce_bytes_per_s": hw.node_bw, "layouts": {}}
  for name, overrides in LAYOUTS.items():
    c = config_lib.load(CONFIG, overrides)
    report = inspect.inspect(c)
    e = report.expected
    t = estimate.step_time(e, e.collectives, hw.peaks[c.model.dtype], hw.node_bw, hw.network_bw, {}, overlap=False)
    out["layouts"][name] = {"predicted_bytes": e.total_bytes_per_device,
                            "compiled_bytes": report.total_bytes_per_device,
                            "predicted_step_s": t.total_s, "predicted_compute_s": t.compute_s,
                            "predicted_comm_s": t.overlapped_s + t.exposed_s}
  return out


def measure(overrides: list[str], steps: int) -> float:
  cmd = [sys.executable, "-m", "meshtrain.bench", "--config", CONFIG, *overrides, "--steps", str(steps), "--json"]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
  return json.loads(proc.stdout)["step_time_s"]


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--out", default="benchmarks/results/plan_validation.json")
  args = parser.parse_args()
  result = predict()
  for name, overrides in LAYOUTS.items():
    result["layouts"][name]["measured_step_s"] = measure(overrides, args.steps)
  rows = result["layouts"]
  print("| layout | memory predicted / compiled | step predicted | step measured | predicted / measured |")
  print("|---|---|---|---|---|")
  for name, r in rows.items():
    print(f"| {name} | {r['predicted_bytes'] / 1e6:.1f} / {r['compiled_bytes'] / 1e6:.1f} MB "
          f"({r['predicted_bytes'] / r['compiled_bytes']:.2f}) | {r['predicted_step_s'] * 1e3:.1f} ms | "
          f"{r['measured_step_s'] * 1e3:.1f} ms | {r['predicted_step_s'] / r['measured_step_s']:.2f} |")
  pairs = agree = 0
  for a, b in itertools.combinations(rows, 2):
    pa, pb = rows[a]["predicted_step_s"], rows[b]["predicted_step_s"]
    if max(pa, pb) / min(pa, pb) < 1.5:
      continue
    pairs += 1
    agree += (pa < pb) == (rows[a]["measured_step_s"] < rows[b]["measured_step_s"])
  result["pairs_predicted_apart_1_5x"] = pairs
  result["pairs_ordered_as_measured"] = agree
  print(f"\npairs predicted more than 1.5x apart: {pairs}; ordered as measured: {agree}")
  print(f"CPU peak {result['peak_flops_per_device'] / 1e9:.1f} GFLOP/s per device, all-reduce "
        f"{result['allreduce_bytes_per_s'] / 1e9:.2f} GB/s per device (measured in this run)")
  pathlib.Path(args.out).write_text(json.dumps(result, indent=2))
  plot(result, pathlib.Path(args.out).with_suffix(".png"))
  return 0


def plot(result: dict, path: pathlib.Path) -> None:
  """Predicted vs measured step time and predicted vs compiled memory, one point per layout."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = result["layouts"]
  fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.5))
  for name, r in rows.items():
    ax_t.scatter(r["predicted_step_s"] * 1e3, r["measured_step_s"] * 1e3)
    ax_t.annotate(name, (r["predicted_step_s"] * 1e3, r["measured_step_s"] * 1e3), fontsize=7)
    ax_m.scatter(r["predicted_bytes"] / 1e6, r["compiled_bytes"] / 1e6)
    ax_m.annotate(name, (r["predicted_bytes"] / 1e6, r["compiled_bytes"] / 1e6), fontsize=7)
  ax_t.set(xlabel="predicted step time (ms)", ylabel="measured step time (ms)",
           title="step time: ranking kept, kernels far below peak")
  lo, hi = min(r["compiled_bytes"] for r in rows.values()) / 1e6, max(r["compiled_bytes"] for r in rows.values()) / 1e6
  ax_m.plot([lo * 0.8, hi * 1.1], [lo * 0.8, hi * 1.1], "k--", lw=0.8, label="equal")
  ax_m.set(xlabel="predicted memory per device (MB)", ylabel="compiled memory per device (MB)",
           title="memory per device")
  ax_m.legend()
  fig.suptitle("meshtrain.plan's arithmetic vs the compiled program and the measured step (tiny, 8 CPU devices)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


if __name__ == "__main__":
  sys.exit(main())
