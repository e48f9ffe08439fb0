"""The commands that read a run hold the trainer's line (issue 29): the wrong tokenizer, another task, a live run's
retention, oversized values, stray bytes, Ctrl-C, Orbax's late noise. Each: one `error:` line and exit 2 (or a
correct result), nothing written into the run that is read, no hang."""
import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
import xla_fast

from meshtrain import checkpoint, config as config_lib, layout as layout_lib, mesh as mesh_lib
from meshtrain.checkpoint import init_from, reader
from meshtrain.cli import convert, generate, sample, train
from meshtrain.errors import UserError
from meshtrain.interop import hf_tokenizer

pytestmark = pytest.mark.slow  # real training runs and subprocesses: the full suite (CI's first Python) runs them

REPO = pathlib.Path(__file__).resolve().parents[1]
TRAIN = ["--config", "configs/tiny.py", "--config.steps=2", "--config.seq_len=32", "--config.batch_size=8",
         "--config.eval_every=0", "--config.log_every=1", "--config.checkpoint_every=1", "--config.checkpoint_keep=2",
         "--config.optimizer.warmup_steps=1", "--config.model.num_layers=2", "--config.cpu_devices=1",
         "--config.mesh.data=1"]
# The same run inside this process, on the 8 CPU devices the test process has (conftest.py).
IN_PROCESS = [a for a in TRAIN if not a.startswith(("--config.cpu_devices=", "--config.mesh.data="))]
# A DiT small enough to sample in seconds.
DIT_MODEL = ["--config.model.d_model=32", "--config.model.num_layers=1", "--config.model.num_heads=2",
             "--config.model.mlp_dim=64"]


def snapshot(directory: pathlib.Path) -> dict[str, str]:
  return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
          for p in sorted(directory.rglob("*")) if p.is_file()}


def run_module(module, *args, timeout=300):
  return subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, capture_output=True, text=True,
                        timeout=timeout, env=xla_fast.env())


def one_line(proc_or_err, *needles, code=2):
  err = proc_or_err if isinstance(proc_or_err, str) else proc_or_err.stderr
  if not isinstance(proc_or_err, str):
    assert proc_or_err.returncode == code, err[-3000:]
  assert err.startswith("error: ") and err.count("\n") == 1, err[-3000:]
  for needle in needles:
    assert needle in err, err


def retention(w):
  """A stand-in for _ParamsSource.restore that deletes the step it is about to read the first time (a live run's
  retention striking mid-read), and the steps it was called for."""
  original, calls = reader._ParamsSource.restore, []

  def restore(self, *args, **kwargs):
    if not calls:
      shutil.rmtree(w / "checkpoints" / str(self.step))
    calls.append(self.step)
    return original(self, *args, **kwargs)
  return restore, calls


def untouched_but_step_2(w, before):
  return snapshot(w) == {k: v for k, v in before.items() if not k.startswith("checkpoints/2/")}


def tuning(run) -> list[str]:
  """The flags of a run fine-tuning `run` in this process: its model and its tokenizer."""
  return [*IN_PROCESS, f"--config.data.tokenizer={run.parent / 'tok' / 'tokenizer.json'}"]


