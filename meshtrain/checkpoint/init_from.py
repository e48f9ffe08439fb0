"""`--config.init_from`: the parameters a fine-tuning run starts from.

A fine-tuning run takes only the parameters of another run (or of a converted Hugging Face model) and starts
its own history: step 0, a fresh optimizer state, its own data, schedule and workdir. The parameters are read
straight into this run's shardings (`reader.load_params`), so the source may have been trained on any mesh.

  PATH                      a workdir: its newest complete checkpoint
  PATH/checkpoints/N        that workdir's step N

The source may be a run that is still training: when its retention (checkpoint_keep) deletes the newest step while
it is read, the newest one there is then is read, recorded and logged instead; a step named as PATH/checkpoints/N
is read or refused (one line). Nothing is written into the source.
"""
import dataclasses
import pathlib

import jax
import orbax.checkpoint as ocp

from meshtrain import step as step_lib
from meshtrain.checkpoint import reader
from meshtrain.checkpoint.integrity import INTEGRITY_KEY
from meshtrain.errors import UserError
from meshtrain.tasks import lm_config

# Model fields that decide what the loaded parameters compute: a different value would fine-tune another function
# of the same numbers (a rotary base, the fan_in scaling folded into the forward pass), silently. param_dtype is
# not among them: the parameters are cast to this run's storage dtype (bfloat16 weights fine-tuned in float32).
MODEL_FIELDS = tuple(f for f in lm_config.SHAPE_FIELDS if f != "param_dtype") + (
    "init", "rope_theta", "norm_eps", "experts_per_token", "rope_type", "rope_factor", "rope_original_max_len",
    "rope_low_freq_factor", "rope_high_freq_factor", "rope_beta_fast", "rope_beta_slow", "rope_attention_factor",
    "sliding_window")
HOW = ("point --config.init_from at a meshtrain workdir (its newest checkpoint), at WORKDIR/checkpoints/N for step N, "
       "or at a converted Hugging Face model (python -m meshtrain.convert from-hf HF_DIR --workdir W)")


@dataclasses.dataclass
class Source:
  workdir: pathlib.Path
  step: int  # the newest when resolved, unless named; initial_state sets the step it read (a live run's may be gone)
  meta: dict  # the checkpoint's meta item: its config, params_only for a converted model, its tokenizer
  asked: bool  # init_from named the step (PATH/checkpoints/N): no other step will do

  def describe(self) -> dict:
    """What this run's checkpoints record about where its parameters came from."""
    return {"workdir": str(self.workdir), "step": self.step, "params_only": bool(self.meta.get("params_only"))}

  @property
  def model(self) -> dict:
    return self.meta.get("config", {}).get("model", {})


def resolve(cfg) -> Source:
  """The checkpoint cfg.init_from names, with its model fields checked against this run's (UserError otherwise)."""
  spec = cfg.init_from
  path, step = pathlib.Path(spec).expanduser().absolute(), None
  if path.parent.name == "checkpoints" and path.name.isdigit():  # WORKDIR/checkpoints/N: the workdir's steps are named
    path, step = path.parent.parent, int(path.name)
  if not path.exists():
    raise UserError(f"init_from={spec!r} does not exist; {HOW}")
  if not path.is_dir():
    raise UserError(f"init_from={spec!r} is a file, not a directory; {HOW}")
  for attempt in range(reader.RETRIES):
    steps = reader.checkpoint_steps(path)
    if not steps:
      raise UserError(f"init_from={spec!r} holds no complete checkpoint (nothing under {path / 'checkpoints'}); "
                      f"{HOW}")
    if step is not None and step not in steps:
      raise UserError(f"init_from={spec!r}: {path} has no complete checkpoint at step {step}; it has steps "
                      f"{', '.join(map(str, steps))}")
    picked = steps[-1] if step is None else step
    try:
      source = Source(path, picked, _read_meta(path, picked), asked=step is not None)
      break
    except UserError:
      # The newest step, deleted by the source run's retention since it was listed: the newest there is now.
      if step is None and attempt < reader.RETRIES - 1 and picked not in reader.checkpoint_steps(path):
        continue
      raise
  if (task := reader.task_of(source.meta)) != cfg.task:
    raise UserError(f"init_from={spec!r} is a task={task} model and this run is task={cfg.task}: its parameters "
                    f"cannot start this model; point init_from at a task={cfg.task} run")
  check_model(source, cfg)
  return source


