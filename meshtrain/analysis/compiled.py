"""What a compiled train step costs each device (the library of `python -m meshtrain.inspect`).

The devices are simulated CPU devices and no array is allocated: XLA compiles the real train step (the one
`python -m meshtrain.train` runs, same shardings) from shapes. Reported per device: parameter, optimizer-state,
gradient and temporary bytes, FLOPs per step and every collective (kind, mesh axes, count and bytes per step), each
next to the analytic expectation of meshtrain/analysis/estimate.py and the ratio measured / expected.
"""
import dataclasses
import math
import time

import jax

from meshtrain import families, layout as layout_lib, mesh as mesh_lib
from meshtrain.analysis import estimate
from meshtrain.costs import hlo
from meshtrain.runtime import startup

GB = 1e9


@dataclasses.dataclass
class Report:
  devices: int
  mesh: dict
  compile_time_s: float
  params_bytes_total: int
  params_bytes_per_device: int
  optimizer_bytes_per_device: int
  batch_bytes_per_device: int
  argument_bytes_per_device: int       # XLA: everything passed in (parameters, optimizer state, batch)
  temp_bytes_per_device: int           # XLA: gradients, activations and scratch during the step
  flops_per_step: float                # per device, every dot in the compiled program x its loop trip count
  collectives: list
  expected: object                     # estimate.Estimate
  task: str = "lm"
  model_flops_per_example: float = 0.0  # the task's formula (task.flops_per_example): the MFU numerator per example
  batch_size: int = 0

  @property
  def total_bytes_per_device(self) -> int:
    return self.argument_bytes_per_device + self.temp_bytes_per_device

  def to_json(self, hbm_bytes: float) -> dict:
    e = self.expected
    out = {
        "devices": self.devices, "mesh": self.mesh, "compile_time_s": self.compile_time_s,
        "params_bytes_total": self.params_bytes_total, "params_bytes_per_device": self.params_bytes_per_device,
        "optimizer_bytes_per_device": self.optimizer_bytes_per_device,
        "argument_bytes_per_device": self.argument_bytes_per_device,
        "temp_bytes_per_device": self.temp_bytes_per_device, "total_bytes_per_device": self.total_bytes_per_device,
        "hbm_bytes": hbm_bytes, "fits": self.total_bytes_per_device <= hbm_bytes,
        "spare_bytes": hbm_bytes - self.total_bytes_per_device, "flops_per_step": self.flops_per_step,
        "collectives": [dataclasses.asdict(c) for c in self.collectives],
        "task": self.task, "model_flops_per_example": self.model_flops_per_example,
        "model_flops_per_step": self.model_flops_per_example * self.batch_size / self.devices,
    }
    return {**out, "gradient_bytes_per_device": e.gradient_bytes_per_device, "expected": {
            "params_bytes_per_device": e.params_bytes_per_device,
            "optimizer_bytes_per_device": e.optimizer_bytes_per_device,
            "gradient_bytes_per_device": e.gradient_bytes_per_device,
            "activation_bytes_per_device": e.activation_bytes_per_device,
            "temp_bytes_per_device": e.temp_bytes_per_device, "total_bytes_per_device": e.total_bytes_per_device,
            "flops_per_step": e.flops_per_step, "model_flops_per_step": e.model_flops_per_step,
            "collectives": [dataclasses.asdict(c) for c in e.collectives]}}


def _shard_bytes(tree) -> int:
  """Bytes one device holds of a tree of sharded shapes: what the compiled program is given, exactly."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def inspect(cfg) -> Report:
  """Compiles cfg's train step for cfg.cpu_devices simulated devices; arrays are never created."""
  startup.start(cfg)
  mesh = mesh_lib.make_mesh(cfg.mesh)
  layout = layout_lib.build(cfg, mesh)
  families.cost_model(cfg)  # a task that has none is refused before the compile, not after
  t0 = time.perf_counter()
  compiled = layout.compile_train_step()
  compile_s = time.perf_counter() - t0
  text = compiled.as_text()
  mem = compiled.memory_analysis()
  expected = estimate.estimate(cfg, dict(mesh.shape))
  batch = layout.batch_abstract(cfg.batch_size)
  return Report(
      devices=mesh.size, mesh={k: v for k, v in mesh.shape.items() if v > 1}, compile_time_s=compile_s,
      params_bytes_total=sum(r.size * r.dtype.itemsize for r in layout.table),
      params_bytes_per_device=_shard_bytes(layout.state_abstract.params),
      # The parameters' average (ema_decay) with the optimizer state, as the estimate counts it.
      optimizer_bytes_per_device=_shard_bytes((layout.state_abstract.opt_state, layout.state_abstract.ema_params)),
      batch_bytes_per_device=_shard_bytes(batch),
      argument_bytes_per_device=mem.argument_size_in_bytes, temp_bytes_per_device=mem.temp_size_in_bytes,
      flops_per_step=hlo.dot_flops(text), collectives=hlo.collectives(text, mesh), expected=expected,
      task=cfg.task, model_flops_per_example=layout.task.flops_per_example(layout.table), batch_size=cfg.batch_size)


