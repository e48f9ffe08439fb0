"""Supervised fine-tuning of the tiny model: a function's body from its signature and docstring.

  python -m meshtrain.train --config configs/tiny.py --workdir runs/tiny
  python -m meshtrain.train --config configs/sft_tiny.py --workdir runs/sft_tiny

The first command trains the tiny model on the stdlib's text; the second starts from its parameters
(init_from=runs/tiny: parameters only, fresh optimizer, step 0) on python_stdlib_sft, built on first use from the
same files (prompt = a function's def line(s) and docstring, completion = its body; the loss counts the completion
tokens only). It evaluates the loaded parameters at step 0, so the log shows the eval loss on held-out completions
before and after: 2.38 at step 0, 1.99 at step 50, 1.86 at step 150 (nats per completion byte;
benchmarks/2026-12-01-sft-tiny.md). Expect 2-3 minutes on an idle 2-core CPU (the dataset build adds ~20 s once).
"""
from meshtrain.config import base_config


def get_config():
  c = base_config()  # the tiny model, as configs/tiny.py trains it: init_from requires the same model fields
  c.init_from = "runs/tiny"
  c.data.name = "python_stdlib_sft"
  c.data.format = "prompt_completion"
  c.seq_len = 256  # one function per row: half of python_stdlib_sft's prompt + completion pairs fit in 256 bytes
  c.batch_size = 16
  c.steps = 150
  c.optimizer.learning_rate = 1e-3  # a third of pretraining's: the parameters are already trained
  c.optimizer.warmup_steps = 10
  c.log_every = 10
  c.eval_every = 50
  c.eval_batches = 8  # 128 of the validation split's ~470 functions, the same ones at every evaluation
  c.checkpoint_every = 50
  c.mesh.data = -1
  c.sharding.rules = "fsdp_tp"
  return c
