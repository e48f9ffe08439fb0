"""Logical-axis rules: the single sharding knob. Importable on its own by research code.

Models name the axes of every parameter and key activation with logical names (`embed`, `mlp`, `heads`,
`act_batch`, ...). A rules table maps each logical name to mesh axes (or to None: replicated). The same model
then runs data-parallel, FSDP, tensor-parallel or FSDP x tensor by switching the table; the model never
names a mesh axis. Parameter names and activation names are separate (`mlp` vs `act_mlp`) so the two can be
laid out differently, e.g. FSDP splits the `embed` dimension of weights while activations keep it whole.
"""
import dataclasses
import math
from collections.abc import Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshtrain.errors import UserError
from meshtrain.mesh import BATCH_AXES

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

# Every preset starts here: parameters replicated, the batch split over all batch axes. The axes of the other
# kinds of parallelism are always mapped, since an axis of size 1 changes nothing: `layers` (the stacked-layer
# axis that scan adds) goes to `stage`, which only a pipelined model has; experts to `expert`; the sequence of
# activations to `sequence` (context parallelism).
_BASE = {"embed": None, "mlp": None, "heads": None, "kv_heads": None, "head_dim": None, "vocab": None,
         "norm": None, "layers": "stage", "expert": "expert", "act_expert": "expert",
         "act_batch": BATCH_AXES, "act_len": "sequence", "act_res_len": "sequence", "act_embed": None,
         "act_heads": None, "act_kv_heads": None, "act_head_dim": None, "act_mlp": None, "act_vocab": None,
         "act_stage": "stage",
         # The generation KV cache (meshtrain/models/llama.py, CACHE_AXES) like the activations it stores: rows over
         # the batch axes, kv heads over `tensor` where the rules split heads. Its layer axis is never split
         # (generation runs unpipelined), nor its slots (no sequence split while decoding).
         "cache_layers": None, "cache_batch": BATCH_AXES, "cache_len": None, "cache_kv_heads": None,
         "cache_head_dim": None}
# ZeRO-3: every matrix has an `embed` dimension, so every matrix (and its optimizer state) is split; XLA
# all-gathers each layer's weights before use and reduce-scatters their gradients.
_FSDP = {"embed": "fsdp"}
# Megatron: column-split Q/K/V and MLP-in, row-split attention-out and MLP-out, split vocab; the activations
# between the two halves are split the same way, so each block needs one all-reduce per half.
_TENSOR = {"mlp": "tensor", "heads": "tensor", "kv_heads": "tensor", "vocab": "tensor",
           "act_heads": "tensor", "act_kv_heads": "tensor", "act_mlp": "tensor", "act_vocab": "tensor",
           "cache_kv_heads": "tensor"}
# Megatron sequence parallelism: between the tensor-parallel halves (norms, residual adds) the residual stream
# is split along the sequence over `tensor` instead of replicated, so each all-reduce becomes a reduce-scatter
# into this layout and an all-gather out of it: the same bytes, 1/tensor of the activation memory and norm work.
_SEQUENCE_PARALLEL = {"act_res_len": ("sequence", "tensor")}
PRESETS: dict[str, Rules] = {
    "dp": tuple(_BASE.items()),
    "fsdp": tuple({**_BASE, **_FSDP}.items()),
    "tp": tuple({**_BASE, **_TENSOR}.items()),
    "fsdp_tp": tuple({**_BASE, **_FSDP, **_TENSOR}.items()),
}


def _mesh_axes(value) -> tuple[str, ...]:
  return (value,) if isinstance(value, str) else tuple(value or ())


