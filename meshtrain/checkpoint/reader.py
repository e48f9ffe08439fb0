"""Reading checkpoints without resuming them: their steps, a run's meta item (plain JSON), and the parameters
alone (host arrays or any mesh), all at once (`load_params`) or one at a time (`param_reader`).

Readers (generate, sample, convert to-hf, init_from) may read a run that is still training: they never write into
it (Orbax's own report of a failed read goes under the system's temporary directory, not WORKDIR/diagnostics/),
and a step the trainer's retention (`checkpoint_keep`) deletes while it is read is `StepVanished`: when the user
did not ask for that step, load_params and read_params then read the newest step there is (`retrying`), callers
of param_reader start over; a step the user asked for is a one-line error."""
import contextlib
import json
import os
import pathlib
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from meshtrain import sharding
from meshtrain.checkpoint.checkpointer import REQUIRED
from meshtrain.checkpoint.integrity import CheckpointDamaged, restore_problem, verified_meta
from meshtrain.checkpoint.orbax_output import BackgroundOutput, quiet_absl, stderr_to
from meshtrain.errors import UserError
from meshtrain.models.llama import ModelConfig, Transformer


def checkpoint_steps(workdir) -> list[int]:
  """The complete checkpoint steps under WORKDIR/checkpoints (every marker and metadata file there), oldest first."""
  directory = pathlib.Path(workdir).expanduser().absolute() / "checkpoints"
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir()
                if p.name.isdigit() and all((p / name).is_file() for name in REQUIRED))


def run_meta(workdir_arg: str, step: int | None, what: str) -> tuple[int, dict]:
  """(step, meta item) of the checkpoint at `step` (default: the newest) of the workdir `workdir_arg` names, read as
  plain JSON (no JAX), so an entry point can still set the device count and XLA flags from the run's config.
  `what` completes the message for a workdir without checkpoints ("pass the directory of ...")."""
  workdir = pathlib.Path(workdir_arg).expanduser()
  for attempt in range(RETRIES):
    steps = checkpoint_steps(workdir)
    if not steps:
      raise UserError(f"--workdir {workdir_arg}: " + ("no such directory" if not workdir.is_dir() else
                      "no complete checkpoint in it") + f"; pass the directory of {what}")
    if step is not None and step not in steps:
      raise UserError(f"--step {step}: {workdir_arg} has checkpoints at steps {', '.join(map(str, steps))}")
    picked = step if step is not None else steps[-1]
    meta_path = workdir / "checkpoints" / str(picked) / "meta" / "metadata"
    try:
      meta = json.loads(meta_path.read_text())
      meta["config"]  # pylint: disable=pointless-statement
    except (OSError, ValueError, KeyError, TypeError) as e:
      # The newest step, deleted by a live run's retention since it was listed: the newest there is now.
      if step is None and attempt < RETRIES - 1 and _gone(meta_path.parents[1]):
        continue
      raise UserError(f"cannot read the run's config from {meta_path}: {e}") from e
    return picked, meta
  raise AssertionError("unreachable")


class StepVanished(UserError):
  """The step being read was deleted meanwhile (a live run's retention): read the newest one again."""

  def __init__(self, step: int, workdir: pathlib.Path):
    super().__init__(f"the checkpoint at step {step} in {workdir} was deleted while it was read (the run is still "
                     "training and keeps only its newest checkpoints, checkpoint_keep); read it again, or pass a "
                     "--step the run keeps")
    self.step = step


@contextlib.contextmanager
def _threads_to_log(workdir: pathlib.Path, step: int):
  """For the duration of a read, what threads other than the main one print goes to the reader's log
  (diagnostics_log), and after a failed read for the rest of the process: Orbax's and TensorStore's threads go on
  failing for a moment after the read raised (a callback per pending read into Orbax's closed event loop: "Event
  loop is closed" tracebacks), while the command prints its one error line. Installed before the read, so that no
  thread holds the terminal's stream when it starts printing; never into the run, never to the terminal."""
  output = BackgroundOutput(diagnostics_log(workdir, "").parent, kind=f"{workdir.name}-read")
  output.step = step
  output.install(own_terminal=False)
  try:
    yield
  except BaseException:
    raise  # left installed: the failure's stragglers are still to come
  else:
    output.uninstall()


def _gone(step_dir: pathlib.Path) -> bool:
  """The step directory is deleted or being deleted (a required file already gone)."""
  return not all((step_dir / name).is_file() for name in REQUIRED)


RETRIES = 3  # newest steps tried when each is deleted while read: a run saving that often is rare


def diagnostics_log(workdir: pathlib.Path, name: str) -> pathlib.Path:
  """Where a reader's Orbax report goes: the system's temporary directory, never the run it reads."""
  return pathlib.Path(tempfile.gettempdir()) / f"meshtrain-{os.getuid()}" / f"{workdir.name}-{name}"


