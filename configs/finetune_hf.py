"""Fine-tune a converted Hugging Face model (any family python -m meshtrain.convert takes) on prompt/completion pairs,
then hand it back to transformers.

  python -m meshtrain.convert from-hf ~/models/Qwen2.5-0.5B --workdir runs/qwen_hf
  python -m meshtrain.train --config configs/finetune_hf.py --config.init_from=runs/qwen_hf --workdir runs/qwen_sft
  python -m meshtrain.convert to-hf --workdir runs/qwen_sft --out runs/qwen_sft_hf    # Qwen2ForCausalLM again

model.preset="init_from" takes every model field (and the tokenizer) from init_from's config.json, so this one file
serves every converted model; --config.model.X on the command line still wins (--config.model.dtype=bfloat16 on
GPUs). The data is python_stdlib_sft (built locally from the stdlib's functions: prompt = signature and docstring,
completion = body; the loss counts completion tokens only). tests/test_open_models.py runs this config on a small
converted Qwen2 model and exports the result back to transformers.
"""
from meshtrain.config import INIT_FROM_PRESET, base_config


def get_config():
  c = base_config()
  c.model.preset = INIT_FROM_PRESET  # the model (and tokenizer) of --config.init_from
  c.data.name = "python_stdlib_sft"
  c.data.format = "prompt_completion"
  c.seq_len = 512
  c.batch_size = 16
  c.steps = 200
  c.optimizer.learning_rate = 2e-5  # pretrained weights: a small step
  c.optimizer.warmup_steps = 20
  c.log_every = 10
  c.eval_every = 100
  c.eval_batches = 8
  c.checkpoint_every = 100
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.sharding.rules = "fsdp"
  return c
