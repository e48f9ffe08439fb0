"""Train a language model over a device mesh.

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
import math
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
    sizes = f" for batch_size={cfg.batch_size}, seq_len={cfg.seq_len}" if cfg is not None else ""
    print(f"error: out of host memory{sizes} ({' '.join(str(e).split())[:200] or 'MemoryError'}); lower seq_len or "
          "batch_size, and see what a layout needs per device with python -m meshtrain.inspect", file=sys.stderr)
    return 2
  return 0


def train(cfg, workdir: pathlib.Path) -> dict:
  """Trains to cfg.steps (resuming from workdir) and returns timing: start-up, compile and the loop's wall time."""
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
    with workdir_lib.exclusive(workdir, jax.process_index(), jax.process_count()):
      return _train(cfg, workdir, preemption)


def _train(cfg, workdir: pathlib.Path, preemption) -> dict:
  import jax
  import jax.numpy as jnp
  from meshtrain import checkpoint, data, finetune, layout as layout_lib, mesh as mesh_lib, perf, sharding
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
  tok = data.tokenizer.for_config(cfg)
  if init is not None:
    finetune.check_tokenizer(init, tok, cfg.data.tokenizer)
  if cfg.data.name != "synthetic" or tok.kind != "byte":  # synthetic tokens are drawn below model.vocab_size
    data.pipeline.check_vocab(cfg, tok)
  train_src = data.make_source(cfg, cfg.data.train_split, shuffle=True, tok=tok)
  eval_src = data.make_source(cfg, cfg.data.eval_split, shuffle=False, tok=tok) if cfg.eval_every else None
  mesh = mesh_lib.make_mesh(cfg.mesh)
  layout = layout_lib.build(cfg, mesh)
  log(f"mesh: {mesh_lib.describe(mesh)}; sharding rules: {cfg.sharding.rules}")
  log(sharding.format_table(layout.table))
  # Before restoring or initialising anything: a state that cannot fit is refused in seconds, not after an OOM.
  layout_lib.check_fits(layout.state_bytes_per_device(), "the train state (parameters and optimizer state)", mesh)
  if (stages := mesh.shape["stage"]) > 1:
    from meshtrain.parallel.pipeline import bubble_fraction
    repeats = cfg.pipeline.repeats if cfg.pipeline.schedule == "circular" else 1
    log(f"pipeline: {stages} stages, {cfg.pipeline.microbatches} micro-batches, {cfg.pipeline.schedule} schedule; "
        f"bubble {bubble_fraction(stages, cfg.pipeline.microbatches, repeats):.1%} of each step idle")
  ckpt = checkpoint.Checkpointer(workdir, cfg.checkpoint_keep, cfg.distributed.barrier_timeout_s)
  def check(step, meta):
    if meta.get("params_only"):
      raise UserError(f"{workdir} holds converted parameters (no optimizer state or data position to resume); use "
                      f"--config.init_from={workdir} with a new --workdir to fine-tune them")
    checkpoint.check_compatible(meta["config"], cfg.model, config_lib.SHAPE_FIELDS, step, ckpt.directory)
    # By the file's fingerprint, not data.tokenizer's string: a moved copy is the same tokenizer. Checkpoints from
    # before tokenizers were recorded are bytes. Refused even with allow_data_change: the ids would mean other text.
    trained_with = meta.get("tokenizer") or {"kind": "byte", "fingerprint": "byte"}
    if trained_with["fingerprint"] != tok.fingerprint:
      raise UserError(f"the checkpoint at step {step} in {ckpt.directory} was trained with the {trained_with['kind']} "
                      f"tokenizer {trained_with['fingerprint'][:12]}, this run has the {tok.kind} tokenizer "
                      f"{tok.fingerprint[:12]} (data.tokenizer={cfg.data.tokenizer!r}); resume with "
                      f"--config.data.tokenizer={workdir / data.tokenizer.WORKDIR_SUBDIR} (the run's copy), or "
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
    # WORKDIR/tokenizer/: generate, export and resume find the run's tokenizer here without a flag.
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
    flops_per_token = perf.model_flops(cfg, layout.table)
    peak, peak_source = perf.device_peak(mesh, cfg.model.dtype)
    log(f"model FLOPs per token {flops_per_token:,.0f}; peak {peak / 1e9:,.1f} GFLOP/s per device ({peak_source})")
    eval_fn = eval_future.result() if eval_future else None
    if init_future:
      state, start = init_future.result(), 0
      log(f"initialised {sum(r.size for r in layout.table):,} parameters" if init is None else
          f"initialised from {init.workdir / 'checkpoints' / str(init.step)}: parameters only (fresh optimizer "
          f"state, step 0)")
    else:
      log(f"resumed from {ckpt.directory / str(start)}")

  # Bytes each id stands for: bits per byte = loss / bytes / ln 2 compares runs with different tokenizers.
  token_bytes = layout.token_bytes_table(tok.token_bytes()) if eval_src is not None else None

  def evaluate(params, at_step):
    sums = None
    for i in range(cfg.eval_batches):
      watchdog.beat(at_step, f"evaluation batch {i}")
      out = eval_fn(params, data.global_batch(eval_src, i, layout.micro_batch, layout.batch_sharding), token_bytes)
      sums = out if sums is None else jax.tree.map(jnp.add, sums, out)
    sums = jax.device_get(sums)
    record = {"step": at_step, "eval_loss": float(sums["loss_sum"] / sums["tokens"])}
    if sums["bytes"] > 0 and cfg.data.name != "synthetic":
      record["eval_bits_per_byte"] = float(sums["loss_sum"] / sums["bytes"] / math.log(2))
    return record

  def save(at_step):
    if cfg.nonfinite == "stop":  # a save is a sync point anyway: never keep a run that should have stopped
      check_finite(jax.device_get({k: getattr(state, k) for k in ("nonfinite_steps", "last_nonfinite_step")}))
    watchdog.beat(at_step, "saving a checkpoint")
    ckpt.save(at_step, state, {"config": cfg.to_dict(), "layer_order": layout.layer_order,
                               "data": {"next_step": at_step, "seed": cfg.seed, "batch_size": cfg.batch_size,
                                        "name": cfg.data.name},
                               "tokenizer": tok.describe(),
                               **({"init_from": init_record} if init_record else {})})

  seen_nonfinite = int(jax.device_get(state.nonfinite_steps))

  def check_finite(metrics):
    if int(metrics["nonfinite_steps"]) > seen_nonfinite and cfg.nonfinite == "stop":
      raise RunAborted(f"the loss or gradients of step {int(metrics['last_nonfinite_step'])} are not finite; the "
                       f"update was dropped and nothing after it was saved (latest checkpoint: "
                       f"{ckpt.latest_step()}). Lower the learning rate or rerun with --config.nonfinite=skip to skip "
                       f"such steps")

  # --- The loop. The host only waits for the device when metrics are due, and then for the previous step. ---
  writer = MetricsWriter(workdir, cfg.steps, start, enabled=is_main)
  batches = data.Batches(train_src, start, cfg.batch_size, layout.batch_sharding)
  watchdog = Watchdog(cfg.watchdog_s, workdir, jax.process_index())
  profiler = StepProfiler(cfg.profile_steps, workdir, enabled=is_main)
  pending = None                                  # (step, metrics on device) to fetch after the next dispatch
  # The host runs at most two steps ahead of the devices: enough to keep them fed, and it bounds the queue (on
  # the CPU backend an unbounded queue of steps with collectives can starve its thread pool into a deadlock).
  in_flight = collections.deque()
  # `excluded` (eval, checkpoints, profiling) is kept out of step times; `loop` times the steps after the first.
  clock = {"t": time.perf_counter(), "step": start, "excluded": 0.0, "loop_t": None, "loop_excluded": 0.0}
  timing = {"compile_s": compile_s}

  def emit(done, metrics):
    watchdog.beat(done, f"waiting for step {done}")
    metrics = jax.device_get(metrics)
    check_finite(metrics)
    now = time.perf_counter()
    seconds = (now - clock["t"] - clock["excluded"]) / max(done - clock["step"], 1)
    clock.update(t=now, step=done, excluded=0.0)
    tokens_per_sec = cfg.batch_size * cfg.seq_len / seconds
    record = {"step": done, "loss": float(metrics["loss"]), "learning_rate": float(metrics["learning_rate"]),
              "grad_norm": float(metrics["grad_norm"]), "step_time_s": seconds, "tokens_per_sec": tokens_per_sec,
              "mfu": flops_per_token * tokens_per_sec / (peak * mesh.size)}
    if metrics["nonfinite_steps"]:
      record["skipped_steps"] = int(metrics["nonfinite_steps"])
    if done == start + 1:  # the first step's time is mostly the first dispatch: start-up is the useful number
      since_start = perf.seconds_since_process_start()
      timing["startup_s"] = record["startup_s"] = since_start if since_start is not None else now - _IMPORTED
      writer.print(f"start-up: first step done {timing['startup_s']:.1f}s after the process started "
                   f"(compile {compile_s:.1f}s)")
      clock.update(loop_t=now, loop_excluded=0.0)
    writer.write(record)

  if init is not None and eval_src is not None:  # the baseline a fine-tuning run's evaluations compare to
    t_pause = time.perf_counter()
    record = evaluate(state.params, 0)
    writer.write(record)
    writer.print(f"step 0 (init_from): eval loss {record['eval_loss']:.4f}")
    clock["excluded"] += time.perf_counter() - t_pause  # not part of the first step's time
  preemption.start_loop(distributed=jax.process_count() > 1)
  try:
    for done in range(start + 1, cfg.steps + 1):
      watchdog.beat(done, "loading data")
      _, batch = next(batches)
      watchdog.beat(done, "dispatching the step")
      profiler.before(done)
      state, metrics = train_fn(state, batch)
      in_flight.append(metrics["loss"])
      if len(in_flight) > 2:
        in_flight.popleft().block_until_ready()
      if preemption.reached(done):
        if pending:
          emit(*pending)
        emit(done, metrics)  # the log ends with the step the checkpoint holds
        save(done)
        ckpt.wait()
        writer.print(f"preempted: saved step {done} to {ckpt.directory / str(done)}; rerun the same command to resume")
        return timing
      if pending:
        emit(*pending)
        pending = None
      if line := profiler.after(done, state):  # after the emit above, so the wait counts towards this step
        clock["excluded"] += profiler.write_s  # writing the trace is not step time
        clock["loop_excluded"] += profiler.write_s
        writer.print(line)
      if done % cfg.log_every == 0 or done in (start + 1, cfg.steps):  # the first step shows the starting loss
        pending = (done, metrics)
      writer.advance(done)
      eval_due = eval_src is not None and (done % cfg.eval_every == 0 or done == cfg.steps)
      save_due = (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == cfg.steps
      if eval_due or save_due:
        if pending:  # keep the log in step order
          emit(*pending)
          pending = None
        t_pause = time.perf_counter()  # eval and save time is kept out of step_time_s
        if eval_due:
          record = evaluate(state.params, done)
          writer.write(record)
          writer.print(f"step {done}: eval loss {record['eval_loss']:.4f}"
                       + (f", {record['eval_bits_per_byte']:.3f} bits/byte" if "eval_bits_per_byte" in record else ""))
        if save_due:
          save(done)
        clock["excluded"] += time.perf_counter() - t_pause
        clock["loop_excluded"] += time.perf_counter() - t_pause
    if pending:
      emit(*pending)
    if clock["loop_t"] is not None and cfg.steps > start + 1:
      jax.block_until_ready(state)
      timing.update(loop_s=time.perf_counter() - clock["loop_t"] - clock["loop_excluded"],
                    loop_steps=cfg.steps - start - 1)
      log(f"loop: {timing['loop_steps']} steps after the first in {timing['loop_s']:.2f}s "
          f"({timing['loop_s'] / timing['loop_steps']:.4f} s/step, evaluation and checkpoints excluded)")
    watchdog.beat(cfg.steps, "committing the last checkpoint")
    ckpt.wait()
  finally:
    profiler.close()
    watchdog.close()
    batches.close()
    try:
      ckpt.wait()   # an async save in flight is committed (or fails) before the process exits
    finally:
      ckpt.close()
      writer.close()
  log(f"done: step {cfg.steps}; checkpoints in {ckpt.directory}; metrics in {writer.path}")
  return timing


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
  sys.exit(main())
