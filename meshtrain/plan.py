"""Pick the layout for a cluster: every valid way to split a model over it, ranked by predicted step time.

  python -m meshtrain.plan --config configs/llama8b.py --devices 64 --gpu h100 [--gpus-per-node 8] [--json]

Works for every task (the language model, the DiT): the task's cost model (meshtrain/tasks) says which axes its
model can be split over and what each split costs. Enumerates data, fsdp, tensor, sequence, expert and stage sizes
(those the task supports; the others stay 1 and the output says why), the rematerialization policy, gradient
accumulation and pipeline micro-batches; estimates each layout's memory and step time from shapes alone
(meshtrain/estimate.py: FLOPs at the GPU's peak plus each collective's bytes over NVLink inside a node or the
network across nodes); drops layouts that do not fit; prints the ranked table and the config overrides of the
winner. The best K (`--verify K`, default 3) are then compiled for simulated devices (as `python -m
meshtrain.inspect` does; cached on disk) and the winner is picked by step times redone with the collectives XLA
actually compiled.
`--gpu cpu` plans for this machine's simulated devices, with peak FLOP/s and collective bandwidth measured here.
"""
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import sys

from meshtrain import config as config_lib, perf
from meshtrain.errors import ArgumentParser, UserError

GB = 1e9
REMATS = ("none", "save_dots", "full")


@dataclasses.dataclass(frozen=True)
class Layout:
  sizes: tuple[tuple[str, int], ...]   # every mesh axis and its total size
  across: tuple[tuple[str, int], ...]  # how many nodes each axis spans
  remat: str
  grad_accum: int
  microbatches: int

  @property
  def rules(self) -> str:
    s = dict(self.sizes)
    return {(True, True): "fsdp_tp", (True, False): "fsdp", (False, True): "tp", (False, False): "dp"}[
        (s["fsdp"] > 1, s["tensor"] > 1)]

  def name(self) -> str:
    return " x ".join(f"{a}={n}" for a, n in self.sizes if n > 1) or "data=1"

  def overrides(self, one_process: bool = False) -> list[str]:
    """The config overrides that train with this layout (`one_process`: all devices simulated in one process)."""
    across = {a: 1 for a, _ in self.across} if one_process else dict(self.across)
    out = [f"--config.mesh.{a}={n // across[a]}" for a, n in self.sizes]
    out += [f"--config.mesh.nodes.{a}={n}" for a, n in across.items() if n > 1]
    out += [f"--config.sharding.rules={self.rules}", f"--config.model.remat={self.remat}",
            f"--config.optimizer.grad_accum_steps={self.grad_accum}"]
    if dict(self.sizes)["stage"] > 1:
      out.append(f"--config.pipeline.microbatches={self.microbatches}")
    return out

  def apply(self, cfg, one_process: bool = False):
    cfg = cfg.copy_and_resolve_references()
    for item in self.overrides(one_process):
      config_lib.apply_override(cfg, item)
    return cfg