def _gb(b: float) -> str:
  return f"{b / GB:,.3f} GB" if abs(b) >= GB else f"{b / 1e6:,.2f} MB"


def _ratio(measured: float, expected: float) -> str:
  return f"{measured / expected:.2f}" if expected else "-"


def format_report(r: Report, hbm_bytes: float) -> str:
  e = r.expected
  rows = [("per device", "compiled", "expected", "ratio"),
          ("parameters", _gb(r.params_bytes_per_device), _gb(e.params_bytes_per_device),
           _ratio(r.params_bytes_per_device, e.params_bytes_per_device)),
          ("optimizer state", _gb(r.optimizer_bytes_per_device), _gb(e.optimizer_bytes_per_device),
           _ratio(r.optimizer_bytes_per_device, e.optimizer_bytes_per_device)),
          ("arguments (+ batch)", _gb(r.argument_bytes_per_device), _gb(e.arguments_bytes_per_device),
           _ratio(r.argument_bytes_per_device, e.arguments_bytes_per_device)),
          ("  gradients", "(in temporaries)", _gb(e.gradient_bytes_per_device), ""),
          ("  activations", "(in temporaries)", _gb(e.activation_bytes_per_device), ""),
          ("temporaries", _gb(r.temp_bytes_per_device), _gb(e.temp_bytes_per_device),
           _ratio(r.temp_bytes_per_device, e.temp_bytes_per_device)),
          ("total", _gb(r.total_bytes_per_device), _gb(e.total_bytes_per_device),
           _ratio(r.total_bytes_per_device, e.total_bytes_per_device)),
          ("FLOPs per step", f"{r.flops_per_step:.4g}", f"{e.flops_per_step:.4g}",
           _ratio(r.flops_per_step, e.flops_per_step))]
  widths = [max(len(row[i]) for row in rows) for i in range(4)]
  lines = [f"mesh: {' x '.join(f'{k}={v}' for k, v in r.mesh.items()) or 'data=1'} ({r.devices} devices); "
           f"{r.params_bytes_total / GB:,.3f} GB of parameters in "
           f"total; compiled in {r.compile_time_s:.1f} s"]
  lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in rows]
  spare = hbm_bytes - r.total_bytes_per_device
  lines.append(f"against {hbm_bytes / GB:g} GB per device: " + (f"fits with {_gb(spare)} to spare" if spare >= 0
                                                                  else f"short by {_gb(-spare)}"))
  lines.append("")
  lines.append("collectives per device per step (compiled | expected):")
  expected = {(c.kind, c.axes): c for c in e.collectives}
  seen = set()
  crow = [("kind", "mesh axes", "count", "bytes", "exp. count", "exp. bytes", "ratio")]
  for c in r.collectives:
    x = expected.get((c.kind, c.axes))
    seen.add((c.kind, c.axes))
    crow.append((c.kind, ",".join(c.axes) or "-", str(c.count), _gb(c.bytes), str(x.count) if x else "-",
                 _gb(x.bytes) if x else "-", _ratio(c.bytes, x.bytes) if x else "-"))
  for key, x in expected.items():
    if key not in seen:
      crow.append((x.kind, ",".join(x.axes), "0", "0", str(x.count), _gb(x.bytes), "0.00"))
  widths = [max(len(row[i]) for row in crow) for i in range(7)]
  lines += ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in crow]
  return "\n".join(lines)