def task_of(meta: dict) -> str:
  """The task a checkpoint was trained for; checkpoints from before tasks existed are language models."""
  return meta.get("task", meta["config"].get("task", "lm"))


def load_params(workdir, step: int | None = None, mesh=None, shardings=None, rules=None):
  """The parameters saved in `workdir` at `step` (default: the newest), and that checkpoint's meta item.

  Only the `params` subtree of the `state` item is read (a partial restore: no optimizer state is touched), or the
  `ema_params` one where the run kept an average of its parameters (optimizer.ema_decay > 0), from a
  trained run (a TrainState) or a converted one (`{"params": ...}`, meta `params_only`). With `mesh=None` the
  leaves are numpy arrays on the host; with a mesh they are jax Arrays split by the model's logical rules (`rules`,
  default the `fsdp_tp` preset: whatever fsdp and tensor axes the mesh has split the weights, other axes
  replicate them), or by `shardings`, a tree of Shardings like the params. Any mesh or device count works:
  Orbax is told the target of every array, so it never needs the topology that wrote them (a plain
  `StandardCheckpointer().restore(.../state)` does, and fails on another one with "Topology mismatch").
  Missing checkpoints or a step that is not there: UserError.
  """
  params, meta, _ = read_params(workdir, step, step is not None, mesh, shardings, rules)
  return params, meta


def read_params(workdir, step: int | None, asked: bool, mesh=None, shardings=None, rules=None):
  """(params, meta, the step read), read as load_params reads them. `asked`: the user asked for `step`, so it is
  the only one to read. Otherwise `step` is the caller's own pick (the newest when it read the run's config, before
  JAX started: sample, init_from), read if the run still has it; once a live run's retention deleted it, the
  newest step there is then is read instead, and returned for the caller to report."""
  def read(step):
    if not asked and step is not None and step not in checkpoint_steps(workdir):
      raise StepVanished(step, workdir)  # deleted since the caller picked it, before this read began: as mid-read
    source = _ParamsSource(workdir, step)
    if mesh is None and shardings is None:
      return source.restore(source.stored), source.meta, source.step
    target_shardings = shardings if shardings is not None else _param_shardings(
        source.meta, mesh, rules, source.stored, source.workdir, source.step)
    target = jax.tree.map(lambda m, s: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=s), source.stored,
                          target_shardings)
    return source.restore(target, ocp.checkpoint_utils.construct_restore_args(target)), source.meta, source.step
  return retrying(read, step, asked)


def retrying(read, step: int | None, asked: bool | None = None):
  """read(step), then read(None) (the newest step there is then) while the step read is deleted under it
  (StepVanished), up to RETRIES tries. A step the user asked for (`asked`; by default, any `step` given) is the
  only one to read: the first StepVanished is raised. So it is in a run of several processes: one process reading
  another step than the others would put two checkpoints' shards into one set of parameters."""
  asked = step is not None if asked is None else asked
  for attempt in range(RETRIES):
    try:
      return read(step if attempt == 0 else None)
    except StepVanished:
      if asked or attempt == RETRIES - 1 or jax.process_count() > 1:
        raise
  raise AssertionError("unreachable")


def param_reader(workdir, step: int | None = None):
  """(meta, stored, read) for reading parameters one at a time, as load_params reads them all (same checks, same
  errors): `stored` is the params' tree of Orbax metadata (`.shape`, `.dtype` per leaf) and `read(path)` restores
  the one parameter at `path` (a tuple of keys) as a numpy array. A model larger than memory can be exported
  this way holding one array at a time."""
  source = _ParamsSource(workdir, step)

  def read(path: tuple):
    leaf = source.stored
    for key in path:
      leaf = leaf[key]
    for key in reversed(path):  # the subtree holding only `leaf`: Orbax restores nothing else (partial restore)
      leaf = {key: leaf}
    node = source.restore(leaf)
    for key in path:
      node = node[key]
    return node

  return source.meta, source.stored, read


