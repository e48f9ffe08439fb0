"""Issue 13's bad inputs, each through the real command: one `error: ...` line on stderr naming the problem and the
fix, exit code 2, no traceback, and nothing written where it should not be.

The first group fails while the config is loaded or the arguments are read, before JAX is imported (about half a
second each); `test_config_mistakes_do_not_import_jax` checks that. The few data and memory cases at the end need
JAX and TFDS and take a few seconds each.
"""
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).parents[1]
TINY = str(REPO / "configs" / "tiny.py")

CONFIG_FILES = {  # name: source of a broken config file
    "syntax.py": "def get_config(:\n  pass\n",
    "module_raises.py": "import os\n\nraise RuntimeError('boom at import')\n",
    "get_config_raises.py": "def get_config():\n  return {}['missing']\n",
    "returns_dict.py": "def get_config():\n  return {'steps': 3}\n",
    "partial.py": ("import ml_collections\n\ndef get_config():\n  c = ml_collections.ConfigDict()\n  c.steps = 3\n"
                   "  c.batch_size = 8\n  return c\n"),
    "typo.py": ("from meshtrain.config import base_config\n\ndef get_config():\n  c = base_config()\n"
                "  c.stpes = 10\n  return c\n"),
    "none_value.py": ("from meshtrain.config import base_config\n\ndef get_config():\n  c = base_config()\n"
                      "  c.steps = None\n  return c\n"),
    "group_replaced.py": ("from meshtrain.config import base_config\n\ndef get_config():\n  c = base_config()\n"
                          "  c.optimizer = {'learning_rate': 1e-3}\n  return c\n"),
    "needs_args.py": "from meshtrain.config import base_config\n\ndef get_config(size):\n  return base_config()\n",
    "not_python.txt": "steps = 3\n",
}

# name: (arguments after `python -m meshtrain.train`, fragments the one error line must contain). {tmp} is the
# test's directory (holding CONFIG_FILES and a plain file `afile`), {tiny} configs/tiny.py.
CASES = {
    # --- config files ---
    "syntax error": (["--config", "{tmp}/syntax.py"], ["syntax.py' has a syntax error at line 1", "def get_config(:"]),
    "module raises": (["--config", "{tmp}/module_raises.py"],
                      ["(line 3) raised RuntimeError while it was imported: boom at import", "fix the file"]),
    "get_config raises": (["--config", "{tmp}/get_config_raises.py"],
                          ["(line 2) raised KeyError in get_config(): 'missing'"]),
    "returns a dict": (["--config", "{tmp}/returns_dict.py"],
                       ["returned dict, not an ml_collections.ConfigDict", "base_config()"]),
    "partial config": (["--config", "{tmp}/partial.py"],
                       ["lacks", "field(s) meshtrain reads", "cpu_devices", "data",
                        "start from meshtrain.config.base_config()"]),
    "typo in the file": (["--config", "{tmp}/typo.py"], ["unknown config key 'stpes'", "did you mean 'steps'?"]),
    "None in the file": (["--config", "{tmp}/none_value.py"], ["'steps' to None", "it takes an integer"]),
    "group replaced": (["--config", "{tmp}/group_replaced.py"],
                       ["lacks", "optimizer.b1", "optimizer.warmup_steps"]),
    "get_config(args)": (["--config", "{tmp}/needs_args.py"], ["get_config(size)", "needs arguments"]),
    "not a .py file": (["--config", "{tmp}/not_python.txt"], ["is not a Python file (.py)"]),
    "config is a directory": (["--config", str(REPO / "configs")],
                              ["is a directory; pass one of its files", "configs/tiny.py", "configs/llama8b.py"]),
    "config without .py": (["--config", TINY[:-3]], ["does not exist (did you mean", "tiny.py'?)"]),
    "empty config": (["--config", ""], ["--config is empty"]),
    # --- arguments ---
    "override without --config.": (["--steps=3"],
                                    ["cannot read argument '--steps=3'", "did you mean --config.steps=3?"]),
    "override without =": (["--config.steps", "3"], ["'--config.steps' has no value", "--config.steps=VALUE"]),
    # --- data settings ---
    "empty data.name": (["--config.data.name="], ["data.name='' is not a dataset name"]),
    "data.name with a space": (["--config.data.name=my corpus"], ["data.name='my corpus' is not a dataset name"]),
    "data.name a path that is not there": (["--config.data.name=../no_such_corpus/"],
                                           ["data.name='../no_such_corpus/': no such file or directory"]),
    "data.name a glob that matches nothing": (["--config.data.name=no_such/*.jsonl"],
                                              ["data.name='no_such/*.jsonl' is a glob that matches no file"]),
    "data.name with ;": (["--config.data.name=a;b"], ["'a;b' is not a dataset name", "tiny_shakespeare"]),
    "empty train split": (["--config.data.train_split="], ["data.train_split is empty"]),
    "empty eval split": (["--config.data.eval_split="], ["data.eval_split is empty", "eval_every=0"]),
    "data_dir is a file": (["--config.data.data_dir={tmp}/afile"], ["data.data_dir=", "afile' is a file"]),
    "data_dir under a file": (["--config.data.data_dir={tmp}/afile/tfds"], ["lies under", "which is a file"]),
    # --- workdir ---
    "workdir is a file": (["--workdir", "{tmp}/afile"], ["--workdir", "afile' is a file, not a directory"]),
    "workdir under a file": (["--workdir", "{tmp}/afile/run"], ["lies under", "afile', which is a file"]),
    # --- sizes and bounds ---
    "seq_len beyond memory": (["--config.seq_len=1000000000000"],  # 576 PB of batch buffers: more than any host
                              ["batch_size=16 x seq_len=1000000000000", "16,000,000,000,000 tokens", "GB of memory",
                               "lower seq_len or batch_size"]),
    "cpu_devices too many": (["--config.cpu_devices=100000"], ["cpu_devices=100000 is more than the 4096"]),
    "negative learning rate": (["--config.optimizer.learning_rate=-3e-3"],
                               ["learning_rate=-0.003 must be positive", "gradient ascent"]),
    "zero learning rate": (["--config.optimizer.learning_rate=0"], ["learning_rate=0.0 must be positive"]),
    "infinite learning rate": (["--config.optimizer.learning_rate=1e999"], ["'optimizer.learning_rate' is inf"]),
    "warmup beyond steps": (["--config.optimizer.warmup_steps=500"], ["warmup_steps=500 is beyond steps=200"]),
    "warmup beyond shortened steps": (["--config.steps=8", "--config.optimizer.warmup_steps=20"],
                                      ["warmup_steps=20 is beyond steps=8"]),
    "watchdog too short": (["--config.watchdog_s=0.2"],
                           ["watchdog_s=0.2 is below the 30 s floor", "or 0 to turn it off"]),
    "negative seed": (["--config.seed=-1"], ["seed=-1 is out of range", "4294967295"]),
    "seed beyond 32 bits": (["--config.seed=4294967296"], ["seed=4294967296 is out of range"]),
    "Adam beta of 1": (["--config.optimizer.b2=1.0"], ["optimizer.b2=1.0 must lie in [0, 1)"]),
    "negative grad_clip": (["--config.optimizer.grad_clip=-1"], ["'optimizer.grad_clip' must be >= 0"]),
    "zero init_std": (["--config.model.init_std=0"], ["'model.init_std' must be positive"]),
    "profile beyond steps": (["--config.profile_steps=300-305"], ["profile_steps='300-305' reaches beyond steps=200"]),
    "xla flag without --xla_": (["--config.xla_flags=--nonsense=1"], ["'--nonsense=1', which is not an XLA flag"]),
    "xla flag without dashes": (["--config.xla_flags=xla_cpu_foo"], ["'xla_cpu_foo', which is not an XLA flag"]),
    "cache dir is a file": (["--config.compilation_cache_dir={tmp}/afile"], ["compilation_cache_dir=", "is a file"]),
    "zero processes": (["--config.distributed.num_processes=0"], ["distributed.num_processes=0"]),
}


