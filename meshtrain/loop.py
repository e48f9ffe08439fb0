"""The train loop as a library: what `python -m meshtrain.train` (and bench's --loop) runs.

`run` starts the runtime and holds the workdir's lock around `train`, which reads as a run goes: the data, the
layout and the checkpoint to resume (every user mistake surfaces there, before any compile), the compiled steps,
the hooks (meshtrain/hooks.py), then `_loop`: load a batch, dispatch the step, call the hooks.
"""
import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import pathlib
import sys
import tempfile
import time

import jax

from meshtrain import data, hooks as hooks_lib, layout as layout_lib, mesh as mesh_lib, sharding
from meshtrain.checkpoint import Checkpointer, init_from, resume
from meshtrain.costs import perf
from meshtrain.metrics import MetricsWriter
from meshtrain.parallel.pipeline import bubble_fraction, pipeline_repeats
from meshtrain.profiling import StepProfiler
from meshtrain.runtime import startup, workdir as workdir_lib
from meshtrain.runtime.preemption import PreemptionNotice
from meshtrain.runtime.watchdog import Watchdog

_IMPORTED = time.perf_counter()  # the start-up clock's fallback where the process start time is unknown


def log(*args) -> None:
  """Prints on process 0 only, flushed (the launcher relays each line as it comes)."""
  if jax.process_index() == 0:
    print(*args, flush=True)


def run(cfg, workdir: pathlib.Path, hooks=(), preemption: PreemptionNotice | None = None) -> dict:
  """Trains to cfg.steps (resuming the workdir's checkpoints) and returns timing: compile and start-up seconds.

  `hooks` (meshtrain/hooks.py) run after the loop's own, e.g. bench's loop clock. `preemption` is the
  PreemptionNotice the command installed at its start (else one is installed here)."""
  if preemption is None:
    with PreemptionNotice() as notice:
      return run(cfg, workdir, hooks, notice)
  startup.start(cfg)  # XLA flags, CPU devices, distributed runtime: before JAX initialises its backends
  origin = resume.begin(cfg, workdir)  # before the lock: a refused run writes nothing there
  # Before anything reads or writes the workdir: a second run there is refused, the first one is left alone.
  with workdir_lib.exclusive(workdir, jax.process_index(), jax.process_count(), cfg.distributed.barrier_timeout_s):
    return train(cfg, workdir, origin, preemption, hooks)


def startup_clock() -> float:
  """Seconds since this process started (or, where unknown, since this module was imported)."""
  since_start = perf.seconds_since_process_start()
  return since_start if since_start is not None else time.perf_counter() - _IMPORTED


