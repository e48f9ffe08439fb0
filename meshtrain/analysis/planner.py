"""Pick the layout for a cluster (the library of `python -m meshtrain.plan`): every valid way to split a model over
it, ranked by predicted step time.

Works for every task (the language model, the DiT): the task's cost model (meshtrain/tasks) says which axes its
model can be split over and what each split costs. Enumerates data, fsdp, tensor, sequence, expert and stage sizes
(those the task supports; the others stay 1 and the output says why), the rematerialization policy, gradient
accumulation and pipeline micro-batches; estimates each layout's memory and step time from shapes alone
(meshtrain/analysis/estimate.py: FLOPs at the GPU's peak plus each collective's bytes over NVLink inside a node or the
network across nodes); drops layouts that do not fit. The best K are then compiled for simulated devices (as
inspect does; cached on disk) and the winner is picked by step times redone with the collectives XLA actually
compiled. The modules that import JAX are imported inside the functions that need them, which run after
runtime.start has set the XLA flags and device count.
"""
import dataclasses
import hashlib
import json
import math
import pathlib
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from meshtrain import config as config_lib, families, mesh as mesh_lib
from meshtrain.analysis import compiled as inspect, estimate
from meshtrain.costs import hlo, perf
from meshtrain.errors import UserError

GB = 1e9
REMATS = ("none", "save_dots", "full")
CACHE_DIR = pathlib.Path("~/.cache/meshtrain/inspect").expanduser()  # compiled reports, keyed by config and code


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
  model = families.cost_model(cfg)
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
  platform, capability = ("cpu", None) if gpu == "cpu" else ("gpu", perf.GPUS[gpu].compute_capability)
  return families.cost_model(cfg).attention_on(platform, capability)


def as_on_target(cfg, gpu: str) -> bool:
  """Sets cfg.model.attention to the function `gpu` runs, as the CPU traces it; returns whether that attention is
  fused (keeps no [L, L] scores), which `rank` and `estimate` then leave out."""
  impl = target_attention(cfg, gpu)
  if impl in ("xla", "cudnn"):
    # Traced and compiled here as XLA's attention, what the target runs or (cuDNN, which the CPU cannot trace)
    # the same function; the estimate then leaves the [L, L] scores out when fused.
    cfg.model.attention = "xla"
  return impl == "cudnn"  # cuDNN's fused kernel keeps no [L, L] scores; XLA's attention keeps them


def measure_cpu_allreduce_bw(mesh, size: int = 1 << 22, repeats: int = 5) -> float:
  """Bytes/s per device an all-reduce over every simulated device moves (ring-equivalent), measured here."""
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
  model = families.cost_model(cfg)
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
  digest = hashlib.sha256(jax.__version__.encode())
  for path in sorted(pathlib.Path(__file__).parents[1].rglob("*.py")):
    digest.update(path.read_bytes())
  return digest.hexdigest()[:12]


