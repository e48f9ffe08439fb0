"""Train a model (any task: meshtrain/tasks) over a device mesh.

  python -m meshtrain.train --config configs/tiny.py --workdir runs/tiny [--config.KEY=VALUE ...]

Re-running the same command with the same workdir resumes from the latest checkpoint, on whatever mesh and
process count the new command has; one run at a time holds a workdir. Exit codes: 0 done or preempted
(checkpoint saved), 2 a user mistake or a refusal (reported before the first step), 3 stopped to protect
results (non-finite loss, a checkpoint that could not be written), 4 hang watchdog, 128 + N signal N during
start-up (130 Ctrl-C, 143 SIGTERM; nothing written).
"""
import collections
import concurrent.futures
import functools
import json
import os
import pathlib
import sys
import time

from meshtrain import config as config_lib
from meshtrain.errors import ArgumentParser, RunAborted, UserError

_IMPORTED = time.perf_counter()  # start-up fallback where the process start time is unknown


def parse_args(argv: list[str]):
  parser = ArgumentParser(prog="python -m meshtrain.train", description=__doc__.split("\n\n")[0],
                          epilog="Any config field can be overridden: --config.model.num_layers=8")
  parser.add_argument("--config", required=True, help="Python config file with get_config(), e.g. configs/tiny.py")
  parser.add_argument("--workdir", required=True, help="checkpoints, metrics and logs go here; reuse it to resume")
  args, overrides = parser.parse_known_args(argv)
  cfg = config_lib.load(args.config, overrides)
  workdir = check_workdir(args.workdir)
  config_lib.check_batch_memory(cfg)  # before JAX: a batch that cannot be allocated is refused in a second
  return cfg, workdir


def check_workdir(path: str) -> pathlib.Path:
  """`path` as the run's directory: not empty, and it or its nearest existing parent a writable directory."""
  if not path.strip():
    raise UserError("--workdir is empty, which would put checkpoints, metrics and logs in the current directory; "
                    "pass a directory for this run, e.g. --workdir runs/tiny (created if missing)")
  workdir = pathlib.Path(path).expanduser()
  existing = config_lib.check_directory("--workdir", str(workdir))
  if not os.access(existing, os.W_OK | os.X_OK):
    raise UserError(f"--workdir {path!r} cannot be written: {str(existing)!r} is not writable by this user; pass a "
                    "directory on a writable file system")
  return workdir


def main(argv: list[str] | None = None) -> int:
  cfg = None
  try:
    cfg, workdir = parse_args(sys.argv[1:] if argv is None else argv)
    train(cfg, workdir)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except RunAborted as e:
    print(f"stopped: {e}", file=sys.stderr)
    return 3
  except MemoryError as e:  # a host-side array of the model or batch (numpy): the sizes asked for are too large
    lm = cfg is None or cfg.task == "lm"
    sizes = "" if cfg is None else f" for batch_size={cfg.batch_size}" + (f", seq_len={cfg.seq_len}" if lm else "")
    print(f"error: out of host memory{sizes} ({' '.join(str(e).split())[:200] or 'MemoryError'}); lower "
          f"{'seq_len or ' if lm else ''}batch_size, and see what a layout needs per device with python -m "
          "meshtrain.inspect", file=sys.stderr)
    return 2
  return 0


def train(cfg, workdir: pathlib.Path, hooks=()) -> dict:
  """Trains to cfg.steps (resuming from workdir) and returns timing: compile and start-up seconds.

  `hooks` (meshtrain/hooks.py) are called after the loop's own (metrics, eval, checkpoint, the task's), e.g.
  bench's loop clock."""
  from meshtrain.preemption import PreemptionNotice
  # Signal handling from the first moment: a signal during start-up ends the process at once with a message
  # (nothing to save yet); once the loop runs, it stops after the current step with a checkpoint.
  with PreemptionNotice() as preemption:
    # Heavy imports after argument checks, so a typo is reported in a fraction of a second.
    from meshtrain import runtime
    runtime.start(cfg)  # XLA flags, CPU devices, distributed runtime: before JAX initialises its backends
    import jax
    from meshtrain import workdir as workdir_lib
    # Before anything reads or writes the workdir: a second run there is refused, the first one is left alone.
    with workdir_lib.exclusive(workdir, jax.process_index(), jax.process_count(), cfg.distributed.barrier_timeout_s):
      return _train(cfg, workdir, preemption, hooks)


