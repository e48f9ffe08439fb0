"""Tasks, JAX-free: the contract every model family implements, and each family's config fields.

The loop knows no model. It asks its task for the model, the batch the data must produce, the loss, the eval
sums and the FLOPs per example. This package is the part that needs no JAX: the contract (below) and each kind's
config fields (`<family>_config.py`: checks, model group, batch memory), registered with meshtrain.config here.
The implementations are meshtrain/families/ (`families.build(cfg, mesh, platform)`, `families.cost_model(cfg)`):
  lm   a causal language model (Llama, optionally mixture-of-experts): meshtrain/families/lm.py
  dit  a class-conditional diffusion transformer on images (rectified flow): meshtrain/families/dit.py
  t2i  a text-to-image transformer on Flux's architecture, on captioned images: meshtrain/families/t2i.py
A third family is a module in meshtrain/families/, a config module here registered below, and a branch in
`families.build` and `families.cost_model`; the loop, layout, checkpoints, launcher, planner and fault handling
serve it unchanged.

Contract (each family module defines a class with these members):

  kind: str                      "lm" | "dit" | "t2i": `cfg.task`, recorded in every checkpoint's meta as "task"
  model: flax.linen.Module       every parameter tagged with logical axes (meshtrain/models/params.py `param`)
  shape_fields: tuple[str, ...]  cfg.model fields that fix the parameter shapes: resume needs them equal
  throughput_key: str            the metrics.jsonl throughput name: "tokens_per_sec" | "images_per_sec"
  units_per_example: int         tokens (LM: seq_len) or images (DiT: 1) per batch row, for that throughput

  batch_spec(batch_size) -> dict[str, jax.ShapeDtypeStruct]
      Global shape and dtype of every array of one batch (no sharding). The data source must produce exactly
      these keys; row r of every array belongs to example r.
  batch_axes() -> dict[str, tuple[str | None, ...]]
      Logical axes of each batch array, first "act_batch" (e.g. ("act_batch", "act_len") for tokens,
      ("act_batch", None, None, None) for images); layout turns them into shardings with the rules.
  init_args(batch_size) -> tuple
      The arguments after the PRNG key that `model.init` takes, as arrays (zeros) of a batch_size batch.
  loss(params, batch) -> (objective, aux)
      Pure and jittable. `objective` (float32 scalar) is what is differentiated: a SUM over the batch's examples
      (or tokens); the train step divides the gradients by the total count (so gradient accumulation equals one
      big batch). aux = {"loss_sum": float32, "count": float32, **metrics}: loss_sum / count is the logged loss;
      any other scalars (e.g. MoE router statistics) are logged as they are. Randomness (noise, timesteps,
      label dropout) comes from per-row seeds in the batch, so a batch is a pure function of (seed, step) and
      the loss of a row does not depend on the layout, the micro-batching or the process count.
  eval_sums(params, batch, extra) -> dict[str, float32 scalar]
      Pure and jittable sums over one eval batch; the loop adds them over cfg.eval_batches batches.
      `extra` is `eval_extra(...)`'s value, passed in replicated (the LM's bytes-per-id table; DiT: None).
  eval_record(sums: dict[str, float]) -> dict[str, float]
      Host side: the summed eval_sums as metrics.jsonl fields, at least "eval_loss".
  flops_per_example(table: list[sharding.ParamRow]) -> float
      Model FLOPs of one training example (forward and backward, matmuls and attention, by formula): the MFU
      numerator, shared by the loop, bench, inspect and plan.

The cost model (`families.cost_model(cfg)`: a class `CostModel` in the family module, built from the config alone,
no mesh or devices) is what meshtrain/analysis/estimate.py needs for inspect's expectation and plan's ranking;
estimate does the arithmetic every task shares (parameter, optimizer and gradient bytes under the rules; JAX's
residuals of the block stack, per layer run; the peak; step time) and asks the task for the rest:
  throughput_key, units_per_example, length   as the task's; length: tokens of one example (LM: seq_len, DiT: patches)
  unsupported_axes: dict[str, str]            mesh axes the model cannot be split over, and why (plan leaves them
                                              at 1 and prints the reasons); num_experts: 0 leaves `expert` at 1
  check_parallelism(sizes, microbatches)      the task's layout refusals (UserError), as the task itself applies them
  attention_on(platform, capability) -> str   the attention kernel the model runs there ("cudnn": fused, no scores)
  abstract_params()                           the boxed parameter shapes with logical axes (jax.eval_shape of init)
  flops_per_example(table), recomputed_flops_per_example(table)   the MFU numerator, and what remat adds
  batch_bytes_per_example(length)             one row of the batch, with `length` of its tokens on a device
  stacks(sizes) -> list[costs.Stacked]        the model's scanned block stacks in forward order (LM, DiT: one; t2i:
                                              text encoder, double, single), each with its layer count, the path
                                              prefix of its stacked weights, its tokens per example, and a hashable
                                              LayerStack: the block as one device runs it: width, dims,
                                              sequence_parallel, without_remat(), backward_peak(l, act) (bytes per
                                              example the block's backward holds beyond its residuals),
                                              gradient_jaxpr(batch, L, shards) (the gradient of a two-layer nn.scan
                                              of the block, for the residuals)
  loss_bytes(b, l, sizes, act)                the working set of the loss and what runs outside the stack
  collectives(sizes, table, gathered, b, l, act) -> list[hlo.Collective]   per device per step, what each split
                                              forces in the task's blocks (estimate.CollectiveList builds it)

Details the core relies on (meshtrain/layout.py, meshtrain/hooks.py):
  - `eval_extra(None)` has the structure and shapes of the real extra: it is the eval step's compile-time template.
    The loop hands `eval_record` the summed eval_sums as fetched (numpy float32 scalars), so a division there keeps
    the precision it had.
  - The train step's metrics name the count after the unit of `throughput_key` ("tokens", "images"); every other
    scalar of the loss's aux (e.g. the LM's moe_*) is averaged over micro-batches and written to metrics.jsonl.
Optional members (the core has a default without them):
  eval_message(record) -> str     the log line after "step N: " (LM: eval loss and bits/byte). Default: eval loss.
  layer_order: str                how stacked layers are stored; a checkpoint of another order is refused.
                                  Default "sequential".
"""
from meshtrain import config as config_lib
from meshtrain.tasks import dit_config, lm_config, t2i_config

# Each kind's own config fields, checked by config.load (which imports no task): registered here, once, when the
# meshtrain package is imported (meshtrain/__init__.py imports this module).
for _kind, _fields in (("lm", lm_config), ("dit", dit_config), ("t2i", t2i_config)):
  config_lib.register_task(_kind, config_lib.TaskFields(_fields.model_group, _fields.check, _fields.check_batch_memory))
KINDS = tuple(config_lib.TASKS)

