"""diffusers' `FluxTransformer2DModel` (Flux.1 dev and schnell) <-> meshtrain's Flux (meshtrain/models/flux.py), one
tensor at a time: the transformer of a Flux pipeline read into meshtrain's parameter tree and written back as a
directory `FluxTransformer2DModel.from_pretrained` loads.

The two are the same network (meshtrain's model was written on Black Forest Labs' reference); what differs is
where things are kept:
- diffusers stores PyTorch Linear weights [out, in]; meshtrain keeps [in, out] with heads as their own axis
  ([D, A, E] for q/k/v, [A, E, D] for the output projections) and each stack of blocks stacked on a leading layer
  axis, so `nn.scan` runs it.
- FluxPipeline packs 2x2 latent patches before the transformer, channel first (c, row, column), and the transformer
  itself has patch_size 1; meshtrain patchifies inside the model, (row, column, channel) as its other image
  models do. x_embedder's input rows and proj_out's output columns are permuted between the two orders.
- AdaLayerNormContinuous (norm_out) gives (scale, shift); Flux's reference and meshtrain take (shift, scale).
- A single-stream block's proj_out maps [attention output, MLP hidden] to the width in one matrix; meshtrain keeps
  the two parts apart (proj, mlp_down) so that each takes its own logical axes.
- Flux attends over its T5 prompt padded to max_sequence_length without a mask, adds CLIP's pooled vector to the
  timestep's, and dev adds a guidance embedding: FluxConfig's text_mask=False, pooled_width and guidance_embed.

Shape letters as in meshtrain/models/flux.py: D width, A heads, E head width, F MLP width, C latent channels,
X patch features (2 x 2 x C), M modulation vectors.
"""
import contextlib
import dataclasses
import json
import pathlib

import flax
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from meshtrain.errors import UserError
from meshtrain.interop import hf, weights
from meshtrain.models.flux import Flux, FluxConfig

CLASS_NAME = "FluxTransformer2DModel"
PATCH = 2  # FluxPipeline's packing: 2x2 latent patches, whatever the transformer's own config says (patch_size 1)
MLP_RATIO = 4  # diffusers' FeedForward (mult=4) and FluxSingleTransformerBlock (mlp_ratio=4.0) are fixed at 4
# The diffusers config keys this reads; another key (a newer variant's) is refused rather than silently ignored.
KNOWN_KEYS = {"patch_size", "in_channels", "out_channels", "num_layers", "num_single_layers", "attention_head_dim",
              "num_attention_heads", "joint_attention_dim", "pooled_projection_dim", "guidance_embeds",
              "axes_dims_rope"}


@dataclasses.dataclass(frozen=True)
class Tensor:
  """Where one diffusers tensor (or, for a single block's proj_out, a column range of it) lives in meshtrain's
  tree: `path` of the leaf, `layer` its index in a stacked leaf (None for unstacked ones), `how` the mapping
  (`to_meshtrain`), `hf_shape` the full diffusers tensor's shape, `cols` the column range taken."""
  path: tuple
  layer: int | None
  how: str
  hf_shape: tuple
  cols: tuple | None = None


def model_fields(hf: dict, where: str) -> dict:
  """meshtrain FluxConfig fields of the transformer config.json `hf` (read from `where`, for the messages). The
  image size and prompt length are not the transformer's (it takes any): the caller sets image_size and text_len."""
  if hf.get("_class_name") != CLASS_NAME:
    raise UserError(f"{where} is a {hf.get('_class_name')!r}, not a {CLASS_NAME}; pass the transformer/ directory "
                    "of a Flux pipeline")
  unknown = sorted(k for k in hf if not k.startswith("_") and k not in KNOWN_KEYS)
  if unknown:
    raise UserError(f"{where} sets {', '.join(unknown)}, which meshtrain's Flux does not model; not converted")
  get = lambda key, default: hf.get(key, default)
  channels, out = get("in_channels", 64), get("out_channels", None)
  heads, head = get("num_attention_heads", 24), get("attention_head_dim", 128)
  axes = tuple(get("axes_dims_rope", (16, 56, 56)))
  problems = [f"patch_size={get('patch_size', 1)} (FluxPipeline packs 2x2 patches itself: 1 expected)"
              if get("patch_size", 1) != 1 else "",
              f"in_channels={channels} (4 x the latent channels expected)" if channels % (PATCH * PATCH) else "",
              f"out_channels={out} differs from in_channels={channels}" if out not in (None, channels) else "",
              f"axes_dims_rope={list(axes)} (3 even numbers summing to attention_head_dim={head} expected)"
              if len(axes) != 3 or sum(axes) != head or any(d % 2 for d in axes) else ""]
  problems = [p for p in problems if p]
  if problems:
    raise UserError(f"{where}: {'; '.join(problems)}; not a Flux.1 transformer meshtrain converts")
  d = heads * head
  return dict(channels=channels // (PATCH * PATCH), patch_size=PATCH, d_model=d, num_heads=heads,
              mlp_dim=MLP_RATIO * d, double_layers=get("num_layers", 19), single_layers=get("num_single_layers", 38),
              axes_dim=axes, text_width=get("joint_attention_dim", 4096),
              pooled_width=get("pooled_projection_dim", 768), guidance_embed=bool(get("guidance_embeds", False)),
              text_norm=False, text_mask=False)