def _read_meta(workdir: pathlib.Path, step: int) -> dict:
  """The meta item of the step, read before any parameter so that a mismatch costs no restore (load_params
  verifies its checksum when it reads the parameters)."""
  try:
    meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(workdir / "checkpoints" / str(step) / "meta")
  except Exception as e:  # Orbax raises many kinds for a damaged or foreign file; the user needs which and where
    raise UserError(f"the checkpoint at step {step} in {workdir} has a meta item that cannot be read "
                    f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); {HOW}") from e
  if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
    raise UserError(f"the checkpoint at step {step} in {workdir} has no readable config in its meta item, so its "
                    f"model is unknown; {HOW}")
  meta.pop(INTEGRITY_KEY, None)
  return meta


def check_model(source: Source, cfg) -> None:
  """Every MODEL_FIELDS value of the source's model equals this run's; else UserError naming each, with the flags
  that match the source. Fields the source's config lacks (written before they existed) are not compared."""
  diffs = [(k, source.model[k], cfg.model[k]) for k in MODEL_FIELDS
           if k in source.model and source.model[k] != cfg.model[k]]
  if diffs:
    flags = " ".join(f"--config.model.{k}={_flag_value(old)}" for k, old, _ in diffs)
    # A converted model also brings its tokenizer: name that flag now too, rather than in a second refusal.
    if (source.meta.get("tokenizer") or {}).get("kind", "byte") != "byte" and cfg.data.tokenizer == "byte":
      flags += f" --config.data.tokenizer={source.workdir / 'tokenizer'}"
    raise UserError(f"init_from={str(source.workdir)!r} (step {source.step}) is another model: "
                    + "; ".join(f"model.{k}: init_from {old!r}, this run {new!r}" for k, old, new in diffs)
                    + f". Fine-tune it with its own model settings: {flags}")


def check_tokenizer(source: Source, tok, spec: str) -> None:
  """The source was trained with `tok` (by its file's fingerprint, as a resume is checked): with another tokenizer
  the same ids would stand for other text. A source recorded before tokenizers were is bytes."""
  trained_with = source.meta.get("tokenizer") or {"kind": "byte", "fingerprint": "byte"}
  if trained_with.get("fingerprint") != tok.fingerprint:
    copy = source.workdir / "tokenizer"
    raise UserError(f"init_from={str(source.workdir)!r} was trained with the {trained_with.get('kind')} tokenizer "
                    f"{str(trained_with.get('fingerprint'))[:12]}, this run has the {tok.kind} tokenizer "
                    f"{tok.fingerprint[:12]} (data.tokenizer={spec!r}); fine-tune with "
                    + (f"--config.data.tokenizer={copy} (its copy)" if trained_with.get("kind") != "byte"
                       else "--config.data.tokenizer=byte"))


def _flag_value(value) -> str:
  return str(value).lower() if isinstance(value, bool) else str(value)


def initial_state(layout, source: Source):
  """The TrainState a fine-tuning run starts from: the source's parameters in this run's shardings (and
  param_dtype), a fresh optimizer state, step 0. `source.step` and `source.meta` become those of the step read:
  another one than resolved when a live source run's retention deleted that one meanwhile (unless it was named)."""
  try:
    params, meta, step = reader.read_params(source.workdir, source.step, source.asked,
                                            shardings=layout.state_sharding.params)
  except reader.StepVanished as e:
    kept = ", ".join(map(str, reader.checkpoint_steps(source.workdir))) or "none now"
    raise UserError(f"init_from: the checkpoint at step {e.step} in {source.workdir} was deleted while it was read "
                    "(that run is still training and keeps only its newest checkpoints, checkpoint_keep); "
                    + (f"point init_from at a step it keeps (steps {kept}) or at the workdir itself (its newest)"
                       if source.asked else "start this run again")) from e
  source.step, source.meta = step, meta
  dtypes = jax.tree.map(lambda a: a.dtype, layout.state_abstract.params)

  def fresh(params):
    params = jax.tree.map(lambda p, dtype: p.astype(dtype), params, dtypes)
    return step_lib.TrainState.create(params, layout.tx.init(params), ema=layout.cfg.optimizer.ema_decay > 0)

  with layout.context():
    # Donated: the loaded arrays become the state's, so the parameters are never held twice.
    return jax.jit(fresh, out_shardings=layout.state_sharding, donate_argnums=0)(params)
