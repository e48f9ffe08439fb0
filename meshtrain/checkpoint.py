"""Orbax checkpoints: async, sharded, resumable onto any mesh.

Each step directory `WORKDIR/checkpoints/<step>` holds two items: `state` (the sharded TrainState) and `meta`
(JSON: the data position and the resolved config). Orbax writes into a temporary directory and renames it
when complete, so a run that dies mid-save never damages an earlier checkpoint and leaves no half step.
"""
import pathlib

import jax
import orbax.checkpoint as ocp

from meshtrain.errors import UserError


class Checkpointer:
  def __init__(self, workdir: str | pathlib.Path, keep: int):
    self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True),
        item_handlers={"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def read_meta(self, step: int) -> dict:
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def restore_state(self, step: int, abstract_state):
    """Restores onto the shardings carried by `abstract_state` (ShapeDtypeStructs): any mesh, any device count."""
    return self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))["state"]

  def save(self, step: int, state, meta: dict) -> None:
    """Starts an async save; returns once the device arrays are copied out, so training continues meanwhile."""
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                       force=True)

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


def check_compatible(saved_config: dict, model_cfg, shape_fields: tuple[str, ...], step: int, directory) -> None:
  """A checkpoint of another model shape cannot be resumed: name every differing field before anything runs."""
  saved_model = saved_config.get("model", {})
  diffs = [f"model.{k}: checkpoint {saved_model.get(k)!r}, this run {model_cfg[k]!r}"
           for k in shape_fields if saved_model.get(k) != model_cfg[k]]
  if diffs:
    raise UserError(f"the checkpoint at step {step} in {directory} was written by a different model shape:\n  "
                    + "\n  ".join(diffs) + "\nuse the same model settings to resume, or a new --workdir to start over")


def abstract_like(tree):
  """ShapeDtypeStructs (with shardings) of a tree of arrays or of ShapeDtypeStructs."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
