"""Every kind of parallelism on the tiny model, side by side with one device.

  python experiments/parallelism_sweep.py [--steps 20] [--only NAME ...]

Trains configs/tiny.py (on its local corpus, the same batches everywhere) for --steps steps under each layout on
8 simulated CPU devices, and the same model on one device. Prints a table: the largest relative difference of
the per-step losses from one device, tokens/s (median of synchronised steps after 3 warm-up steps), per-device
memory of the compiled step (arguments + temporaries) and the collectives in its HLO; writes
benchmarks/results/parallelism_sweep.json and benchmarks/results/parallelism_sweep.png. On 2 CPU cores the
tokens/s compare the layouts' overheads (collectives are memory copies here), not what they would do on GPUs.
"""
import argparse
import collections
import json
import pathlib
import re
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE.parent / "benchmarks" / "results"
sys.path.insert(0, str(HERE.parent))

# name: (mesh sizes, rules preset, other overrides). Each is compared with the one-device run of the same model
# (the MoE layout with a one-device MoE run).
MOE = {"model.num_experts": 8, "model.experts_per_token": 2, "model.capacity_factor": 1.5}
LAYOUTS = {
    "data=8": ({"data": 8}, "dp", {}),
    "fsdp=8": ({"fsdp": 8}, "fsdp", {}),
    "fsdp=4 x tensor=2": ({"fsdp": 4, "tensor": 2}, "fsdp_tp", {}),
    "data=2 x tensor=4 +SP": ({"data": 2, "tensor": 4}, "tp", {"sharding.sequence_parallel": True}),
    "data=2 x sequence=4 (ring)": ({"data": 2, "sequence": 4}, "dp", {}),
    "sequence=8 (all-gather)": ({"sequence": 8}, "dp", {"model.context_attention": "allgather"}),
    "data=2 x expert=4 (MoE)": ({"data": 2, "expert": 4}, "dp", MOE),
    "stage=2 x data=4": ({"stage": 2, "data": 4}, "dp", {}),
    "stage=4 x fsdp=2": ({"stage": 4, "fsdp": 2}, "fsdp", {}),
    "fsdp=2 x sequence=2 x tensor=2": ({"fsdp": 2, "sequence": 2, "tensor": 2}, "fsdp_tp", {}),
    "stage=2 x fsdp=2 x tensor=2 (circular)": ({"stage": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp",
                                               {"pipeline.schedule": "circular", "pipeline.repeats": 2}),
}
COLLECTIVE = re.compile(r"= (?:\([^)]*\)|\S+) "
                        r"(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)(-start)?\(")


def make_config(mesh_sizes, rules, overrides, steps):
  from meshtrain import config
  cfg = config.load(str(HERE.parent / "configs" / "tiny.py"), [])
  cfg.unlock()
  cfg.steps = steps
  cfg.mesh.update({"data": 1, **mesh_sizes})
  cfg.sharding.rules = rules
  for key, value in overrides.items():
    group, name = key.split(".")
    cfg[group][name] = value
  return cfg


def run(cfg, devices, init_params=None):
  import jax

  from meshtrain import data, layout as layout_lib, mesh as mesh_lib
  layout = layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh, devices=devices))
  src = data.make_source(cfg, cfg.data.train_split, shuffle=True)
  step_fn = layout.compile_train_step()
  state = layout.init(cfg.seed)
  if init_params is not None:
    state = state.replace(params=jax.device_put(init_params, layout.state_sharding.params))
  losses, times = [], []
  for step in range(cfg.steps):
    batch = data.global_batch(src, step, cfg.batch_size, layout.batch_sharding)
    t0 = time.perf_counter()
    state, metrics = step_fn(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - t0)
    losses.append(float(metrics["loss"]))
  mem = step_fn.memory_analysis()
  kinds = collections.Counter(m.group(1) for m in COLLECTIVE.finditer(step_fn.as_text()))
  return {"losses": losses, "tokens_per_sec": cfg.batch_size * cfg.seq_len / statistics.median(times[3:]),
          "memory_mib": (mem.argument_size_in_bytes + mem.temp_size_in_bytes) / 2**20,
          "collectives": dict(kinds)}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--only", nargs="*", default=None, help="layout names to run (default: all)")
  args = parser.parse_args()
  if args.steps < 5:
    parser.error("--steps must be >= 5 (3 warm-up steps are not timed)")
  from meshtrain import mesh as mesh_lib
  mesh_lib.simulate_cpu_devices(8)
  import jax
  import numpy as np

  from meshtrain.parallel import pipeline

  names = args.only or list(LAYOUTS)
  unknown = [n for n in names if n not in LAYOUTS]
  if unknown:
    parser.error(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
  references = {}
  rows = []
  for name in names:
    mesh_sizes, rules, overrides = LAYOUTS[name]
    moe = "model.num_experts" in overrides
    if moe not in references:
      ref_cfg = make_config({}, "dp", MOE if moe else {}, args.steps)
      print(f"one device{' (MoE)' if moe else ''} ...", flush=True)
      references[moe] = run(ref_cfg, jax.devices()[:1])
      from meshtrain import layout as layout_lib
      references[moe]["params"] = layout_lib.build(
          ref_cfg, mesh_lib.make_mesh(ref_cfg.mesh, devices=jax.devices()[:1])).init(ref_cfg.seed).params
    ref = references[moe]
    cfg = make_config(mesh_sizes, rules, overrides, args.steps)
    init = None
    if overrides.get("pipeline.schedule") == "circular":  # same weights, stored stage-major
      init = {**ref["params"], "layers": pipeline.to_pipeline_params(ref["params"]["layers"], mesh_sizes["stage"],
                                                                    overrides["pipeline.repeats"])}
    print(f"{name} ...", flush=True)
    r = run(cfg, jax.devices(), init)
    diff = float(np.max(np.abs(np.array(r["losses"]) - ref["losses"]) / np.array(ref["losses"])))
    rows.append({"layout": name, "max_loss_rel_diff": diff, "tokens_per_sec": r["tokens_per_sec"],
                 "one_device_tokens_per_sec": ref["tokens_per_sec"], "memory_mib": r["memory_mib"],
                 "one_device_memory_mib": ref["memory_mib"], "collectives": r["collectives"],
                 "first_loss": r["losses"][0], "last_loss": r["losses"][-1]})

  print(f"\n| layout | loss vs one device (max rel. diff, {args.steps} steps) | tokens/s | memory/device (MiB) | "
        f"collectives in the step |\n|---|---|---|---|---|")
  for r in rows:
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["collectives"].items())) or "none"
    print(f"| {r['layout']} | {r['max_loss_rel_diff']:.1e} | {r['tokens_per_sec']:,.0f} | "
          f"{r['memory_mib']:.1f} | {kinds} |")
  for moe, ref in references.items():
    print(f"one device{' (MoE)' if moe else ''}: {ref['tokens_per_sec']:,.0f} tokens/s, {ref['memory_mib']:.1f} MiB, "
          f"loss {ref['losses'][0]:.3f} -> {ref['losses'][-1]:.3f}")
  RESULTS.mkdir(parents=True, exist_ok=True)
  (RESULTS / "parallelism_sweep.json").write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=1) + "\n")

  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
  y = range(len(rows))
  ax1.barh(y, [r["tokens_per_sec"] for r in rows], color="tab:blue")
  ax1.axvline(references[False]["tokens_per_sec"] if False in references else 0, color="gray", ls="--",
              label="one device")
  ax1.set_yticks(list(y), [r["layout"] for r in rows])
  ax1.invert_yaxis()
  ax1.set_xlabel("tokens/s (8 simulated CPU devices on 2 cores)")
  ax1.legend()
  ax2.barh(y, [max(r["max_loss_rel_diff"], 1e-9) for r in rows], color="tab:green")
  ax2.set_xscale("log")
  ax2.set_xlabel(f"max relative loss difference from one device ({args.steps} steps)")
  fig.tight_layout()
  fig.savefig(RESULTS / "parallelism_sweep.png", dpi=100)
  print(f"\nwrote {RESULTS / 'parallelism_sweep.json'} and {RESULTS / 'parallelism_sweep.png'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
