"""Resume or start fresh: the checks a checkpoint passes before a run continues it, and what decides between
resuming the workdir's own checkpoints and starting from `--config.init_from` (or from scratch).

The loop enters here once, `begin(cfg, workdir)`, and keeps the `Resume` it returns: it restores (`restore`) and
names what every checkpoint records (`checkpoint_meta`). A workdir with checkpoints resumes them, whatever init_from
says, so a fine-tuning source deleted since the run started does not stop its resumption. Every refusal is a
UserError naming the step, what differs and the flag that resumes it, raised before anything is compiled.
"""
import dataclasses
import pathlib
from collections.abc import Callable

from meshtrain import config as config_lib
from meshtrain.checkpoint import init_from, reader
from meshtrain.data import tokenization as tokenizer_lib
from meshtrain.errors import UserError


def converted_error(workdir) -> UserError:
  return UserError(f"{workdir} holds converted parameters (no optimizer state or data position to resume); use "
                   f"--config.init_from={workdir} with a new --workdir to fine-tune them")


def refuse_converted(workdir) -> None:
  """A converted model's workdir (parameters only) is never trained in: refused from its meta item (plain JSON),
  before the run takes the workdir's lock, so a refused run writes nothing there."""
  if reader.checkpoint_steps(workdir) and reader.run_meta(str(workdir), None, "a run")[1].get("params_only"):
    raise converted_error(workdir)


def check_compatible(saved_config: dict, model_cfg, shape_fields: tuple[str, ...], step: int, directory) -> None:
  """A checkpoint of another model shape cannot be resumed: name every differing field before anything runs. A
  field the checkpoint's config lacks (written before the field existed: attention_bias, qk_norm) is not compared:
  such a run had the field's default."""
  saved_model = saved_config.get("model", {})
  diffs = [f"model.{k}: checkpoint {saved_model.get(k)!r}, this run {model_cfg[k]!r}"
           for k in shape_fields if k in saved_model and saved_model[k] != model_cfg[k]]
  if diffs:
    raise UserError(f"the checkpoint at step {step} in {directory} was written by a different model shape:\n  "
                    + "\n  ".join(diffs) + "\nuse the same model settings to resume, or a new --workdir to start over")


def content_changes(was: dict, now: dict, most: int = 3) -> str:
  """What differs between two records of a data path's files (select.input_files'), for a message: files whose
  contents changed, files added and removed (a file moved with its contents is neither)."""
  if "listed" not in was or "listed" not in now:
    return f"{was['files']:,} files then, {now['files']:,} now, with other contents"
  old, new = {f["path"]: f for f in was["listed"]}, {f["path"]: f for f in now["listed"]}
  old_hashes, new_hashes = {f["sha256"] for f in was["listed"]}, {f["sha256"] for f in now["listed"]}
  parts = [f"{p} changed ({old[p]['bytes']:,} -> {new[p]['bytes']:,} bytes)" for p in sorted(old.keys() & new.keys())
           if old[p]["sha256"] != new[p]["sha256"]]
  parts += [f"{p} added" for p in sorted(new.keys() - old.keys()) if new[p]["sha256"] not in old_hashes]
  parts += [f"{p} removed" for p in sorted(old.keys() - new.keys()) if old[p]["sha256"] not in new_hashes]
  parts = parts or ["the same paths hold other contents"]
  return ", ".join(parts[:most]) + (f" and {len(parts) - most} more" if len(parts) > most else "")


