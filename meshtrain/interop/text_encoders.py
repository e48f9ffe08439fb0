"""Flux's two text encoders from and to transformers' directories: a `CLIPTextModel` (a Flux pipeline's
text_encoder/) into meshtrain/models/clip_text.py's parameter tree, a `T5EncoderModel` (text_encoder_2/) into
meshtrain/models/t5.py's, and each tree back into a directory that transformers' from_pretrained loads.

Reading goes one tensor at a time through safetensors' numpy API (meshtrain/interop/weights.py): each tensor is
copied into its slot of the stacked array and dropped, so memory holds the tree plus one tensor (T5-XXL's tree is
19 GB in float32, 9.5 GB in bfloat16). Writing holds one stacked array and one output shard at a time, in a staged
directory renamed into place at the end (meshtrain/interop/hf.py's `staged`). Everything is checked first, from the
config and the safetensors headers (architecture, fields, activation, every tensor's presence and shape), so a
refusal is a UserError that names the problem and nothing is written.

Layouts (torch's Linear stores weight [out, in]; meshtrain [in, out] with heads as their own axes), by mapping:
  copy     as stored: embeddings, norms, biases of D or F values, T5's relative_attention_bias [U, A]
  heads    bias [A*E] -> [A, E]                        (CLIP's q/k/v biases)
  t        [out, in] -> [in, out]                      (MLP: fc1, fc2; wi, wi_0, wi_1, wo)
  t_heads  [A*E, D] -> [D, A, E]                       (q, k, v)
  o        [D, A*E] -> [A, E, D]                       (CLIP's out_proj, T5's o)
CLIP: text_model.embeddings.{token,position}_embedding -> token_embedding, position_embedding;
  text_model.encoder.layers.i.{layer_norm1, self_attn.{q,k,v,out}_proj, layer_norm2, mlp.fc1, mlp.fc2}.{weight,bias}
  -> layers/{attn_norm(_bias), attn/{q,k,v,o}(_bias), mlp_norm(_bias), mlp/{up,down}(_bias)}[i];
  text_model.final_layer_norm -> final_norm(_bias). The "text_model." prefix is optional on reading (transformers
  5 saves without it) and written (every published checkpoint has it; transformers 4 needs it, 5 accepts it).
T5: shared.weight (or encoder.embed_tokens.weight, the same tied table; either or both may be stored) ->
  embedding; encoder.block.0.layer.0.SelfAttention.relative_attention_bias -> relative_attention_bias (the
  encoder's, shared by every layer); encoder.block.i.layer.0.{layer_norm, SelfAttention.{q,k,v,o}} ->
  layers/{attn_norm, attn/{q,k,v,o}}[i]; encoder.block.i.layer.1.{layer_norm, DenseReluDense.{wi | wi_0, wi_1, wo}}
  -> layers/{mlp_norm, mlp/{up | gate, up, down}}[i]; encoder.final_layer_norm -> final_norm. Written as
  save_pretrained writes it: shared.weight alone.
The trees come back as numpy arrays: bfloat16 when every stored tensor is, else float32 (float16 widens exactly).
"""
import dataclasses
import json
import math
import pathlib

import flax.linen as nn
import numpy as np

from meshtrain.errors import UserError
from meshtrain.interop import hf, hf_config, weights
from meshtrain.models import clip_text, t5
from meshtrain.models.activations import HIDDEN_ACT

CLIP = "CLIPTextModel"
T5 = "T5EncoderModel"
# config.json's model_type, the Flux pipeline's folder, and how to get a directory this reads.
KINDS = {CLIP: ("clip_text_model", "text_encoder", "pass a Flux pipeline's text_encoder/ or a directory "
                "CLIPTextModel.save_pretrained wrote"),
         T5: ("t5", "text_encoder_2", "pass a Flux pipeline's text_encoder_2/, or load the model with "
              "T5EncoderModel.from_pretrained and save_pretrained it (that keeps the encoder alone)")}
CLIP_PREFIX = "text_model."
# transformers 5's defaults for fields a config.json may omit (CLIPTextConfig, T5Config).
CLIP_DEFAULTS = {"hidden_act": "quick_gelu", "layer_norm_eps": 1e-5, "eos_token_id": 49407}
T5_DEFAULTS = {"relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
               "layer_norm_epsilon": 1e-6, "feed_forward_proj": "relu", "is_decoder": False}