def compile_report(cfg, row: Row, cache_dir: pathlib.Path) -> dict:
  """Compiles the layout for simulated devices (cached on disk) and returns inspect's JSON report."""
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
                  f"{t.exposed_s:.4g}", f"{t.network_s:.4g}", f"{t.total_s:.4g}", f"{r.mfu:.1%}",
                  f"{r.units_per_sec_per_device:,.0f}"))
  widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
  return "\n".join("  ".join(c.ljust(w) if i in (1, 2, 3) else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                   for line in lines)


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


@dataclasses.dataclass
class Plan:
  gpu: str
  devices: int
  nodes: int
  nodes_from: str      # where the node count came from (a flag, the GPU's node size, this machine)
  hbm: float           # bytes per device
  seen: int            # layouts estimated
  rows: list[Row]      # those that fit, best first
  checked: list[Verified]
  unsupported: dict    # mesh axis -> why the task cannot split it
  fused: bool          # the target's attention keeps no [L, L] scores
  bf16_on_gpu: bool

  @property
  def best(self) -> Row:
    return self.checked[0].row if self.checked and self.checked[0].fits else self.rows[0]

  def to_json(self) -> dict:
    return {"gpu": self.gpu, "devices": self.devices, "nodes": self.nodes, "nodes_from": self.nodes_from,
            "hbm_bytes": self.hbm, "layouts_considered": self.seen, "fits": len(self.rows),
            "unsupported_axes": self.unsupported, "best": self.best.to_json(),
            "ranked": [r.to_json() for r in self.rows], "verified": [v.to_json() for v in self.checked]}


def plan(cfg, devices: int, nodes: int, nodes_from: str, gpu: str, hbm: float = 0, node_bw: float = 0,
         network_bw: float = 0, overlap: bool = True, verify_k: int = 3,
         cache_dir: pathlib.Path = CACHE_DIR) -> Plan:
  """Every layout of `cfg` over `devices` devices in `nodes` nodes of `gpu` (bandwidths in bytes/s and `hbm` in bytes
  override the GPU's; 0 keeps them), ranked, and the best `verify_k` compiled. Call after startup.start(cfg)."""
  unsupported = families.cost_model(cfg).unsupported_axes
  hw = hardware(gpu, mesh_lib.make_mesh({"data": -1}), cfg.model.dtype)
  hw = dataclasses.replace(hw, node_bw=node_bw or hw.node_bw, network_bw=network_bw or hw.network_bw)
  hbm = hbm or hw.hbm_bytes
  bf16_on_gpu = gpu != "cpu" and cfg.model.dtype == "bfloat16"
  fused = as_on_target(cfg, gpu)
  rows, seen = rank(cfg, devices, nodes, hw, hbm, fused, overlap=overlap)
  if not seen:
    raise UserError(f"no layout of this model splits evenly over {devices} devices: batch_size="
                    f"{cfg.batch_size} must divide over the batch axes, model.num_heads={cfg.model.num_heads} and "
                    f"model.mlp_dim={cfg.model.mlp_dim} over tensor; plan for a device count that divides them")
  if not rows:
    raise UserError(f"none of the {seen} layouts of this model fits in {hbm / GB:g} GB per device on "
                    f"{devices} devices; use more devices, a smaller batch_size or seq_len")
  checked = verify(cfg, rows, verify_k, hw, hbm, overlap, cache_dir, bf16_on_gpu)
  return Plan(hw.name, devices, nodes, nodes_from, hbm, seen, rows, checked, unsupported, fused, bf16_on_gpu)


def format_plan(p: Plan, cfg, config_path: str, top: int, overlap: bool) -> str:
  """The ranked table, the compiled check of the best and the command that trains the winner."""
  lines = [f"{cfg.model.get('preset', 'model')}: {p.seen} layouts considered on {p.devices} x {p.gpu} "
           f"({p.nodes} node(s) of {p.devices // p.nodes} ({p.nodes_from}), {p.hbm / GB:g} GB each); {len(p.rows)} "
           "fit. Predicted with kernels at peak, "
           + ("data/fsdp traffic hidden behind compute:" if overlap else "every collective in sequence:")]
  if p.unsupported:
    lines.append(f"not split (task={cfg.task}): " + "; ".join(f"{a}: {why}" for a, why in p.unsupported.items()))
  lines.append(format_rows(p.rows, top))
  if p.checked:
    fused = ", less the attention scores a fused kernel does not keep" if p.fused else ""
    bf16 = "; fit by the predicted memory: the CPU keeps bfloat16 residuals as float32" if p.bf16_on_gpu else ""
    lines.append(f"\n{len(p.checked)} of the best compiled for {p.devices} simulated devices (step time redone with "
                 f"the compiled collectives; memory as compiled{fused}{bf16}):")
    lines.append(format_verified(p.checked))
  best = p.best
  lines.append(f"\nbest: {best.layout.name()}, {best.layout.remat} remat, grad_accum_steps={best.layout.grad_accum}\n"
               f"  python -m meshtrain.train --config {config_path} --workdir RUN "
               + " ".join(best.layout.overrides()))
  return "\n".join(lines)
