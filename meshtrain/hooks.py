"""The train loop's periodic work, as hook objects, and the timer that keeps paused work out of step time.

The loop (meshtrain/loop.py `_loop`) only loads batches and dispatches steps; everything else is a hook, called
in list order (Levanter's hooks, nanodo's periodic actions). The protocol:

  class Hook:
    def before(self, step, run): ...   before step `step` is dispatched (its batch is loaded)
    def after(self, step, run): ...    after it was dispatched: run.state and run.metrics are its outputs, still on
                                       the devices (reading them waits for the step; the metrics hook reads each
                                       step's metrics one step late so the host never stalls the devices)
    def end(self, run): ...            after the last step of a run that reached cfg.steps (not when stopped)
    def close(self): ...               always, in the loop's `finally`, in reverse list order

Every method is optional (the `Hook` base does nothing). A hook that sets `run.stopped = True` in `after` ends
the loop after that step: the hooks after it in the list are not called for that step, `end` is not called.

`Periodic(every)` is the base of work at every `every`-th step and at the last step (every=0: the last step only):
its `run_at(step, run)` is called with the metrics due written first (metrics.jsonl stays in step order) and the
timer paused (its time is neither step time nor loop time). Evaluation, checkpoints and a task's own hooks
(`task.hooks(run)`, e.g. the DiT sample grid) are Periodic.

The loop's list (`for_loop`), in order: Preemption, MetricsLog, Heartbeat, ProfileWindow, Evaluate (with
eval_every), Checkpoint, then the task's (the image families' sample grids, the language model's harness tasks),
then those passed to `train.train(cfg, workdir, hooks=[...])` (bench's loop clock). Every process runs every hook:
work that calls compiled functions on sharded arrays must run on all processes alike; the writer writes on process
0 only.

`Run` is what hooks see: cfg, workdir, mesh, layout (layout.state_sharding.params, layout.batch_sharding), task,
writer (MetricsWriter: write, print, image), timer (Timer: paused(), exclude()), ckpt (Checkpointer), start
(the step the run resumed from, 0 when fresh), last_step (cfg.steps), state / params / metrics (current, on
device), timing (what train() returns), beat(step, what) (the hang watchdog's heartbeat, for long work), and
flush_metrics() (write the metrics due now).
"""
import contextlib
import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp

from meshtrain import data
from meshtrain.errors import RunAborted
from meshtrain.inference import dit_sampler, harness_tasks

# The train step's own metrics (meshtrain/step.py), besides the count named after the task's unit.
STEP_METRICS = ("loss", "grad_norm", "learning_rate", "nonfinite_steps", "last_nonfinite_step")


class Timer:
  """Wall time of the loop with paused work taken out (big_vision's chrono): evaluation, checkpoints and trace
  writing are kept out of step times and out of loop times."""

  def __init__(self, step: int):
    self.paused_s = 0.0             # every second paused since the loop started
    # When step_time last measured (a step's metrics were fetched), at which step and with how much paused so far.
    self.mark, self._mark_step, self.paused_at_mark = time.perf_counter(), step, 0.0

  @contextlib.contextmanager
  def paused(self):
    t0 = time.perf_counter()
    try:
      yield
    finally:
      self.exclude(time.perf_counter() - t0)

  def exclude(self, seconds: float) -> None:
    """Takes `seconds` (measured by the caller, e.g. a trace write) out of the running step time."""
    self.paused_s += seconds

  def step_time(self, step: int) -> float:
    """Seconds per step from the last call (or the loop's start) to now, paused time excluded; marks `step`."""
    now = time.perf_counter()
    seconds = (now - self.mark - (self.paused_s - self.paused_at_mark)) / max(step - self._mark_step, 1)
    self.mark, self._mark_step, self.paused_at_mark = now, step, self.paused_s
    return seconds


class Hook:
  """Does nothing at every point of the loop; subclasses override what they need (see the module docstring)."""

  def before(self, step: int, run: "Run") -> None:
    pass

  def after(self, step: int, run: "Run") -> None:
    pass

  def end(self, run: "Run") -> None:
    pass

  def close(self) -> None:
    pass


class Periodic(Hook):
  """Work at every `every`-th step and at the last step, after the metrics due, with the timer paused."""

  def __init__(self, every: int):
    self.every = every

  def due(self, step: int, run: "Run") -> bool:
    return bool(self.every and step % self.every == 0) or step == run.last_step

  def after(self, step: int, run: "Run") -> None:
    if self.due(step, run):
      run.flush_metrics()  # keep the log in step order
      with run.timer.paused():
        self.run_at(step, run)

  def run_at(self, step: int, run: "Run") -> None:
    raise NotImplementedError