# ----------------------------------------------------------------------------------------------------------------
# config.json

def model_dir(path, architecture: str) -> pathlib.Path:
  """The directory holding the model: `path`, or its Flux-pipeline folder (text_encoder/, text_encoder_2/) when
  `path` is the pipeline's root."""
  src = pathlib.Path(path).expanduser()
  _, folder, hint = KINDS[architecture]
  if not src.is_dir():
    raise UserError(f"{str(path)!r} is not a directory; {hint} (config.json and *.safetensors)")
  if not (src / "config.json").is_file() and (src / folder / "config.json").is_file():
    return src / folder
  return src


def load_config(src: pathlib.Path, architecture: str) -> dict:
  """config.json, checked to describe `architecture`."""
  model_type, _, hint = KINDS[architecture]
  config = hf_config.load(src)
  found_type, found = config.get("model_type"), config.get("architectures")
  if found_type != model_type or (found is not None and found != [architecture]):
    what = found[0] if isinstance(found, list) and found else found_type
    raise UserError(f"{str(src)!r} holds a {what} (config.json: model_type {found_type!r}, architectures "
                    f"{found}); this reads a {architecture} (model_type {model_type!r}, architectures "
                    f"[{architecture!r}]) only; {hint}")
  return config


def fields(config: dict, src: pathlib.Path, names: tuple, defaults: dict) -> dict:
  """The config.json fields `names` (positive integers) and `defaults` (their value when absent)."""
  where = str(src / "config.json")
  missing = [n for n in names if n not in config]
  if missing:
    raise UserError(f"{where!r} lacks {', '.join(missing)}; the config.json save_pretrained writes has them")
  out = {n: hf_config.positive(where, n, config[n], int) for n in names}
  return {**out, **{n: config.get(n, v) for n, v in defaults.items()}}


