"""Everything that depends on the mesh: shardings of the whole train state, sharded init, compiled steps.

`build(cfg, mesh)` runs every layout check (mesh vs rules, batch vs batch axes, every parameter dimension vs
the axes splitting it) from shapes alone, so a bad layout is reported before anything compiles. The train
loop, the benchmarks and the tests all get their steps from here, so they run exactly the same program.
"""
import contextlib
import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshtrain import config as config_lib, optim, sharding, step as step_lib
from meshtrain.errors import UserError
from meshtrain.parallel import context
from meshtrain.models import attention
from meshtrain.models.llama import ModelConfig, Transformer


@dataclasses.dataclass
class Layout:
  cfg: object
  mesh: Mesh
  rules: sharding.Rules
  model: Transformer
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  table: list[sharding.ParamRow]
  state_sharding: step_lib.TrainState   # a TrainState of NamedShardings
  batch_sharding: NamedSharding         # for [batch, length] token arrays
  state_abstract: step_lib.TrainState   # ShapeDtypeStructs carrying the shardings: Orbax restore targets
  token_order: np.ndarray | None        # column permutation fed to the model (context-parallel load balance)

  @property
  def layer_order(self) -> str:
    """How the stacked layer axis is ordered in the parameters (and checkpoints): the circular pipeline stores
    layers stage-major, so its checkpoints only fit a run with the same stages and repeats."""
    c = self.model.cfg
    if c.pipeline_stages > 1 and c.pipeline_schedule == "circular" and c.pipeline_repeats > 1:
      return f"circular(stages={c.pipeline_stages}, repeats={c.pipeline_repeats})"
    return "sequential"

  @property
  def micro_batch(self) -> int:
    return self.cfg.batch_size // self.cfg.optimizer.grad_accum_steps

  @contextlib.contextmanager
  def context(self):
    """Mesh + logical rules active while tracing, so the model's activation constraints resolve."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      yield

  def _init(self, key):
    tokens = jnp.zeros((self.micro_batch, self.cfg.seq_len), jnp.int32)
    params = nn.meta.unbox(self.model.init(key, tokens)["params"])
    return step_lib.TrainState.create(params, self.tx.init(params))

  def init(self, seed: int) -> step_lib.TrainState:
    """A fresh state, created directly in its shardings: no device ever holds a full replica."""
    with self.context():
      return jax.jit(self._init, out_shardings=self.state_sharding)(jax.random.key(seed))

  def batch_abstract(self, batch_size: int) -> dict:
    return {k: jax.ShapeDtypeStruct((batch_size, self.cfg.seq_len), jnp.int32, sharding=self.batch_sharding)
            for k in ("inputs", "targets")}

  def state_bytes_per_device(self) -> int:
    """Bytes of the train state (parameters, optimizer state, counters) each device holds: exact, from the shapes and
    shardings (every split is even, `build` checked that)."""
    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
               for a in jax.tree.leaves(self.state_abstract))

  def compile_train_step(self):
    """The train step compiled ahead of time: state donated, every input and output sharding explicit."""
    lowered = self.lower_train_step()
    with self.context():
      return lowered.compile()

  def lower_train_step(self, platforms: tuple[str, ...] | None = None):
    """The train step lowered, for `platforms` (default: the mesh's devices'; ("cuda",) on a CPU machine gives
    the program a GPU would compile, with a layout built for platform="gpu")."""
    fn = functools.partial(step_lib.train_step, apply_fn=self.model.apply, tx=self.tx, schedule=self.schedule,
                           accum_steps=self.cfg.optimizer.grad_accum_steps,
                           nan_at_step=self.cfg.faults.nan_at_step, token_order=self.token_order)
    replicated = NamedSharding(self.mesh, P())
    with self.context():
      return jax.jit(fn, in_shardings=(self.state_sharding, self.batch_sharding),
                     out_shardings=(self.state_sharding, replicated), donate_argnums=0,
                     ).trace(self.state_abstract, self.batch_abstract(self.cfg.batch_size)
                             ).lower(lowering_platforms=platforms)

  def compile_eval_step(self):
    """Eval on micro-batch-sized batches, so evaluation never needs more memory than training.

    Called as eval_fn(params, batch, self.token_bytes_table(tokenizer.token_bytes())).
    """
    fn = functools.partial(step_lib.eval_step, apply_fn=self.model.apply, token_order=self.token_order)
    replicated = NamedSharding(self.mesh, P())
    table = jax.ShapeDtypeStruct((self.cfg.model.vocab_size,), jnp.int32, sharding=replicated)
    with self.context():
      return jax.jit(fn, in_shardings=(self.state_sharding.params, self.batch_sharding, replicated),
                     out_shardings=replicated,
                     ).lower(self.state_abstract.params, self.batch_abstract(self.micro_batch), table).compile()

  def token_bytes_table(self, token_bytes) -> jax.Array:
    """The eval step's bytes-per-id table: a tokenizer's `token_bytes()` zero-padded to model.vocab_size (ids the
    tokenizer never emits stand for no text), replicated on the mesh."""
    token_bytes = np.asarray(token_bytes, np.int32)
    vocab = self.cfg.model.vocab_size
    if len(token_bytes) > vocab:
      raise UserError(f"model.vocab_size={vocab} is smaller than the tokenizer's vocabulary of {len(token_bytes)} "
                      f"ids; set --config.model.vocab_size={len(token_bytes)} or more")
    table = np.zeros(vocab, np.int32)
    table[:len(token_bytes)] = token_bytes
    return jax.device_put(table, NamedSharding(self.mesh, P()))

  def compile_grad(self):
    """Mean-loss gradients for a params tree and a batch (used to prove layouts agree)."""
    def grads(params, batch):
      def mean_loss(p):
        total, (_, count, _) = step_lib.loss_sums(p, batch, apply_fn=self.model.apply, token_order=self.token_order)
        return total / count
      return jax.value_and_grad(mean_loss)(params)
    with self.context():
      return jax.jit(grads, in_shardings=(self.state_sharding.params, self.batch_sharding),
                     out_shardings=(NamedSharding(self.mesh, P()), self.state_sharding.params),
                     ).lower(self.state_abstract.params, self.batch_abstract(self.cfg.batch_size)).compile()


def build(cfg, mesh: Mesh, *, platform: str | None = None) -> Layout:
  """Checks the layout from shapes alone, then derives every sharding of the train state.

  Nothing here depends on the tokenizer: the loss skips targets < 0 (`step.IGNORE_ID`), and the eval step takes
  the bytes-per-id table as an argument (`Layout.token_bytes_table`).

  `platform` is the one the steps are for (default: the mesh's devices'); "gpu" lets a CPU machine lower the
  steps a GPU would run (`lower(lowering_platforms=("cuda",))`), cuDNN attention included.
  """
  rules = sharding.for_mesh(sharding.rules_for(cfg.sharding.rules, cfg.sharding.sequence_parallel), mesh)
  stages, shards = mesh.shape["stage"], mesh.shape["sequence"]
  p = cfg.pipeline
  repeats = p.repeats if stages > 1 else 1
  device, m = mesh.devices.flat[0], cfg.model
  impl = attention.resolve(m.attention, platform or device.platform, m.dtype, m.head_dim, m.num_heads,
                           m.num_kv_heads, getattr(device, "compute_capability", None))
  model_cfg = dataclasses.replace(ModelConfig.from_config(cfg.model), pipeline_stages=stages,
                                  pipeline_microbatches=p.microbatches if stages > 1 else 1,
                                  pipeline_schedule=p.schedule, pipeline_repeats=repeats, attention=impl)
  if cfg.model.num_layers % (stages * repeats):
    raise UserError(f"model.num_layers={cfg.model.num_layers} cannot be split into mesh.stage={stages} x "
                    f"pipeline.repeats={repeats} equal layer groups; use sizes whose product divides the layer count")
  if stages > 1 and cfg.model.num_experts:
    raise UserError("pipeline stages (mesh.stage > 1) with a mixture-of-experts model are not supported: the "
                    "router's auxiliary loss is not carried through the pipeline; use mesh.stage=1")
  if shards > 1 and cfg.model.num_experts and cfg.sharding.causal_load_balance:
    raise UserError("a mixture-of-experts model under context parallelism (mesh.sequence > 1) needs "
                    "--config.sharding.causal_load_balance=false: expert capacity is given out in token order, so "
                    "the zigzag order would drop different tokens than one device does")
  if stages > 1 and shards > 1:
    raise UserError("pipeline stages (mesh.stage > 1) with context parallelism (mesh.sequence > 1) are not "
                    "supported: ring attention's shard_map cannot run inside the pipeline's stage vmap; use one of them")
  if stages > 1 and p.schedule == "circular" and p.microbatches < stages:
    raise UserError(f"the circular schedule needs pipeline.microbatches >= mesh.stage ({p.microbatches} < {stages})")
  sharding.check_mesh_uses_rules(mesh, rules, has_experts=cfg.model.num_experts > 0, pipelined=stages > 1)
  sharding.check_batch(mesh, cfg.batch_size, cfg.optimizer.grad_accum_steps)
  if stages > 1:
    sharding.check_batch(mesh, cfg.batch_size, cfg.optimizer.grad_accum_steps * cfg.pipeline.microbatches,
                         split_by="(grad_accum_steps x pipeline.microbatches)")
  token_order = None
  if shards > 1:
    chunks = 2 * shards if cfg.sharding.causal_load_balance else shards
    if cfg.seq_len % chunks:
      raise UserError(f"seq_len={cfg.seq_len} must be divisible by {chunks} to split it over mesh.sequence={shards}"
                      + (" in zigzag order (2 chunks per device)" if cfg.sharding.causal_load_balance else ""))
    if cfg.sharding.causal_load_balance:
      token_order = context.zigzag_permutation(cfg.seq_len, shards)[0]
  model = Transformer(model_cfg)
  tokens = jax.ShapeDtypeStruct((cfg.batch_size // cfg.optimizer.grad_accum_steps, cfg.seq_len), jnp.int32)
  boxed = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
  table = sharding.param_table(boxed, mesh, rules)
  param_sh = sharding.shardings_of(boxed, mesh, rules)
  tx = optim.make_optimizer(cfg.optimizer, cfg.steps)
  replicated = NamedSharding(mesh, P())
  params_abstract = nn.meta.unbox(boxed)
  opt_abstract = jax.eval_shape(tx.init, params_abstract)
  # Optimizer moments take their parameter's sharding; without this, jit would put them all on one device.
  opt_sh = optax.tree_map_params(tx, lambda _, s: s, opt_abstract, param_sh, transform_non_params=lambda _: replicated)
  state_sh = step_lib.TrainState(step=replicated, params=param_sh, opt_state=opt_sh, nonfinite_steps=replicated,
                                 last_nonfinite_step=replicated)
  abstract = step_lib.TrainState.create(params_abstract, opt_abstract)  # shapes only: the model is traced once
  state_abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_sh)
  return Layout(cfg, mesh, rules, model, tx, optim.learning_rate_schedule(cfg.optimizer, cfg.steps), table,
                state_sh, sharding.batch_sharding(mesh, rules), state_abstract, token_order)


def device_memory(mesh: Mesh) -> tuple[int, str]:
  """Bytes one device of `mesh` can hold, and where that figure comes from: the accelerator allocator's limit, or
  on the CPU this host's RAM (the smaller of physical memory and a cgroup limit) shared by the simulated devices."""
  device = mesh.local_devices[0]
  stats = device.memory_stats() or {}
  if "bytes_limit" in stats:
    return stats["bytes_limit"], f"the {device.device_kind} allocator's limit"
  ram = config_lib.host_memory_bytes()
  local = len(mesh.local_devices)
  return ram // local, f"{ram / 1e9:.1f} GB of host RAM shared by {local} simulated CPU devices"


def check_fits(needed: int, what: str, mesh: Mesh) -> None:
  """Refuses, with the figures and the commands to find a layout that fits, a run whose per-device memory exceeds
  what a device has: failing here costs seconds, an out-of-memory crash (or a swapping host) much more."""
  capacity, source = device_memory(mesh)
  if needed > capacity:
    raise UserError(f"{what} needs {needed / 1e9:,.2f} GB per device, more than the {capacity / 1e9:,.2f} GB a device "
                    f"has ({source}). Split the state over more devices (mesh.fsdp, mesh.tensor, mesh.stage), "
                    f"rematerialize (model.remat=full), or shrink batch_size / seq_len; explore layouts without "
                    f"allocating anything with python -m meshtrain.inspect --config CONFIG --devices {mesh.size} "
                    f"[--config.mesh.*=...] or python -m meshtrain.plan --config CONFIG --devices {mesh.size}")


def compiled_bytes(compiled) -> int:
  """Per-device memory a compiled program needs at its peak, by XLA's own buffer assignment: arguments, outputs
  not aliased to (donated) arguments, and temporaries."""
  mem = compiled.memory_analysis()
  return mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes + mem.temp_size_in_bytes