@dataclasses.dataclass
class Run:
  """What the loop and its hooks share (see the module docstring)."""
  cfg: object
  workdir: object
  mesh: object
  layout: object
  writer: object
  timer: Timer
  watchdog: object
  ckpt: object
  start: int
  state: object
  metrics_log: "MetricsLog" = None
  metrics: dict | None = None
  timing: dict = dataclasses.field(default_factory=dict)
  stopped: bool = False
  first_record: dict = dataclasses.field(default_factory=dict)  # added to the first step's metrics (data notes)

  @property
  def task(self):
    return self.layout.task

  @property
  def params(self):
    return self.state.params

  @property
  def sample_params(self):
    """The weights samples are drawn with: the average of the parameters where the run keeps one (ema_decay)."""
    return self.state.params if self.state.ema_params is None else self.state.ema_params

  @property
  def last_step(self) -> int:
    return self.cfg.steps

  def beat(self, step: int, what: str) -> None:
    self.watchdog.beat(step, what)

  def flush_metrics(self) -> None:
    if self.metrics_log is not None:
      self.metrics_log.flush(self)


class Hooks:
  """A list of hooks called in order; `after` stops at a hook that stopped the run."""

  def __init__(self, hooks: list[Hook]):
    self.hooks = list(hooks)

  def before(self, step: int, run: Run) -> None:
    for hook in self.hooks:
      hook.before(step, run)

  def after(self, step: int, run: Run) -> None:
    for hook in self.hooks:
      hook.after(step, run)
      if run.stopped:
        return

  def end(self, run: Run) -> None:
    for hook in self.hooks:
      hook.end(run)

  def close(self) -> None:
    """Every hook's close, last first, each even when an earlier one raised (the first error is re-raised)."""
    error = None
    for hook in reversed(self.hooks):
      try:
        hook.close()
      except BaseException as e:  # pylint: disable=broad-except
        error = error or e
    if error is not None:
      raise error


class MetricsLog(Hook):
  """Training metrics in metrics.jsonl, fetched one step late: the host reads a step's metrics after dispatching
  the next one, so it never makes the devices wait. Also the non-finite check (stop, or count skipped steps),
  the first step's start-up record and the progress bar."""

  def __init__(self, run: Run, flops_per_example: float, peak: float, startup_clock):
    self.pending = None               # (step, metrics on device) to fetch after the next dispatch
    self.seen_nonfinite = int(jax.device_get(run.state.nonfinite_steps))
    self.flops_per_example, self.peak = flops_per_example, peak
    # () -> seconds since the process started, for the first step's start-up record
    self.startup_clock = startup_clock

  def after(self, step: int, run: Run) -> None:
    self.flush(run)
    if step % run.cfg.log_every == 0 or step in (run.start + 1, run.last_step):  # the first step: the starting loss
      self.pending = (step, run.metrics)
    run.writer.advance(step)

  def end(self, run: Run) -> None:
    self.flush(run)

  def flush(self, run: Run) -> None:
    if self.pending:
      self.emit(*self.pending, run)
      self.pending = None

  def check_finite(self, metrics: dict, run: Run) -> None:
    if int(metrics["nonfinite_steps"]) > self.seen_nonfinite and run.cfg.nonfinite == "stop":
      raise RunAborted(f"the loss or gradients of step {int(metrics['last_nonfinite_step'])} are not finite; the "
                       f"update was dropped and nothing after it was saved (latest checkpoint: "
                       f"{run.ckpt.latest_step()}). Lower the learning rate or rerun with --config.nonfinite=skip to "
                       f"skip such steps")

  def emit(self, step: int, metrics: dict, run: Run) -> None:
    run.beat(step, f"waiting for step {step}")
    metrics = jax.device_get(metrics)
    self.check_finite(metrics, run)
    seconds = run.timer.step_time(step)
    cfg, task = run.cfg, run.task
    examples_per_sec = cfg.batch_size / seconds
    record = {"step": step, "loss": float(metrics["loss"]), "learning_rate": float(metrics["learning_rate"]),
              "grad_norm": float(metrics["grad_norm"]), "step_time_s": seconds,
              task.throughput_key: cfg.batch_size * task.units_per_example / seconds,
              "mfu": self.flops_per_example * examples_per_sec / (self.peak * run.mesh.size)}
    # The loss's other scalars as they are (the LM's MoE router statistics, moe_*): the task's aux metrics.
    record.update({k: float(v) for k, v in metrics.items() if k not in STEP_METRICS
                   and k != task.throughput_key.removesuffix("_per_sec")})
    if metrics["nonfinite_steps"]:
      record["skipped_steps"] = int(metrics["nonfinite_steps"])
    if step == run.start + 1:  # the first step's time is mostly the first dispatch: start-up is the useful number
      run.timing["startup_s"] = record["startup_s"] = self.startup_clock()
      record.update(run.first_record)
      run.writer.print(f"start-up: first step done {run.timing['startup_s']:.1f}s after the process started "
                       f"(compile {run.timing['compile_s']:.1f}s)")
    run.writer.write(record)