def fine_tuning(run, *overrides):
  """(config, layout) of a run fine-tuning `run`, on this process's devices."""
  cfg = config_lib.load("configs/tiny.py", [*tuning(run)[2:], *overrides])
  return cfg, layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A 2-step tiny run (checkpoints 1 and 2) trained with a tokenizer.json (byte-level, as its own file)."""
  root = tmp_path_factory.mktemp("readers")
  (root / "tok").mkdir()
  (root / "tok" / "tokenizer.json").write_text(hf_tokenizer.byte_tokenizer_json())
  done = run_module("meshtrain.train", *TRAIN, f"--config.data.tokenizer={root / 'tok' / 'tokenizer.json'}",
                    "--workdir", root / "run")
  assert done.returncode == 0, done.stderr[-3000:]
  assert checkpoint.checkpoint_steps(root / "run") == [1, 2]
  return root / "run"


@pytest.fixture(scope="module")
def dit(tmp_path_factory):
  """A DiT workdir with checkpoints 1 and 2 of a small model's parameters, zeros (the refusals look at its meta item
  only; sample reads the parameters, whatever their values)."""
  workdir = tmp_path_factory.mktemp("dit") / "w"
  cfg = config_lib.load("configs/dit_digits.py", DIT_MODEL)
  abstract = layout_lib.build(cfg, mesh_lib.make_mesh(cfg.mesh)).state_abstract.params
  params = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract)
  ckpt = checkpoint.Checkpointer(workdir, keep=2)
  for step in (1, 2):
    ckpt.save(step, {"params": params}, {"config": cfg.to_dict(), "params_only": True, "task": "dit"})
  ckpt.wait()
  ckpt.close()
  return workdir


def test_generate_refuses_a_tokenizer_the_run_was_not_trained_with(run, tmp_path):
  w = tmp_path / "w"
  shutil.copytree(run, w)
  other = json.loads((w / "tokenizer" / "tokenizer.json").read_text())
  other["added_tokens"] = other["added_tokens"][:-1]  # still valid, another file: another fingerprint
  (w / "tokenizer" / "tokenizer.json").write_text(json.dumps(other))
  before = snapshot(w)
  one_line(run_module("meshtrain.generate", "--workdir", w, "--prompt", "def", "--max-new-tokens", 2),
           "trained with the hf tokenizer", "restore the run's own tokenizer files")
  assert snapshot(w) == before


def test_readers_write_nothing_into_the_run(run, tmp_path):
  w = tmp_path / "w"
  shutil.copytree(run, w)
  before = snapshot(w)
  done = run_module("meshtrain.generate", "--workdir", w, "--prompt", "def", "--max-new-tokens", 2, "--json")
  assert done.returncode == 0, done.stderr[-3000:]
  assert convert.main(["to-hf", "--workdir", str(w), "--out", str(tmp_path / "hf")]) == 0
  assert snapshot(w) == before


def test_a_step_deleted_while_read_reads_the_newest_again(run, tmp_path, monkeypatch):
  """A live run's retention deletes the step a reader is reading: load_params and to-hf read the step that is there
  now, and write nothing into the run; with --step given it is one line naming what happened."""
  w = tmp_path / "w"
  shutil.copytree(run, w)
  before = snapshot(w)
  restore, calls = retention(w)
  monkeypatch.setattr(reader._ParamsSource, "restore", restore)
  params, meta = checkpoint.load_params(w)
  assert calls[0] == 2 and calls[-1] == 1 and checkpoint.checkpoint_steps(w) == [1]
  assert untouched_but_step_2(w, before)

  shutil.rmtree(w)
  shutil.copytree(run, w)
  before = snapshot(w)
  restore, calls = retention(w)
  monkeypatch.setattr(reader._ParamsSource, "restore", restore)
  assert convert.main(["to-hf", "--workdir", str(w), "--out", str(tmp_path / "hf")]) == 0
  assert calls[0] == 2 and calls[-1] == 1 and (tmp_path / "hf" / "model.safetensors").is_file()
  assert untouched_but_step_2(w, before) and not list(tmp_path.glob(".hf.partial-*"))

  shutil.rmtree(w)
  shutil.copytree(run, w)
  restore, calls = retention(w)
  monkeypatch.setattr(reader._ParamsSource, "restore", restore)
  with pytest.raises(checkpoint.StepVanished, match="deleted while it was read"):
    checkpoint.load_params(w, step=2)

  # With several processes none reads another step on its own: its parameters would mix two checkpoints' shards.
  tried = []

  def vanishing(step):
    tried.append(step)
    raise checkpoint.StepVanished(2, w)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(checkpoint.StepVanished):
    checkpoint.retrying(vanishing, None)
  assert tried == [None]  # not tried again


def test_sample_reads_the_newest_step_when_its_own_is_deleted(dit, tmp_path, monkeypatch, capsys):
  """sample picks the newest step to read its config before JAX starts; deleted by the run's retention by the time
  its parameters are read, the newest step there is then is sampled and named. A --step asked for: one line."""
  w = tmp_path / "w"
  shutil.copytree(dit, w)
  before = snapshot(w)
  restore, calls = retention(w)
  monkeypatch.setattr(reader._ParamsSource, "restore", restore)
  argv = ["--workdir", str(w), "--classes", "0", "--per-class", "1", "--steps", "1", "--config.cpu_devices=8"]
  assert sample.main([*argv, "--out", str(tmp_path / "g.png")]) == 0
  assert calls == [2, 1] and capsys.readouterr().out.startswith("step 1: 1 samples")
  assert untouched_but_step_2(w, before)

  shutil.rmtree(w)
  shutil.copytree(dit, w)
  restore, calls = retention(w)
  monkeypatch.setattr(reader._ParamsSource, "restore", restore)
  assert sample.main([*argv, "--step", "2", "--out", str(tmp_path / "g2.png")]) == 2
  one_line(capsys.readouterr().err, "step 2", "deleted while it was read", "pass a --step the run keeps")
  assert calls == [2] and not (tmp_path / "g2.png").exists()


def test_a_server_starts_on_the_newest_step_when_its_own_is_deleted(run, tmp_path, monkeypatch):
  """serve picks the newest step to read its config before JAX starts; deleted by the run's retention by the time
  its parameters are read, the engine serves and follows the newest step there is then. A step asked for (serve
  --step): a one-line error."""
  from meshtrain.cli import serve
  from meshtrain.inference import serving
  from meshtrain.inference.generator import Generator
  w = tmp_path / "w"
  shutil.copytree(run, w)
  restore, calls = retention(w)
  monkeypatch.setattr(reader._ParamsSource, "restore", restore)
  args, cfg, workdir, picked = serve.parse_args(["--workdir", str(w), "--slots", "1"])
  engine = serving.language_engine(workdir, cfg, args)
  assert picked == 2 and calls == [2, 1] and engine.step_served == engine.live.step == 1
  shutil.rmtree(w)
  shutil.copytree(run, w)
  restore, calls = retention(w)
  monkeypatch.setattr(reader._ParamsSource, "restore", restore)
  with pytest.raises(UserError, match="deleted while it was read"):
    Generator.from_workdir(w, 2)
  assert calls == [2]


def test_init_from_reads_the_newest_step_when_its_own_is_deleted(run, tmp_path, monkeypatch, capsys):
  """init_from=W resolves W's newest step before the run compiles; deleted by W's retention while its parameters
  are read, the run starts from the newest step there is then, and records and logs that one; nothing is written
  into W. init_from=W/checkpoints/2 deleted the same way: one line."""
  w = tmp_path / "w"
  shutil.copytree(run, w)
  before = snapshot(w)
  restore, calls = retention(w)
  monkeypatch.setattr(reader._ParamsSource, "restore", restore)
  ft = tmp_path / "ft"
  assert train.main([*tuning(run), "--config.steps=1", f"--config.init_from={w}", "--workdir", str(ft)]) == 0
  assert calls == [2, 1] and f"initialised from {w / 'checkpoints' / '1'}: parameters only" in capsys.readouterr().out
  recorded = checkpoint.run_meta(str(ft), 1, "a run")[1]["init_from"]
  assert recorded == {"workdir": str(w), "step": 1, "params_only": False}
  assert untouched_but_step_2(w, before)

  shutil.rmtree(w)
  shutil.copytree(run, w)
  restore, calls = retention(w)
  monkeypatch.setattr(reader._ParamsSource, "restore", restore)
  cfg, layout = fine_tuning(run, f"--config.init_from={w / 'checkpoints' / '2'}")
  with pytest.raises(UserError, match=r"step 2 .* deleted while it was read .* a step it keeps \(steps 1\)") as e:
    init_from.initial_state(layout, init_from.resolve(cfg))
  assert "\n" not in str(e.value) and calls == [2]


def test_the_newest_step_deleted_before_it_is_read(run, tmp_path, monkeypatch):
  """Retention striking before the read begins: the step sample picked when it read the config is gone by the time
  it reads the parameters (the newest is read; a step asked for is refused); between listing the steps and reading
  the newest one's meta item, run_meta (generate, sample, serve) and init_from read the newest step there is then."""
  w = tmp_path / "w"
  shutil.copytree(run, w)
  shutil.rmtree(w / "checkpoints" / "2")
  assert checkpoint.read_params(w, 2, asked=False)[2] == 1
  with pytest.raises(UserError, match="no complete checkpoint at step 2"):
    checkpoint.read_params(w, 2, asked=True)
  listed, real = [], reader.checkpoint_steps

  def stale(workdir):  # the first listing, made while step 2 was still there
    listed.append(True)
    return [1, 2] if len(listed) == 1 else real(workdir)
  monkeypatch.setattr(reader, "checkpoint_steps", stale)
  assert reader.run_meta(str(w), None, "a run")[0] == 1
  listed.clear()
  source = init_from.resolve(config_lib.load("configs/tiny.py", [*tuning(run)[2:], f"--config.init_from={w}"]))
  assert (source.step, source.asked) == (1, False)


