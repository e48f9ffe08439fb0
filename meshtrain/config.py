"""Configs: Python files returning an `ml_collections.ConfigDict`, plus `--config.a.b=value` overrides.

`base_config()` holds every field with its meaning; files in `configs/` start from it and change what they
need. Overrides are parsed here rather than through absl's config_flags because config_flags checks keys and
types lazily (a typo surfaces as a traceback deep in the run); here every override is checked at once and a
mistake is a `UserError` naming the key.
"""
import ast
import dataclasses
import difflib
import importlib.util
import inspect
import itertools
import json
import math
import os
import pathlib
import re
import traceback
from typing import Callable

import ml_collections

from meshtrain import presets
from meshtrain.errors import UserError

# Fields that decide which tokens the batch at step k holds: a resumed run that changes one silently continues on
# another data order, so resuming with a change needs allow_data_change. (data.data_dir is not among them: the
# same dataset may move.)
# data.tokenizer is not among them either: the tokenizer a checkpoint was trained with is compared by its file's
# fingerprint (checkpoint meta "tokenizer"), so a moved file resumes and another file is refused outright.
DATA_ORDER_FIELDS = ("seed", "batch_size", "seq_len", "data.name", "data.text_key", "data.train_split",
                     "data.format", "data.prompt_key", "data.completion_key", "data.image_key", "data.label_key",
                     "data.messages_key", "data.eval_fraction", "data.skip_bad_records", "data.mixture")
DTYPES = ("float32", "bfloat16")
MIN_MIXTURE_SHARE = 1e-9
# distributed.barrier_timeout_s's default; also inference.generator.Generator's, for research code without a config.
BARRIER_TIMEOUT_S = 1200
# Simulated CPU devices in one process, at most: the largest cluster `python -m meshtrain.inspect` compiles for.
# Each costs host memory before anything runs (JAX start-up alone: 158 MB at 8 devices, 573 MB at 4,096, measured on
# the CI machine) and every compile grows with the count; 100,000 ran silently past 5 GB.
MAX_CPU_DEVICES = 4096
# The shortest hang watchdog (watchdog_s; 0 = off). The watchdog exists only once everything is compiled, and the
# loop beats before each batch, each dispatch, each metrics fetch, each evaluation batch and each save, but between
# two beats it legitimately blocks for up to two queued steps (the host runs two steps ahead), the wait at a
# collective for the slowest peer, an evaluation's final fetch, a profiler trace being written, or a checkpoint
# commit. XLA's own CPU collectives treat a 20 s wait for a peer as normal (they warn only after it), so a limit
# below 30 s would declare healthy runs hung and blame a dead peer that is not dead.
MIN_WATCHDOG_S = 30.0
# Seeds are 32-bit: JAX's default PRNG keeps the low 32 bits, so seed 2**32 initialises exactly like seed 0.
MAX_SEED = 2**32 - 1
# A TFDS dataset name, as tensorflow_datasets.core.naming._NAME_REG (not imported here: TFDS is slow to import):
# [namespace:]name[/config][:major.minor.patch][/kwargs].
# data.name as local files (meshtrain/data/files.py): the suffixes read, and how a path is told from a TFDS name.
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")
_TFDS_NAME = re.compile(r"^(?:[\w\-]+:)?[a-zA-Z]\w*(?:/[\w+\-.]+)?(?::(?:\d+|\*)(?:\.(?:\d+|\*)){2})?"
                        r"(?:/(?:\w+=[^,\s]+,?)+)?$")


def is_path(name: str) -> bool:
  """Whether a data name is a path or glob of local files rather than a TFDS name: it starts with /, ~ or ., holds a
  glob character, ends in a suffix meshtrain/data/files.py reads, or names something that exists on disk."""
  return (name.startswith(("/", "~", ".")) or any(c in name for c in "*?[") or name.endswith(FILE_SUFFIXES)
          or os.path.exists(name))


def _through_directory_link(path: pathlib.Path, fixed: pathlib.Path) -> bool:
  """Whether `path` (a glob match) is, or lies under, a link to a directory below `fixed`."""
  below = path.relative_to(fixed).parts
  return any((fixed.joinpath(*below[:i]).is_symlink() and fixed.joinpath(*below[:i]).is_dir())
             for i in range(1, len(below) + 1))


def matching_paths(key: str, spec: str) -> list[pathlib.Path]:
  """The paths a data path or glob names (sorted); UserError when it names none. Checked with the config (before
  anything heavy loads) and again when the files are read (meshtrain/data/files.py)."""
  expanded = os.path.expanduser(spec)
  if any(c in expanded for c in "*?["):
    # Links to directories below the pattern's fixed part are not followed (glob.glob's ** would: a link to "."
    # repeats every file 40 times, one to ".." walks the parent): pathlib's ** does not descend into them, and a
    # match through one (a * that named a link) is left out. Hidden files are not matched, as the shell's glob.
    parts = pathlib.Path(expanded).parts
    fixed = pathlib.Path(*itertools.takewhile(lambda part: not any(c in part for c in "*?["), parts))
    paths = sorted(p for p in fixed.glob(str(pathlib.Path(*parts[len(fixed.parts):])))
                   if not _through_directory_link(p, fixed) and not any(
                       part.startswith(".") for part in p.relative_to(fixed).parts))
    if not paths:
      raise UserError(f"{key}={spec!r} is a glob that matches no file; check the pattern (quote it so the shell "
                      "does not expand it, and use ** to match subdirectories)")
    return paths
  if not os.path.exists(expanded):
    raise UserError(f"{key}={spec!r}: no such file or directory (a path is read as your own files; a TFDS name "
                    "has no / . or ~ at its start)")
  return [pathlib.Path(expanded)]


