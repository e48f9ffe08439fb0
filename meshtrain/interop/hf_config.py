"""Hugging Face config.json <-> meshtrain's `model` fields, for the five families that convert.

  family (model_type)  architecture         what it adds to the Llama block            meshtrain fields
  llama                LlamaForCausalLM     (rotary scaling: llama3, linear, yarn)      rope_*
  mistral              MistralForCausalLM   sliding_window                              sliding_window
  qwen2                Qwen2ForCausalLM     biases on q, k, v                           attention_bias
  qwen3                Qwen3ForCausalLM     RMSNorm over each q and k head              qk_norm
  mixtral              MixtralForCausalLM   mixture of experts, top-k renormalised      num_experts, experts_per_token
Every family takes every rotary scaling meshtrain has (transformers computes them in one place for all of them).
Anything else that changes the computation (another rope_type, biases on o or the MLP, Qwen's per-layer sliding
window, partial rotary, another activation) is refused by name: `read` raises a UserError naming the field and
what converts. `write` is the inverse, for the family `export_family` picks.
"""
import json
import math
import pathlib

from meshtrain.errors import UserError

FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM"}
SUPPORTED = ", ".join(f"{t} ({a})" for t, a in FAMILIES.items())
# transformers' defaults (5.x) for fields a config.json may omit: hub files written by transformers have them all;
# older or hand-written files do not.
DEFAULTS = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False, "max_position_embeddings": 2048, "pretraining_tp": 1,
            "sliding_window": None, "use_sliding_window": False, "partial_rotary_factor": 1.0}
FAMILY_DEFAULTS = {"mixtral": {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "num_local_experts": 8,
                               "num_experts_per_tok": 2, "router_jitter_noise": 0.0},
                   "mistral": {"sliding_window": 4096}}
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# The keys of each rope type meshtrain computes (models/rope.py); rope_theta and rope_type itself everywhere.
ROPE_KEYS = {"default": set(), "linear": {"factor"},
             "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
             "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
                      "mscale", "mscale_all_dim", "truncate"}}