class Heartbeat(Hook):
  """The hang watchdog's heartbeat before each dispatch (other work beats through run.beat); closes it."""

  def __init__(self, watchdog):
    self.watchdog = watchdog

  def before(self, step: int, run: Run) -> None:
    self.watchdog.beat(step, "dispatching the step")

  def close(self) -> None:
    self.watchdog.close()


class ProfileWindow(Hook):
  """`profile_steps=A-B`: a jax.profiler trace of steps A..B (meshtrain/profiling.py); writing it is paused time."""

  def __init__(self, profiler):
    self.profiler = profiler

  def before(self, step: int, run: Run) -> None:
    self.profiler.before(step)

  def after(self, step: int, run: Run) -> None:
    if line := self.profiler.after(step, run.state):  # the wait for the last step counts towards step time
      run.timer.exclude(self.profiler.write_s)        # writing the trace does not
      run.writer.print(line)

  def close(self) -> None:
    self.profiler.close()


class Evaluate(Periodic):
  """The task's eval sums over cfg.eval_batches micro-batch-sized batches of the eval split, at eval_every and at
  the end; the record (task.eval_record) goes to metrics.jsonl and one line to the log."""

  def __init__(self, every: int, eval_fn, source, extra):
    super().__init__(every)
    self.eval_fn, self.source, self.extra = eval_fn, source, extra

  def evaluate(self, step: int, run: Run) -> dict:
    layout, sums = run.layout, None
    for i in range(run.cfg.eval_batches):
      run.beat(step, f"evaluation batch {i}")
      out = self.eval_fn(run.params, data.global_batch(self.source, i, layout.micro_batch, layout.batch_sharding),
                         self.extra)
      sums = out if sums is None else jax.tree.map(jnp.add, sums, out)
    # Handed over as fetched (numpy scalars), so the task divides in the sums' own precision.
    return {"step": step, **run.task.eval_record(jax.device_get(sums))}

  def baseline(self, run: Run) -> None:
    """Step 0's evaluation, the baseline a fine-tuning run's evaluations compare to; not part of the first step's
    time."""
    with run.timer.paused():
      record = self.evaluate(0, run)
      run.writer.write(record)
      run.writer.print(f"step 0 (init_from): eval loss {record['eval_loss']:.4f}")

  def run_at(self, step: int, run: Run) -> None:
    record = self.evaluate(step, run)
    run.writer.write(record)
    message = getattr(run.task, "eval_message", None)
    run.writer.print(f"step {step}: " + (message(record) if message else f"eval loss {record['eval_loss']:.4f}"))


class Checkpoint(Periodic):
  """An async Orbax checkpoint at checkpoint_every and at the end, never of a run that should have stopped."""

  def __init__(self, every: int, meta: dict):
    super().__init__(every)
    self.meta = meta  # what every checkpoint's meta item holds besides the data position

  def run_at(self, step: int, run: Run) -> None:
    self.save(step, run)

  def save(self, step: int, run: Run) -> None:
    cfg = run.cfg
    if cfg.nonfinite == "stop":  # a save is a sync point anyway: never keep a run that should have stopped
      run.metrics_log.check_finite(
          jax.device_get({k: getattr(run.state, k) for k in ("nonfinite_steps", "last_nonfinite_step")}), run)
    run.beat(step, "saving a checkpoint")
    run.ckpt.save(step, run.state, {**self.meta, "data": {"next_step": step, "seed": cfg.seed,
                                                          "batch_size": cfg.batch_size, "name": cfg.data.name}})


class Preemption(Hook):
  """A preemption notice (SIGTERM, or a peer's) stops the run after the step it arrived in: its metrics are written,
  a checkpoint of it is saved and committed, and the loop returns (exit 0; rerunning the command resumes)."""

  def __init__(self, notice, checkpoint: Checkpoint):
    self.notice, self.checkpoint = notice, checkpoint

  def after(self, step: int, run: Run) -> None:
    if not self.notice.reached(step):
      return
    run.flush_metrics()
    run.metrics_log.emit(step, run.metrics, run)  # the log ends with the step the checkpoint holds
    self.checkpoint.save(step, run)
    run.ckpt.wait()
    run.writer.print(f"preempted: saved step {step} to {run.ckpt.directory / str(step)}; rerun the same command to "
                     "resume")
    run.stopped = True