# What the commands that run a trained model (generate, serve) may override: how it is laid out and compiled,
# not what it is (that comes from the checkpoint).
INFERENCE_OVERRIDES = ("mesh.", "sharding.", "cpu_devices", "xla_flags", "compilation_cache_dir", "model.dtype")


def inference_config(overrides: list[str], what: str) -> tuple[ml_collections.ConfigDict, str | None]:
  """(config, model.dtype if overridden else None) of a command that runs a trained model (`what`: "generation",
  "serving"), from its --config.* overrides; UserError for one it cannot take. One device by default on the CPU:
  simulated devices are threads sharing the same cores, so splitting a decode over them only adds collectives;
  --config.cpu_devices=8 with mesh overrides simulates a mesh, as train does."""
  cfg = base_config()
  cfg.cpu_devices = 1
  dtype = None  # the run's compute dtype unless --config.model.dtype is given
  for item in overrides:
    key = apply_override(cfg, item)
    if key == "model.dtype":
      dtype = cfg.model.dtype
    if not key.startswith(INFERENCE_OVERRIDES):
      raise UserError(f"--config.{key} cannot be set for {what} (the model comes from the checkpoint); only "
                      "mesh.*, sharding.*, cpu_devices, xla_flags, compilation_cache_dir and model.dtype")
  validate(cfg)
  return cfg, dtype


def parse_mixture(spec: str) -> list[tuple[str, float]]:
  """data.mixture "SRC=WEIGHT,SRC=WEIGHT" as [(SRC, WEIGHT)]; UserError naming the entry that does not parse. A
  weight is the text after an entry's last "=", so a path may hold "=" but not ","."""
  entries = []
  for item in spec.split(","):
    source, eq, weight = item.strip().rpartition("=")
    try:
      value = float(weight)
    except ValueError:
      value = float("nan")
    if not eq or not source.strip() or not math.isfinite(value) or value <= 0:
      raise UserError(f"data.mixture={spec!r}: entry {item.strip()!r} is not SRC=WEIGHT with a weight > 0; write "
                      "e.g. --config.data.mixture='python_stdlib=0.7,corpus/*.jsonl=0.3'")
    entries.append((source.strip(), value))
  total = sum(w for _, w in entries)
  # grain's mix turns the weights into integers: a share below 1e-9 (or a sum past floats) overflows there, and no
  # run would draw from it anyway.
  if not math.isfinite(total) or min(w for _, w in entries) / total < MIN_MIXTURE_SHARE:
    raise UserError(f"data.mixture={spec!r}: weights must be proportions with each source's share at least "
                    f"{MIN_MIXTURE_SHARE:g} of the total (these sum to {total:g}, the smallest "
                    f"{min(w for _, w in entries):g}); write e.g. 0.7 and 0.3, and leave out a source you do not want")
  names = [n for n, _ in entries]
  if len(set(names)) < len(names):
    raise UserError(f"data.mixture={spec!r} names a source twice; give each source once with its total weight")
  return entries


@dataclasses.dataclass(frozen=True)
class TaskFields:
  """What a task kind tells the config about its own fields. The tasks register themselves (meshtrain/tasks/
  __init__.py, imported with the package: see meshtrain/__init__.py), so this module never imports a task, and
  each task's fields are checked by the task's own module (JAX-free: a bad config is refused before JAX loads)."""
  model_group: Callable  # (the config file's model group) -> the group with every field and default, or None: base's
  check: Callable        # (cfg) -> None: the task's own fields, raising UserError
  check_batch_memory: Callable  # (cfg, rows per process, "who holds them" text, host bytes) -> None


TASKS: dict[str, TaskFields] = {}


def register_task(kind: str, fields: TaskFields) -> None:
  TASKS[kind] = fields


def base_config() -> ml_collections.ConfigDict:
  """Every field meshtrain reads, with its default and meaning."""
  c = ml_collections.ConfigDict()
  c.task = "lm"                 # what is trained (meshtrain/tasks): lm (language model) | dit (class-conditional) | t2i
  c.steps = 200                 # optimizer updates to train for (a resumed run stops at the same step)
  c.seed = 0                    # seeds parameter init and the data order; the batch at step k depends on (seed, k) only
  c.batch_size = 16             # global batch, in sequences, summed over all devices and micro-batches
  c.seq_len = 128               # tokens per sequence
  c.log_every = 10              # write metrics every N steps (fetched one step late so the host never blocks)
  c.eval_every = 100            # validation loss every N steps, and at the end; 0 disables
  c.eval_batches = 4            # validation batches (of `batch_size`) per evaluation
  c.checkpoint_every = 100      # async Orbax checkpoint every N steps, and at the end; 0: only at the end
  c.checkpoint_keep = 3         # keep the newest N checkpoints
  c.cpu_devices = 8             # devices to simulate when JAX runs on the CPU (ignored on GPUs)
  c.nonfinite = "stop"          # a step with NaN/inf loss or gradients: stop (keep the last good checkpoint) | skip
  c.watchdog_s = 600.0          # no progress this long (a hung collective, a dead peer): dump stacks, exit 4; 0: off
  c.checkpoint_fallback = False  # latest checkpoint damaged: resume from the previous good one (renaming, not deleting)
  c.allow_data_change = False   # resume though seed, batch_size, seq_len or the dataset changed (logged); else refused
  # Fine-tuning: start from the parameters of WORKDIR (its latest checkpoint), of WORKDIR/checkpoints/N, or of a
  # converted Hugging Face model (python -m meshtrain.convert from-hf): fresh optimizer, step 0, this run's data.
  # Ignored (and logged) once this run's workdir has checkpoints of its own: those resume.
  c.init_from = ""
  # Persistent XLA cache: a rerun skips compiling; "" disables. GPU/TPU only (see runtime.start for the CPU).
  c.compilation_cache_dir = "~/.cache/meshtrain/xla"
  c.profile_steps = ""          # e.g. "20-24": jax.profiler trace of those steps in WORKDIR/profile (TensorBoard)
  c.xla_flags = ""              # extra XLA flags, after meshtrain's GPU defaults and $XLA_FLAGS (later flags win)

  # Several processes (hosts). Empty / -1: from the environment (meshtrain.launch, SLURM, Open MPI, Kubernetes).
  c.distributed = _distributed_fields()

  # Mesh: size of each named axis inside one node (fast links). One size may be -1: filled from the device count.
  c.mesh = _mesh_fields()

  c.sharding = _sharding_fields()

  # Pipeline parallelism (mesh.stage > 1): the global batch is cut into micro-batches that flow through the stages.
  c.pipeline = _pipeline_fields()

  c.model = presets.model_config("tiny")

  c.optimizer = _optimizer_fields()

  # Fault injection, for testing the recovery paths; leave off in real runs.
  c.faults = _faults_fields()

  c.data = _data_fields()

  # task=dit and t2i: sampling during training (grids at eval_every) and python -m meshtrain.sample's defaults
  c.sample = _sample_fields()

  # task=lm: lm-evaluation-harness tasks on the current parameters during training (docs/evaluation.md)
  c.harness = _harness_fields()
  return c


