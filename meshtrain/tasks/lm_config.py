"""The language model's config fields (task=lm): their choices and checks, and the host memory its batches need.
JAX-free, so a bad value is refused before JAX loads; registered with meshtrain.config by meshtrain/tasks."""
from meshtrain import config as config_lib
from meshtrain.errors import UserError

# Fields that decide the shape of the train state: a checkpoint is only compatible when all of them match.
SHAPE_FIELDS = ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                "num_experts", "tie_embeddings", "attention_bias", "qk_norm", "scan_layers", "param_dtype")
DATA_FORMATS = ("text", "prompt_completion", "chat")  # meshtrain/data/packing.py and meshtrain/data/sft.py
REMAT_POLICIES = ("none", "full", "save_dots")  # meshtrain/models/llama.py's policies by these names
INITS = ("normal", "fan_in")  # meshtrain/models/params.py (not imported here: it pulls in JAX)
ATTENTION = ("auto", "blocked", "xla", "cudnn")  # meshtrain/models/attention.py (likewise)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # meshtrain/models/rope.py (likewise)
HF_MODEL_TYPES = ("", "llama", "mistral", "qwen2", "qwen3", "mixtral")  # meshtrain/interop/hf.py's families
# The input pipeline (data.Batches) holds, per process, at most 4 batches of its rows: 2 read ahead by grain's
# workers (each, while built, int32 inputs, targets and the packed [rows, seq_len + 1] array they are cut from), 1 in
# grain's device-prefetch buffer and 1 in use; counted as 3 int32 arrays each: 4 x 3 x 4 bytes per token.
BATCH_BUFFER_BYTES_PER_TOKEN = 4 * 3 * 4


def model_group(model):
  """base_config()'s model group (a language model preset) is this task's: nothing to replace."""
  del model
  return None


def check(cfg) -> None:
  """The language model's fields (task=lm)."""
  m = cfg.model
  positive = {"seq_len": cfg.seq_len, **{f"model.{k}": m[k] for k in ("vocab_size", "num_layers", "d_model",
                                                                       "num_heads", "num_kv_heads", "head_dim",
                                                                       "mlp_dim")}}
  for key, value in positive.items():
    if value <= 0:
      raise UserError(f"config key {key!r} must be positive, got {value}")
  if m.scan_unroll < 0:
    raise UserError(f"config key 'model.scan_unroll' must be >= 0, got {m.scan_unroll}")
  for key, value in (("model.init_std", m.init_std), ("model.norm_eps", m.norm_eps),
                     ("model.rope_theta", m.rope_theta)):
    if value <= 0:
      raise UserError(f"config key {key!r} must be positive, got {value}")
  for key, value in (("model.aux_loss_weight", m.aux_loss_weight),
                     ("model.router_z_loss_weight", m.router_z_loss_weight)):
    if value < 0:
      raise UserError(f"config key {key!r} must be >= 0 (0 turns it off), got {value}")
  config_lib.check_choice("model.remat", m.remat, REMAT_POLICIES)
  config_lib.check_choice("model.dtype", m.dtype, config_lib.DTYPES)
  config_lib.check_choice("model.param_dtype", m.param_dtype, config_lib.DTYPES)
  config_lib.check_choice("model.attention", m.attention, ATTENTION)
  config_lib.check_choice("model.context_attention", m.context_attention, ("ring", "allgather"))
  config_lib.check_choice("model.init", m.init, INITS)
  if m.scan_unroll > 1 and m.remat != "none":
    raise UserError(f"model.scan_unroll={m.scan_unroll} with model.remat={m.remat}: XLA schedules the recomputation of "
                    "unrolled layers next to the forward pass it repeats, so remat would save no memory; use "
                    "model.scan_unroll=0 (auto) or 1")
  if m.scan_unroll > 1 and cfg.mesh.sequence != 1:
    raise UserError(f"model.scan_unroll={m.scan_unroll} with mesh.sequence={cfg.mesh.sequence}: unrolled "
                    "ring-attention layers loaded from the persistent compilation cache deadlock on the CPU; use "
                    "model.scan_unroll=0 (auto) or 1")
  if m.num_experts < 0 or (m.num_experts and not 1 <= m.experts_per_token <= m.num_experts):
    raise UserError(f"model.num_experts={m.num_experts}, model.experts_per_token={m.experts_per_token}: use "
                    "num_experts=0 (dense MLP) or 1 <= experts_per_token <= num_experts")
  if m.capacity_factor <= 0:
    raise UserError(f"model.capacity_factor={m.capacity_factor} must be positive (1.0-2.0 is usual)")
  if m.num_heads % m.num_kv_heads:
    raise UserError(f"model.num_heads={m.num_heads} is not a multiple of model.num_kv_heads={m.num_kv_heads}; "
                    "grouped-query attention shares each KV head among num_heads/num_kv_heads query heads")
  if m.head_dim % 2:
    raise UserError(f"model.head_dim={m.head_dim} must be even for rotary position embedding")
  check_rope_and_window(cfg)
  check_text_data(cfg)