class PromptSampleHook(Periodic):
  """At eval_every and at the end of a text-to-image run: sample.per_prompt pictures of each of sample.prompts (or,
  without them, of the first captions of the eval split), written to WORKDIR/samples/step_N.png and to TensorBoard
  as the image `samples`; on `shapes`, the judge's accuracy on held-out and seen captions to metrics.jsonl
  (sample_heldout_accuracy, sample_seen_accuracy and their colour and shape parts)."""

  def __init__(self, cfg):
    super().__init__(cfg.eval_every)
    self._sampler = self._captions = None
    self.prompts = [p.strip() for p in cfg.sample.prompts.split(";") if p.strip()] or eval_captions(cfg)

  def run_at(self, step: int, run) -> None:
    from meshtrain.inference import t2i_sampler  # Pillow: the GPU machines have none; only t2i runs get here
    s = run.cfg.sample
    run.beat(step, "sampling images")
    if self._sampler is None:
      self._sampler = t2i_sampler.Sampler(run.layout, s.steps, s.guidance)
    if self._captions is None:
      self._captions = data.images.Captions(run.cfg.model)
    texts, index = t2i_sampler.prompt_texts(self._captions, self.prompts, s.per_prompt)
    pictures = self._sampler(run.sample_params, texts, [s.seed] * len(index), index)  # every process: one program
    if jax.process_index() != 0:
      return
    path = pathlib.Path(run.workdir) / dit_sampler.SAMPLES_DIR / f"step_{step}.png"
    run.writer.image("samples", t2i_sampler.save_grid(path, pictures, self.prompts), step)
    scores = t2i_sampler.judged(run.cfg.data.name, pictures, self.prompts)
    if scores:
      run.writer.write({"step": step, **scores})
    run.writer.print(f"step {step}: samples of {len(self.prompts)} prompts in {path}"
                     + (f"; {t2i_sampler.judged_line(scores)}" if scores else ""))


class HarnessHook(Periodic):
  """task=lm with harness.tasks: lm-evaluation-harness's tasks on the run's current parameters, on its own mesh
  (meshtrain/inference/harness.py's MeshLM over a Generator of them), at harness.every (default eval_every) and at
  the end; every metric to metrics.jsonl and TensorBoard as harness/TASK/METRIC. The tasks and their data are
  loaded when the hook is made, before anything is compiled: an unknown task, or one whose data would have to be
  downloaded, is a UserError then."""

  def __init__(self, cfg, tokenizer):
    super().__init__(cfg.harness.every or cfg.eval_every)
    self.names = [t.strip() for t in cfg.harness.tasks.split(",") if t.strip()]
    self.manager = harness_tasks.load(self.names, cfg.harness.include_path or None, "harness.tasks")
    self.tokenizer = tokenizer
    self.lm = None  # made at the first evaluation, then given each evaluation's parameters (its programs stay)

  def run_at(self, step: int, run) -> None:
    # lm_eval (the eval extra) through harness: only runs with harness.tasks get here
    from meshtrain.inference import generator, harness  # pylint: disable=g-import-not-at-top
    run.beat(step, "lm-evaluation-harness tasks")
    h = run.cfg.harness
    if self.lm is None:
      gen = generator.Generator(run.params, run.cfg.model, tokenizer=self.tokenizer, mesh=run.mesh,
                                rules=run.layout.rules, max_len=run.cfg.seq_len)
      self.lm = harness.MeshLM(gen, h.batch_size)
    else:
      self.lm.gen.params = self.lm.gen.place_params(run.params)
    results = harness.evaluate(self.lm, self.names, self.manager, h.limit or None,
                               None if h.num_fewshot < 0 else h.num_fewshot, bootstrap_iters=0, verbosity="WARNING")
    record = harness_tasks.metrics(results)
    run.writer.write({"step": step, **record})
    run.writer.print(f"step {step}: " + ", ".join(f"{k.removeprefix('harness/')} {v:.4g}" for k, v in record.items()))


def eval_captions(cfg, count: int = 4) -> list[str]:
  """The first `count` distinct captions of the eval split, decoded from its caption ids."""
  source = data.make_source(cfg, cfg.data.eval_split, shuffle=False)
  found = []
  for i in range(min(64, source.num_examples or 64)):
    ids = source.example(i)[1]
    text = bytes((ids[ids > 0] - 1).astype("uint8").tolist()).decode("utf-8", "replace")
    if text not in found:
      found.append(text)
    if len(found) == count:
      break
  return found