def test_init_from_another_task_is_refused_at_once(dit, tmp_path):
  one_line(run_module("meshtrain.train", *TRAIN, f"--config.init_from={dit}", "--workdir", tmp_path / "ft"),
           "task=dit model and this run is task=lm")
  assert not (tmp_path / "ft" / "config.json").exists() and not (tmp_path / "ft" / "checkpoints").exists()


def test_to_hf_refuses_a_diffusion_model(dit, tmp_path, capsys):
  assert convert.main(["to-hf", "--workdir", str(dit), "--out", str(tmp_path / "hf")]) == 2
  one_line(capsys.readouterr().err, "holds a dit model", "task=lm")
  assert not (tmp_path / "hf").exists()


def test_training_in_a_converted_workdir_is_refused_without_a_lock(run, tmp_path):
  w = tmp_path / "converted"
  cfg = config_lib.load("configs/tiny.py", [])
  ckpt = checkpoint.Checkpointer(w, keep=1)
  ckpt.save(0, {"params": {"x": np.zeros((2, 2), np.float32)}}, {"config": cfg.to_dict(), "params_only": True})
  ckpt.wait()
  ckpt.close()
  before = snapshot(w)
  one_line(run_module("meshtrain.train", *TRAIN, "--workdir", w), "holds converted parameters",
           f"--config.init_from={w}")
  assert snapshot(w) == before and not (w / "meshtrain.lock").exists()