class _ParamsSource:
  """The checkpoint load_params and param_reader read: step directory, verified meta item, and the metadata of
  the stored params (found before any array is read, so a wrong workdir or step costs no restore)."""

  def __init__(self, workdir, step: int | None):
    workdir = pathlib.Path(workdir).expanduser().absolute()
    steps = checkpoint_steps(workdir)
    if not steps:
      what = "no such directory" if not workdir.is_dir() else "no complete checkpoint in its checkpoints/ directory"
      raise UserError(f"cannot load parameters from {workdir}: {what}; pass the --workdir of a training run (or of "
                      "python -m meshtrain.convert from-hf)")
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise UserError(f"{workdir} has no complete checkpoint at step {step}; it has steps "
                      f"{', '.join(map(str, steps))}")
    step_dir = workdir / "checkpoints" / str(step)
    try:
      meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(step_dir / "meta")
      meta, _ = verified_meta(meta)
    except CheckpointDamaged as e:
      if _gone(step_dir):
        raise StepVanished(step, workdir) from e
      raise UserError(f"the checkpoint at step {step} ({step_dir}) is damaged: {e}") from e
    except Exception as e:  # Orbax's error for a directory that is gone; anything else is reported as it is
      if _gone(step_dir):
        raise StepVanished(step, workdir) from e
      raise
    if meta.get("layer_order", "sequential") != "sequential":
      raise UserError(f"the checkpoint at step {step} in {workdir} stores its layers in {meta['layer_order']} "
                      "order (a circular pipeline's); load it in a run with the same pipeline settings instead")
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    log = diagnostics_log(workdir, f"metadata-step{step}-process{jax.process_index()}.log")
    try:
      # Reading an item on its own, Orbax warns that the step's own metadata file is not its.
      with stderr_to(log, keep_empty=False), quiet_absl(), _threads_to_log(workdir, step):
        metadata = checkpointer.metadata(step_dir / "state")
        stored = getattr(getattr(metadata, "item_metadata", None), "tree", None)
        if stored is None:  # a damaged OCDBT node or manifest reads as no metadata at all
          raise ValueError("no readable tree metadata")
    except Exception as e:
      if _gone(step_dir):
        raise StepVanished(step, workdir) from e
      raise UserError(f"the checkpoint at step {step} ({step_dir}) is damaged: its state's metadata cannot be read "
                      f"({restore_problem(e, step_dir)}; Orbax's own report: {log})") from e
    finally:
      checkpointer.close()
    if not isinstance(stored, dict) or "params" not in stored:
      raise UserError(f"the checkpoint at step {step} in {workdir} holds no params (its state has "
                      f"{sorted(stored) if isinstance(stored, dict) else type(stored).__name__})")
    # A run that kept an average of its parameters (optimizer.ema_decay > 0) is read as that average: the weights
    # diffusion models (and, mostly, language models too) are sampled and released with.
    self.key = "ema_params" if stored.get("ema_params") else "params"
    self.workdir, self.step, self.step_dir, self.meta, self.stored = workdir, step, step_dir, meta, stored[self.key]

  def restore(self, target, restore_args=None):
    """The params in `target` (a subtree of `stored`, or ShapeDtypeStructs with shardings and their
    `restore_args`); numpy arrays on the host when no restore_args are given."""
    if restore_args is None:
      restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
      target = jax.tree.map(lambda m: np.empty(m.shape, m.dtype), target)  # never touched: no memory
    log = diagnostics_log(self.workdir, f"load-params-step{self.step}-process{jax.process_index()}.log")
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
    try:
      with stderr_to(log, keep_empty=False), quiet_absl(), _threads_to_log(self.workdir, self.step):
        restored = checkpointer.restore(self.step_dir / "state", args=ocp.args.PyTreeRestore(
            {self.key: target}, restore_args={self.key: restore_args}, partial_restore=True))
    except Exception as e:
      if _gone(self.step_dir):
        raise StepVanished(self.step, self.workdir) from e
      raise UserError(f"the checkpoint at step {self.step} ({self.step_dir}) cannot be read: "
                      f"{restore_problem(e, self.step_dir)} (Orbax's own report: {log})") from e
    finally:
      checkpointer.close()
    return restored[self.key]


def _param_shardings(meta: dict, mesh, rules, stored, workdir, step):
  """NamedShardings of the checkpoint's params on `mesh`, from the model's logical axis names and the rules."""
  # Flax and the model only here: a command that reads only meta items or host arrays does not import them.
  model_cfg = ModelConfig.from_config(meta["config"]["model"])
  boxed = jax.eval_shape(Transformer(model_cfg).init, jax.random.key(0), jax.ShapeDtypeStruct((1, 1), jnp.int32))
  boxed = boxed["params"]
  expected = {jax.tree_util.keystr(p): tuple(a.shape) for p, a in jax.tree_util.tree_leaves_with_path(
      nn.meta.unbox(boxed))}
  found = {jax.tree_util.keystr(p): tuple(m.shape) for p, m in jax.tree_util.tree_leaves_with_path(stored)}
  if expected != found:
    diff = sorted(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
    raise UserError(f"the params at step {step} in {workdir} do not match the model in its own config: "
                    + "; ".join(f"{k}: config {expected.get(k)}, stored {found.get(k)}" for k in diff[:4]))
  rules = sharding.for_mesh(rules or sharding.rules_for("fsdp_tp"), mesh)
  sharding.param_table(boxed, mesh, rules)  # a dimension the mesh cannot split evenly is named (UserError)
  return sharding.shardings_of(boxed, mesh, rules)
