"""Every documented bad input: a message naming the problem and the fix, exit code 2, before any compile."""
import subprocess
import sys

import pytest

from meshtrain.cli import train

BASE = ["--config", "configs/tiny.py", "--config.steps=4"]
CASES = {  # extra arguments: fragments the message must contain
    "unknown key": (["--config.stepz=3"], ["unknown config key 'stepz'", "did you mean 'steps'"]),
    "unknown nested key": (["--config.model.num_layer=3"], ["'model.num_layer'", "did you mean 'model.num_layers'"]),
    "wrong type": (["--config.steps=abc"], ["'steps' takes an integer, got 'abc'"]),
    "wrong bool": (["--config.model.scan_layers=maybe"], ["takes true or false"]),
    "bad choice": (["--config.model.remat=sometimes"], ["'model.remat' is 'sometimes'", "none, full, save_dots"]),
    "missing config": (["--config", "configs/nope.py"], ["configs/nope.py' does not exist"]),
    "mesh product": (["--config.mesh.data=3"], ["multiply to 3, but there are 8 devices", "make the product 8"]),
    "mesh fill": (["--config.mesh.fsdp=3"], ["cannot fill data=-1", "8 devices are not divisible"]),
    "two fills": (["--config.mesh.fsdp=-1"], ["only one axis may be -1"]),
    "batch axes": (["--config.batch_size=12"], ["batch_size=12 is not divisible by the batch axes data = 8",
                                                 "multiple of 8"]),
    "micro-batch": (["--config.batch_size=16", "--config.optimizer.grad_accum_steps=4"],
                    ["grad_accum_steps=4 = 4 per micro-batch is not divisible by the batch axes data = 8",
                     "multiple of 32"]),
    "accumulation": (["--config.optimizer.grad_accum_steps=3"], ["batch_size=16 is not divisible by "
                                                                  "optimizer.grad_accum_steps=3"]),
    "model dim": (["--config.mesh.data=1", "--config.mesh.tensor=8", "--config.model.num_kv_heads=4"],
                  ["layers/attn/k dimension 2 (kv_heads) has size 4", "not divisible by mesh axes tensor = 8"]),
    "heads vs kv heads": (["--config.model.num_kv_heads=3"], ["num_heads=8 is not a multiple of model.num_kv_heads=3"]),
    "unused axis": (["--config.sharding.rules=dp", "--config.mesh.data=1", "--config.mesh.fsdp=8"],
                    ["mesh axis fsdp=8 is not used", "fsdp, fsdp_tp"]),
    "unknown rules": (["--config.sharding.rules=zero3"], ["not a preset", "dp, fsdp, tp, fsdp_tp"]),
    "not positive": (["--config.eval_batches=0"], ["'eval_batches' must be positive, got 0"]),
    "unroll under remat": (["--config.model.remat=full", "--config.model.scan_unroll=4"],
                           ["scan_unroll=4 with model.remat=full", "remat would save no memory", "scan_unroll=0"]),
    "unroll with ring": (["--config.mesh.data=2", "--config.mesh.sequence=4", "--config.model.scan_unroll=2"],
                         ["scan_unroll=2 with mesh.sequence=4", "deadlock", "scan_unroll=0"]),
    "bad attention": (["--config.model.attention=flash"],
                      ["'model.attention' is 'flash'", "auto, blocked, xla, cudnn"]),
    "lr ratio": (["--config.optimizer.min_lr_ratio=2"], ["min_lr_ratio=2.0 must lie in [0, 1]"]),
    "vocab": (["--config.model.vocab_size=256"],
              ["model.vocab_size=256 is smaller than the vocabulary of the byte tokenizer, which has 259 ids",
               "data.name=synthetic"]),
    "moe with zigzag": (["--config.model.num_experts=4", "--config.mesh.data=4", "--config.mesh.sequence=2"],
                        ["--config.sharding.causal_load_balance=false"]),
    "pipeline and context": (["--config.mesh.data=2", "--config.mesh.stage=2", "--config.mesh.sequence=2"],
                             ["mesh.sequence > 1) are not supported"]),
    "expert without experts": (["--config.mesh.data=2", "--config.mesh.expert=4"], ["set model.num_experts"]),
    "stage count": (["--config.mesh.data=1", "--config.mesh.stage=8"],
                    ["num_layers=4 cannot be split into mesh.stage=8"]),
    "seq vs shards": (["--config.mesh.data=1", "--config.mesh.sequence=8", "--config.seq_len=120"],
                      ["seq_len=120 must be divisible by 16"]),
    "profile range": (["--config.profile_steps=5-2"], ["profile_steps='5-2' is not a step range", "e.g. 20-24"]),
    "unknown dataset": (["--config.data.name=no_such_dataset_xyz"], ["no_such_dataset_xyz"]),
    "window with ring": (["--config.mesh.data=2", "--config.mesh.sequence=4", "--config.model.sliding_window=64"],
                         ["sliding_window=64 is shorter than seq_len=128", "mesh.sequence=1"]),
    "rope type": (["--config.model.rope_type=dynamic"], ["'model.rope_type' is 'dynamic'", "llama3, yarn"]),
    "llama3 without length": (["--config.model.rope_type=llama3", "--config.model.rope_factor=8"],
                              ["needs model.rope_original_max_len"]),
    "hf family": (["--config.model.hf_model_type=gemma"], ["'model.hf_model_type' is 'gemma'", "qwen3"]),
}


@pytest.mark.parametrize("name", CASES)
def test_bad_input(name, tmp_path, capsys):
  extra, fragments = CASES[name]
  assert train.main([*BASE, "--workdir", str(tmp_path), *extra]) == 2
  captured = capsys.readouterr()
  for fragment in fragments:
    assert fragment in captured.err, captured.err
  assert "compiled" not in captured.out  # reported before anything compiled
  assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


@pytest.mark.parametrize("extra", [["--config.stepz=3"], ["--config.mesh.data=3"]])
def test_command_line_exit_code_and_no_traceback(extra, tmp_path):
  proc = subprocess.run([sys.executable, "-m", "meshtrain.train", *BASE, "--workdir", str(tmp_path), *extra],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