def clip_config(config: dict, src: pathlib.Path) -> clip_text.ClipTextConfig:
  f = fields(config, src, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads", "max_position_embeddings"), CLIP_DEFAULTS)
  where = str(src / "config.json")
  if not isinstance(f["hidden_act"], str) or f["hidden_act"] not in HIDDEN_ACT:
    raise UserError(f"{where!r}: hidden_act {json.dumps(f['hidden_act'])} is not an activation meshtrain's CLIP "
                    f"computes ({', '.join(HIDDEN_ACT)})")
  if f["hidden_size"] % f["num_attention_heads"]:
    raise UserError(f"{where!r}: hidden_size {f['hidden_size']} is not divisible by num_attention_heads "
                    f"{f['num_attention_heads']} (CLIP's heads split the width)")
  if not isinstance(f["eos_token_id"], int) or isinstance(f["eos_token_id"], bool):
    raise UserError(f"{where!r}: eos_token_id is {json.dumps(f['eos_token_id'])}; CLIPTextModel pools at one "
                    "end-of-text id, so it must be one integer")
  return clip_text.ClipTextConfig(
      vocab_size=f["vocab_size"], d_model=f["hidden_size"], num_layers=f["num_hidden_layers"],
      num_heads=f["num_attention_heads"], mlp_dim=f["intermediate_size"], max_positions=f["max_position_embeddings"],
      activation=f["hidden_act"], norm_eps=hf_config.positive(where, "layer_norm_eps", f["layer_norm_eps"]),
      eos_token_id=f["eos_token_id"])


def t5_activation(feed_forward_proj, where: str) -> tuple[str, bool]:
  """(dense_act_fn, gated) as T5Config derives them: "gated-gelu" is gelu_new, the tanh approximation."""
  parts = feed_forward_proj.split("-") if isinstance(feed_forward_proj, str) else []
  if not parts or len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
    raise UserError(f"{where!r}: feed_forward_proj {json.dumps(feed_forward_proj)} is not ACT or gated-ACT (e.g. "
                    "relu, gated-gelu)")
  act = "gelu_new" if feed_forward_proj == "gated-gelu" else parts[-1]
  if act not in HIDDEN_ACT:
    raise UserError(f"{where!r}: feed_forward_proj {feed_forward_proj!r} uses {act!r}, not an activation "
                    f"meshtrain's T5 computes ({', '.join(HIDDEN_ACT)})")
  return act, parts[0] == "gated"


def t5_config(config: dict, src: pathlib.Path) -> t5.T5EncoderConfig:
  f = fields(config, src, ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads"), T5_DEFAULTS)
  where = str(src / "config.json")
  if f["is_decoder"]:
    raise UserError(f"{where!r}: is_decoder is true (a causal decoder stack); T5EncoderModel's is bidirectional")
  buckets = hf_config.positive(where, "relative_attention_num_buckets", f["relative_attention_num_buckets"], int)
  distance = hf_config.positive(where, "relative_attention_max_distance", f["relative_attention_max_distance"], int)
  if buckets < 4 or distance <= buckets // 4:
    raise UserError(f"{where!r}: relative_attention_num_buckets {buckets} and relative_attention_max_distance "
                    f"{distance} leave no log-spaced buckets (need at least 4 buckets and a distance above "
                    "buckets / 4)")
  act, gated = t5_activation(f["feed_forward_proj"], where)
  return t5.T5EncoderConfig(
      vocab_size=f["vocab_size"], d_model=f["d_model"], num_layers=f["num_layers"], num_heads=f["num_heads"],
      head_dim=f["d_kv"], mlp_dim=f["d_ff"], num_buckets=buckets, max_distance=distance, activation=act,
      gated=gated, norm_eps=hf_config.positive(where, "layer_norm_epsilon", f["layer_norm_epsilon"]))


# ----------------------------------------------------------------------------------------------------------------
# Tensor tables: HF name -> (meshtrain path, index (the layer, or ()), HF shape, mapping)

def clip_tensors(c: clip_text.ClipTextConfig, prefix: str) -> dict:
  D, F, AE = c.d_model, c.mlp_dim, c.num_heads * c.head_dim
  layer = [("layer_norm1.weight", ("attn_norm",), (D,), "copy"),
           ("layer_norm1.bias", ("attn_norm_bias",), (D,), "copy")]
  for hf_name, ours in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
    layer += [(f"self_attn.{hf_name}.weight", ("attn", ours), (AE, D), "t_heads"),
              (f"self_attn.{hf_name}.bias", ("attn", f"{ours}_bias"), (AE,), "heads")]
  layer += [("self_attn.out_proj.weight", ("attn", "o"), (D, AE), "o"),
            ("self_attn.out_proj.bias", ("attn", "o_bias"), (D,), "copy"),
            ("layer_norm2.weight", ("mlp_norm",), (D,), "copy"), ("layer_norm2.bias", ("mlp_norm_bias",), (D,), "copy"),
            ("mlp.fc1.weight", ("mlp", "up"), (F, D), "t"), ("mlp.fc1.bias", ("mlp", "up_bias"), (F,), "copy"),
            ("mlp.fc2.weight", ("mlp", "down"), (D, F), "t"), ("mlp.fc2.bias", ("mlp", "down_bias"), (D,), "copy")]
  out = {f"{prefix}embeddings.token_embedding.weight": (("token_embedding",), (), (c.vocab_size, D), "copy"),
         f"{prefix}embeddings.position_embedding.weight": (("position_embedding",), (), (c.max_positions, D), "copy")}
  for i in range(c.num_layers):
    for name, path, shape, how in layer:
      out[f"{prefix}encoder.layers.{i}.{name}"] = (("layers", *path), (i,), shape, how)
  out[f"{prefix}final_layer_norm.weight"] = (("final_norm",), (), (D,), "copy")
  out[f"{prefix}final_layer_norm.bias"] = (("final_norm_bias",), (), (D,), "copy")
  return out


def t5_tensors(c: t5.T5EncoderConfig, embedding: str = "shared.weight") -> dict:
  D, F, AE = c.d_model, c.mlp_dim, c.num_heads * c.head_dim
  mlp = ((("wi_0", "gate"), ("wi_1", "up")) if c.gated else (("wi", "up"),))
  layer = [("layer.0.layer_norm.weight", ("attn_norm",), (D,), "copy")]
  layer += [(f"layer.0.SelfAttention.{n}.weight", ("attn", n), (AE, D), "t_heads") for n in ("q", "k", "v")]
  layer += [("layer.0.SelfAttention.o.weight", ("attn", "o"), (D, AE), "o"),
            ("layer.1.layer_norm.weight", ("mlp_norm",), (D,), "copy")]
  layer += [(f"layer.1.DenseReluDense.{hf_name}.weight", ("mlp", ours), (F, D), "t") for hf_name, ours in mlp]
  layer += [("layer.1.DenseReluDense.wo.weight", ("mlp", "down"), (D, F), "t")]
  out = {embedding: (("embedding",), (), (c.vocab_size, D), "copy"),
         "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight":
             (("relative_attention_bias",), (), (c.num_buckets, c.num_heads), "copy")}
  for i in range(c.num_layers):
    for name, path, shape, how in layer:
      out[f"encoder.block.{i}.{name}"] = (("layers", *path), (i,), shape, how)
  out["encoder.final_layer_norm.weight"] = (("final_norm",), (), (D,), "copy")
  return out


def param_shapes(tensors: dict, head_dim: int, num_layers: int) -> dict:
  """meshtrain path -> the shape of its (stacked) array, from the table's HF shapes and mappings."""
  ours = {"copy": lambda s: s, "heads": lambda s: (s[0] // head_dim, head_dim), "t": lambda s: (s[1], s[0]),
          "t_heads": lambda s: (s[1], s[0] // head_dim, head_dim), "o": lambda s: (s[1] // head_dim, head_dim, s[0])}
  return {path: ((num_layers,) if index else ()) + ours[how](shape)
          for path, index, shape, how in tensors.values()}


# ----------------------------------------------------------------------------------------------------------------
# transformers -> meshtrain

def check_tensors(files: dict, expected: dict, ignored: dict, src: pathlib.Path, architecture: str) -> np.dtype:
  """Every tensor the config implies is stored with its shape, nothing else is (but `ignored`: name -> the shape
  it must have, or None); returns the dtype the tree stores. Reads only the safetensors headers."""
  extra = sorted(set(files) - set(expected) - set(ignored))
  if extra:
    raise UserError(f"{str(src)!r} holds {len(extra)} tensor(s) a {architecture} with this config.json has not, e.g. "
                    f"{extra[0]!r} (another architecture, a projection head or more layers); not read")
  missing = [n for n in expected if n not in files]
  if missing:
    raise UserError(f"{str(src)!r} lacks {len(missing)} tensor(s) its config.json implies, e.g. {missing[0]!r}; "
                    "the weights and config.json do not match")
  shapes = {**{n: e[2] for n, e in expected.items()}, **{n: s for n, s in ignored.items() if n in files}}
  by_file, dtypes = {}, set()
  for name in shapes:
    by_file.setdefault(files[name], []).append(name)
  for file, names in by_file.items():
    with weights.open_safetensors(file) as f:
      held = set(f.keys())
      for name in names:
        if name not in held:  # an index naming the wrong shard
          raise UserError(f"model.safetensors.index.json puts {name} in {file.name}, which does not hold it; fix "
                          "the index or re-save the model")
        piece = f.get_slice(name)
        found, dtype = tuple(piece.get_shape()), piece.get_dtype()
        if shapes[name] is not None and found != shapes[name]:
          raise UserError(f"{file.name}: {name} has shape {list(found)}, config.json implies {list(shapes[name])}; "
                          "the weights and config.json do not match")
        if name in expected:
          if dtype not in weights.PARAM_DTYPES:
            raise UserError(f"{file.name}: {name} is {dtype}; meshtrain reads float32, bfloat16 and float16 weights")
          dtypes.add(dtype)
  return hf.stored_dtype("bfloat16" if dtypes == {"BF16"} else "float32")


def read_tree(files: dict, expected: dict, shapes: dict, dtype: np.dtype) -> dict:
  """The parameter tree, each HF tensor read, copied into its slot (transposed on the way) and dropped."""
  params = {}
  for path, shape in shapes.items():
    node = params
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = np.empty(shape, dtype)
  by_file = {}
  for name in expected:
    by_file.setdefault(files[name], []).append(name)
  for file, names in by_file.items():
    with weights.open_safetensors(file) as f:
      for name in names:
        path, index, _, how = expected[name]
        node = params
        for key in path:
          node = node[key]
        to_meshtrain(how, f.get_tensor(name), node[index] if index else node)
  return params


def to_meshtrain(how: str, w: np.ndarray, out: np.ndarray) -> None:
  """Copies HF tensor `w` into its slot `out` by mapping `how` (see the module docstring); writing through a
  reshaped view of the slot needs no temporary of the transposed tensor."""
  if how in ("copy", "heads"):
    np.copyto(out.reshape(w.shape), w, casting="same_kind")
  elif how == "o":  # [D, A*E] -> [A, E, D]
    np.copyto(out.reshape(-1, out.shape[-1]), w.T, casting="same_kind")
  else:  # t, t_heads: [out, in] -> [in, out...]
    np.copyto(out.reshape(out.shape[0], -1), w.T, casting="same_kind")


def read_clip_text(path) -> tuple[clip_text.ClipTextConfig, dict]:
  """(config, parameter tree of clip_text.ClipText) of the CLIPTextModel in `path` (or in a Flux pipeline's
  text_encoder/ when `path` is the pipeline)."""
  src = model_dir(path, CLIP)
  c = clip_config(load_config(src, CLIP), src)
  files = weights.weight_files(src)
  prefix = CLIP_PREFIX if any(n.startswith(CLIP_PREFIX) for n in files) else ""
  expected = clip_tensors(c, prefix)
  # A buffer transformers before 4.31 saved (torch.arange(P)); recomputed, so not read.
  ignored = {f"{prefix}embeddings.position_ids": None}
  dtype = check_tensors(files, expected, ignored, src, CLIP)
  c = dataclasses.replace(c, param_dtype=dtype.name)
  return c, read_tree(files, expected, param_shapes(expected, c.head_dim, c.num_layers), dtype)


def read_t5_encoder(path) -> tuple[t5.T5EncoderConfig, dict]:
  """(config, parameter tree of t5.T5Encoder) of the T5EncoderModel in `path` (or in a Flux pipeline's
  text_encoder_2/ when `path` is the pipeline)."""
  src = model_dir(path, T5)
  c = t5_config(load_config(src, T5), src)
  files = weights.weight_files(src)
  # The tied table may be stored under either name or both; one is read, the other only checked for its shape.
  tied = ("shared.weight", "encoder.embed_tokens.weight")
  embedding = next((n for n in tied if n in files), tied[0])
  expected = t5_tensors(c, embedding)
  ignored = {n: (c.vocab_size, c.d_model) for n in tied if n != embedding}
  dtype = check_tensors(files, expected, ignored, src, T5)
  c = dataclasses.replace(c, param_dtype=dtype.name)
  return c, read_tree(files, expected, param_shapes(expected, c.head_dim, c.num_layers), dtype)


# ----------------------------------------------------------------------------------------------------------------
# meshtrain -> transformers

def check_tree(params: dict, shapes: dict, what: str) -> str:
  """The tree holds exactly the arrays `shapes` names, with those shapes; returns the config.json dtype."""
  flat = {}

  def walk(node, path):
    for key, value in node.items():
      if isinstance(value, dict) or hasattr(value, "items"):
        walk(value, (*path, key))
      else:
        flat[(*path, key)] = value

  walk(params, ())
  name = "/".join
  missing, extra = sorted(set(shapes) - set(flat)), sorted(set(flat) - set(shapes))
  if missing or extra:
    raise UserError(f"the {what} parameter tree does not match its config: "
                    f"{'missing ' + name(missing[0]) if missing else 'unexpected ' + name(extra[0])} "
                    f"({len(missing)} missing, {len(extra)} unexpected); pass the tree the reader or model.init gave")
  for path, shape in shapes.items():
    if tuple(flat[path].shape) != shape:
      raise UserError(f"the {what} parameter {name(path)} has shape {list(flat[path].shape)}, its config implies "
                      f"{list(shape)}; pass the config the tree was made with")
  dtypes = {np.dtype(a.dtype).name for a in flat.values()}
  return dtypes.pop() if len(dtypes) == 1 and dtypes <= {"float32", "bfloat16", "float16"} else "float32"


def hf_tensors(params: dict, tensors: dict):
  """(HF name, [out, in] numpy array) pairs, one stacked array converted to numpy (and so gathered from devices)
  at a time."""
  by_path = {}
  for hf_name, (path, index, _, how) in tensors.items():
    by_path.setdefault(path, []).append((hf_name, index, how))
  for path, entries in by_path.items():
    node = params
    for key in path:
      node = node[key]
    array = np.asarray(node)
    for hf_name, index, how in entries:
      yield hf_name, to_hf(how, array[index] if index else array)
    del array


def to_hf(how: str, w: np.ndarray) -> np.ndarray:
  """The HF tensor of one layer's meshtrain array `w` by mapping `how`: the inverse of to_meshtrain."""
  if how == "copy":
    return np.ascontiguousarray(w)
  if how == "heads":
    return np.ascontiguousarray(w.reshape(-1))
  if how == "o":
    return np.ascontiguousarray(w.reshape(-1, w.shape[-1]).T)
  return np.ascontiguousarray(w.reshape(w.shape[0], -1).T)


def write(out, params: dict, tensors: dict, shapes: dict, config: dict, what: str) -> pathlib.Path:
  """Checks everything, then writes config.json and the safetensors into a staged directory renamed to `out`."""
  target = pathlib.Path(out).expanduser()
  hf.check_output(target, "output directory")
  params = nn.meta.unbox(params)  # model.init's tree carries its logical axes in boxes
  dtype = check_tree(params, shapes, what)
  hf.check_space(target, sum(4 * math.prod(s) for s in shapes.values()) + (1 << 20), f"writing the {what}")
  with hf.staged(target) as tmp:
    weights.write_safetensors(tmp, hf_tensors(params, tensors))
    (tmp / "config.json").write_text(json.dumps({**config, "dtype": dtype, "torch_dtype": dtype}, indent=2))
  return target


def write_clip_text(out, c: clip_text.ClipTextConfig, params: dict) -> pathlib.Path:
  """Writes a ClipText tree as a directory CLIPTextModel.from_pretrained loads (config.json, model.safetensors)."""
  if c.activation not in HIDDEN_ACT:
    raise UserError(f"activation {c.activation!r} is not one of {', '.join(HIDDEN_ACT)}")
  config = {"architectures": [CLIP], "model_type": KINDS[CLIP][0], "vocab_size": c.vocab_size,
            "hidden_size": c.d_model, "intermediate_size": c.mlp_dim, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "max_position_embeddings": c.max_positions,
            "hidden_act": c.activation, "layer_norm_eps": c.norm_eps, "eos_token_id": c.eos_token_id}
  tensors = clip_tensors(c, CLIP_PREFIX)
  return write(out, params, tensors, param_shapes(tensors, c.head_dim, c.num_layers), config, "CLIP text encoder")


def write_t5_encoder(out, c: t5.T5EncoderConfig, params: dict) -> pathlib.Path:
  """Writes a T5Encoder tree as a directory T5EncoderModel.from_pretrained loads (config.json, model.safetensors)."""
  if c.activation not in HIDDEN_ACT:
    raise UserError(f"activation {c.activation!r} is not one of {', '.join(HIDDEN_ACT)}")
  if c.gated and c.activation == "gelu":
    raise UserError("a gated MLP with the erf GELU has no T5Config spelling (feed_forward_proj \"gated-gelu\" means "
                    "gelu_new, the tanh form); use activation \"gelu_new\"")
  proj = "gated-gelu" if c.gated and c.activation == "gelu_new" else ("gated-" if c.gated else "") + c.activation
  config = {"architectures": [T5], "model_type": KINDS[T5][0], "vocab_size": c.vocab_size, "d_model": c.d_model,
            "d_kv": c.head_dim, "d_ff": c.mlp_dim, "num_layers": c.num_layers, "num_heads": c.num_heads,
            "relative_attention_num_buckets": c.num_buckets, "relative_attention_max_distance": c.max_distance,
            "layer_norm_epsilon": c.norm_eps, "feed_forward_proj": proj, "is_encoder_decoder": False,
            "use_cache": False}
  tensors = t5_tensors(c)
  return write(out, params, tensors, param_shapes(tensors, c.head_dim, c.num_layers), config, "T5 encoder")