def for_loop(run: Run, notice, profiler, evaluate: Evaluate | None, checkpoint_meta: dict, extra=()) -> Hooks:
  """The loop's hooks in their order (see the module docstring): Preemption saves through the same Checkpoint hook,
  `run.metrics_log` (set before) writes the metrics, `notice` is the PreemptionNotice, `profiler` the StepProfiler,
  `checkpoint_meta` what every checkpoint's meta item holds besides the data position, `extra` the caller's."""
  save = Checkpoint(run.cfg.checkpoint_every, checkpoint_meta)
  # The image families' own periodic work: a sample grid (and, on digits, its quality) at eval_every.
  sample_hooks = {"dit": SampleHook, "t2i": PromptSampleHook}
  task_hooks = [sample_hooks[run.cfg.task](run.cfg)] if run.cfg.task in sample_hooks and run.cfg.eval_every else []
  return Hooks([Preemption(notice, save), run.metrics_log, Heartbeat(run.watchdog), ProfileWindow(profiler),
                *([evaluate] if evaluate else []), save, *task_hooks, *extra])


class LoopClock(Hook):
  """Bench's hook (`python -m meshtrain.bench --loop`): times the loop from the moment the first step's metrics are
  fetched (start-up and the first dispatch are behind it) to the end, every step's result on the devices, the
  loop's paused time (evaluation, checkpoints, trace writing) excluded."""

  def __init__(self):
    self.t0 = self.paused0 = self.first = None
    self.seconds, self.steps = None, 0

  def after(self, step, run):
    # Called after the metrics hook: at the second step it has fetched the first step's metrics. The clock starts
    # at the timer's mark of that fetch, not now: what the loop did since (the first metrics record's writing, with
    # its lazy imports) is in the next step's time, and must be in the loop's time too.
    if step == run.start + 2:
      self.t0, self.paused0, self.first = run.timer.mark, run.timer.paused_at_mark, step - 1

  def end(self, run):
    if self.t0 is None:
      return
    jax.block_until_ready(run.state)
    self.seconds = time.perf_counter() - self.t0 - (run.timer.paused_s - self.paused0)
    self.steps = run.last_step - self.first
    run.writer.print(f"loop: {self.steps} steps after the first in {self.seconds:.2f}s "
                     f"({self.seconds / self.steps:.4f} s/step, evaluation and checkpoints excluded)")


class SampleHook(Periodic):
  """At eval_every and at the end of a DiT run: sample.per_class images of every class with the run's `sample`
  settings, write WORKDIR/samples/step_N.png and the TensorBoard image `samples`, and on digits log sample_accuracy
  and sample_frechet (meshtrain/inference/quality.py) to metrics.jsonl. In the loop's list of a DiT run (`for_loop`)."""

  def __init__(self, cfg):
    super().__init__(cfg.eval_every)
    self._sampler = None
    self._judge = None
    self._warned = False

  def run_at(self, step: int, run) -> None:
    cfg, s = run.cfg, run.cfg.sample
    run.beat(step, "sampling images")
    if self._sampler is None:
      self._sampler = dit_sampler.Sampler(run.layout, s.steps, s.guidance)
    labels, index = dit_sampler.class_labels(range(cfg.model.num_classes), s.per_class)
    images = self._sampler(run.sample_params, labels, index, s.seed)  # every process: one program over the mesh
    if jax.process_index() != 0:
      return
    path = pathlib.Path(run.workdir) / dit_sampler.SAMPLES_DIR / f"step_{step}.png"
    try:
      grid = dit_sampler.save_grid(path, images, labels)
      run.writer.image("samples", grid, step)
    except ImportError as e:  # e.g. the GPU machines carry no pillow: the run goes on without pictures
      if not self._warned:
        run.writer.print(f"step {step}: no sample grid ({e}); pip install pillow to get one")
      self._warned, path = True, None
    if self._judge is None:
      self._judge = dit_sampler.judge_for(cfg.data.name, images.shape[1:]) or False
    if self._judge:
      scores = self._judge.score(images, labels)
      run.writer.write({"step": step, **scores})
      run.writer.print(f"step {step}: sample accuracy {scores['sample_accuracy']:.3f}, Frechet distance "
                       f"{scores['sample_frechet']:.2f}" + (f" ({path})" if path else ""))
    elif path:
      run.writer.print(f"step {step}: samples in {path}")