def diffusers_config(c: FluxConfig) -> dict:
  """The config.json of c's transformer as diffusers writes it (the inverse of `model_fields`)."""
  if c.patch_size != PATCH or c.mlp_dim != MLP_RATIO * c.d_model or c.text_norm or c.text_mask or not c.pooled_width:
    raise UserError("only a Flux.1-shaped model converts to diffusers' FluxTransformer2DModel (patch_size 2, "
                    f"mlp_dim 4 x d_model, unnormalised unmasked text features and a pooled vector); this one has "
                    f"patch_size={c.patch_size}, mlp_dim={c.mlp_dim}, text_norm={c.text_norm}, text_mask={c.text_mask}"
                    f", pooled_width={c.pooled_width}")
  return {"_class_name": CLASS_NAME, "patch_size": 1, "in_channels": c.channels * PATCH * PATCH,
          "out_channels": None, "num_layers": c.double_layers, "num_single_layers": c.single_layers,
          "attention_head_dim": c.head_dim, "num_attention_heads": c.num_heads, "joint_attention_dim": c.text_width,
          "pooled_projection_dim": c.pooled_width, "guidance_embeds": c.guidance_embed,
          "axes_dims_rope": list(c.axes_dim)}


def tensors(c: FluxConfig) -> dict:
  """(diffusers name, column part) -> Tensor, for every tensor a transformer of config c holds."""
  D, F, X, G = c.d_model, c.mlp_dim, c.patch_dim, c.text_width
  out = {}

  def add(name, path, how, hf_shape, layer=None, cols=None):
    out[(name, cols)] = Tensor(path, layer, how, hf_shape, cols)

  add("x_embedder.weight", ("img_in",), "patch_in", (D, X))
  add("x_embedder.bias", ("img_in_bias",), "b", (D,))
  add("context_embedder.weight", ("txt_in",), "w", (D, G))
  add("context_embedder.bias", ("txt_in_bias",), "b", (D,))
  embedders = [("timestep_embedder", "time", 256), ("text_embedder", "vector", c.pooled_width)]
  if c.guidance_embed:
    embedders.append(("guidance_embedder", "guidance", 256))
  for hf_name, ours, width in embedders:
    for i, (part, size) in enumerate((("in", width), ("out", D))):
      add(f"time_text_embed.{hf_name}.linear_{i + 1}.weight", (f"{ours}_{part}",), "w", (D, size))
      add(f"time_text_embed.{hf_name}.linear_{i + 1}.bias", (f"{ours}_{part}_bias",), "b", (D,))
  add("norm_out.linear.weight", ("final_mod", "w"), "scale_shift", (2 * D, D))
  add("norm_out.linear.bias", ("final_mod", "b"), "scale_shift_bias", (2 * D,))
  add("proj_out.weight", ("out",), "patch_out", (X, D))
  add("proj_out.bias", ("out_bias",), "patch_out_bias", (X,))

  def attention(prefix, stack, ours, layer, q, k, v, norm):
    for hf_name, p in ((q, "q"), (k, "k"), (v, "v")):
      add(f"{prefix}.{hf_name}.weight", (stack, ours, p), "w", (D, D), layer)
      add(f"{prefix}.{hf_name}.bias", (stack, ours, f"{p}_bias"), "b", (D,), layer)
    for p in ("q", "k"):
      add(f"{prefix}.{norm}_{p}.weight", (stack, ours, f"{p}_norm"), "b", (c.head_dim,), layer)

  for i in range(c.double_layers):
    p = f"transformer_blocks.{i}"
    for s, norm, ff, (q, k, v), norm_name, proj in (
        ("img", "norm1", "ff", ("to_q", "to_k", "to_v"), "norm", "to_out.0"),
        ("txt", "norm1_context", "ff_context", ("add_q_proj", "add_k_proj", "add_v_proj"), "norm_added", "to_add_out")):
      add(f"{p}.{norm}.linear.weight", ("double", f"{s}_mod", "w"), "w", (6 * D, D), i)
      add(f"{p}.{norm}.linear.bias", ("double", f"{s}_mod", "b"), "b", (6 * D,), i)
      attention(f"{p}.attn", "double", f"{s}_qkv", i, q, k, v, norm_name)
      add(f"{p}.attn.{proj}.weight", ("double", f"{s}_proj"), "o", (D, D), i)
      add(f"{p}.attn.{proj}.bias", ("double", f"{s}_proj_bias"), "b", (D,), i)
      add(f"{p}.{ff}.net.0.proj.weight", ("double", f"{s}_mlp", "up"), "w", (F, D), i)
      add(f"{p}.{ff}.net.0.proj.bias", ("double", f"{s}_mlp", "up_bias"), "b", (F,), i)
      add(f"{p}.{ff}.net.2.weight", ("double", f"{s}_mlp", "down"), "w", (D, F), i)
      add(f"{p}.{ff}.net.2.bias", ("double", f"{s}_mlp", "down_bias"), "b", (D,), i)
  for i in range(c.single_layers):
    p = f"single_transformer_blocks.{i}"
    add(f"{p}.norm.linear.weight", ("single", "mod", "w"), "w", (3 * D, D), i)
    add(f"{p}.norm.linear.bias", ("single", "mod", "b"), "b", (3 * D,), i)
    attention(f"{p}.attn", "single", "qkv", i, "to_q", "to_k", "to_v", "norm")
    add(f"{p}.proj_mlp.weight", ("single", "mlp_up"), "w", (F, D), i)
    add(f"{p}.proj_mlp.bias", ("single", "mlp_up_bias"), "b", (F,), i)
    add(f"{p}.proj_out.weight", ("single", "proj"), "o", (D, D + F), i, cols=(0, D))
    add(f"{p}.proj_out.weight", ("single", "mlp_down"), "w", (D, D + F), i, cols=(D, D + F))
    add(f"{p}.proj_out.bias", ("single", "proj_bias"), "b", (D,), i)
  return out