def train(cfg, workdir: pathlib.Path, origin: resume.Resume, preemption, extra_hooks) -> dict:
  """Trains to cfg.steps (resuming the workdir's checkpoints) and returns timing: compile and start-up seconds.

  Called by `run`, inside the runtime and the lock."""
  is_main = jax.process_index() == 0
  # --- Data, layout and the checkpoint to resume from: every user mistake surfaces here, before any compile. ---
  init = origin.init
  tok, train_src, eval_src = _data(cfg, init)
  # lm-evaluation-harness tasks during training: loaded now, so that a bad task name or data it would have to
  # download is refused before anything compiles.
  harness = hooks_lib.HarnessHook(cfg, tok) if cfg.task == "lm" and cfg.harness.tasks else None
  mesh, layout = _mesh_and_layout(cfg)
  # Each process got here at its own pace (data, tokenizer, tracing); Orbax's barriers are collectives: start together.
  startup.barrier("the checkpoint restore", cfg.distributed.barrier_timeout_s)
  ckpt = Checkpointer(workdir, cfg.checkpoint_keep, cfg.distributed.barrier_timeout_s)
  inputs = data.select.input_files(cfg)  # after _data: the conversion has hashed (and cached) every file
  start, state = origin.restore(ckpt, layout, tok, inputs, log)
  if start is not None and start >= cfg.steps:
    log(f"{ckpt.directory} already holds step {start} >= steps={cfg.steps}; nothing to do "
        f"(raise --config.steps to train further)")
    return {}
  if is_main:
    _write_run_files(cfg, workdir, tok)
  programs, initial_state = _compile(cfg, mesh, layout, init, fresh=start is None, with_eval=eval_src is not None)
  if start is None:
    state, start = initial_state, 0
    origin.started_fresh()
  else:
    log(f"resumed from {ckpt.directory / str(start)}")

  # --- The hooks: all periodic work of the loop (meshtrain/hooks.py). ---
  writer = MetricsWriter(workdir, cfg.steps, start, enabled=is_main)
  batches = data.Batches(train_src, start, cfg.batch_size, layout.batch_sharding)
  watchdog = Watchdog(cfg.watchdog_s, workdir, jax.process_index())
  profiler = StepProfiler(cfg.profile_steps, workdir, enabled=is_main)
  run = hooks_lib.Run(cfg, workdir, mesh, layout, writer, hooks_lib.Timer(start), watchdog, ckpt, start, state,
                      timing={"compile_s": programs.compile_s})
  if cfg.task == "lm" and (skipped := data.files.skipped_records(cfg)):
    run.first_record["data/skipped_records"] = skipped  # data.skip_bad_records=true: what the conversion left out
  run.metrics_log = hooks_lib.MetricsLog(run, programs.flops_per_example, programs.peak, startup_clock)
  evaluate = None
  if eval_src is not None:
    # The task's extra eval input, e.g. the bytes each id stands for: bits per byte compares tokenizers.
    evaluate = hooks_lib.Evaluate(cfg.eval_every, programs.eval_fn, eval_src, layout.eval_extra(tok))
  hooks = hooks_lib.for_loop(run, preemption, profiler, evaluate, origin.checkpoint_meta(layout, tok, inputs),
                             [*([harness] if harness else []), *extra_hooks])
  if init is not None and evaluate is not None:
    evaluate.baseline(run)
  # Compile and restore times differ between processes; the first step's collectives must not wait 30 s for a peer.
  startup.barrier("the first step", cfg.distributed.barrier_timeout_s)
  preemption.start_loop(distributed=jax.process_count() > 1)
  try:
    _loop(run, programs.train_fn, batches, hooks)
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


def _data(cfg, init: init_from.Source | None):
  """(tokenizer or None, train source, eval source or None). The data first: a split too short for seq_len is named
  as such, before any model-sized buffer exists. The tokenizer before the data (a bpe:N one is trained here on
  first use), and the model checked against it."""
  tok = data.tokenizer_for_config(cfg) if cfg.task == "lm" else None  # other tasks read no text
  if init is not None and tok is not None:
    init_from.check_tokenizer(init, tok, cfg.data.tokenizer)
  if tok is not None and (cfg.data.name != "synthetic" or tok.kind != "byte"):  # synthetic ids: below vocab_size
    data.select.check_vocab(cfg, tok)
  train_src = data.make_source(cfg, cfg.data.train_split, shuffle=True, tok=tok)
  eval_src = data.make_source(cfg, cfg.data.eval_split, shuffle=False, tok=tok) if cfg.eval_every else None
  return tok, train_src, eval_src


def _mesh_and_layout(cfg):
  """The mesh and the layout of the train state on it, logged; a state that cannot fit is refused in seconds,
  before anything is restored or initialised, not after an OOM."""
  mesh = mesh_lib.make_mesh(cfg.mesh)
  layout = layout_lib.build(cfg, mesh)
  log(f"mesh: {mesh_lib.describe(mesh)}; sharding rules: {cfg.sharding.rules}")
  log(sharding.format_table(layout.table))
  layout_lib.check_fits(layout.state_bytes_per_device(), "the train state (parameters and optimizer state)", mesh)
  if (stages := mesh.shape["stage"]) > 1:
    log(f"pipeline: {stages} stages, {cfg.pipeline.microbatches} micro-batches, {cfg.pipeline.schedule} schedule; "
        f"bubble {bubble_fraction(stages, cfg.pipeline.microbatches, pipeline_repeats(cfg, stages)):.1%} of each "
        "step idle")
  return mesh, layout


