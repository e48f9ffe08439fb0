"""Devices and the named device mesh. Importable on its own by research code.

The mesh has one named axis per kind of parallelism:
  stage     pipeline stages (layers split into consecutive groups; activations passed stage to stage)
  data      batch split, everything else replicated; one gradient all-reduce per step
  fsdp      batch split, parameters and optimizer state split (ZeRO-3); all-gathers and reduce-scatters per layer
  expert    mixture-of-experts weights split by expert; the batch is split too; all-to-all per MoE layer
  sequence  context parallelism: the sequence split through the whole model; K/V passed around a ring
  tensor    Megatron tensor parallelism: heads and MLP width split; all-reduces inside every layer
Axis order is outermost to innermost: the axes that carry the most traffic, on the critical path of every layer
(tensor, sequence, expert), are innermost so their groups are neighbouring devices on the fastest links. Across
nodes (one node per process, or per TPU slice) only the `mesh.nodes` sizes apply; by default that is `data`, the
axis that communicates least (one gradient all-reduce per step, overlappable).
"""
import math
import warnings
from collections.abc import Mapping

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from meshtrain.errors import UserError

AXES = ("stage", "data", "fsdp", "expert", "sequence", "tensor")
# The batch is split over every axis that does not split activations some other way: expert devices are data
# parallel outside the MoE layers (as in GShard); sequence, tensor and stage devices share their batch rows.
BATCH_AXES = ("data", "fsdp", "expert")
# Axes with a collective inside every layer, on the critical path: they belong on the fast links inside a node.
HEAVY_AXES = ("tensor", "sequence", "expert")


def simulate_cpu_devices(count: int) -> None:
  """Makes the CPU backend expose `count` devices, so meshes and collectives are real without accelerators.

  Must run before JAX initialises its backends. It only shapes the CPU backend: on a GPU machine the default
  backend is still the GPUs.
  """
  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError as e:  # backends already up (e.g. inside a test process that set its own count)
    if jax.device_count("cpu") != count and jax.default_backend() == "cpu":
      raise UserError(f"JAX was initialised with {jax.device_count('cpu')} CPU devices before meshtrain could ask "
                      f"for cpu_devices={count}; set cpu_devices={jax.device_count('cpu')} "
                      "or start a fresh process") from e


def fill_sizes(sizes: Mapping[str, int], total: int, what: str, unit: str = "devices") -> dict[str, int]:
  """Resolves at most one -1 in `sizes` so that the sizes multiply to `total`; errors name the numbers."""
  sizes = {axis: int(sizes.get(axis, 1)) for axis in AXES}
  shown = " x ".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "data=1"
  unknown = [a for a, s in sizes.items() if s == -1]
  if len(unknown) > 1:
    raise UserError(f"{what}: only one axis may be -1, got {shown}; give explicit sizes to all but one")
  known = math.prod(s for s in sizes.values() if s != -1)
  if unknown:
    if total % known:
      raise UserError(f"{what}: cannot fill {unknown[0]}=-1: {total} {unit} are not divisible by the other axes "
                      f"({shown}, product {known}); choose sizes whose product divides {total}")
    sizes[unknown[0]] = total // known
  elif known != total:
    raise UserError(f"{what}: axis sizes {shown} multiply to {known}, but there are {total} {unit}; make the "
                    f"product {total} (or set one axis to -1 to fill it from the {unit[:-1]} count)")
  return sizes


def _node_count(devices) -> int:
  # A node is the unit joined by slow links: a TPU slice when devices report one, otherwise a process (host).
  slices = {getattr(d, "slice_index", None) for d in devices}
  if None not in slices and len(slices) > 1:
    return len(slices)
  return len({d.process_index for d in devices})


def make_mesh(sizes: Mapping, devices=None) -> Mesh:
  """Builds the mesh from per-node axis sizes (`sizes["data"]`, ...) and optional `sizes["nodes"]` sizes.

  `sizes` is the `mesh` config group or any mapping, e.g. `make_mesh({"fsdp": -1})` for research code.
  Each final axis size is (size inside a node) x (size across nodes). Axis types are Auto, so sharding is
  driven by PartitionSpecs and XLA's partitioner (the logical-rules style), not by explicit-sharding types.
  """
  devices = list(devices if devices is not None else jax.devices())
  nodes = _node_count(devices)
  node_sizes = dict(sizes.get("nodes", None) or {})
  across = fill_sizes({a: node_sizes.get(a, -1 if a == "data" else 1) for a in AXES}, nodes,
                      f"mesh.nodes ({nodes} nodes)", unit="nodes")
  inside = fill_sizes(sizes, len(devices) // nodes,
                      f"mesh ({len(devices) // nodes} devices per node)" if nodes > 1
                      else f"mesh ({len(devices)} devices)")
  ici_shape = tuple(inside[a] for a in AXES)
  dcn_shape = tuple(across[a] for a in AXES)
  if nodes > 1:
    is_slices = nodes != len({d.process_index for d in devices})
    grid = mesh_utils.create_hybrid_device_mesh(ici_shape, dcn_shape, devices, process_is_granule=not is_slices,
                                                allow_split_physical_axes=True)
  else:
    grid = mesh_utils.create_device_mesh(ici_shape, devices, allow_split_physical_axes=True)
  if nodes > 1:
    warn_slow_links(across)
  return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def warn_slow_links(across: Mapping[str, int]) -> list[str]:
  """Warns (and returns the axes) when an axis with per-layer collectives spans nodes, i.e. the slow links."""
  slow = [a for a in HEAVY_AXES if across.get(a, 1) > 1]
  if slow:
    warnings.warn(f"mesh.nodes puts {', '.join(f'{a}={across[a]}' for a in slow)} across nodes: every layer then "
                  f"waits on the inter-node network; keep {', '.join(slow)} inside a node (mesh.{slow[0]}) and put "
                  f"data, fsdp or stage across nodes instead", stacklevel=3)
  return slow


def describe(mesh: Mesh) -> str:
  """One line: the axes larger than 1, device count and kind, e.g. `data=2 x fsdp=4 (8 cpu devices, 1 process(es))`."""
  axes = " x ".join(f"{name}={size}" for name, size in mesh.shape.items() if size > 1) or "data=1"
  return f"{axes} ({mesh.size} {mesh.devices.flat[0].platform} devices, {jax.process_count()} process(es))"