def check_rope_and_window(cfg) -> None:
  """Rotary scaling, the sliding window and the export family."""
  m = cfg.model
  config_lib.check_choice("model.rope_type", m.rope_type, ROPE_TYPES)
  config_lib.check_choice("model.hf_model_type", m.hf_model_type, HF_MODEL_TYPES)
  if m.rope_type != "default" and m.rope_factor < 1:
    raise UserError(f"model.rope_factor={m.rope_factor} with model.rope_type={m.rope_type}: the factor extends the "
                    "context, it must be >= 1")
  if m.rope_type in ("llama3", "yarn") and m.rope_original_max_len <= 0:
    raise UserError(f"model.rope_type={m.rope_type} needs model.rope_original_max_len, the context the model was "
                    "pretrained on (Llama 3.1: 8192)")
  if m.rope_type == "llama3" and not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
    raise UserError(f"model.rope_low_freq_factor={m.rope_low_freq_factor} and model.rope_high_freq_factor="
                    f"{m.rope_high_freq_factor} must satisfy 0 < low < high (Llama 3.1: 1 and 4)")
  if m.sliding_window < 0:
    raise UserError(f"model.sliding_window={m.sliding_window} must be >= 0 (0: attend to every earlier token)")


def check_text_data(cfg) -> None:
  """The text data's format and features (task=lm)."""
  data = cfg.data
  config_lib.check_choice("data.format", data.format, DATA_FORMATS)
  if data.name == "python_stdlib_sft" and data.format == "text":
    raise UserError("data.name=python_stdlib_sft holds prompt/completion pairs, not documents; set "
                    "data.format=prompt_completion (or use data.name=python_stdlib for the same files as text)")
  if data.tokenize_workers < 1:
    raise UserError(f"data.tokenize_workers={data.tokenize_workers} must be >= 1 (1: no worker processes)")
  if not 0 <= data.eval_fraction < 1:
    raise UserError(f"data.eval_fraction={data.eval_fraction} must be in [0, 1): the fraction of your files' documents "
                    "held out for evaluation (0.01 = 1%)")
  names = [n for n, _ in config_lib.parse_mixture(data.mixture)] if data.mixture else [data.name]
  if data.format == "chat":
    if not data.messages_key.strip():
      raise UserError("data.messages_key is empty; name the record key holding the list of messages (default "
                      "messages)")
    if str(data.tokenizer) == "byte" or str(data.tokenizer).startswith("bpe:"):
      raise UserError(f"data.format=chat renders each conversation with the tokenizer's chat template, and "
                      f"data.tokenizer={data.tokenizer!r} has none; use the tokenizer of a converted model "
                      "(--config.data.tokenizer=WORKDIR/tokenizer, or model.preset=init_from, which adopts it)")
  if data.format in ("prompt_completion", "chat") and "synthetic" in names:
    raise UserError(f"data.format={data.format} needs records with prompts and completions (or messages), and "
                    "synthetic has none; use your files, python_stdlib_sft (built locally) or a TFDS dataset with "
                    "such features")
  if data.format == "prompt_completion":
    if str(data.tokenizer).startswith("bpe:"):
      raise UserError(f"data.tokenizer={data.tokenizer!r} trains a tokenizer on a text dataset, and "
                      "data.format=prompt_completion data is for fine-tuning: use the tokenizer of the model in "
                      "init_from (--config.data.tokenizer=WORKDIR/tokenizer) or byte")
    if not data.prompt_key.strip() or not data.completion_key.strip() or data.prompt_key == data.completion_key:
      raise UserError(f"data.prompt_key={data.prompt_key!r} and data.completion_key={data.completion_key!r} must name "
                      "two different features of the dataset (python_stdlib_sft: prompt and completion)")


def check_batch_memory(cfg, rows: int, per: str, memory: int) -> None:
  needed = rows * (cfg.seq_len + 1) * BATCH_BUFFER_BYTES_PER_TOKEN
  if needed > memory:
    raise UserError(f"batch_size={cfg.batch_size} x seq_len={cfg.seq_len} is {cfg.batch_size * cfg.seq_len:,} tokens "
                    f"per step; for {per} the input pipeline's buffers alone need {needed / 1e9:,.1f} GB "
                    f"({BATCH_BUFFER_BYTES_PER_TOKEN} bytes per token: int32 inputs, targets and packed rows, 4 "
                    f"batches in flight), more than this host's {memory / 1e9:,.1f} GB of memory; lower seq_len or "
                    "batch_size")