def _write_run_files(cfg, workdir: pathlib.Path, tok) -> None:
  """WORKDIR/config.json, written whole or not at all (a signal during start-up ends the process wherever it is),
  and WORKDIR/tokenizer/, where generate, export and resume find the run's tokenizer."""
  (workdir / "config.json.tmp").write_text(json.dumps(cfg.to_dict(), indent=2))
  (workdir / "config.json.tmp").replace(workdir / "config.json")
  if tok is not None:
    data.tokenization.save_to_workdir(tok, workdir)


@dataclasses.dataclass(frozen=True)
class Programs:
  """The compiled steps, and the model FLOPs and device peak the metrics' MFU is computed from."""
  train_fn: object
  eval_fn: object | None      # None without eval_every
  compile_s: float            # the train step's compile time
  flops_per_example: float
  peak: float                 # FLOP/s per device


def _compile(cfg, mesh, layout, init, fresh: bool, with_eval: bool) -> tuple[Programs, object]:
  """(programs, the initial state or None when resuming). The train step, the eval step and a fresh run's initial
  state (init_from's parameters, or initialised) are compiled on two threads: XLA compiles without holding the
  GIL, so start-up waits for the longest compile rather than the sum, and the main thread only waits on futures,
  where a signal is handled at once."""
  log("compiling the train step" + (", the eval step" if with_eval else "")
      + (" and the initial state" if fresh else ""))
  with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="compile") as pool:
    train_future = pool.submit(timed, layout.compile_train_step)
    eval_future = pool.submit(layout.compile_eval_step) if with_eval else None
    init_future = None
    if fresh:
      init_future = pool.submit(init_from.initial_state, layout, init) if init else pool.submit(layout.init, cfg.seed)
    train_fn, compile_s = train_future.result()
    log(f"train step compiled in {compile_s:.1f}s; {compiled_summary(train_fn)}")
    layout_lib.check_fits(layout_lib.compiled_bytes(train_fn), "the compiled train step", mesh)
    flops_per_example, peak = _model_flops(cfg, mesh, layout)
    programs = Programs(train_fn, eval_future.result() if eval_future else None, compile_s, flops_per_example, peak)
    if not init_future:
      return programs, None
    state = init_future.result()
    log(f"initialised {sum(r.size for r in layout.table):,} parameters" if init is None else
        f"initialised from {init.workdir / 'checkpoints' / str(init.step)}: parameters only (fresh optimizer "
        f"state, step 0)")
    return programs, state


def _model_flops(cfg, mesh, layout) -> tuple[float, float]:
  """(model FLOPs per example, peak FLOP/s per device), logged: what MFU divides."""
  task = layout.task
  flops_per_example = task.flops_per_example(layout.table)
  peak, peak_source = perf.device_peak(mesh, cfg.model.dtype)
  unit = task.throughput_key.removesuffix("_per_sec").removesuffix("s")  # "token", "image"
  log(f"model FLOPs per {unit} {flops_per_example / task.units_per_example:,.0f}; peak {peak / 1e9:,.1f} GFLOP/s "
      f"per device ({peak_source})")
  return flops_per_example, peak


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


def efficiency(cfg, steps: int, step_s: float) -> dict:
  """Bench's `--loop`: runs the train loop itself for `steps` steps in a temporary workdir and compares its wall time
  with `step_s` x steps."""
  cfg = cfg.copy_and_resolve_references()
  cfg.unlock()
  cfg.update(steps=steps, eval_every=0, checkpoint_every=0, log_every=max(1, steps // 5), profile_steps="")
  clock = hooks_lib.LoopClock()
  # The loop's own log goes to stderr, so --json output stays one object on stdout.
  with tempfile.TemporaryDirectory(prefix="meshtrain-bench-") as workdir, contextlib.redirect_stdout(sys.stderr):
    run(cfg, pathlib.Path(workdir), hooks=[clock])
  loop_step_s = clock.seconds / clock.steps
  return {"loop_step_time_s": loop_step_s, "loop_efficiency": loop_step_s / step_s, "loop_steps": clock.steps}