def active_mesh_axes(logical: str) -> tuple[str, ...]:
  """The axes of the active mesh (size > 1) that the active rules map `logical` to; () outside a mesh context.

  For model code that must act differently when a dimension is split (ring attention over a split sequence,
  a pipeline's stage dimension) without naming a mesh axis itself."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  axes = _mesh_axes(nn.logical_to_mesh_axes((logical,))[0])
  return tuple(a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1)


def rules_for(preset: str, sequence_parallel: bool = False) -> Rules:
  if preset not in PRESETS:
    raise UserError(f"sharding.rules={preset!r} is not a preset; choose one of {', '.join(PRESETS)}")
  rules = dict(PRESETS[preset])
  if sequence_parallel:
    if rules["act_heads"] != "tensor":
      raise UserError(f"sharding.sequence_parallel needs tensor parallelism; use sharding.rules=tp or fsdp_tp "
                      f"(got {preset})")
    rules.update(_SEQUENCE_PARALLEL)
  # Flax gives each mesh axis to the first rule that claims it. In MoE layers the dispatched tokens [X, G, C, D]
  # put `act_expert` before `act_batch`, so `expert` goes to the experts; this fallback then still splits the
  # groups over the other batch axes (without it they would be replicated).
  return (*rules.items(), ("act_batch", tuple(a for a in BATCH_AXES if a != "expert")))


def for_mesh(rules: Rules, mesh: Mesh) -> Rules:
  """The rules without the mesh axes of size 1: they split nothing, and specs and tables stay readable."""
  def keep(value):
    axes = tuple(a for a in _mesh_axes(value) if mesh.shape.get(a, 1) > 1)
    return None if not axes else axes[0] if len(axes) == 1 else axes
  return tuple((name, keep(value)) for name, value in rules)


def check_mesh_uses_rules(mesh: Mesh, rules: Rules, has_experts: bool = False, pipelined: bool = False) -> None:
  """Rejects, before compiling, a mesh axis (>1) that would silently do nothing useful.

  `data` only ever splits the batch. `fsdp` and `tensor` are there to split parameters: if the rules never name
  them the run silently degrades (fsdp=8 under the `dp` preset is plain data parallelism). `expert` needs a
  mixture-of-experts model, `stage` a pipelined one; `sequence` always splits the activations.
  """
  def splits_params(r: Rules, axis: str) -> bool:
    # Activations and the generation cache follow the parameters' layout; only parameter rules count.
    return any(axis in _mesh_axes(v) for k, v in r if not k.startswith(("act_", "cache_")))
  for axis, size in mesh.shape.items():
    if size == 1 or axis in ("data", "sequence"):
      continue
    if axis == "expert" and not has_experts:
      raise UserError(f"mesh.expert={size} splits mixture-of-experts layers, but this model has none; set "
                      f"model.num_experts (e.g. {size * 2}) or put the devices on mesh.data")
    if axis == "stage" and not pipelined:
      raise UserError(f"mesh.stage={size} needs model.num_layers divisible into {size} stages")
    if axis in ("fsdp", "tensor") and not splits_params(rules, axis):
      fits = [name for name, r in PRESETS.items() if splits_params(r, axis)]
      raise UserError(f"mesh axis {axis}={size} is not used by these sharding rules to split parameters; choose "
                      f"sharding.rules from {', '.join(fits)} or set mesh.{axis}=1 (and put the devices on mesh.data)")


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules) -> P:
  return nn.logical_to_mesh_axes(tuple(logical_axes), rules)


def batch_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
  """Sharding of a [batch, length] token array."""
  return NamedSharding(mesh, logical_to_spec(("act_batch", "act_len"), rules))


def check_batch(mesh: Mesh, batch_size: int, micro_batches: int = 1, split_by: str = "grad_accum_steps") -> None:
  """The batch, and each of its `micro_batches` parts, must split evenly over the batch axes."""
  ways = math.prod(mesh.shape[a] for a in BATCH_AXES)
  micro = batch_size // micro_batches
  if micro % ways:
    what = f"batch_size={batch_size}" + (f" / {split_by}={micro_batches} = {micro} per micro-batch"
                                         if micro_batches > 1 else "")
    axes = " x ".join(a for a in BATCH_AXES if mesh.shape[a] > 1) or "data"
    good = ways * micro_batches
    raise UserError(f"{what} is not divisible by the batch axes {axes} = {ways}; use a batch_size that is a "
                    f"multiple of {good} (e.g. {good * max(1, round(batch_size / good))}) or change the mesh")


@dataclasses.dataclass(frozen=True)
class ParamRow:
  path: str
  shape: tuple[int, ...]
  logical: tuple[str | None, ...]
  spec: P
  dtype: np.dtype
  bytes_per_device: int

  @property
  def size(self) -> int:
    return math.prod(self.shape)


def param_table(abstract_params, mesh: Mesh, rules: Rules) -> list[ParamRow]:
  """One row per parameter of a Flax Linen variable tree whose leaves carry logical names (LogicallyPartitioned).

  `abstract_params` is what `jax.eval_shape(model.init, ...)` returns (or its "params" collection).
  Raises UserError when a dimension is not divisible by the mesh axes it is split over.
  """
  logical = nn.get_partition_spec(abstract_params)
  values = nn.meta.unbox(abstract_params)
  rows = []
  for (path, leaf), spec_logical in zip(jax.tree_util.tree_leaves_with_path(values),
                                        jax.tree_util.tree_leaves(logical, is_leaf=lambda x: isinstance(x, P))):
    names = tuple(spec_logical) + (None,) * (leaf.ndim - len(spec_logical))
    spec = logical_to_spec(names, rules)
    shard = list(leaf.shape)
    name = "/".join(str(getattr(k, "key", k)) for k in path)
    for dim, axes in enumerate(tuple(spec) + (None,) * (leaf.ndim - len(spec))):
      ways = math.prod(mesh.shape[a] for a in _mesh_axes(axes))
      if shard[dim] % ways:
        raise UserError(f"parameter {name} dimension {dim} ({names[dim]}) has size {shard[dim]}, which is not "
                        f"divisible by mesh axes {axes} = {ways} devices; change the model size or the mesh "
                        f"(e.g. a {names[dim]} size that is a multiple of {ways}, or a smaller {axes} axis)")
      shard[dim] //= ways
    rows.append(ParamRow(name, tuple(leaf.shape), names, spec, np.dtype(leaf.dtype),
                         math.prod(shard) * np.dtype(leaf.dtype).itemsize))
  return rows


def shardings_of(abstract_params, mesh: Mesh, rules: Rules):
  """NamedShardings for the (unboxed) parameter tree, from its logical names and the rules."""
  return nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract_params), mesh, rules)


def format_table(rows: list[ParamRow]) -> str:
  """The parameter table as text: path, shape, logical axes, PartitionSpec, bytes per device; then totals."""
  def fmt_axes(t):
    return "(" + ", ".join(str(a) for a in t) + ")"
  lines = [("parameter", "shape", "logical axes", "partition spec", "bytes/device")]
  for r in rows:
    lines.append((r.path, "x".join(map(str, r.shape)), fmt_axes(r.logical), fmt_axes(tuple(r.spec)),
                  f"{r.bytes_per_device:,}"))
  total = sum(r.size for r in rows)
  total_bytes = sum(r.size * r.dtype.itemsize for r in rows)
  per_device = sum(r.bytes_per_device for r in rows)
  widths = [max(len(line[i]) for line in lines) for i in range(5)]
  out = ["  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))) for line in lines]
  out.insert(1, "  ".join("-" * w for w in widths))
  out.append(f"total: {total:,} parameters, {total_bytes / 2**20:,.1f} MiB; per device {per_device / 2**20:,.2f} MiB "
             f"of parameters (x3 with Adam's two moments)")
  return "\n".join(out)