def _harness_fields() -> ml_collections.ConfigDict:
  g = ml_collections.ConfigDict()
  g.tasks = ""          # comma-separated harness task names ("": none); needs the eval extra
  g.every = 0           # every N steps and at the end; 0: at eval_every (0 there too: at the end only)
  g.include_path = ""   # a folder of task YAMLs over local files (nothing is ever downloaded)
  g.limit = 0           # at most N documents per task; 0: all
  g.num_fewshot = -1    # few-shot examples; -1: each task's own
  g.batch_size = 8      # rows per scoring or generation call
  return g


def _distributed_fields() -> ml_collections.ConfigDict:
  g = ml_collections.ConfigDict()
  g.coordinator_address = ""  # host:port of process 0's coordination service
  g.coordinator_bind_address = ""  # where process 0 listens; "": the coordinator's own IP (see runtime.py)
  g.num_processes = -1
  g.process_id = -1
  g.init_timeout_s = 300      # all processes must reach the coordinator within this time
  g.heartbeat_timeout_s = 100  # a process silent this long is declared dead and the job stops
  g.barrier_timeout_s = BARRIER_TIMEOUT_S   # longest wait for all processes at a barrier: start-up, checkpoints
  return g


def _mesh_fields() -> ml_collections.ConfigDict:
  g = ml_collections.ConfigDict()
  g.data = -1              # pure data parallelism: batch split, parameters replicated
  g.fsdp = 1               # ZeRO-3: batch split, parameters and optimizer state split along `embed`
  g.tensor = 1             # Megatron tensor parallelism: heads, MLP width and vocab split
  g.sequence = 1           # context parallelism: the sequence split through the model (ring attention)
  g.expert = 1             # expert parallelism: MoE experts split (needs model.num_experts), batch split too
  g.stage = 1              # pipeline parallelism: consecutive layers per stage (see `pipeline`)
  # Sizes across nodes (slow links, one node per process or slice). -1 fills from the node count, so by
  # default only data parallelism, the least traffic, crosses nodes.
  g.nodes = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, sequence=1, expert=1, stage=1))
  return g


def _sharding_fields() -> ml_collections.ConfigDict:
  g = ml_collections.ConfigDict()
  g.rules = "fsdp_tp"  # logical-axis rules preset: dp | fsdp | tp | fsdp_tp (see meshtrain/sharding.py)
  g.sequence_parallel = False  # Megatron sequence parallelism: residual stream split over `tensor` too
  g.causal_load_balance = True  # with mesh.sequence > 1: zigzag token order so causal work is even
  return g


def _pipeline_fields() -> ml_collections.ConfigDict:
  g = ml_collections.ConfigDict()
  g.microbatches = 4   # more micro-batches: smaller bubble ((stages-1)/(microbatches+stages-1) idle)
  g.schedule = "gpipe"  # gpipe | circular (each stage holds `repeats` non-adjacent layer groups)
  g.repeats = 1        # circular only: passes through the stages; bubble (S-1)/(repeats*M+S-1)
  return g


def _optimizer_fields() -> ml_collections.ConfigDict:
  g = ml_collections.ConfigDict()
  g.learning_rate = 3e-3    # peak learning rate, reached after warmup
  g.warmup_steps = 20       # linear warmup from 0
  g.min_lr_ratio = 0.1      # cosine decays to learning_rate * min_lr_ratio at `steps`
  g.b1 = 0.9
  g.b2 = 0.95
  g.eps = 1e-8
  g.weight_decay = 0.1      # decoupled (AdamW); never applied to norm scales
  g.grad_clip = 1.0         # global-norm clipping; 0 disables
  g.grad_accum_steps = 1    # micro-batches per step: the batch is split, gradients are summed
  # > 0: keep an exponential moving average of the parameters in the checkpoint (float32), warmed up as
  # min(ema_decay, (1 + step) / (10 + step)); samples, generate, serve and init_from then read it (usual: 0.999-0.9999)
  g.ema_decay = 0.0
  return g