def to_meshtrain(how: str, w: np.ndarray, slot: np.ndarray) -> None:
  """Copies diffusers tensor `w` (already cut to its column part) into meshtrain's `slot` (a view of the leaf)."""
  if how == "b":  # biases, norm scales: [A*E] -> [A, E] or as they are
    slot[...] = w.reshape(slot.shape)
  elif how == "w":  # [out, in] -> [in, out...]
    slot.reshape(slot.shape[0], -1)[...] = w.T
  elif how == "o":  # [D, A*E] -> [A, E, D]
    slot.reshape(-1, slot.shape[-1])[...] = w.T
  elif how == "scale_shift":  # [2D (scale, shift), D] -> [D, 2 (shift, scale), D]
    slot[...] = w.T.reshape(slot.shape)[:, ::-1]
  elif how == "scale_shift_bias":
    slot[...] = w.reshape(slot.shape)[::-1]
  elif how == "patch_in":  # [D, (c, row, col)] -> [(row, col, c), D]
    C = w.shape[1] // (PATCH * PATCH)
    slot[...] = w.T.reshape(C, PATCH, PATCH, -1).transpose(1, 2, 0, 3).reshape(slot.shape)
  elif how == "patch_out":  # [(c, row, col), D] -> [D, (row, col, c)]
    C = w.shape[0] // (PATCH * PATCH)
    slot[...] = w.T.reshape(-1, C, PATCH, PATCH).transpose(0, 2, 3, 1).reshape(slot.shape)
  elif how == "patch_out_bias":
    slot[...] = w.reshape(-1, PATCH, PATCH).transpose(1, 2, 0).reshape(slot.shape)
  else:
    raise AssertionError(how)