def _factorizations(n: int, parts: int):
  """Every ordered tuple of `parts` positive integers whose product is n."""
  if parts == 1:
    yield (n,)
    return
  for d in range(1, n + 1):
    if n % d == 0:
      for rest in _factorizations(n // d, parts - 1):
        yield (d, *rest)


def _nodes_split(sizes: dict, nodes: int) -> dict | None:
  """Which axes cross nodes: the light ones (data, then fsdp, then stage) take the node count; None if they cannot."""
  across, left = {a: 1 for a in sizes}, nodes
  for axis in ("data", "fsdp", "stage"):
    f = math.gcd(sizes[axis], left)
    across[axis], left = f, left // f
  return across if left == 1 else None


def layouts(cfg, devices: int, nodes: int):
  """Every layout worth estimating for this model on `devices` devices in `nodes` nodes."""
  from meshtrain import mesh as mesh_lib, tasks
  model = tasks.cost_model(cfg)
  m = cfg.model
  per_node = devices // nodes
  # Axes the task cannot split (model.unsupported_axes, reported by main) and, without experts, `expert` stay 1.
  axes = [a for a in mesh_lib.AXES
          if a not in model.unsupported_axes and (a != "expert" or model.num_experts)]
  for combo in _factorizations(devices, len(axes)):
    sizes = {a: 1 for a in mesh_lib.AXES} | dict(zip(axes, combo))
    stage, tensor = sizes["stage"], sizes["tensor"]
    if sizes["tensor"] * sizes["sequence"] * sizes["expert"] > per_node:
      continue                                    # per-layer collectives stay on the fast links
    if m.num_heads % tensor or m.mlp_dim % tensor:
      continue                                    # the weights would not split evenly
    try:  # the combinations the model cannot run, from the one place that refuses them
      model.check_parallelism(sizes, microbatches=stage)  # (micro-batches below are multiples of the stages)
    except UserError:
      continue
    across = _nodes_split(sizes, nodes)
    if across is None:
      continue
    batch_ways = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    for remat in (r for r in REMATS if r in model.remat_policies):
      for accum in (1, 2, 4, 8, 16, 32):
        if cfg.batch_size % (accum * batch_ways):
          break
        micro_options = [1] if stage == 1 else [k * stage for k in (1, 2, 4, 8)]
        for micro in micro_options:
          if cfg.batch_size % (accum * batch_ways * micro):
            continue
          yield Layout(tuple(sizes.items()), tuple(across.items()), remat, accum, micro)


@dataclasses.dataclass
class Row:
  layout: Layout
  estimate: object   # estimate.Estimate
  time: object       # estimate.StepTime
  units_per_sec_per_device: float   # the task's throughput unit: tokens (LM), images (DiT)
  mfu: float
  throughput_key: str               # the task's: tokens_per_sec | images_per_sec

  def to_json(self) -> dict:
    e, t = self.estimate, self.time
    return {"layout": self.layout.name(), "overrides": self.layout.overrides(), "remat": self.layout.remat,
            "grad_accum_steps": self.layout.grad_accum, "microbatches": self.layout.microbatches,
            "across_nodes": {a: n for a, n in self.layout.across if n > 1},
            "memory_bytes_per_device": e.total_bytes_per_device, "params_bytes_per_device": e.params_bytes_per_device,
            "optimizer_bytes_per_device": e.optimizer_bytes_per_device,
            "gradient_bytes_per_device": e.gradient_bytes_per_device,
            "activation_bytes_per_device": e.activation_bytes_per_device,
            "step_time_s": t.total_s, "compute_s": t.compute_s, "overlapped_comm_s": t.overlapped_s,
            "exposed_comm_s": t.exposed_s, "network_s": t.network_s, "mfu": self.mfu,
            f"{self.throughput_key}_per_device": self.units_per_sec_per_device}


def hardware(name: str, mesh, dtype: str) -> perf.Gpu:
  """A GPU from the table, or ("cpu") this machine's simulated devices measured now."""
  if name != "cpu":
    return perf.GPUS[name]
  peak = perf.measure_cpu_peak(mesh, dtype)
  bw = measure_cpu_allreduce_bw(mesh)
  return perf.Gpu("simulated CPU devices (measured)", 1e15, {dtype: peak}, bw, bw)


def target_attention(cfg, gpu: str) -> str:
  """The attention the model runs on `gpu` (a GPUS name or "cpu"), decided as the layout decides it there."""
  from meshtrain import tasks  # the task modules import jax: only after runtime.start
  platform, capability = ("cpu", None) if gpu == "cpu" else ("gpu", perf.GPUS[gpu].compute_capability)
  return tasks.cost_model(cfg).attention_on(platform, capability)


def measure_cpu_allreduce_bw(mesh, size: int = 1 << 22, repeats: int = 5) -> float:
  """Bytes/s per device an all-reduce over every simulated device moves (ring-equivalent), measured here."""
  import time
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P
  n = mesh.size
  x = jax.jit(lambda: jnp.ones((n, size // 4), jnp.float32), out_shardings=NamedSharding(mesh, P(mesh.axis_names)))()
  f = jax.jit(lambda a: jnp.broadcast_to(a.sum(0), a.shape), out_shardings=NamedSharding(mesh, P(mesh.axis_names)))
  f(x).block_until_ready()
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    f(x).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2 * (n - 1) / n * size / best


def rank(cfg, devices: int, nodes: int, hw: perf.Gpu, hbm: float, fused_attention: bool,
         overlap: bool = True) -> tuple[list[Row], int]:
  """(every fitting layout best first, how many layouts were estimated)."""
  from meshtrain import estimate, tasks
  model = tasks.cost_model(cfg)
  boxed = model.abstract_params()
  peak = hw.peaks[cfg.model.dtype]
  rows, seen = [], 0
  for lay in layouts(cfg, devices, nodes):
    seen += 1
    c = lay.apply(cfg)
    try:
      est = estimate.estimate(c, dict(lay.sizes), boxed, fused_attention=fused_attention)
    except UserError:
      continue  # a dimension that does not split evenly
    if est.total_bytes_per_device > hbm:
      continue
    t = estimate.step_time(est, est.collectives, peak, hw.node_bw, hw.network_bw, dict(lay.across), overlap)
    units = cfg.batch_size * model.units_per_example / devices / t.total_s
    rows.append(Row(lay, est, t, units, est.model_flops_per_step / t.total_s / peak, model.throughput_key))
  rows.sort(key=lambda r: (r.time.total_s, r.estimate.flops_per_step, r.estimate.total_bytes_per_device))
  return rows, seen


def _code_version() -> str:
  """A digest of meshtrain's sources and JAX's version: a cached compile is only reused for the same program."""
  import jax
  digest = hashlib.sha256(jax.__version__.encode())
  for path in sorted(pathlib.Path(__file__).parent.rglob("*.py")):
    digest.update(path.read_bytes())
  return digest.hexdigest()[:12]


def compile_report(cfg, row: Row, cache_dir: pathlib.Path) -> dict:
  """Compiles the layout for simulated devices (cached on disk) and returns inspect's JSON report."""
  from meshtrain import inspect
  c = row.layout.apply(cfg, one_process=True)
  key = hashlib.sha256((json.dumps(c.to_dict(), sort_keys=True, default=str) + _code_version()).encode())
  path = cache_dir / f"{key.hexdigest()[:20]}.json"
  if path.exists():
    return json.loads(path.read_text())
  report = inspect.inspect(c).to_json(hbm_bytes=0)
  cache_dir.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(report))
  return report


@dataclasses.dataclass
class Verified:
  row: Row
  compiled: dict       # inspect's JSON report
  time: object         # estimate.StepTime with the compiled program's collectives
  compiled_memory: int  # compiled bytes per device (less the [L, L] attention scores a fused GPU kernel never keeps)
  memory: int          # what `fits` was decided by: compiled_memory, or the prediction where the CPU compile overstates
  fits: bool

  def to_json(self) -> dict:
    c = self.compiled
    return {"layout": self.row.layout.name(), "overrides": self.row.layout.overrides(),
            "predicted_step_time_s": self.row.time.total_s, "step_time_s": self.time.total_s,
            "memory_bytes_per_device": self.memory, "fits": self.fits,
            "compiled_memory_bytes_per_device": self.compiled_memory,
            "predicted_memory_bytes_per_device": self.row.estimate.total_bytes_per_device,
            "params_bytes_per_device": c["params_bytes_per_device"],
            "optimizer_bytes_per_device": c["optimizer_bytes_per_device"],
            "cpu_temp_bytes_per_device": c["temp_bytes_per_device"],
            "collective_bytes": sum(x["bytes"] for x in c["collectives"]),
            "predicted_collective_bytes": sum(x.bytes for x in self.row.estimate.collectives)}


def verify(cfg, rows: list[Row], k: int, hw: perf.Gpu, hbm: float, overlap: bool,
           cache_dir: pathlib.Path, bf16_on_gpu: bool = False) -> list[Verified]:
  """Compiles the best predicted layouts until k of them fit (at most 2k compiles); fitting ones first, best first.

  The compiled program is the ground truth for memory and collectives: XLA's buffer assignment is not modelled
  exactly, and its partitioner sometimes reshards far more than a layout needs ("involuntary full
  rematerialization"). Compiled on the CPU, attention keeps its [L, L] scores; for a GPU target whose fused kernel
  does not, the analytic size of those scores is taken out of the compiled figure. With bfloat16 compute for a GPU
  target (`bf16_on_gpu`), fit is decided by the prediction instead: XLA's CPU backend has no bfloat16 matmul, so it
  converts the layers' bfloat16 residuals to float32 and keeps those, overstating a GPU's memory (8B, 64 devices:
  98 GB compiled against 58 GB); the prediction is checked against float32 CPU compiles (within 5%,
  experiments/plan_validation.py) and the compiled figure is printed beside it.
  """
  from meshtrain import estimate, hlo
  out = []
  for row in rows[:2 * k]:
    if sum(v.fits for v in out) >= k:
      break
    report = compile_report(cfg, row, cache_dir)
    compiled = [hlo.Collective(x["kind"], tuple(x["axes"]), x["count"], x["bytes"], x["exact_groups"])
                for x in report["collectives"]]
    t = estimate.step_time(row.estimate, compiled, hw.peaks[cfg.model.dtype], hw.node_bw, hw.network_bw,
                           dict(row.layout.across), overlap)
    scores = report["expected"]["temp_bytes_per_device"] - row.estimate.temp_bytes_per_device  # 0 unless fused
    compiled_memory = report["total_bytes_per_device"] - max(scores, 0)
    memory = row.estimate.total_bytes_per_device if bf16_on_gpu else compiled_memory
    out.append(Verified(row, report, t, compiled_memory, memory, memory <= hbm))
  return sorted(out, key=lambda v: (not v.fits, v.time.total_s, v.row.estimate.flops_per_step))


# Column heads of the throughput units (the task's throughput_key without "_per_sec").
_UNIT_HEADS = {"tokens": "tok/s/dev", "images": "img/s/dev"}


def format_rows(rows: list[Row], top: int) -> str:
  unit = rows[0].throughput_key.removesuffix("_per_sec")  # one task's rows (main refuses an empty ranking)
  head = ("#", "layout", "nodes", "remat", "accum", "micro", "GB/dev", "compute s", "dp/fsdp s", "exposed s",
          "network s", "step s", "MFU", _UNIT_HEADS.get(unit, f"{unit}/s/dev"))
  lines = [head]
  for i, r in enumerate(rows[:top], 1):
    t, lay = r.time, r.layout
    across = ",".join(f"{a}={n}" for a, n in lay.across if n > 1) or "-"
    lines.append((str(i), lay.name(), across, lay.remat, str(lay.grad_accum), str(lay.microbatches),
                  f"{r.estimate.total_bytes_per_device / GB:.3g}", f"{t.compute_s:.4g}", f"{t.overlapped_s:.4g}",
                  f"{t.exposed_s:.4g}", f"{t.network_s:.4g}", f"{t.total_s:.4g}", f"{r.mfu:.1%}", f"{r.units_per_sec_per_device:,.0f}"))
  widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
  return "\n".join("  ".join(c.ljust(w) if i in (1, 2, 3) else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                   for line in lines)


def main(argv: list[str] | None = None) -> int:
  parser = ArgumentParser(prog="python -m meshtrain.plan", description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("--devices", type=int, required=True, help="devices in the cluster")
  parser.add_argument("--gpu", required=True, choices=[*perf.GPUS, "cpu"])
  parser.add_argument("--nodes", type=int, default=0,
                      help="nodes the devices are spread over, in equal shares (default: --devices / --gpus-per-node)")
  parser.add_argument("--gpus-per-node", type=int, default=0, metavar="N",
                      help="devices in one node, one NVLink domain (default: 8 for the GPUs listed; cpu: all of them)")
  parser.add_argument("--hbm", type=float, default=0, metavar="GB", help="memory per device (default: the GPU's)")
  parser.add_argument("--node-bw", type=float, default=0, metavar="GB/s", help="per-device bandwidth inside a node")
  parser.add_argument("--network-bw", type=float, default=0, metavar="GB/s", help="per-device bandwidth across nodes")
  parser.add_argument("--top", type=int, default=10, help="rows to print")
  parser.add_argument("--no-overlap", action="store_true",
                      help="rank by compute + every collective in sequence (an upper bound) instead of overlapping "
                           "data/fsdp traffic with compute")
  parser.add_argument("--verify", type=int, default=3, metavar="K",
                      help="compile the best K predicted layouts and pick the winner by their compiled collectives "
                           "(default 3; 0: arithmetic only)")
  parser.add_argument("--cache", default="~/.cache/meshtrain/inspect", help="where compiled reports are kept")
  parser.add_argument("--json", action="store_true")
  try:
    args, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    args.nodes, nodes_from = nodes_of(args.devices, args.gpu, args.nodes, args.gpus_per_node)
    if args.devices > config_lib.MAX_CPU_DEVICES:
      raise UserError(f"--devices {args.devices} is more than the {config_lib.MAX_CPU_DEVICES} devices plan can "
                      "simulate to compile and check its layouts; plan for at most that many")
    for flag, value in (("--hbm", args.hbm), ("--node-bw", args.node_bw), ("--network-bw", args.network_bw)):
      if not (math.isfinite(value) and value >= 0):
        raise UserError(f"{flag} {value:g} must be a positive number (0 or omitted: the GPU's own figure)")
    if args.top < 1 or args.verify < 0:
      raise UserError(f"--top must be >= 1 (rows to print) and --verify >= 0 (layouts to compile; 0: none); got "
                      f"--top {args.top} --verify {args.verify}")
    cfg = config_lib.load(args.config, [*overrides, f"--config.cpu_devices={args.devices}"])
    os.environ["JAX_PLATFORMS"] = "cpu"  # shapes and simulated devices only, whatever this machine has
    from meshtrain import runtime
    runtime.start(cfg)
    from meshtrain import mesh as mesh_lib, tasks
    unsupported = tasks.cost_model(cfg).unsupported_axes
    hw = hardware(args.gpu, mesh_lib.make_mesh({"data": -1}), cfg.model.dtype)
    hw = dataclasses.replace(hw, node_bw=args.node_bw * GB or hw.node_bw, network_bw=args.network_bw * GB or hw.network_bw)
    hbm = args.hbm * GB or hw.hbm_bytes
    bf16_on_gpu = args.gpu != "cpu" and cfg.model.dtype == "bfloat16"
    impl = target_attention(cfg, args.gpu)
    fused = impl == "cudnn"  # cuDNN's fused kernel keeps no [L, L] scores; XLA's attention keeps them
    if impl in ("xla", "cudnn"):
      # Traced and compiled here as XLA's attention, what the target runs or (cuDNN, which the CPU cannot trace)
      # the same function; the estimate then leaves the [L, L] scores out when fused.
      cfg.model.attention = "xla"
    rows, seen = rank(cfg, args.devices, args.nodes, hw, hbm, fused, overlap=not args.no_overlap)
    if not seen:
      raise UserError(f"no layout of this model splits evenly over {args.devices} devices: batch_size="
                      f"{cfg.batch_size} must divide over the batch axes, model.num_heads={cfg.model.num_heads} and "
                      f"model.mlp_dim={cfg.model.mlp_dim} over tensor; plan for a device count that divides them")
    if not rows:
      raise UserError(f"none of the {seen} layouts of this model fits in {hbm / GB:g} GB per device on "
                      f"{args.devices} devices; use more devices, a smaller batch_size or seq_len")
    checked = verify(cfg, rows, args.verify, hw, hbm, not args.no_overlap,
                     pathlib.Path(os.path.expanduser(args.cache)), bf16_on_gpu)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  best = checked[0].row if checked and checked[0].fits else rows[0]
  if args.json:
    print(json.dumps({"gpu": hw.name, "devices": args.devices, "nodes": args.nodes, "nodes_from": nodes_from,
                      "hbm_bytes": hbm, "layouts_considered": seen, "fits": len(rows), "unsupported_axes": unsupported,
                      "best": best.to_json(),
                      "ranked": [r.to_json() for r in rows], "verified": [v.to_json() for v in checked]}))
    return 0
  print(f"{cfg.model.get('preset', 'model')}: {seen} layouts considered on {args.devices} x {hw.name} "
        f"({args.nodes} node(s) of {args.devices // args.nodes} ({nodes_from}), {hbm / GB:g} GB each); {len(rows)} "
        "fit. Predicted with kernels at peak, "
        + ("every collective in sequence:" if args.no_overlap else "data/fsdp traffic hidden behind compute:"))
  if unsupported:
    print(f"not split (task={cfg.task}): " + "; ".join(f"{a}: {why}" for a, why in unsupported.items()))
  print(format_rows(rows, args.top))
  if checked:
    print(f"\n{len(checked)} of the best compiled for {args.devices} simulated devices (step time redone with the "
          f"compiled collectives; memory as compiled{', less the attention scores a fused kernel does not keep' if fused else ''}"
          + ("; fit by the predicted memory: the CPU keeps bfloat16 residuals as float32" if bf16_on_gpu else "") + "):")
    print(format_verified(checked))
  print(f"\nbest: {best.layout.name()}, {best.layout.remat} remat, grad_accum_steps={best.layout.grad_accum}\n"
        f"  python -m meshtrain.train --config {args.config} --workdir RUN " + " ".join(best.layout.overrides()))
  return 0


def nodes_of(devices: int, gpu: str, nodes: int, per_node: int) -> tuple[int, str]:
  """How many nodes `devices` devices fill, and where that came from: --nodes, else whole nodes of --gpus-per-node
  or of the GPU's own node size (64 H100s are 8 NVLink domains, not one); `cpu` is this one machine."""
  if devices < 1 or nodes < 0 or per_node < 0:
    raise UserError(f"--devices {devices}, --nodes {nodes} and --gpus-per-node {per_node} must be positive")
  if nodes and per_node and nodes * per_node != devices:
    raise UserError(f"--nodes {nodes} x --gpus-per-node {per_node} is {nodes * per_node} devices, not --devices "
                    f"{devices}; give one of the two")
  source = "--nodes" if nodes else "--gpus-per-node" if per_node else None
  if not nodes:
    per_node = per_node or (perf.GPUS[gpu].per_node if gpu in perf.GPUS else devices)
    nodes = -(-devices // per_node)
  if devices % nodes or (source != "--nodes" and nodes > 1 and devices % per_node):
    raise UserError(f"--devices {devices} is not {nodes} whole nodes of equal size; give --nodes or --gpus-per-node "
                    "so that the devices split evenly")
  source = source or (f"{perf.GPUS[gpu].name} nodes hold {per_node}; --gpus-per-node N to change" if gpu in perf.GPUS
                      else "this machine")
  return nodes, source


def format_verified(checked: list[Verified]) -> str:
  lines = [("layout", "remat", "accum", "predicted s", "compiled s", "compiled GB/dev", "predicted GB/dev", "fits",
            "params+opt GB", "(predicted)", "collective GB", "(predicted)")]
  for v in checked:
    c, e, lay = v.compiled, v.row.estimate, v.row.layout
    lines.append((lay.name(), lay.remat, str(lay.grad_accum), f"{v.row.time.total_s:.4g}", f"{v.time.total_s:.4g}",
                  f"{v.compiled_memory / GB:.3g}", f"{e.total_bytes_per_device / GB:.3g}", "yes" if v.fits else "NO",
                  f"{(c['params_bytes_per_device'] + c['optimizer_bytes_per_device']) / GB:.3f}",
                  f"{(e.params_bytes_per_device + e.optimizer_bytes_per_device) / GB:.3f}",
                  f"{sum(x['bytes'] for x in c['collectives']) / GB:.2f}",
                  f"{sum(x.bytes for x in e.collectives) / GB:.2f}"))
  widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
  return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                   for line in lines)


if __name__ == "__main__":
  from meshtrain import runtime
  runtime.run_main(main)
