"""Cost helpers every task's cost model shares with meshtrain/analysis/estimate.py: the mesh of a layout without its
devices, the stacked layer rows of the parameter table, the pipeline schedule's shape and the list that collects a
task's collectives, the base of each task's block stack and the record that places a stack in its model. Nothing
here knows a model family, so the tasks (below estimate) and estimate both import it."""
import dataclasses
from typing import Any, NamedTuple

from jax.sharding import AbstractMesh, AxisType

from meshtrain import mesh as mesh_lib
from meshtrain.costs.hlo import Collective
from meshtrain.parallel.pipeline import pipeline_repeats


def abstract_mesh(sizes: dict) -> AbstractMesh:
  """The mesh of `sizes` (mesh axis -> size) without devices, with Auto axes like mesh.make_mesh's: an AbstractMesh's
  axes default to Explicit on JAX 0.12 (Auto on 0.10), and the model's sharding constraints assert on Explicit axes."""
  return AbstractMesh(tuple(sizes[a] for a in mesh_lib.AXES), mesh_lib.AXES,
                      axis_types=(AxisType.Auto,) * len(mesh_lib.AXES))


def pipeline_shape(cfg, stages: int) -> tuple[int, int, int]:
  """(micro-batches M, passes R, loop iterations R*M + S - 1) of the pipeline schedule; (1, 1, 1) without stages."""
  if stages == 1:
    return 1, 1, 1
  micro = cfg.pipeline.microbatches
  repeats = pipeline_repeats(cfg, stages)
  return micro, repeats, repeats * micro + stages - 1


def layer_rows(rows):
  """The parameter table's rows of the stacked layers (`layers/...`): what is gathered or reduced per layer run."""
  return [r for r in rows if r.path.startswith("layers/")]


class CollectiveList(list):
  """Collectives per device per step as a task's `collectives` derives them: `add` drops mesh axes of size 1 (and
  a collective left with none, or run zero times)."""

  def __init__(self, sizes: dict):
    super().__init__()
    self.sizes = sizes

  def add(self, kind: str, axes, count, nbytes) -> None:
    axes = tuple(a for a in mesh_lib.AXES if a in axes and self.sizes[a] > 1)
    if axes and count:
      self.append(Collective(kind, axes, int(count), int(nbytes), True))


@dataclasses.dataclass(frozen=True)
class BlockStack:
  """What every task's `LayerStack` shares: `model`, the model config as one device of the split holds it, whose
  d_model is the residual stream's width. A task's subclass adds its fields, `dims` and `backward_peak`."""
  model: Any

  @property
  def width(self) -> int:
    return self.model.d_model

  def without_remat(self):
    return dataclasses.replace(self, model=dataclasses.replace(self.model, remat="none"))


class Stacked(NamedTuple):
  """One scanned stack of identical blocks of a model, as a cost model's `stacks(sizes)` lists them in the order
  the forward pass runs them (the LM and DiT have one; Flux three: text encoder, double- and single-stream)."""
  stack: BlockStack  # the block as one device runs it: what estimate traces for its residuals
  layers: int        # blocks in the stack (all stages together)
  prefix: str        # the parameter table's rows of its stacked weights are those whose path starts so
  length: int        # tokens of one example that its blocks carry (the residual stream's, [length, width])