def to_diffusers(how: str, ours: np.ndarray, hf_shape: tuple) -> np.ndarray:
  """The inverse of `to_meshtrain`: meshtrain's `ours` (one layer's) as the diffusers tensor (or column part) of
  `hf_shape`'s rows."""
  rows = hf_shape[0]
  if how == "b":
    return ours.reshape(hf_shape)
  if how == "w":
    return ours.reshape(ours.shape[0], rows).T
  if how == "o":
    return ours.reshape(-1, rows).T
  if how == "scale_shift":
    return ours[:, ::-1].reshape(ours.shape[0], rows).T
  if how == "scale_shift_bias":
    return ours[::-1].reshape(hf_shape)
  if how == "patch_in":
    C = ours.shape[0] // (PATCH * PATCH)
    return ours.reshape(PATCH, PATCH, C, -1).transpose(2, 0, 1, 3).reshape(-1, rows).T
  if how == "patch_out":
    C = ours.shape[1] // (PATCH * PATCH)
    return ours.reshape(-1, PATCH, PATCH, C).transpose(0, 3, 1, 2).reshape(-1, rows).T
  if how == "patch_out_bias":
    return ours.reshape(PATCH, PATCH, -1).transpose(2, 0, 1).reshape(hf_shape)
  raise AssertionError(how)


def check_tensors(expected: dict, shapes: dict, where: str) -> None:
  """`shapes` (diffusers name -> shape, from the safetensors headers) holds exactly the tensors `expected` names,
  with their shapes; else one UserError saying what differs."""
  names = {name: t.hf_shape for (name, _), t in expected.items()}
  unexpected = sorted(set(shapes) - set(names))
  if unexpected:
    raise UserError(f"{where} holds {len(unexpected)} tensor(s) a {CLASS_NAME} with its config.json has not, e.g. "
                    f"{unexpected[0]!r} (a LoRA, extra layers or another model); not converted")
  missing = sorted(set(names) - set(shapes))
  if missing:
    raise UserError(f"{where} lacks {len(missing)} tensor(s) its config.json implies, e.g. {missing[0]!r}; the "
                    "weights and config.json do not match")
  for name, shape in names.items():
    if tuple(shapes[name]) != tuple(shape):
      raise UserError(f"{where}: {name} has shape {list(shapes[name])}, config.json implies {list(shape)}; the "
                      "weights and config.json do not match")


def read_params(read, expected: dict, leaves: dict) -> dict:
  """Fills `leaves` (meshtrain leaf path -> numpy array of its full, stacked shape: zeros, or memory-mapped files)
  from `read(name, cols)`, which returns one diffusers tensor (or its column range) at a time; returns the nested
  tree of the leaves."""
  for (name, cols), t in expected.items():
    leaf = leaves[t.path]
    to_meshtrain(t.how, read(name, cols), leaf if t.layer is None else leaf[t.layer])
  tree = {}
  for path, leaf in leaves.items():
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = leaf
  return tree


def diffusers_tensors(expected: dict, leaf):
  """(diffusers name, array) pairs of meshtrain's parameters, one at a time: `leaf(path)` returns a leaf (numpy).
  A single block's proj_out is put back together from its two column parts. The names come leaf by leaf (every
  layer's q, then every layer's k, ...), so that a `leaf` reading a checkpoint needs each stacked leaf once, and
  two at a time for proj_out: the order of safetensors' files does not matter to diffusers."""
  parts = {}
  for (name, cols), t in expected.items():
    parts.setdefault(name, []).append((cols or (0, 0), t))
  first = lambda item: min(item[1], key=lambda p: p[0])[1]
  for name, pieces in sorted(parts.items(), key=lambda item: (first(item).path, first(item).layer or 0)):
    arrays = []
    for _, t in sorted(pieces, key=lambda p: p[0]):
      w = leaf(t.path)
      w = np.asarray(w if t.layer is None else w[t.layer])
      shape = t.hf_shape if t.cols is None else (t.hf_shape[0], t.cols[1] - t.cols[0])
      arrays.append(to_diffusers(t.how, w, shape))
    yield name, np.ascontiguousarray(arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=1))