@pytest.mark.parametrize("ids", ["1,,2", "1,-2", "1;2", "1,2,", "x"])
def test_malformed_prompt_ids_are_refused(run, ids, capsys):
  assert generate.main(["--workdir", str(run), "--prompt-ids", ids]) == 2
  one_line(capsys.readouterr().err, "--prompt-ids", "comma-separated non-negative integers")


def test_a_kv_cache_beyond_memory_is_refused_before_compiling(run):
  one_line(run_module("meshtrain.generate", "--workdir", run, "--prompt", "def", "--max-len", 10**9,
                      "--max-new-tokens", 10**9), "need a KV cache of", "lower --max-new-tokens or --max-len")
  # --max-len alone, as issue 29 reproduced it (RESOURCE_EXHAUSTED then): it caps the cache, the prompt and
  # --max-new-tokens (128) size it, so this is a correct result.
  done = run_module("meshtrain.generate", "--workdir", run, "--prompt", "def", "--max-len", 10**9, "--json")
  assert done.returncode == 0 and not done.stderr, done.stderr[-3000:]
  assert len(json.loads(done.stdout)["token_ids"][0]) == 128


@pytest.mark.parametrize("flag, value, needle", [
    ("--per-class", 10**9, "smaller --per-class"), ("--steps", 10**9, "more than 10,000 Euler steps")])
def test_sample_refuses_what_it_could_not_hold_or_finish(dit, tmp_path, capsys, flag, value, needle):
  assert sample.main(["--workdir", str(dit), "--out", str(tmp_path / "g.png"), flag, str(value)]) == 2
  one_line(capsys.readouterr().err, needle)