@pytest.fixture
def tmp(tmp_path):
  for name, source in CONFIG_FILES.items():
    (tmp_path / name).write_text(source)
  (tmp_path / "afile").write_text("not a directory\n")
  return tmp_path


def run(argv, cwd=REPO, module="meshtrain.train", timeout=120):
  # This checkout's meshtrain, also when the command runs in another directory.
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
  return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=timeout,
                        cwd=cwd, env=env)


def assert_one_error(proc, fragments):
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
  assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
  for fragment in fragments:
    assert fragment in lines[0], (fragment, lines[0])


def train_args(extra, tmp):
  """`--config tiny.py --workdir TMP/run` unless the case gives its own, then the case's arguments."""
  extra = [a.format(tmp=tmp, tiny=TINY) for a in extra]
  base = [] if "--config" in extra else ["--config", TINY]
  base += [] if "--workdir" in extra else ["--workdir", str(tmp / "run")]
  return base + extra


@pytest.mark.parametrize("name", CASES)
def test_bad_input(name, tmp):
  extra, fragments = CASES[name]
  assert_one_error(run(train_args(extra, tmp)), fragments)
  assert not (tmp / "run").exists()  # refused before anything was written


def test_config_mistakes_do_not_import_jax(tmp):
  # Every case above in one process: each is refused before JAX (seconds to import) is ever loaded.
  script = ("import sys\nfrom meshtrain import train\ncodes = [train.main(a) for a in eval(sys.argv[1])]\n"
            "print(codes, 'jax' in sys.modules)\n")
  argvs = [train_args(extra, tmp) for extra, _ in CASES.values()]
  proc = subprocess.run([sys.executable, "-c", script, repr(argvs)], capture_output=True, text=True, timeout=120,
                        cwd=REPO)
  assert proc.stdout.strip() == f"{[2] * len(argvs)} False", proc.stdout + proc.stderr[-2000:]


def test_empty_workdir_writes_nothing_in_the_current_directory(tmp_path):
  # `--workdir ""` used to mean ".": checkpoints, metrics and the lock landed wherever the command was run.
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  assert_one_error(run(["--config", TINY, "--workdir", "", "--config.steps=2"], cwd=cwd), ["--workdir is empty"])
  assert not any(cwd.iterdir())


