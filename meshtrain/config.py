"""Configs: Python files returning an `ml_collections.ConfigDict`, plus `--config.a.b=value` overrides.

`base_config()` holds every field with its meaning; files in `configs/` start from it and change what they
need. Overrides are parsed here rather than through absl's config_flags because config_flags checks keys and
types lazily (a typo surfaces as a traceback deep in the run); here every override is checked at once and a
mistake is a `UserError` naming the key.
"""
import ast
import difflib
import importlib.util
import pathlib

import ml_collections

from meshtrain.errors import UserError
from meshtrain import profiling
from meshtrain.models import presets

# Fields that decide the shape of the train state: a checkpoint is only compatible when all of them match.
SHAPE_FIELDS = ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "num_experts",
                "tie_embeddings", "scan_layers", "param_dtype")
REMAT_POLICIES = ("none", "full", "save_dots")
DTYPES = ("float32", "bfloat16")
INITS = ("normal", "fan_in")  # meshtrain/models/params.py (not imported here: it pulls in JAX)
ATTENTION = ("auto", "blocked", "xla", "cudnn")  # meshtrain/models/attention.py (likewise)


def base_config() -> ml_collections.ConfigDict:
  """Every field meshtrain reads, with its default and meaning."""
  c = ml_collections.ConfigDict()
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
  c.watchdog_s = 600.0          # no progress for this long (a hung collective, a dead peer): dump stacks, exit 4; 0: off
  c.checkpoint_fallback = False  # latest checkpoint damaged: resume from the previous good one (renaming, not deleting)
  c.compilation_cache_dir = "~/.cache/meshtrain/xla"  # persistent XLA cache: a rerun skips compiling; "" disables
  c.profile_steps = ""          # e.g. "20-24": jax.profiler trace of those steps in WORKDIR/profile (TensorBoard, Perfetto)
  c.xla_flags = ""              # extra XLA flags, after meshtrain's GPU defaults and $XLA_FLAGS (later flags win)

  # Several processes (hosts). Empty / -1: from the environment (meshtrain.launch, SLURM, Open MPI, Kubernetes).
  c.distributed = ml_collections.ConfigDict()
  c.distributed.coordinator_address = ""  # host:port of process 0's coordination service
  c.distributed.num_processes = -1
  c.distributed.process_id = -1
  c.distributed.init_timeout_s = 300      # all processes must reach the coordinator within this time
  c.distributed.heartbeat_timeout_s = 100  # a process silent this long is declared dead and the job stops
  c.distributed.barrier_timeout_s = 1200   # longest wait for all processes at a checkpoint barrier

  # Mesh: size of each named axis inside one node (fast links). One size may be -1: filled from the device count.
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1              # pure data parallelism: batch split, parameters replicated
  c.mesh.fsdp = 1               # ZeRO-3: batch split, parameters and optimizer state split along `embed`
  c.mesh.tensor = 1             # Megatron tensor parallelism: heads, MLP width and vocab split
  c.mesh.sequence = 1           # context parallelism: the sequence split through the model (ring attention)
  c.mesh.expert = 1             # expert parallelism: MoE experts split (needs model.num_experts), batch split too
  c.mesh.stage = 1              # pipeline parallelism: consecutive layers per stage (see `pipeline`)
  # Sizes across nodes (slow links, one node per process or slice). -1 fills from the node count, so by
  # default only data parallelism, the least traffic, crosses nodes.
  c.mesh.nodes = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, sequence=1, expert=1, stage=1))

  c.sharding = ml_collections.ConfigDict()
  c.sharding.rules = "fsdp_tp"  # logical-axis rules preset: dp | fsdp | tp | fsdp_tp (see meshtrain/sharding.py)
  c.sharding.sequence_parallel = False  # Megatron sequence parallelism: residual stream split over `tensor` too
  c.sharding.causal_load_balance = True  # with mesh.sequence > 1: zigzag token order so causal work is even

  # Pipeline parallelism (mesh.stage > 1): the global batch is cut into micro-batches that flow through the stages.
  c.pipeline = ml_collections.ConfigDict()
  c.pipeline.microbatches = 4   # more micro-batches: smaller bubble ((stages-1)/(microbatches+stages-1) idle)
  c.pipeline.schedule = "gpipe"  # gpipe | circular (each stage holds `repeats` non-adjacent layer groups)
  c.pipeline.repeats = 1        # circular only: passes through the stages; bubble (S-1)/(repeats*M+S-1)

  c.model = presets.model_config("tiny")

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.learning_rate = 3e-3    # peak learning rate, reached after warmup
  c.optimizer.warmup_steps = 20       # linear warmup from 0
  c.optimizer.min_lr_ratio = 0.1      # cosine decays to learning_rate * min_lr_ratio at `steps`
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.95
  c.optimizer.eps = 1e-8
  c.optimizer.weight_decay = 0.1      # decoupled (AdamW); never applied to norm scales
  c.optimizer.grad_clip = 1.0         # global-norm clipping; 0 disables
  c.optimizer.grad_accum_steps = 1    # micro-batches per step: the batch is split, gradients are summed

  # Fault injection, for testing the recovery paths; leave off in real runs.
  c.faults = ml_collections.ConfigDict()
  c.faults.nan_at_step = -1     # poison the gradients of this step with NaN

  c.data = ml_collections.ConfigDict()
  c.data.name = "python_stdlib"  # python_stdlib (built locally) | synthetic | any TFDS dataset name
  c.data.data_dir = ""           # TFDS data directory; "" = TFDS default (~/tensorflow_datasets)
  c.data.text_key = "text"       # feature holding the text, for TFDS datasets
  c.data.train_split = "train"
  c.data.eval_split = "validation"
  return c