def test_tokenizer_refuses_a_huge_vocabulary_and_encodes_stray_bytes():
  one_line(run_module("meshtrain.tokenizer", "train", "--config", "configs/tiny.py", "--vocab-size", 10**9, "--out",
                      "/nonexistent/never"), "--vocab-size 1,000,000,000", "1,048,576")
  done = subprocess.run([sys.executable, "-m", "meshtrain.tokenizer", "show", "--config", "configs/tiny.py",
                         "--text", b"de\xff"], cwd=REPO, capture_output=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  assert json.loads(done.stdout)["ids"] == [100, 101, 255]  # bytes: d, e and the stray 0xff itself


def test_ctrl_c_in_to_hf_leaves_nothing_and_exits_130(run, tmp_path, monkeypatch, capsys):
  """SIGINT while the export runs: acted on at the next tensor, whatever Orbax was doing; the output is removed."""
  from meshtrain.interop import hf
  original, sent = hf._to_hf, []

  def interrupted(how, w):
    if not sent:
      sent.append(True)
      os.kill(os.getpid(), signal.SIGINT)
    return original(how, w)
  monkeypatch.setattr(hf, "_to_hf", interrupted)
  handler = signal.getsignal(signal.SIGINT)  # the default, or pytest-xdist's worker's
  assert convert.main(["to-hf", "--workdir", str(run), "--out", str(tmp_path / "hf")]) == 130
  err = capsys.readouterr().err
  assert err.startswith("interrupted: nothing was written") and err.count("\n") == 1, err
  assert list(tmp_path.iterdir()) == [] and signal.getsignal(signal.SIGINT) is handler  # restored


def test_ctrl_c_in_from_hf_leaves_nothing_and_exits_130(run, tmp_path, monkeypatch, capsys):
  """As in to-hf: SIGINT while the weights are converted is acted on at the next tensor; no workdir is left."""
  from meshtrain.interop import hf
  assert convert.main(["to-hf", "--workdir", str(run), "--out", str(tmp_path / "hf")]) == 0
  capsys.readouterr()
  original, sent = hf._to_meshtrain, []

  def interrupted(how, w, out):
    if not sent:
      sent.append(True)
      os.kill(os.getpid(), signal.SIGINT)
    return original(how, w, out)
  monkeypatch.setattr(hf, "_to_meshtrain", interrupted)
  handler = signal.getsignal(signal.SIGINT)  # the default, or pytest-xdist's worker's
  assert convert.main(["from-hf", str(tmp_path / "hf"), "--workdir", str(tmp_path / "w")]) == 130
  err = capsys.readouterr().err
  assert err.startswith("interrupted: nothing was written") and err.count("\n") == 1, err
  assert sent and [p.name for p in tmp_path.iterdir()] == ["hf"] and signal.getsignal(signal.SIGINT) is handler


# The init_from read below fails inside this process: Orbax's event loops, torn down mid-read, report "Event loop
# is closed" when collected (what errors.silence_stderr keeps off a command's stderr; generate's is checked above).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_checkpoint_is_one_line_every_time(run, tmp_path):
  """A flipped bit in each data file of the newest step: generate's refusal is its only stderr line, in every one of
  several runs (Orbax's threads used to print "Event loop is closed" tracebacks after it, 1 run in 6). Neither it
  nor init_from, refused the same way, writes into the run (Orbax's report once went to W/diagnostics/)."""
  w = tmp_path / "w"
  shutil.copytree(run, w)
  for data in (w / "checkpoints" / "2" / "state").rglob("d/*"):  # every data file: the params' chunks among them
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
  before = snapshot(w)
  for _ in range(3):
    done = run_module("meshtrain.generate", "--workdir", w, "--prompt", "def", "--max-new-tokens", 2)
    one_line(done, "step 2", "is damaged")
    assert not re.search("Traceback|Event loop", done.stderr)
  assert snapshot(w) == before
  cfg, layout = fine_tuning(run, f"--config.init_from={w}")
  with pytest.raises(UserError, match="step 2") as e:
    init_from.initial_state(layout, init_from.resolve(cfg))
  assert "\n" not in str(e.value) and snapshot(w) == before