@dataclasses.dataclass(frozen=True)
class ResumeCheck:
  """`check_meta(step, meta)` for Checkpointer.restore_latest: refuses a checkpoint this run cannot continue (a
  converted model, another task, model shape, tokenizer, layer order or data order) and logs the schedule and
  data fields it continues with changed."""
  cfg: object
  workdir: pathlib.Path
  directory: pathlib.Path          # WORKDIR/checkpoints, as the messages name it
  shape_fields: tuple[str, ...]    # the task's model fields that decide the state's shapes
  layer_order: str                 # this run's ("sequential", or a circular pipeline's)
  tok: object                      # this run's tokenizer; None for tasks that read no text
  inputs: dict                     # this run's data files' contents (meshtrain/data/select.py input_files)
  log: Callable[[str], None]

  def __call__(self, step: int, meta: dict) -> None:
    cfg = self.cfg
    if meta.get("params_only"):  # refused before the lock already (refuse_converted); kept for other callers
      raise converted_error(self.workdir)
    if (trained_task := meta.get("task", "lm")) != cfg.task:  # checkpoints from before tasks are language models
      raise UserError(f"the checkpoint at step {step} in {self.directory} was trained with task={trained_task}, "
                      f"this run has task={cfg.task}; resume it with its own config, or start a new --workdir")
    check_compatible(meta["config"], cfg.model, self.shape_fields, step, self.directory)
    saved_ema = meta["config"].get("optimizer", {}).get("ema_decay", 0.0)
    if (saved_ema > 0) != (cfg.optimizer.ema_decay > 0):
      raise UserError(f"the checkpoint at step {step} in {self.directory} was written with optimizer.ema_decay="
                      f"{saved_ema:g}, this run has {cfg.optimizer.ema_decay:g}: a run keeps its average of the "
                      f"parameters from its first step or never; resume with ema_decay "
                      f"{'> 0' if saved_ema > 0 else '= 0'}, or start a new --workdir (init_from can start one "
                      "from this checkpoint)")
    if self.tok is not None:
      self._check_tokenizer(step, meta)
    if meta.get("layer_order", "sequential") != self.layer_order:
      raise UserError(f"the checkpoint at step {step} in {self.directory} stores its layers in "
                      f"{meta['layer_order']} order, this run in {self.layer_order} order; use its pipeline settings "
                      "to resume")
    self._check_data_order(step, meta)

  def _check_tokenizer(self, step: int, meta: dict) -> None:
    """By the file's fingerprint, not data.tokenizer's string: a moved copy is the same tokenizer. Checkpoints from
    before tokenizers were recorded are bytes. Refused even with allow_data_change: the ids would mean other text."""
    trained_with = meta.get("tokenizer") or {"kind": "byte", "fingerprint": "byte"}
    if trained_with["fingerprint"] != self.tok.fingerprint:
      raise UserError(f"the checkpoint at step {step} in {self.directory} was trained with the "
                      f"{trained_with['kind']} tokenizer {trained_with['fingerprint'][:12]}, this run has the "
                      f"{self.tok.kind} tokenizer {self.tok.fingerprint[:12]} "
                      f"(data.tokenizer={self.cfg.data.tokenizer!r}); resume with "
                      f"--config.data.tokenizer={self.workdir / tokenizer_lib.WORKDIR_SUBDIR} (the run's copy), or "
                      "start a new workdir")

  def _check_data_order(self, step: int, meta: dict) -> None:
    """Another data order is refused unless allow_data_change; every changed data or schedule field is logged."""
    cfg = self.cfg
    data_changes = config_lib.changes(meta["config"], cfg, config_lib.DATA_ORDER_FIELDS)
    if data_changes and not cfg.allow_data_change:
      raise UserError(f"the checkpoint at step {step} in {self.directory} was trained on another data order: "
                      + "; ".join(f"{k}: checkpoint {old!r}, this run {new!r}" for k, old, new in data_changes)
                      + ". Resuming would silently change which batches come next; use the checkpoint's values, or "
                      "rerun with --config.allow_data_change=true to continue with the new ones")
    for key, old, new in data_changes + config_lib.changes(meta["config"], cfg, config_lib.schedule_fields(cfg)):
      self.log(f"resuming with {key} changed: {old!r} -> {new!r}")
    # The same paths may hold other contents: an edited, added or removed file is another corpus (checkpoints from
    # before contents were recorded have none to compare).
    for spec, was in meta.get("data_inputs", {}).items():
      if spec not in self.inputs:
        continue  # another data.name: named above
      if was["digest"] == self.inputs[spec]["digest"]:
        continue  # the same contents, wherever they moved
      changed = content_changes(was, self.inputs[spec])
      if not cfg.allow_data_change:
        raise UserError(f"the checkpoint at step {step} in {self.directory} was trained on other contents of "
                        f"data {spec!r}: {changed}. Resuming would silently continue on another corpus; put the "
                        "files back as they were, start a new --workdir, or rerun with "
                        f"--config.allow_data_change=true to train on the new contents from step {step} on")
      self.log(f"resuming with the contents of data {spec!r} changed: {changed}")


def begin(cfg, workdir: pathlib.Path) -> "Resume":
  """The run's one entry here, before it takes the workdir's lock: a converted model's workdir is refused (nothing is
  written there), and a fine-tuning source is checked first (it exists, its model is this run's); none when not
  fine-tuning or when the workdir has checkpoints of its own to resume."""
  refuse_converted(workdir)
  init = init_from.resolve(cfg) if cfg.init_from and not reader.checkpoint_steps(workdir) else None
  return Resume(cfg, workdir, init)


@dataclasses.dataclass
class Resume:
  """Where a run starts: its workdir's newest usable checkpoint, `init` (the fine-tuning source), or scratch; and
  what every checkpoint of the run records about it (`checkpoint_meta`)."""
  cfg: object
  workdir: pathlib.Path
  init: init_from.Source | None    # the checkpoint a fine-tuning run starts from; None otherwise
  init_record: dict | None = None  # where a fine-tuning run's parameters came from, in every checkpoint's meta

  def restore(self, ckpt, layout, tok, inputs: dict, log: Callable[[str], None]) -> tuple[int | None, object]:
    """(step, state) of the newest usable checkpoint, restored straight into this run's shardings (another mesh or
    process count needs no conversion); (None, None) when the run starts fresh."""
    cfg, init = self.cfg, self.init
    check = ResumeCheck(cfg, self.workdir, ckpt.directory, layout.task.shape_fields, layout.layer_order, tok, inputs,
                        log)
    start, state, resumed_meta = ckpt.restore_latest(layout.state_abstract, cfg.checkpoint_fallback, check)
    if start is not None and cfg.init_from:
      log(f"init_from={cfg.init_from!r} is ignored: {self.workdir} has checkpoints of its own, resuming from step "
          f"{start}")
    if init is not None and layout.layer_order != "sequential":
      raise UserError(f"init_from needs the layers in sequential order, but this run stores them in "
                      f"{layout.layer_order} order; fine-tune with pipeline.schedule=gpipe or pipeline.repeats=1")
    self.init_record = init.describe() if init is not None else (resumed_meta or {}).get("init_from")
    return start, state

  def started_fresh(self) -> None:
    """The run initialised its state: from init_from's step as loaded (a live source may have deleted the one
    resolved meanwhile), or from scratch."""
    if self.init is not None:
      self.init_record = self.init.describe()

  def checkpoint_meta(self, layout, tok, inputs: dict) -> dict:
    """What every checkpoint of this run records besides the data position: what ResumeCheck reads back (config,
    task, layer order, tokenizer, the data files' contents) and, for a fine-tuning run, where its parameters came
    from."""
    cfg = self.cfg
    return {"config": cfg.to_dict(), "task": cfg.task, "layer_order": layout.layer_order, "data_inputs": inputs,
            **({"tokenizer": tok.describe()} if tok is not None else {}),
            **({"init_from": self.init_record} if self.init_record else {})}