def _faults_fields() -> ml_collections.ConfigDict:
  g = ml_collections.ConfigDict()
  g.nan_at_step = -1     # poison the gradients of this step with NaN
  return g


def _data_fields() -> ml_collections.ConfigDict:
  g = ml_collections.ConfigDict()
  g.name = "python_stdlib"  # python_stdlib (built locally) | synthetic | any TFDS dataset name
  g.data_dir = ""           # TFDS data directory; "" = TFDS default (~/tensorflow_datasets)
  g.text_key = "text"       # feature holding the text, for TFDS datasets
  g.image_key = "image"     # task=dit: the image feature of a TFDS image dataset (uint8 [H, W, C])
  g.label_key = "label"     # task=dit: its class-label feature (ClassLabel)
  g.caption_key = "text"    # task=t2i: the caption column of your metadata.jsonl/.csv or rows (or a TFDS feature)
  # text: documents packed into sequences, every token trained | prompt_completion: one example per row, the loss
  # on the completion's tokens only (supervised fine-tuning; python_stdlib_sft is built locally)
  g.format = "text"
  g.prompt_key = "prompt"          # prompt_completion: the feature holding the prompt
  g.completion_key = "completion"  # prompt_completion: the feature holding the completion
  g.messages_key = "messages"      # chat: the record's list of {"role", "content"} messages
  # Local files (data.name a path or glob, meshtrain/data/files.py): the fraction of documents held out as the
  # validation split, by a hash of each document's content; or a path (or TFDS name) to evaluate on instead.
  g.eval_fraction = 0.01
  g.eval_name = ""
  # Local worker processes of the one-time tokenizing pass of a non-byte tokenizer, per process (each a share of
  # the documents); 1: none, the process encodes with the tokenizer's own threads (measured faster on 2 cores)
  g.tokenize_workers = 1
  g.skip_bad_records = False  # local files: skip (and count) records that cannot be read, instead of exit 2
  # "SRC=WEIGHT,SRC=WEIGHT": train on a mixture (each SRC a TFDS name or a path/glob) drawn in those proportions;
  # data.name is then not read
  g.mixture = ""
  # byte (UTF-8 bytes + 3 specials) | PATH of a tokenizer.json, a SentencePiece .model or a directory holding one |
  # bpe:N (a byte-level BPE of N ids trained on the train split on first use, cached under the data dir)
  g.tokenizer = "byte"
  g.train_split = "train"
  g.eval_split = "validation"
  return g


def _sample_fields() -> ml_collections.ConfigDict:
  g = ml_collections.ConfigDict()
  g.steps = 32           # Euler steps from noise (t = 1) to an image (t = 0)
  g.guidance = 1.0       # classifier-free guidance scale, >= 0: 0 unconditional, 1 conditional only, > 1 stronger
  g.per_class = 8        # task=dit: images per class in the training-time grid and quality check
  g.per_prompt = 4       # task=t2i: images per prompt in the training-time grid
  g.prompts = ""         # task=t2i: the grid's prompts, separated by ";" ("": the dataset's first eval captions)
  g.seed = 0             # seeds the sampling noise
  return g


def load(path: str, overrides: list[str]) -> ml_collections.ConfigDict:
  """Loads `path` (a Python file with `get_config()`), applies `--config.a.b=value` overrides, validates."""
  cfg = from_file(path)
  overridden = set()
  for item in overrides:
    overridden.add(apply_override(cfg, item))
  if cfg.task == "lm" and cfg.model.get("preset") == INIT_FROM_PRESET:
    adopt_init_from_model(cfg, overridden)
  validate(cfg)
  _check_step_fields(cfg, overridden)
  cfg.lock()
  return cfg


INIT_FROM_PRESET = "init_from"  # model.preset: the model (and tokenizer) of the checkpoint init_from names