def test_missing_arguments_are_one_line(tmp_path):
  assert_one_error(run([]), ["the following arguments are required: --config, --workdir",
                             "python -m meshtrain.train --help"])


# --- the other entry points' own flags ---

OTHER = {
    "launch without --": ("meshtrain.launch", ["--processes", "2", "--devices-per-process", "4"],
                          ["put the training arguments after --"]),
    "launch with nothing after --": ("meshtrain.launch", ["--processes", "2", "--devices-per-process", "4", "--"],
                                     ["no training arguments after --"]),
    "launch zero processes": ("meshtrain.launch", ["--processes", "0", "--devices-per-process", "4", "--", "x"],
                              ["--processes 0", "must be at least 1"]),
    "launch too many devices": ("meshtrain.launch", ["--processes", "2000", "--devices-per-process", "4", "--", "x"],
                                ["8000 simulated devices, more than the 4096"]),
    "launch not a number": ("meshtrain.launch", ["--processes", "two", "--devices-per-process", "4", "--", "x"],
                            ["argument --processes: invalid int value: 'two'", "--help"]),
    "inspect zero devices": ("meshtrain.inspect", ["--config", TINY, "--devices", "0"],
                             ["--devices 0 is out of range", "1 to 4096"]),
    "inspect too many devices": ("meshtrain.inspect", ["--config", TINY, "--devices", "5000"],
                                 ["--devices 5000 is out of range"]),
    "inspect nan hbm": ("meshtrain.inspect", ["--config", TINY, "--hbm", "nan"], ["--hbm nan must be a positive"]),
    "plan zero top": ("meshtrain.plan", ["--config", TINY, "--devices", "8", "--gpu", "h100", "--top", "0"],
                      ["--top must be >= 1", "--top 0"]),
    "plan negative verify": ("meshtrain.plan", ["--config", TINY, "--devices", "8", "--gpu", "h100", "--verify", "-1"],
                             ["--verify >= 0", "--verify -1"]),
    "plan negative hbm": ("meshtrain.plan", ["--config", TINY, "--devices", "8", "--gpu", "h100", "--hbm", "-80"],
                          ["--hbm -80 must be a positive number"]),
    "plan too many devices": ("meshtrain.plan", ["--config", TINY, "--devices", "8192", "--gpu", "h100"],
                              ["--devices 8192 is more than the 4096"]),
    "plan unknown gpu": ("meshtrain.plan", ["--config", TINY, "--devices", "8", "--gpu", "v100"],
                         ["argument --gpu: invalid choice: 'v100'"]),
}


@pytest.mark.parametrize("name", OTHER)
def test_other_entry_points(name):
  module, argv, fragments = OTHER[name]
  assert_one_error(run(argv, module=module), fragments)


def test_launch_help():
  proc = run(["--help"], module="meshtrain.launch")
  assert proc.returncode == 0, proc.stderr
  assert "--processes" in proc.stdout and "TRAIN_ARGS, after --" in proc.stdout and "--workdir" in proc.stdout


# --- cases that need JAX and TFDS (the dataset is opened after the mesh is built): a few seconds each ---

def _unwritable_dir(tmp_path) -> str:
  if os.geteuid() == 0:  # permissions do not stop root; sysfs refuses new directories even to root
    return "/sys/meshtrain_bad_input_test"
  ro = tmp_path / "read_only"
  ro.mkdir()
  ro.chmod(0o555)
  return str(ro / "tfds")


@pytest.mark.parametrize("extra, fragments", [
    (["--config.data.train_split=train[:0]"], ["data split 'train[:0]' of dataset 'python_stdlib' holds no examples"]),
    (["--config.data.eval_split=validation[100%:]"], ["'validation[100%:]'", "holds no examples"]),
    (["--config.data.train_split=train[abc]"], ["data split 'train[abc]'", "cannot be parsed", "'train[:90%]'"]),
    # The seq_len: refused by the batch-buffer bound on hosts under 58 GB (this one). A step whose batch
    # fits but whose temporaries do not is refused after its compile (tests/test_faults.py).
    (["--config.seq_len=100000000"], ["seq_len=100000000", "memory", "lower seq_len or batch_size"]),
], ids=["empty split", "empty eval slice", "unparseable split", "seq_len 1e8"])
def test_bad_data_and_sizes(extra, fragments, tmp_path):
  assert_one_error(run(["--config", TINY, "--workdir", str(tmp_path / "run"), "--config.steps=2", *extra],
                       timeout=600), fragments)


def test_unwritable_data_dir(tmp_path):
  # python_stdlib is built where data.data_dir points on first use; there it cannot be.
  data_dir = _unwritable_dir(tmp_path)
  proc = run(["--config", TINY, "--workdir", str(tmp_path / "run"), "--config.steps=2",
              f"--config.data.data_dir={data_dir}"], timeout=600)
  assert_one_error(proc, ["python_stdlib", data_dir, "point data.data_dir at a writable directory"])