def load(hf_dir: pathlib.Path) -> dict:
  """The config.json of `hf_dir` as a dict, or a UserError saying why it cannot be read."""
  path = hf_dir / "config.json"
  if not path.is_file():
    raise UserError(f"{str(hf_dir)!r} has no config.json; pass a Hugging Face model directory (config.json and "
                    "*.safetensors, as save_pretrained writes)")
  try:
    hf = json.loads(path.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise UserError(f"{str(path)!r} is not valid JSON ({e}); pass a Hugging Face model directory") from None
  if not isinstance(hf, dict):
    raise UserError(f"{str(path)!r} holds a JSON {type(hf).__name__}, not an object; pass a Hugging Face model "
                    "directory")
  return hf


def positive(where: str, field: str, value, kind=float, zero: bool = False):
  """A config.json field's value as `kind`, or a UserError naming it: a finite number above zero (or at it with
  `zero`), an integer for int (JSON's 4096.0 is not one)."""
  is_number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
  if not is_number or (kind is int and not isinstance(value, int)) or value < 0 or (value == 0 and not zero):
    sign = "non-negative" if zero else "positive"
    raise UserError(f"{where!r}: {field} is {json.dumps(value)}; it must be a {sign} "
                    f"{'integer' if kind is int else 'number'}")
  return kind(value)


def read(hf_dir: pathlib.Path) -> dict:
  """meshtrain model fields (plus `family` and `max_position_embeddings`) of the config.json in `hf_dir`, or a
  UserError naming the first field meshtrain cannot run and what converts."""
  raw = load(hf_dir)
  where = str(hf_dir / "config.json")
  family, archs = raw.get("model_type"), raw.get("architectures") or []
  if family not in FAMILIES or (archs and archs != [FAMILIES[family]]):
    raise UserError(f"{where!r}: model_type {family!r}, architectures {archs} does not convert; meshtrain converts "
                    f"{SUPPORTED}")
  hf = {**DEFAULTS, **FAMILY_DEFAULTS.get(family, {}), **raw}
  missing = [k for k in REQUIRED_FIELDS if not isinstance(hf.get(k), int) or hf[k] <= 0]
  if missing:
    raise UserError(f"{where!r} lacks a positive integer {missing[0]!r}; a {FAMILIES[family]} config.json needs "
                    f"{', '.join(REQUIRED_FIELDS)}")

  def refuse(field, value, supported):
    raise UserError(f"{where!r}: {field} is {json.dumps(value)}; meshtrain's {family} converts only {supported}")

  expected = {"hidden_act": "silu", "mlp_bias": False, "pretraining_tp": 1, "partial_rotary_factor": 1.0}
  if family in ("llama", "qwen3"):
    expected["attention_bias"] = False  # theirs puts a bias on o too, which meshtrain's attention has not
  if family in ("qwen2", "qwen3"):
    expected["use_sliding_window"] = False  # Qwen's window covers only layers >= max_window_layers
  for field, value in expected.items():
    if hf.get(field) != value:
      refuse(field, hf.get(field), f"{field}={json.dumps(value)}")
  heads = hf["num_attention_heads"]
  m = {"family": family, "vocab_size": hf["vocab_size"], "num_layers": hf["num_hidden_layers"],
       "d_model": hf["hidden_size"], "num_heads": heads,
       "num_kv_heads": positive(where, "num_key_value_heads", hf.get("num_key_value_heads") or heads, int),
       "head_dim": positive(where, "head_dim", hf.get("head_dim") or hf["hidden_size"] // heads, int),
       "mlp_dim": hf["intermediate_size"], "tie_embeddings": bool(hf["tie_word_embeddings"]),
       "norm_eps": positive(where, "rms_norm_eps", hf["rms_norm_eps"]),
       "max_position_embeddings": positive(where, "max_position_embeddings", hf["max_position_embeddings"], int),
       "attention_bias": family == "qwen2", "qk_norm": family == "qwen3", "sliding_window": 0, "num_experts": 0,
       "experts_per_token": 2}
  if family in ("mistral", "mixtral") and hf["sliding_window"] is not None:
    if not isinstance(hf["sliding_window"], int) or hf["sliding_window"] <= 0:
      refuse("sliding_window", hf["sliding_window"], "null or a positive integer")
    m["sliding_window"] = hf["sliding_window"]
  if family == "mixtral":
    if hf["router_jitter_noise"]:  # training-time noise on the router input: not in meshtrain's router
      refuse("router_jitter_noise", hf["router_jitter_noise"], "router_jitter_noise=0")
    if not 2 <= hf["num_experts_per_tok"] <= hf["num_local_experts"]:
      # k = 1: transformers renormalises the one weight to 1, meshtrain keeps the router probability (Switch).
      refuse("num_experts_per_tok", hf["num_experts_per_tok"], "2 <= num_experts_per_tok <= num_local_experts")
    m["num_experts"], m["experts_per_token"] = hf["num_local_experts"], hf["num_experts_per_tok"]
    m["aux_loss_weight"] = positive(where, "router_aux_loss_coef", hf.get("router_aux_loss_coef", 0.001), zero=True)
  m.update(_read_rope(hf, where, family))
  return m


def _read_rope(hf: dict, where: str, family: str) -> dict:
  """The rope_* model fields of transformers 5's `rope_parameters` or 4.x's `rope_scaling` + `rope_theta`; a
  non-null rope_scaling wins, as in transformers 5 (convert_rope_params_to_dict)."""
  rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
  rope_type = rope.pop("rope_type", rope.pop("type", "default"))
  theta = positive(where, "rope_theta", rope.pop("rope_theta", hf["rope_theta"]))
  if rope.pop("partial_rotary_factor", 1.0) != 1.0:
    raise UserError(f"{where!r}: partial_rotary_factor is not 1; meshtrain rotates every dimension of each head")
  if rope_type not in ROPE_KEYS:
    raise UserError(f"{where!r}: rope_type {rope_type!r} does not convert; meshtrain's {family} converts rope_type "
                    f"{', '.join(ROPE_KEYS)}")
  unknown = sorted(set(rope) - ROPE_KEYS[rope_type])
  if unknown:
    raise UserError(f"{where!r}: rope field {unknown[0]!r} is not one meshtrain computes for rope_type {rope_type!r} "
                    f"(it does: {', '.join(sorted(ROPE_KEYS[rope_type])) or 'rope_theta only'})")
  if rope.get("truncate", True) is not True:
    raise UserError(f"{where!r}: yarn with truncate=false does not convert; meshtrain floors and ceils the "
                    "correction range (transformers' default, truncate=true)")
  out = {"rope_theta": theta, "rope_type": rope_type}
  if rope_type == "default":
    return out
  factor = positive(where, "factor", rope.get("factor") or 1.0)
  out["rope_factor"] = factor
  if rope_type in ("llama3", "yarn"):
    out["rope_original_max_len"] = positive(where, "original_max_position_embeddings",
                                            rope.get("original_max_position_embeddings")
                                            or hf["max_position_embeddings"], int)
  if rope_type == "llama3":
    out["rope_low_freq_factor"] = positive(where, "low_freq_factor", rope.get("low_freq_factor"))
    out["rope_high_freq_factor"] = positive(where, "high_freq_factor", rope.get("high_freq_factor"))
  if rope_type == "yarn":
    out["rope_beta_fast"] = positive(where, "beta_fast", rope.get("beta_fast") or 32)
    out["rope_beta_slow"] = positive(where, "beta_slow", rope.get("beta_slow") or 1)
    attention = rope.get("attention_factor")
    if attention is None and rope.get("mscale") and rope.get("mscale_all_dim"):
      mscale = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
      attention = mscale(rope["mscale"]) / mscale(rope["mscale_all_dim"])
    out["rope_attention_factor"] = float(attention or 0.0)  # 0: the model's default, 0.1 ln(factor) + 1
  return out


def export_family(model: dict) -> str:
  """The family to-hf writes a meshtrain model as: model.hf_model_type when set (a converted model keeps its own),
  else the simplest that holds its features; a UserError when the chosen family cannot hold them."""
  experts, bias, qk_norm = bool(model.get("num_experts")), model.get("attention_bias"), model.get("qk_norm")
  window = model.get("sliding_window", 0)
  family = model.get("hf_model_type") or ("mixtral" if experts else "qwen3" if qk_norm else "qwen2" if bias
                                          else "mistral" if window else "llama")
  cannot = {"llama": [(experts, "experts"), (bias, "attention_bias"), (qk_norm, "qk_norm"), (window, "sliding_window")],
            "mistral": [(experts, "experts"), (bias, "attention_bias"), (qk_norm, "qk_norm")],
            "qwen2": [(experts, "experts"), (qk_norm, "qk_norm"), (window, "sliding_window")],
            "qwen3": [(experts, "experts"), (bias, "attention_bias"), (not qk_norm, "no qk_norm"),
                      (window, "sliding_window")],
            "mixtral": [(not experts, "no experts"), (bias, "attention_bias"), (qk_norm, "qk_norm"),
                        (experts and model.get("experts_per_token", 2) < 2, "experts_per_token=1")]}[family]
  held = [what for has, what in cannot if has]
  if held:
    raise UserError(f"the model has {held[0]}, which {FAMILIES[family]} cannot hold"
                    + (f" (model.hf_model_type={family})" if model.get("hf_model_type") else "")
                    + "; set model.hf_model_type to a family that holds it, or leave it empty to pick one: "
                    "experts -> mixtral, qk_norm -> qwen3, attention_bias -> qwen2, sliding_window -> mistral")
  return family


def write(model: dict, family: str, tied: bool, dtype: str, seq_len: int, tokenizer_ids: dict) -> dict:
  """config.json of `family` for meshtrain model fields `model` (the inverse of `read`)."""
  rope = {"rope_type": model.get("rope_type", "default"), "rope_theta": model["rope_theta"]}
  if rope["rope_type"] != "default":
    rope["factor"] = model["rope_factor"]
  if rope["rope_type"] in ("llama3", "yarn"):
    rope["original_max_position_embeddings"] = model["rope_original_max_len"]
  if rope["rope_type"] == "llama3":
    rope.update(low_freq_factor=model["rope_low_freq_factor"], high_freq_factor=model["rope_high_freq_factor"])
  if rope["rope_type"] == "yarn":
    rope.update(beta_fast=model["rope_beta_fast"], beta_slow=model["rope_beta_slow"])
    if model["rope_attention_factor"]:
      rope["attention_factor"] = model["rope_attention_factor"]
  out = {
      "architectures": [FAMILIES[family]], "model_type": family,
      "vocab_size": model["vocab_size"], "hidden_size": model["d_model"], "intermediate_size": model["mlp_dim"],
      "num_hidden_layers": model["num_layers"], "num_attention_heads": model["num_heads"],
      "num_key_value_heads": model["num_kv_heads"], "head_dim": model["head_dim"], "hidden_act": "silu",
      "max_position_embeddings": seq_len, "rms_norm_eps": model["norm_eps"],
      # transformers >= 5 reads rope_parameters; 4.x reads rope_theta and rope_scaling.
      "rope_theta": model["rope_theta"], "rope_parameters": rope,
      "rope_scaling": None if rope["rope_type"] == "default" else {k: v for k, v in rope.items() if k != "rope_theta"},
      "tie_word_embeddings": tied, "attention_dropout": 0.0, "initializer_range": model.get("init_std", 0.02),
      "use_cache": True, "dtype": dtype, "torch_dtype": dtype, **tokenizer_ids,
  }
  if family == "llama":
    out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
  if family in ("qwen2", "qwen3"):
    out.update(use_sliding_window=False, sliding_window=None, max_window_layers=model["num_layers"])
  if family == "qwen3":
    out["attention_bias"] = False
  if family in ("mistral", "mixtral"):
    out["sliding_window"] = model.get("sliding_window") or None
  if family == "mixtral":
    out.update(num_local_experts=model["num_experts"], num_experts_per_tok=model["experts_per_token"],
               router_aux_loss_coef=model.get("aux_loss_weight", 0.001), output_router_logits=False,
               router_jitter_noise=0.0)
  return out