def leaf_shapes(c: FluxConfig) -> dict:
  """meshtrain leaf path -> shape of the model of config c (traced, nothing allocated; the parameters do not depend
  on the image size or prompt length, so the smallest of each is traced)."""
  text = {"text_features": jax.ShapeDtypeStruct((1, 1, c.text_width), jnp.float32),
          "text_keep": jax.ShapeDtypeStruct((1, 1), jnp.bool_),
          "text_pooled": jax.ShapeDtypeStruct((1, max(c.pooled_width, 1)), jnp.float32)}
  image = jax.ShapeDtypeStruct((1, c.patch_size, c.patch_size, c.channels), jnp.float32)
  guidance = jax.ShapeDtypeStruct((1,), jnp.float32) if c.guidance_embed else None
  shapes = jax.eval_shape(lambda x, t, txt, g: Flux(c).init(jax.random.key(0), x, t, txt, g), image,
                          jax.ShapeDtypeStruct((1,), jnp.float32), text, guidance)
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(flax.linen.meta.unbox(shapes["params"])))
  return {path: tuple(leaf.shape) for path, leaf in flat.items()}


def read_transformer(src: pathlib.Path, image_size: int, text_len: int, text_encoder: str, allocate=None) -> tuple:
  """(FluxConfig, parameter tree of numpy arrays) of the diffusers transformer directory `src`, every tensor checked
  against its config.json by the safetensors headers before any is read. `text_encoder` names where the model's
  prompt features come from (FluxConfig.text_encoder). `allocate(path, shape, dtype)` makes each leaf's array
  (default: zeros in memory; the converter passes memory-mapped files, so a model larger than memory converts)."""
  config = src / "config.json"
  if not config.is_file():
    raise UserError(f"{str(src)!r} has no config.json; pass the transformer/ directory of a diffusers Flux pipeline")
  try:
    hf_config = json.loads(config.read_text())
  except json.JSONDecodeError as e:
    raise UserError(f"{str(config)!r} is not JSON ({e}); re-save the model") from None
  fields = model_fields(hf_config, repr(str(config)))
  c = FluxConfig(image_size=image_size, text_len=text_len, text_layers=0, text_heads=1, text_mlp_dim=0,
                 text_encoder=text_encoder, **fields)
  files = weights.weight_files(src)
  headers, dtypes = {}, set()
  for file in sorted(set(files.values())):
    with weights.open_safetensors(file) as f:
      for name in f.keys():
        piece = f.get_slice(name)
        headers[name] = tuple(piece.get_shape())
        dtypes.add(piece.get_dtype())
  expected = tensors(c)
  check_tensors(expected, headers, repr(str(src)))
  if not dtypes <= set(weights.PARAM_DTYPES):
    raise UserError(f"{str(src)!r} holds {sorted(dtypes - set(weights.PARAM_DTYPES))[0]} tensors; meshtrain converts "
                    "float32, bfloat16 and float16 weights")
  param_dtype = "bfloat16" if dtypes == {"BF16"} else "float32"
  c = dataclasses.replace(c, param_dtype=param_dtype)
  dtype = np.dtype(ml_dtypes.bfloat16) if param_dtype == "bfloat16" else np.dtype(np.float32)
  allocate = allocate or (lambda path, shape, dtype: np.zeros(shape, dtype))
  leaves = {path: allocate(path, shape, dtype) for path, shape in leaf_shapes(c).items()}
  with contextlib.ExitStack() as stack:
    handles = {file: stack.enter_context(weights.open_safetensors(file)) for file in set(files.values())}

    def read(name, cols):
      piece = handles[files[name]].get_slice(name)
      return piece[:, cols[0]:cols[1]] if cols else piece[:]

    return c, read_params(read, expected, leaves)


def write_transformer(out: pathlib.Path, c: FluxConfig, params: dict) -> None:
  """Writes `params` (numpy or JAX arrays) as a diffusers FluxTransformer2DModel directory at `out` (absent or
  empty): config.json and diffusion_pytorch_model*.safetensors, staged beside it and renamed when complete."""
  diffusers_config(c)  # a model diffusers cannot hold is refused before anything is written
  hf.check_output(out, "--out")
  flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(params))
  expected = tensors(c)
  missing = sorted({t.path for t in expected.values()} - set(flat))
  if missing:
    raise UserError(f"the parameters lack {'/'.join(missing[0])}; not a Flux.1-shaped meshtrain checkpoint")
  with hf.staged(out) as tmp:
    write_files(tmp, c, lambda path: np.asarray(flat[path]))


def write_files(directory: pathlib.Path, c: FluxConfig, leaf) -> None:
  """The transformer's config.json and safetensors files into `directory`, its parameters from `leaf(path)`."""
  weights.write_safetensors(directory, diffusers_tensors(tensors(c), leaf), stem="diffusion_pytorch_model")
  (directory / "config.json").write_text(json.dumps(diffusers_config(c), indent=2))