def load(path: str, overrides: list[str]) -> ml_collections.ConfigDict:
  """Loads `path` (a Python file with `get_config()`), applies `--config.a.b=value` overrides, validates."""
  file = pathlib.Path(path)
  if not file.is_file():
    raise UserError(f"config file {path!r} does not exist; pass a Python file such as configs/tiny.py")
  spec = importlib.util.spec_from_file_location(f"meshtrain_config_{file.stem}", file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise UserError(f"config file {path!r} has no get_config() function")
  cfg = module.get_config()
  for item in overrides:
    apply_override(cfg, item)
  validate(cfg)
  cfg.lock()
  return cfg


def apply_override(cfg: ml_collections.ConfigDict, item: str) -> None:
  """Applies one `--config.a.b=value`; the value is converted to the type the field already has."""
  if not item.startswith("--config.") or "=" not in item:
    raise UserError(f"cannot read argument {item!r}; overrides look like --config.model.num_layers=8")
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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(old, int) and not isinstance(value, int)):
      raise UserError(f"config key {key!r} takes {'an integer' if isinstance(old, int) else 'a number'}, got {raw!r}")
    return type(old)(value)
  return raw


def _check_choice(key, value, choices):
  if value not in choices:
    raise UserError(f"config key {key!r} is {value!r}; choose one of {', '.join(map(str, choices))}")


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Checks everything that can be checked without devices; mesh and sharding checks come later, also before compile."""
  positive = {"distributed.init_timeout_s": cfg.distributed.init_timeout_s,
              "distributed.heartbeat_timeout_s": cfg.distributed.heartbeat_timeout_s,
              "distributed.barrier_timeout_s": cfg.distributed.barrier_timeout_s, "steps": cfg.steps, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "log_every": cfg.log_every,
              "checkpoint_keep": cfg.checkpoint_keep, "cpu_devices": cfg.cpu_devices,
              "eval_batches": cfg.eval_batches, "optimizer.grad_accum_steps": cfg.optimizer.grad_accum_steps,
              **{f"model.{k}": cfg.model[k] for k in ("vocab_size", "num_layers", "d_model", "num_heads",
                                                       "num_kv_heads", "head_dim", "mlp_dim")}}
  for key, value in positive.items():
    if value <= 0:
      raise UserError(f"config key {key!r} must be positive, got {value}")
  non_negative = {"eval_every": cfg.eval_every, "checkpoint_every": cfg.checkpoint_every, "watchdog_s": cfg.watchdog_s,
                  "optimizer.warmup_steps": cfg.optimizer.warmup_steps, "model.scan_unroll": cfg.model.scan_unroll}
  for key, value in non_negative.items():
    if value < 0:
      raise UserError(f"config key {key!r} must be >= 0, got {value}")
  profiling.parse_steps(cfg.profile_steps)
  m = cfg.model
  _check_choice("nonfinite", cfg.nonfinite, ("stop", "skip"))
  _check_choice("model.remat", m.remat, REMAT_POLICIES)
  _check_choice("model.dtype", m.dtype, DTYPES)
  _check_choice("model.param_dtype", m.param_dtype, DTYPES)
  _check_choice("model.attention", m.attention, ATTENTION)
  _check_choice("model.context_attention", m.context_attention, ("ring", "allgather"))
  _check_choice("model.init", m.init, INITS)
  if m.scan_unroll > 1 and m.remat != "none":
    raise UserError(f"model.scan_unroll={m.scan_unroll} with model.remat={m.remat}: XLA schedules the recomputation of "
                    "unrolled layers next to the forward pass it repeats, so remat would save no memory; use "
                    "model.scan_unroll=0 (auto) or 1")
  if m.scan_unroll > 1 and cfg.mesh.sequence != 1:
    raise UserError(f"model.scan_unroll={m.scan_unroll} with mesh.sequence={cfg.mesh.sequence}: unrolled ring-attention "
                    "layers loaded from the persistent compilation cache deadlock on the CPU; use "
                    "model.scan_unroll=0 (auto) or 1")
  if m.num_experts < 0 or (m.num_experts and not 1 <= m.experts_per_token <= m.num_experts):
    raise UserError(f"model.num_experts={m.num_experts}, model.experts_per_token={m.experts_per_token}: use "
                    "num_experts=0 (dense MLP) or 1 <= experts_per_token <= num_experts")
  if m.capacity_factor <= 0:
    raise UserError(f"model.capacity_factor={m.capacity_factor} must be positive (1.0-2.0 is usual)")
  if cfg.pipeline.microbatches < 1 or cfg.pipeline.repeats < 1:
    raise UserError(f"pipeline.microbatches={cfg.pipeline.microbatches} and pipeline.repeats="
                    f"{cfg.pipeline.repeats} must be >= 1")
  _check_choice("pipeline.schedule", cfg.pipeline.schedule, ("gpipe", "circular"))
  if cfg.pipeline.schedule == "gpipe" and cfg.pipeline.repeats != 1:
    raise UserError(f"pipeline.repeats={cfg.pipeline.repeats} needs pipeline.schedule=circular; GPipe makes one pass")
  if m.num_heads % m.num_kv_heads:
    raise UserError(f"model.num_heads={m.num_heads} is not a multiple of model.num_kv_heads={m.num_kv_heads}; "
                    "grouped-query attention shares each KV head among num_heads/num_kv_heads query heads")
  if m.head_dim % 2:
    raise UserError(f"model.head_dim={m.head_dim} must be even for rotary position embedding")
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