def _train(cfg, workdir: pathlib.Path, preemption, extra_hooks) -> dict:
  import jax
  from meshtrain import checkpoint, data, finetune, hooks as hooks_lib, layout as layout_lib, mesh as mesh_lib, perf
  from meshtrain import runtime, sharding
  from meshtrain.metrics import MetricsWriter
  from meshtrain.profiling import StepProfiler
  from meshtrain.watchdog import Watchdog

  is_main = jax.process_index() == 0
  log = functools.partial(print, flush=True) if is_main else (lambda *a, **k: None)
  # A fine-tuning run's source is checked first (it exists, its model is this run's); a workdir with checkpoints
  # resumes them instead, so a source deleted since the run started does not stop its resumption.
  init = finetune.resolve(cfg) if cfg.init_from and not checkpoint.checkpoint_steps(workdir) else None

  # --- Data, layout and the checkpoint to resume from: every user mistake surfaces here, before any compile. ---
  # The data first: a split too short for seq_len is named as such, before any model-sized buffer exists.
  # The tokenizer before the data (a bpe:N one is trained here on first use), and the model checked against it.
  tok = data.tokenizer.for_config(cfg) if cfg.task == "lm" else None  # other tasks read no text
  if init is not None and tok is not None:
    finetune.check_tokenizer(init, tok, cfg.data.tokenizer)
  if tok is not None and (cfg.data.name != "synthetic" or tok.kind != "byte"):  # synthetic ids: below vocab_size
    data.pipeline.check_vocab(cfg, tok)
  train_src = data.make_source(cfg, cfg.data.train_split, shuffle=True, tok=tok)
  eval_src = data.make_source(cfg, cfg.data.eval_split, shuffle=False, tok=tok) if cfg.eval_every else None
  mesh = mesh_lib.make_mesh(cfg.mesh)
  layout = layout_lib.build(cfg, mesh)
  task = layout.task
  log(f"mesh: {mesh_lib.describe(mesh)}; sharding rules: {cfg.sharding.rules}")
  log(sharding.format_table(layout.table))
  # Before restoring or initialising anything: a state that cannot fit is refused in seconds, not after an OOM.
  layout_lib.check_fits(layout.state_bytes_per_device(), "the train state (parameters and optimizer state)", mesh)
  if (stages := mesh.shape["stage"]) > 1:
    from meshtrain.parallel.pipeline import bubble_fraction
    from meshtrain.tasks.lm import pipeline_repeats
    log(f"pipeline: {stages} stages, {cfg.pipeline.microbatches} micro-batches, {cfg.pipeline.schedule} schedule; "
        f"bubble {bubble_fraction(stages, cfg.pipeline.microbatches, pipeline_repeats(cfg, stages)):.1%} of each "
        "step idle")
  # Each process got here at its own pace (data, tokenizer, tracing); Orbax's barriers are collectives: start together.
  runtime.barrier("the checkpoint restore", cfg.distributed.barrier_timeout_s)
  ckpt = checkpoint.Checkpointer(workdir, cfg.checkpoint_keep, cfg.distributed.barrier_timeout_s)
  def check(step, meta):
    if meta.get("params_only"):
      raise UserError(f"{workdir} holds converted parameters (no optimizer state or data position to resume); use "
                      f"--config.init_from={workdir} with a new --workdir to fine-tune them")
    if (trained_task := meta.get("task", "lm")) != cfg.task:  # checkpoints from before tasks are language models
      raise UserError(f"the checkpoint at step {step} in {ckpt.directory} was trained with task={trained_task}, this "
                      f"run has task={cfg.task}; resume it with its own config, or start a new --workdir")
    checkpoint.check_compatible(meta["config"], cfg.model, task.shape_fields, step, ckpt.directory)
    if tok is not None:
      # By the file's fingerprint, not data.tokenizer's string: a moved copy is the same tokenizer. Checkpoints
      # from before tokenizers were recorded are bytes. Refused even with allow_data_change: the ids would mean
      # other text.
      trained_with = meta.get("tokenizer") or {"kind": "byte", "fingerprint": "byte"}
      if trained_with["fingerprint"] != tok.fingerprint:
        raise UserError(f"the checkpoint at step {step} in {ckpt.directory} was trained with the "
                        f"{trained_with['kind']} tokenizer {trained_with['fingerprint'][:12]}, this run has the "
                        f"{tok.kind} tokenizer {tok.fingerprint[:12]} (data.tokenizer={cfg.data.tokenizer!r}); resume "
                        f"with --config.data.tokenizer={workdir / data.tokenizer.WORKDIR_SUBDIR} (the run's copy), or "
                        "start a new workdir")
    if meta.get("layer_order", "sequential") != layout.layer_order:
      raise UserError(f"the checkpoint at step {step} in {ckpt.directory} stores its layers in {meta['layer_order']} "
                      f"order, this run in {layout.layer_order} order; use its pipeline settings to resume")
    data_changes = config_lib.changes(meta["config"], cfg, config_lib.DATA_ORDER_FIELDS)
    if data_changes and not cfg.allow_data_change:
      raise UserError(f"the checkpoint at step {step} in {ckpt.directory} was trained on another data order: "
                      + "; ".join(f"{k}: checkpoint {old!r}, this run {new!r}" for k, old, new in data_changes)
                      + ". Resuming would silently change which batches come next; use the checkpoint's values, or "
                      "rerun with --config.allow_data_change=true to continue with the new ones")
    for key, old, new in data_changes + config_lib.changes(meta["config"], cfg, config_lib.schedule_fields(cfg)):
      log(f"resuming with {key} changed: {old!r} -> {new!r}")
  # Restored straight into this run's shardings: another mesh or process count needs no conversion.
  start, state, resumed_meta = ckpt.restore_latest(layout.state_abstract, cfg.checkpoint_fallback, check)
  if start is not None and cfg.init_from:
    log(f"init_from={cfg.init_from!r} is ignored: {workdir} has checkpoints of its own, resuming from step {start}")
  if init is not None and layout.layer_order != "sequential":
    raise UserError(f"init_from needs the layers in sequential order, but this run stores them in {layout.layer_order} "
                    "order; fine-tune with pipeline.schedule=gpipe or pipeline.repeats=1")
  # Recorded in every checkpoint of a fine-tuning run, resumed or not: where its parameters came from.
  init_record = init.describe() if init is not None else (resumed_meta or {}).get("init_from")
  if start is not None and start >= cfg.steps:
    log(f"{ckpt.directory} already holds step {start} >= steps={cfg.steps}; nothing to do "
        f"(raise --config.steps to train further)")
    return {}
  if is_main:  # written whole or not at all: a signal during start-up ends the process wherever it is
    (workdir / "config.json.tmp").write_text(json.dumps(cfg.to_dict(), indent=2))
    (workdir / "config.json.tmp").replace(workdir / "config.json")
    if tok is not None:  # WORKDIR/tokenizer/: generate, export and resume find the run's tokenizer here
      data.tokenizer.save_to_workdir(tok, workdir)

  # The train step, the eval step and the initial state are compiled on two threads: XLA compiles without holding
  # the GIL, so start-up waits for the longest compile rather than the sum, and the main thread only waits on
  # futures, where a signal is handled at once.
  log("compiling the train step" + (", the eval step" if eval_src is not None else "")
      + (" and the initial state" if start is None else ""))
  with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="compile") as pool:
    train_future = pool.submit(timed, layout.compile_train_step)
    eval_future = pool.submit(layout.compile_eval_step) if eval_src is not None else None
    init_future = None
    if start is None:
      init_future = pool.submit(finetune.initial_state, layout, init) if init else pool.submit(layout.init, cfg.seed)
    train_fn, compile_s = train_future.result()
    log(f"train step compiled in {compile_s:.1f}s; {compiled_summary(train_fn)}")
    layout_lib.check_fits(layout_lib.compiled_bytes(train_fn), "the compiled train step", mesh)
    flops_per_example = task.flops_per_example(layout.table)
    peak, peak_source = perf.device_peak(mesh, cfg.model.dtype)
    unit = task.throughput_key.removesuffix("_per_sec").removesuffix("s")  # "token", "image"
    log(f"model FLOPs per {unit} {flops_per_example / task.units_per_example:,.0f}; peak {peak / 1e9:,.1f} GFLOP/s "
        f"per device ({peak_source})")
    eval_fn = eval_future.result() if eval_future else None
    if init_future:
      state, start = init_future.result(), 0
      log(f"initialised {sum(r.size for r in layout.table):,} parameters" if init is None else
          f"initialised from {init.workdir / 'checkpoints' / str(init.step)}: parameters only (fresh optimizer "
          f"state, step 0)")
    else:
      log(f"resumed from {ckpt.directory / str(start)}")

  # --- The hooks: all periodic work of the loop (meshtrain/hooks.py). ---
  writer = MetricsWriter(workdir, cfg.steps, start, enabled=is_main)
  batches = data.Batches(train_src, start, cfg.batch_size, layout.batch_sharding)
  watchdog = Watchdog(cfg.watchdog_s, workdir, jax.process_index())
  profiler = StepProfiler(cfg.profile_steps, workdir, enabled=is_main)
  run = hooks_lib.Run(cfg, workdir, mesh, layout, writer, hooks_lib.Timer(start), watchdog, ckpt, start, state,
                      timing={"compile_s": compile_s})
  run.metrics_log = hooks_lib.MetricsLog(run, flops_per_example, peak, startup_clock)
  save = hooks_lib.Checkpoint(cfg.checkpoint_every, {
      "config": cfg.to_dict(), "task": cfg.task, "layer_order": layout.layer_order,
      **({"tokenizer": tok.describe()} if tok is not None else {}),
      **({"init_from": init_record} if init_record else {})})
  evaluate = None
  if eval_src is not None:
    # The task's extra eval input, e.g. the bytes each id stands for: bits per byte compares tokenizers.
    evaluate = hooks_lib.Evaluate(cfg.eval_every, eval_fn, eval_src, layout.eval_extra(tok))
  task_hooks = task.hooks(run) if hasattr(task, "hooks") else []
  hooks = hooks_lib.Hooks([hooks_lib.Preemption(preemption, save), run.metrics_log, hooks_lib.Heartbeat(watchdog),
                           hooks_lib.ProfileWindow(profiler), *([evaluate] if evaluate else []), save, *task_hooks,
                           *extra_hooks])
  if init is not None and evaluate is not None:  # the baseline a fine-tuning run's evaluations compare to
    with run.timer.paused():  # not part of the first step's time
      record = evaluate.evaluate(0, run)
      writer.write(record)
      writer.print(f"step 0 (init_from): eval loss {record['eval_loss']:.4f}")
  # Compile and restore times differ between processes; the first step's collectives must not wait 30 s for a peer.
  runtime.barrier("the first step", cfg.distributed.barrier_timeout_s)
  preemption.start_loop(distributed=jax.process_count() > 1)
  try:
    _loop(run, train_fn, batches, hooks)
  finally:
    hooks.close()  # the profile window, then the watchdog
    batches.close()
    try:
      ckpt.wait()   # an async save in flight is committed (or fails) before the process exits
    finally:
      ckpt.close()
      writer.close()
  if not run.stopped:
    log(f"done: step {cfg.steps}; checkpoints in {ckpt.directory}; metrics in {writer.path}")
  return run.timing