def adopt_init_from_model(cfg: ml_collections.ConfigDict, overridden: set[str]) -> None:
  """model.preset="init_from": the model fields (and data.tokenizer) become those of the run or converted model
  init_from names, read from its WORKDIR/config.json, so one fine-tuning config serves any converted model. Fields
  given on the command line (--config.model.dtype=bfloat16, say) keep their value; init_from's checkpoint is still
  checked against the result when the run starts (meshtrain/checkpoint/init_from.py)."""
  if not cfg.init_from:
    raise UserError(f"model.preset={INIT_FROM_PRESET!r} takes the model of init_from, which is empty; pass "
                    "--config.init_from=WORKDIR (a training run, or a model python -m meshtrain.convert from-hf wrote)")
  workdir = pathlib.Path(cfg.init_from).expanduser()
  if workdir.parent.name == "checkpoints" and workdir.name.isdigit():  # WORKDIR/checkpoints/N
    workdir = workdir.parent.parent
  try:
    source = json.loads((workdir / "config.json").read_text())
    model = source["model"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise UserError(f"model.preset={INIT_FROM_PRESET!r}: cannot read the model of init_from={cfg.init_from!r} from "
                    f"{str(workdir / 'config.json')!r} ({type(e).__name__}: {e}); point init_from at a training run "
                    "or a converted model's workdir") from None
  for key, value in model.items():
    if key in cfg.model and f"model.{key}" not in overridden and key != "preset":
      cfg.model[key] = value
  tokenizer = (source.get("data") or {}).get("tokenizer")
  if tokenizer and "data.tokenizer" not in overridden:
    cfg.data.tokenizer = tokenizer


def _one_line(text: str, limit: int = 400) -> str:
  text = " ".join(str(text).split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _failure(path: str, origin: str, what: str, error: BaseException) -> UserError:
  """`error` raised by the config file's own code, as one line naming the file's line that raised it."""
  lines = [f.lineno for f in traceback.extract_tb(error.__traceback__) if f.filename == origin]
  where = f" (line {lines[-1]})" if lines else ""
  message = _one_line(error) or "(no message)"
  return UserError(f"config file {path!r}{where} raised {type(error).__name__} {what}: {message}; fix the file "
                   "(configs/tiny.py shows the expected shape: get_config() returning base_config() with changes)")


def from_file(path: str) -> ml_collections.ConfigDict:
  """The ConfigDict `get_config()` of the Python file `path` returns, checked against `base_config()`'s fields."""
  file = pathlib.Path(path)
  if not path.strip():
    raise UserError("--config is empty; pass a Python config file such as configs/tiny.py")
  if file.is_dir():
    found = sorted(str(p) for p in file.glob("*.py") if p.name != "__init__.py")
    raise UserError(f"config {path!r} is a directory; pass one of its files: {', '.join(found)}" if found else
                    f"config {path!r} is a directory with no .py files; pass a Python file such as configs/tiny.py")
  if not file.is_file():
    hint = ""
    if file.parent.is_dir():
      near = difflib.get_close_matches(file.name, [p.name for p in file.parent.glob("*.py")], n=3)
      hint = f" (did you mean {', '.join(repr(str(file.parent / n)) for n in near)}?)" if near else ""
    raise UserError(f"config file {path!r} does not exist{hint}; pass a Python file such as configs/tiny.py")
  if file.suffix != ".py":
    raise UserError(f"config file {path!r} is not a Python file (.py); pass a .py file whose get_config() returns "
                    "the config, such as configs/tiny.py")
  spec = importlib.util.spec_from_file_location(f"meshtrain_config_{file.stem}", file)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except UserError:
    raise
  except SyntaxError as e:
    if e.filename == spec.origin:
      code = f" ({_one_line(e.text, 120)!r})" if e.text and e.text.strip() else ""
      raise UserError(f"config file {path!r} has a syntax error at line {e.lineno}: {e.msg}{code}; fix the "
                      "file") from None
    raise _failure(path, spec.origin, "while it was imported", e) from None
  except (Exception, SystemExit) as e:  # pylint: disable=broad-except
    raise _failure(path, spec.origin, "while it was imported", e) from None
  get_config = getattr(module, "get_config", None)
  if get_config is None:
    raise UserError(f"config file {path!r} has no get_config() function; define one that returns the config, "
                    "as configs/tiny.py does")
  if not callable(get_config):
    raise UserError(f"get_config in config file {path!r} is a {type(get_config).__name__}, not a function; define "
                    "def get_config(): returning the config, as configs/tiny.py does")
  try:
    signature = inspect.signature(get_config)
  except (TypeError, ValueError):
    signature = None
  kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
  if signature and any(p.default is p.empty and p.kind in kinds for p in signature.parameters.values()):
    raise UserError(f"get_config{signature} in config file {path!r} needs arguments, but meshtrain calls "
                    "get_config() without any (absl's file.py:ARG form is not supported); give them defaults, or "
                    "drop them and use --config.KEY=VALUE overrides")
  try:
    cfg = get_config()
  except UserError:
    raise
  except (Exception, SystemExit) as e:  # pylint: disable=broad-except
    raise _failure(path, spec.origin, "in get_config()", e) from None
  if isinstance(cfg, ml_collections.FrozenConfigDict):
    cfg = ml_collections.ConfigDict(cfg)  # overrides need a mutable copy
  if not isinstance(cfg, ml_collections.ConfigDict):
    raise UserError(f"get_config() in config file {path!r} returned {type(cfg).__name__}, not an "
                    "ml_collections.ConfigDict; return meshtrain.config.base_config() with your changes, as "
                    "configs/tiny.py does (c = base_config(); c.steps = ...; return c)")
  _check_fields(cfg, reference_config(cfg, f"get_config() in config file {path!r}"),
                f"get_config() in config file {path!r}")
  return cfg


def reference_config(cfg, where: str) -> ml_collections.ConfigDict:
  """base_config() with the model group of cfg's task, the fields `cfg` must have: a diffusion transformer's
  model fields are not a language model's."""
  base = base_config()
  task = cfg.get("task", base.task)
  if task not in TASKS:
    raise UserError(f"{where} sets task={task!r}; choose one of {', '.join(TASKS)}")
  model = cfg.get("model")
  group = TASKS[task].model_group(model) if isinstance(model, ml_collections.ConfigDict) else None
  if group is not None:
    base.model = group
  return base


def _type_name(value) -> str:
  if isinstance(value, ml_collections.ConfigDict):
    return "a group of fields"
  if isinstance(value, bool):
    return "true or false"
  return {int: "an integer", float: "a number", str: "a string"}.get(type(value), type(value).__name__)


def _fits_type(value, default) -> bool:
  if isinstance(default, ml_collections.ConfigDict):
    return isinstance(value, ml_collections.ConfigDict)
  if isinstance(default, bool) or isinstance(value, bool):
    return isinstance(value, bool) and isinstance(default, bool)
  if isinstance(default, float):
    return isinstance(value, (int, float))
  return type(value) is type(default)  # pylint: disable=unidiomatic-typecheck


def _check_fields(cfg, base, where: str) -> None:
  """Every field of `base` is in `cfg` with a value of its type, and `cfg` has no field `base` lacks: a missing field
  would fail deep in the run, an unknown one (a typo) would be silently ignored."""
  missing, unknown, wrong = [], [], []

  def walk(node, ref, prefix):
    for key, default in ref.items():
      if key not in node:
        missing.append(prefix + key)
      elif not _fits_type(node[key], default):
        wrong.append((prefix + key, node[key], default))
      elif isinstance(default, ml_collections.ConfigDict):
        walk(node[key], default, f"{prefix}{key}.")
    unknown.extend((prefix + key, list(ref)) for key in node if key not in ref)

  walk(cfg, base, "")
  if missing:
    shown = ", ".join(missing[:12]) + (f" and {len(missing) - 12} more" if len(missing) > 12 else "")
    raise UserError(f"{where} lacks {len(missing)} field(s) meshtrain reads: {shown}; start from "
                    "meshtrain.config.base_config(), which holds every field with its default, and change what you "
                    "need, as configs/tiny.py does (c = base_config(); c.steps = ...; return c)")
  if unknown:
    key, known = unknown[0]
    near = difflib.get_close_matches(key.rsplit(".", 1)[-1], known, n=1)
    prefix = key.rsplit(".", 1)[0] + "." if "." in key else ""
    hint = f" (did you mean {prefix + near[0]!r}?)" if near else ""
    raise UserError(f"{where} sets unknown config key {key!r}{hint}, which meshtrain would ignore; every field is "
                    "listed, with its meaning, in base_config() in meshtrain/config.py")
  if wrong:
    key, value, default = wrong[0]
    shown_default = ("in base_config()" if isinstance(default, ml_collections.ConfigDict)
                     else _one_line(repr(default), 80))
    raise UserError(f"{where} sets config key {key!r} to {_one_line(repr(value), 80)} ({type(value).__name__}); it "
                    f"takes {_type_name(default)} (default {shown_default})")


def apply_override(cfg: ml_collections.ConfigDict, item: str) -> str:
  """Applies one `--config.a.b=value` (the value is converted to the type the field already has); returns the key."""
  if item.startswith("--config.") and "=" not in item:
    raise UserError(f"override {item!r} has no value; write {item}=VALUE as one argument (no space around '=')")
  if not item.startswith("--config.") or "=" not in item:
    name = item.lstrip("-").split("=", 1)[0]
    hint = ""
    if item.startswith("--") and name and _has_key(cfg, name):
      hint = f"; did you mean --config.{item.lstrip('-')}{'' if '=' in item else '=VALUE'}?"
    raise UserError(f"cannot read argument {item!r}; overrides look like --config.model.num_layers=8{hint}")
  key, raw = item[len("--config."):].split("=", 1)
  *parents, leaf = key.split(".")
  node = cfg
  for i, part in enumerate(parents + [leaf]):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      known = list(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
      near = difflib.get_close_matches(part, known, n=1)
      hint = f"; did you mean {'.'.join(parents[:i] + near)!r}?" if near else f"; known keys here: {', '.join(known)}"
      raise UserError(f"unknown config key {key!r}{hint}")
    if i < len(parents):
      node = node[part]
  old = node[leaf]
  if isinstance(old, ml_collections.ConfigDict):
    raise UserError(f"config key {key!r} is a group; set one of its fields, e.g. --config.{key}.{next(iter(old))}=...")
  node[leaf] = _convert(key, raw, old)
  return key


def _has_key(cfg, dotted: str) -> bool:
  node = cfg
  for part in dotted.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      return False
    node = node[part]
  return True


def _convert(key, raw, old):
  if isinstance(old, bool):
    if raw.lower() in ("true", "1", "yes"):
      return True
    if raw.lower() in ("false", "0", "no"):
      return False
    raise UserError(f"config key {key!r} takes true or false, got {raw!r}")
  if isinstance(old, (int, float)):
    try:
      value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
      value = None
    not_int = isinstance(old, int) and not isinstance(value, int)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not_int:
      raise UserError(f"config key {key!r} takes {'an integer' if isinstance(old, int) else 'a number'}, got {raw!r}")
    return type(old)(value)
  if isinstance(old, tuple):  # e.g. model.axes_dim=16,56,56 or (16, 56, 56)
    try:
      value = ast.literal_eval(raw if raw.strip().startswith(("(", "[")) else f"({raw},)")
    except (ValueError, SyntaxError):
      value = None
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
      raise UserError(f"config key {key!r} takes integers separated by commas (e.g. 16,56,56), got {raw!r}")
    return tuple(value)
  return raw


def parse_profile_steps(text: str) -> tuple[int, int] | None:
  """`profile_steps`: "" -> None, "7" -> (7, 7), "20-24" -> (20, 24); anything else is a UserError naming the format."""
  if not text:
    return None
  first, _, last = text.partition("-")
  try:
    a, b = int(first), int(last or first)
  except ValueError:
    a, b = 0, -1
  if not 1 <= a <= b:
    raise UserError(f"profile_steps={text!r} is not a step range; write A-B with 1 <= A <= B (e.g. 20-24) or one step")
  return a, b


def check_choice(key, value, choices):
  if value not in choices:
    raise UserError(f"config key {key!r} is {value!r}; choose one of {', '.join(map(str, choices))}")


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Checks everything that can be checked without devices; mesh and sharding checks come later, also before compile
  (layout.build and the task's own, meshtrain/tasks). The model fields are checked for cfg.task only."""
  check_choice("task", cfg.task, TASKS)
  positive = {"distributed.init_timeout_s": cfg.distributed.init_timeout_s,
              "distributed.heartbeat_timeout_s": cfg.distributed.heartbeat_timeout_s,
              "distributed.barrier_timeout_s": cfg.distributed.barrier_timeout_s, "steps": cfg.steps,
              "batch_size": cfg.batch_size, "log_every": cfg.log_every,
              "checkpoint_keep": cfg.checkpoint_keep, "cpu_devices": cfg.cpu_devices,
              "eval_batches": cfg.eval_batches, "optimizer.grad_accum_steps": cfg.optimizer.grad_accum_steps}
  for key, value in positive.items():
    if value <= 0:
      raise UserError(f"config key {key!r} must be positive, got {value}")
  non_negative = {"eval_every": cfg.eval_every, "checkpoint_every": cfg.checkpoint_every, "watchdog_s": cfg.watchdog_s,
                  "optimizer.warmup_steps": cfg.optimizer.warmup_steps}
  for key, value in non_negative.items():
    if value < 0:
      raise UserError(f"config key {key!r} must be >= 0, got {value}")
  parse_profile_steps(cfg.profile_steps)
  _check_values(cfg)
  check_choice("nonfinite", cfg.nonfinite, ("stop", "skip"))
  if cfg.pipeline.microbatches < 1 or cfg.pipeline.repeats < 1:
    raise UserError(f"pipeline.microbatches={cfg.pipeline.microbatches} and pipeline.repeats="
                    f"{cfg.pipeline.repeats} must be >= 1")
  check_choice("pipeline.schedule", cfg.pipeline.schedule, ("gpipe", "circular"))
  # The one place this rule lives: everything after reads pipeline.repeats as given
  # (meshtrain/parallel/pipeline.py's pipeline_repeats).
  if cfg.pipeline.schedule == "gpipe" and cfg.pipeline.repeats != 1:
    raise UserError(f"pipeline.repeats={cfg.pipeline.repeats} needs pipeline.schedule=circular; GPipe makes one pass")
  accum = cfg.optimizer.grad_accum_steps
  if cfg.batch_size % accum:
    raise UserError(f"batch_size={cfg.batch_size} is not divisible by optimizer.grad_accum_steps={accum}; "
                    f"use a batch_size that is a multiple of {accum}")
  if not 0 <= cfg.optimizer.min_lr_ratio <= 1:
    raise UserError(f"optimizer.min_lr_ratio={cfg.optimizer.min_lr_ratio} must lie in [0, 1]")
  for axis in [k for k in cfg.mesh if k != "nodes"]:
    for key, size in ((f"mesh.{axis}", cfg.mesh[axis]), (f"mesh.nodes.{axis}", cfg.mesh.nodes[axis])):
      if size == 0 or size < -1:
        raise UserError(f"config key {key!r} is {size}; axis sizes are positive, or -1 to fill from the device count")
  _check_harness(cfg)
  TASKS[cfg.task].check(cfg)


def _check_harness(cfg) -> None:
  h = cfg.harness
  if not h.tasks:
    return
  if cfg.task != "lm":
    raise UserError(f"harness.tasks={h.tasks!r}: lm-evaluation-harness evaluates language models (task=lm), this "
                    f"run is task={cfg.task}")
  for key, value, low in (("every", h.every, 0), ("limit", h.limit, 0), ("batch_size", h.batch_size, 1),
                          ("num_fewshot", h.num_fewshot, -1)):
    if value < low:
      raise UserError(f"config key 'harness.{key}' is {value}; it must be >= {low}")
  for axis in ("stage", "sequence"):  # the harness scores through the Generator, which splits over neither
    if cfg.mesh[axis] != 1 or cfg.mesh.nodes[axis] != 1:
      raise UserError(f"harness.tasks runs on the training mesh without mesh.{axis}; set mesh.{axis}=1 (and "
                      f"mesh.nodes.{axis}=1), or evaluate the checkpoints with python -m meshtrain.eval")


def _floats(node, prefix=""):
  for key, value in node.items():
    if isinstance(value, ml_collections.ConfigDict):
      yield from _floats(value, f"{prefix}{key}.")
    elif isinstance(value, float):
      yield prefix + key, value


def _check_values(cfg) -> None:
  """Bounds and formats validate() did not check before (issue 13's bad inputs)."""
  for key, value in _floats(cfg):
    if not math.isfinite(value):
      raise UserError(f"config key {key!r} is {value}; use a finite number")
  if not 0 <= cfg.seed <= MAX_SEED:
    raise UserError(f"seed={cfg.seed} is out of range; use 0 <= seed <= {MAX_SEED} (2**32 - 1): JAX's random keys keep "
                    "32 bits, so larger or negative seeds silently repeat the initialisation of another seed")
  if cfg.cpu_devices > MAX_CPU_DEVICES:
    raise UserError(f"cpu_devices={cfg.cpu_devices} is more than the {MAX_CPU_DEVICES} CPU devices one process can "
                    "simulate (each costs memory before anything runs, and every compile grows with the count); to "
                    "see what a large cluster needs use python -m meshtrain.inspect --devices N (N <= "
                    f"{MAX_CPU_DEVICES}) or python -m meshtrain.plan")
  o = cfg.optimizer
  if o.learning_rate <= 0:
    raise UserError(f"optimizer.learning_rate={o.learning_rate} must be positive: with a negative rate the updates "
                    "climb the loss (gradient ascent), with 0 nothing trains; typical peaks are 1e-4 to 3e-3")
  if not (0 <= o.b1 < 1 and 0 <= o.b2 < 1):
    raise UserError(f"optimizer.b1={o.b1} and optimizer.b2={o.b2} must lie in [0, 1) (Adam's moment decay rates; "
                    "usual: 0.9 and 0.95)")
  if o.eps <= 0:
    raise UserError(f"config key 'optimizer.eps' must be positive, got {o.eps}")
  for key, value in (("optimizer.weight_decay", o.weight_decay), ("optimizer.grad_clip", o.grad_clip)):
    if value < 0:
      raise UserError(f"config key {key!r} must be >= 0 (0 turns it off), got {value}")
  if not 0 <= o.ema_decay < 1:
    raise UserError(f"optimizer.ema_decay={o.ema_decay} must lie in [0, 1): 0 keeps no average of the parameters; "
                    "0.999 averages over about the last 1,000 steps")
  if 0 < cfg.watchdog_s < MIN_WATCHDOG_S:
    raise UserError(f"watchdog_s={cfg.watchdog_s:g} is below the {MIN_WATCHDOG_S:g} s floor: between two heartbeats "
                    "a healthy loop may wait that long (two queued steps, the slowest peer at a collective, a "
                    "checkpoint commit), so a shorter watchdog would end healthy runs and blame a dead peer; use "
                    f"watchdog_s >= {MIN_WATCHDOG_S:g} (default 600) or 0 to turn it off")
  d = cfg.distributed
  if d.num_processes == 0 or d.num_processes < -1 or d.process_id < -1:
    raise UserError(f"distributed.num_processes={d.num_processes}, distributed.process_id={d.process_id}: use "
                    "num_processes >= 1 and 0 <= process_id < num_processes, or -1 for both to take them from the "
                    "environment")
  data = cfg.data
  named = [("data.mixture", n) for n, _ in parse_mixture(data.mixture)] if data.mixture else [("data.name", data.name)]
  named += [("data.eval_name", data.eval_name)] if data.eval_name else []
  for key, name in named:
    if is_path(name):
      matching_paths(key, name)
    elif not _TFDS_NAME.match(name):
      raise UserError(f"{key}={name!r} is not a dataset name: TFDS names are letters, digits and _ "
                      "(name[/config][:1.2.3]), starting with a letter; use python_stdlib (built locally), synthetic, "
                      "a TFDS dataset name such as tiny_shakespeare or lm1b, or a path or glob of your own files "
                      "(.jsonl, .json, .parquet, .txt; ./ for a relative path)")
  splits = [("data.train_split", data.train_split)] + ([("data.eval_split", data.eval_split)] if cfg.eval_every else [])
  for key, split in splits:
    if not split.strip():
      raise UserError(f"{key} is empty; name a split of the dataset, e.g. train, validation or a slice such as "
                      "'train[:90%]'" + (" (or set eval_every=0 to skip evaluation)" if key == "data.eval_split"
                                         else ""))
  for key, value in (("data.data_dir", data.data_dir), ("compilation_cache_dir", cfg.compilation_cache_dir)):
    if value:
      check_directory(key, os.path.expanduser(value))
  for flag in cfg.xla_flags.split():
    if not re.fullmatch(r"--xla_\w+(=.*)?", flag):
      raise UserError(f"xla_flags holds {flag!r}, which is not an XLA flag: XLA flags look like "
                      "--xla_name=value, separated by spaces (XLA aborts on an unknown one, and ignores words "
                      "without --)")


def check_directory(key: str, path: str) -> pathlib.Path:
  """`path` is a directory or can become one: neither it nor any parent is an existing non-directory. Returns the
  nearest existing one (`path` itself, or the parent it would be created in)."""
  p = pathlib.Path(path)
  for candidate in [p, *p.parents]:
    if candidate.exists():
      break
  if not candidate.is_dir():
    what = "is a file" if candidate == p else f"lies under {str(candidate)!r}, which is a file"
    raise UserError(f"{key}={path!r} {what}, not a directory; point it at a directory (it is created if missing)")
  return candidate


def _check_step_fields(cfg, overridden: set[str]) -> None:
  """Fields that count steps of the run must lie within `steps`, where the config file or an override sets them
  so. A run shortened with --config.steps=N alone (a quick trial of a config) keeps the file's warmup and profile
  range, and simply ends before or inside them."""
  shortened = "steps" in overridden
  warmup = cfg.optimizer.warmup_steps
  if warmup > cfg.steps and (not shortened or "optimizer.warmup_steps" in overridden):
    raise UserError(f"optimizer.warmup_steps={warmup} is beyond steps={cfg.steps}: the learning rate would never "
                    f"reach optimizer.learning_rate and the cosine decay would never start; use warmup_steps <= "
                    f"{cfg.steps} (a few percent of the run is usual) or raise steps")
  profile = parse_profile_steps(cfg.profile_steps)
  if profile and profile[1] > cfg.steps and (not shortened or "profile_steps" in overridden):
    raise UserError(f"profile_steps={cfg.profile_steps!r} reaches beyond steps={cfg.steps}, so the trace would never "
                    f"be complete; profile steps within 1-{cfg.steps}")


def schedule_fields(cfg) -> tuple[str, ...]:
  """Fields a resumed run may change: they shape the updates (learning rate, schedule length), not the data."""
  return ("steps", *(f"optimizer.{k}" for k in cfg.optimizer))


def changes(saved: dict, cfg, keys) -> list[tuple[str, object, object]]:
  """(key, saved value, this run's value) for each dotted key whose value differs; keys either side lacks (fields
  added since the checkpoint was written, or not in this config) are skipped."""
  out = []
  for key in keys:
    old, new = saved, cfg
    for part in key.split("."):
      old = old.get(part) if isinstance(old, dict) else None
      new = new[part] if isinstance(new, ml_collections.ConfigDict) and part in new else None
    if old is not None and new is not None and old != new:
      out.append((key, old, new))
  return out
