"""Everything that depends on the mesh: shardings of the whole train state, sharded init, compiled steps.

`build(cfg, mesh)` runs every layout check (the task's own, mesh vs rules, batch vs batch axes, every parameter
dimension vs the axes splitting it) from shapes alone, so a bad layout is reported before anything compiles. The
train loop, the benchmarks and the tests all get their steps from here, so they run exactly the same program.
Nothing here knows the model family: the task (meshtrain/tasks) gives the model, the batch, the loss and the eval.
"""
import contextlib
import dataclasses
import functools
import math

import flax.linen as nn
import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshtrain import families, optim, sharding, step as step_lib
from meshtrain.errors import UserError
from meshtrain.runtime import host


@dataclasses.dataclass
class Layout:
  cfg: object
  mesh: Mesh
  rules: sharding.Rules
  task: object                          # families.build's: the model, batch spec, loss and eval of cfg.task
  tx: optax.GradientTransformation
  schedule: optax.Schedule
  table: list[sharding.ParamRow]
  state_sharding: step_lib.TrainState   # a TrainState of NamedShardings
  batch_shardings: dict[str, NamedSharding]  # per batch key, from the task's batch axes
  state_abstract: step_lib.TrainState   # ShapeDtypeStructs carrying the shardings: Orbax restore targets

  @property
  def model(self):
    return self.task.model

  @property
  def layer_order(self) -> str:
    """How the stacked layer axis is stored (checkpoints of another order do not fit); "sequential" unless the task
    says otherwise (the LM's circular pipeline stores layers stage-major)."""
    return getattr(self.task, "layer_order", "sequential")

  @property
  def batch_sharding(self):
    """What data.Batches / data.global_batch / jax.device_put take for a batch: the one NamedSharding every key
    shares (the LM's [batch, length] arrays), else the dict per key."""
    shardings = set(self.batch_shardings.values())
    return next(iter(shardings)) if len(shardings) == 1 else dict(self.batch_shardings)

  @property
  def micro_batch(self) -> int:
    return self.cfg.batch_size // self.cfg.optimizer.grad_accum_steps

  @contextlib.contextmanager
  def context(self):
    """Mesh + logical rules active while tracing, so the model's activation constraints resolve."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      yield

  def _init(self, key):
    params = nn.meta.unbox(self.task.model.init(key, *self.task.init_args(self.micro_batch))["params"])
    return step_lib.TrainState.create(params, self.tx.init(params), ema=self.cfg.optimizer.ema_decay > 0)

  def init(self, seed: int) -> step_lib.TrainState:
    """A fresh state, created directly in its shardings: no device ever holds a full replica."""
    with self.context():
      return jax.jit(self._init, out_shardings=self.state_sharding)(jax.random.key(seed))

  def batch_abstract(self, batch_size: int) -> dict:
    return {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.batch_shardings[k])
            for k, a in self.task.batch_spec(batch_size).items()}

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
    fn = functools.partial(step_lib.train_step, loss_fn=self.task.loss, batch_axes=self.task.batch_axes(),
                           tx=self.tx, schedule=self.schedule, accum_steps=self.cfg.optimizer.grad_accum_steps,
                           nan_at_step=self.cfg.faults.nan_at_step,
                           count_name=self.task.throughput_key.removesuffix("_per_sec"),
                           ema_decay=self.cfg.optimizer.ema_decay)
    replicated = NamedSharding(self.mesh, P())
    with self.context():
      return jax.jit(fn, in_shardings=(self.state_sharding, self.batch_shardings),
                     out_shardings=(self.state_sharding, replicated), donate_argnums=0,
                     ).trace(self.state_abstract, self.batch_abstract(self.cfg.batch_size)
                             ).lower(lowering_platforms=platforms)

  def eval_extra(self, tokenizer=None):
    """The task's `eval_extra(tokenizer)` (the LM's bytes-per-id table; None for a task without one), replicated on
    the mesh: the third argument of the compiled eval step."""
    return jax.device_put(self.task.eval_extra(tokenizer), NamedSharding(self.mesh, P()))

  def compile_eval_step(self):
    """The task's eval sums on micro-batch-sized batches, so evaluation never needs more memory than training.

    Called as eval_fn(params, batch, self.eval_extra(tokenizer)).
    """
    replicated = NamedSharding(self.mesh, P())
    # The task's eval_extra without a tokenizer has the shapes of the real one: the compile-time template.
    extra = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
                         self.task.eval_extra(None))
    with self.context():
      return jax.jit(self.task.eval_sums, in_shardings=(self.state_sharding.params, self.batch_shardings, replicated),
                     out_shardings=replicated,
                     ).lower(self.state_abstract.params, self.batch_abstract(self.micro_batch), extra).compile()

  def compile_grad(self):
    """Mean-loss gradients for a params tree and a batch (used to prove layouts agree)."""
    def grads(params, batch):
      def mean_loss(p):
        total, aux = self.task.loss(p, batch)
        return total / aux["count"]
      return jax.value_and_grad(mean_loss)(params)
    with self.context():
      return jax.jit(grads, in_shardings=(self.state_sharding.params, self.batch_shardings),
                     out_shardings=(NamedSharding(self.mesh, P()), self.state_sharding.params),
                     ).lower(self.state_abstract.params, self.batch_abstract(self.cfg.batch_size)).compile()


def build(cfg, mesh: Mesh, platform: str | None = None) -> Layout:
  """Checks the layout from shapes alone, then derives every sharding of the train state.

  The task (`families.build`) runs its model-specific checks and builds the model; everything else here is the same
  for every task. Nothing depends on the tokenizer: the eval step takes the task's eval_extra as an argument.

  `platform` is the one the steps are for (default: the mesh's devices'); "gpu" lets a CPU machine lower the
  steps a GPU would run (`lower(lowering_platforms=("cuda",))`), cuDNN attention included.
  """
  rules = sharding.for_mesh(sharding.rules_for(cfg.sharding.rules, cfg.sharding.sequence_parallel), mesh)
  task = families.build(cfg, mesh, platform)
  stages = mesh.shape["stage"]
  sharding.check_mesh_uses_rules(mesh, rules, has_experts=cfg.model.get("num_experts", 0) > 0, pipelined=stages > 1)
  sharding.check_batch(mesh, cfg.batch_size, cfg.optimizer.grad_accum_steps)
  if stages > 1:
    sharding.check_batch(mesh, cfg.batch_size, cfg.optimizer.grad_accum_steps * cfg.pipeline.microbatches,
                         split_by="(grad_accum_steps x pipeline.microbatches)")
  micro = cfg.batch_size // cfg.optimizer.grad_accum_steps
  init_args = jax.eval_shape(lambda: task.init_args(micro))  # shapes only: no batch-sized array is allocated
  boxed = jax.eval_shape(task.model.init, jax.random.key(0), *init_args)["params"]
  table = sharding.param_table(boxed, mesh, rules)
  param_sh = sharding.shardings_of(boxed, mesh, rules)
  tx = optim.make_optimizer(cfg.optimizer, cfg.steps)
  replicated = NamedSharding(mesh, P())
  params_abstract = nn.meta.unbox(boxed)
  opt_abstract = jax.eval_shape(tx.init, params_abstract)
  # Optimizer moments take their parameter's sharding; without this, jit would put them all on one device.
  opt_sh = optax.tree_map_params(tx, lambda _, s: s, opt_abstract, param_sh, transform_non_params=lambda _: replicated)
  ema = cfg.optimizer.ema_decay > 0
  state_sh = step_lib.TrainState(step=replicated, params=param_sh, opt_state=opt_sh, nonfinite_steps=replicated,
                                 last_nonfinite_step=replicated, ema_params=param_sh if ema else None)
  # Shapes only: the model is traced once.
  abstract = jax.eval_shape(lambda p, o: step_lib.TrainState.create(p, o, ema), params_abstract, opt_abstract)
  state_abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, state_sh)
  batch_sh = {k: NamedSharding(mesh, sharding.logical_to_spec(axes, rules)) for k, axes in task.batch_axes().items()}
  return Layout(cfg, mesh, rules, task, tx, optim.learning_rate_schedule(cfg.optimizer, cfg.steps), table,
                state_sh, batch_sh, state_abstract)


def device_memory(mesh: Mesh) -> tuple[int, str]:
  """Bytes one device of `mesh` can hold, and where that figure comes from: the accelerator allocator's limit, or
  on the CPU this host's RAM (the smaller of physical memory and a cgroup limit) shared by the simulated devices."""
  device = mesh.local_devices[0]
  stats = device.memory_stats() or {}
  if "bytes_limit" in stats:
    return stats["bytes_limit"], f"the {device.device_kind} allocator's limit"
  ram = host.host_memory_bytes()
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