def _loop(run, train_fn, batches, hooks) -> None:
  """The train loop: load a batch, dispatch the step, let the hooks do the rest (meshtrain/hooks.py)."""
  import jax
  in_flight = collections.deque()
  for step in range(run.start + 1, run.last_step + 1):
    run.beat(step, "loading data")
    _, batch = next(batches)
    hooks.before(step, run)
    with jax.profiler.StepTraceAnnotation("train", step_num=step):
      run.state, run.metrics = train_fn(run.state, batch)
    # The host runs at most two steps ahead of the devices: enough to keep them fed, and it bounds the queue (on
    # the CPU backend an unbounded queue of steps with collectives can starve its thread pool into a deadlock).
    in_flight.append(run.metrics["loss"])
    if len(in_flight) > 2:
      in_flight.popleft().block_until_ready()
    hooks.after(step, run)  # metrics one step late, profile window, eval, checkpoint, preemption
    if run.stopped:
      return
  hooks.end(run)
  run.beat(run.last_step, "committing the last checkpoint")
  run.ckpt.wait()


def startup_clock() -> float:
  """Seconds since this process started (or, where unknown, since this module was imported)."""
  from meshtrain import perf
  since_start = perf.seconds_since_process_start()
  return since_start if since_start is not None else time.perf_counter() - _IMPORTED


def timed(fn):
  """fn() and the seconds it took."""
  t0 = time.perf_counter()
  return fn(), time.perf_counter() - t0


def compiled_summary(compiled) -> str:
  """Per-device memory of the compiled step and its FLOPs, from XLA's own analyses."""
  mem = compiled.memory_analysis()
  mib = lambda b: f"{b / 2**20:,.1f} MiB"
  parts = [f"per-device memory: arguments {mib(mem.argument_size_in_bytes)}, outputs {mib(mem.output_size_in_bytes)} "
           f"(aliased {mib(mem.alias_size_in_bytes)}), temporaries {mib(mem.temp_size_in_bytes)}"]
  cost = compiled.cost_analysis()
  if cost and "flops" in cost:
    parts.append(f"{cost['flops'] / 1e9:,.2f} GFLOP per device per step")
  return "; ".join(parts)


if __name__ == "__main__":
  from meshtrain import runtime
  runtime.run_main(main)
