"""diffusers' AutoencoderKL directories in and out (`read`, `write`): config.json and
diffusion_pytorch_model.safetensors (or its shards and index), what `AutoencoderKL.save_pretrained` writes and a
diffusers pipeline keeps in its vae/ folder, as meshtrain/models/vae.py's VAEConfig and parameter tree.

Names: a diffusers tensor name is the Flax parameter path with each list index split from its name
(encoder/down_blocks_0/resnets_1/conv1/kernel <-> encoder.down_blocks.0.resnets.1.conv1.weight; a GroupNorm's
scale is its weight). Older checkpoints name the mid block's attention query / key / value / proj_attn; diffusers
renames those on load to to_q / to_k / to_v / to_out.0, and so does `read` (the shapes are the same).
Layouts: conv weights OIHW (torch) <-> HWIO (JAX), linear weights [out, in] <-> [in, out], the rest as they are.
Which tensors there are, and their shapes, comes from the Flax model itself (vae.param_shapes), so the two
cannot disagree.

Both stream one tensor at a time through safetensors' numpy API (meshtrain/interop/weights.py; no torch): `read`
holds the parameter tree it returns plus one tensor, `write` the tree plus one shard. Every check (the config, which
tensors are there, their shapes and dtypes; on write, the tree against the config) runs before anything is read
or written, and `write` stages its output beside the target and renames it into place when complete (hf.staged):
a refused or failed write leaves no output directory.
"""
import json
import math
import pathlib
import re
from collections.abc import Mapping

import ml_dtypes  # registers bfloat16 with numpy: safetensors' numpy API then reads BF16 tensors
import numpy as np

from meshtrain.errors import UserError
from meshtrain.interop import hf, weights
from meshtrain.models import vae

CLASS_NAME = "AutoencoderKL"
# diffusers' weights file name: STEM.safetensors, or shards and STEM.safetensors.index.json
STEM = "diffusion_pytorch_model"
OLD_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}
READ_DTYPES = ("F32", "F16", "BF16")  # all widen to float32 exactly
WRITE_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                "float16": np.dtype(np.float16)}


def read(vae_dir, dtype: str = "float32") -> tuple[vae.VAEConfig, dict]:
  """The VAEConfig (compute dtype `dtype`) and the parameter tree (float32 numpy arrays: device_put them once
  before encoding many batches) of the diffusers AutoencoderKL saved in `vae_dir`."""
  src = pathlib.Path(vae_dir).expanduser()
  if not src.is_dir():
    raise UserError(f"{str(vae_dir)!r} is not a directory; pass the directory AutoencoderKL.save_pretrained wrote "
                    "(a diffusers pipeline's vae/ folder)")
  cfg = read_config(src, dtype)
  table = tensor_table(cfg)
  files = stored_files(src)
  stored = stored_names(files, table, src)
  by_file = {}
  for name, held in stored.items():
    by_file.setdefault(files[held], []).append(name)
  check_stored(by_file, stored, table)
  params = {}
  for file, names in by_file.items():
    with weights.open_safetensors(file) as f:
      for name in names:
        path, _ = table[name]
        node = params
        for key in path[:-1]:
          node = node.setdefault(key, {})
        node[path[-1]] = np.ascontiguousarray(flax_layout(f.get_tensor(stored[name])), dtype=np.float32)
  return cfg, params


def write(out_dir, cfg: vae.VAEConfig, params: Mapping, dtype: str = "float32") -> pathlib.Path:
  """Writes `params` (a tree as `read` returns, numpy or JAX arrays) as a diffusers AutoencoderKL directory at
  `out_dir` (absent or empty), its tensors stored in `dtype` (float32, bfloat16, float16); returns its path."""
  target = pathlib.Path(out_dir).expanduser()
  if dtype not in WRITE_DTYPES:
    raise UserError(f"dtype {dtype!r} is not one diffusers' weights are stored in; pass one of {list(WRITE_DTYPES)}")
  hf.check_output(target, "the output directory")
  table = tensor_table(cfg)
  flat = check_tree(flatten(params), {path: shape for path, shape in table.values()})
  out = WRITE_DTYPES[dtype]
  hf.check_space(target, sum(math.prod(shape) for _, shape in table.values()) * out.itemsize + (1 << 20),
                 f"writing the VAE to {str(target)!r}")
  with hf.staged(target) as tmp:
    (tmp / "config.json").write_text(json.dumps({"_class_name": CLASS_NAME, **cfg.to_diffusers()}, indent=2,
                                                sort_keys=True) + "\n")
    tensors = ((name, np.ascontiguousarray(torch_layout(np.asarray(flat[path])), dtype=out))
               for name, (path, _) in table.items())
    weights.write_safetensors(tmp, tensors, stem=STEM)
  return target


def check_tree(flat: dict, expected: dict) -> dict:
  """`flat` (Flax path -> array) holds exactly the parameters of `expected` (path -> shape), with their shapes."""
  if flat and all(path[0] == "params" for path in flat):
    raise UserError("the parameter tree is a variables dict (its one key is 'params'); pass params['params'], the "
                    "tree under the collection (nothing was written)")
  extra = sorted(set(flat) - set(expected))
  if extra:
    raise UserError(f"the parameter tree has {len(extra)} parameter(s) an AutoencoderKL with this config has not, "
                    f"e.g. {'/'.join(extra[0])}; pass the tree `read` (or the model's init) made for this config "
                    "(nothing was written)")
  missing = [path for path in expected if path not in flat]
  if missing:
    raise UserError(f"the parameter tree lacks {len(missing)} parameter(s) this config implies, e.g. "
                    f"{'/'.join(missing[0])}; nothing was written")
  for path, shape in expected.items():
    if tuple(np.shape(flat[path])) != shape:
      raise UserError(f"parameter {'/'.join(path)} has shape {list(np.shape(flat[path]))}, this config implies "
                      f"{list(shape)}; the tree and the config do not match (nothing was written)")
  return flat


def read_config(src: pathlib.Path, dtype: str) -> vae.VAEConfig:
  path = src / "config.json"
  if not path.is_file():
    hint = (f" (it holds a pipeline's model_index.json: pass its vae/ folder, {str(src / 'vae')!r})"
            if (src / "model_index.json").is_file() else "")
    raise UserError(f"{str(src)!r} has no config.json{hint}; pass the directory AutoencoderKL.save_pretrained wrote")
  try:
    config = json.loads(path.read_text())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise UserError(f"{str(path)!r} is not JSON ({e}); re-download or re-save the VAE") from None
  if not isinstance(config, dict) or config.get("_class_name") != CLASS_NAME:
    found = config.get("_class_name") if isinstance(config, dict) else None
    raise UserError(f"{str(path)!r} describes a {found or 'model without _class_name'}, not an AutoencoderKL; pass "
                    "a diffusers AutoencoderKL's directory (a pipeline's vae/ folder)")
  return vae.VAEConfig.from_diffusers(config, str(path), dtype)


def stored_files(src: pathlib.Path) -> dict:
  """diffusers tensor name -> the safetensors file holding it: STEM.safetensors, or the shards its index names.
  Only those: variants beside them (STEM.fp16.safetensors) would hold the same names."""
  if (src / f"{STEM}.safetensors.index.json").is_file():
    return weights.weight_files(src)
  single = src / f"{STEM}.safetensors"
  if single.is_file():
    with weights.open_safetensors(single) as f:
      return {name: single for name in f.keys()}
  others = sorted(p.name for p in src.iterdir() if p.suffix in (".safetensors", ".bin", ".ckpt", ".pth"))
  hint = f" (it has {', '.join(others[:3])}: rename the safetensors variant to use to {STEM}.safetensors, or " \
         "re-save with save_pretrained(..., safe_serialization=True))" if others else ""
  raise UserError(f"{str(src)!r} has no {STEM}.safetensors nor its shard index{hint}; pass the directory "
                  "AutoencoderKL.save_pretrained wrote")


def stored_names(files: dict, table: dict, src: pathlib.Path) -> dict:
  """Expected diffusers name -> the name it is stored under (the same, or its old attention name); a UserError
  for a missing or unexpected tensor."""
  renamed = {}
  for name in files:
    new = re.sub(r"(\.attentions\.\d+\.)(query|key|value|proj_attn)\.",
                 lambda m: f"{m[1]}{OLD_ATTENTION[m[2]]}.", name)
    if new in renamed:
      raise UserError(f"{str(src)!r} holds both {renamed[new]!r} and {name!r}, the new and old names of one tensor; "
                      "re-save the VAE with diffusers (AutoencoderKL.from_pretrained, then save_pretrained)")
    renamed[new] = name
  decides = ("block_out_channels, layers_per_block, latent_channels, use_quant_conv, use_post_quant_conv and "
             "mid_block_add_attention decide which tensors there are")
  unexpected = sorted(set(renamed) - set(table))
  if unexpected:
    raise UserError(f"{str(src)!r} holds {len(unexpected)} tensor(s) an AutoencoderKL with its config.json has not, "
                    f"e.g. {renamed[unexpected[0]]!r} ({decides}); the weights and config.json do not match")
  missing = [name for name in table if name not in renamed]
  if missing:
    raise UserError(f"{str(src)!r} lacks {len(missing)} tensor(s) its config.json implies, e.g. {missing[0]!r} "
                    f"({decides}); the weights and config.json do not match")
  return {name: renamed[name] for name in table}


def check_stored(by_file: dict, stored: dict, table: dict) -> None:
  """Every tensor is where the index says, with the shape the config implies and a float dtype (headers only)."""
  for file, names in by_file.items():
    with weights.open_safetensors(file) as f:
      held = set(f.keys())
      for name in names:
        if stored[name] not in held:  # an index naming the wrong shard
          raise UserError(f"{STEM}.safetensors.index.json puts {stored[name]} in {file.name}, which does not hold "
                          "it; fix the index or re-save the VAE")
        piece = f.get_slice(stored[name])
        shape, dtype = tuple(piece.get_shape()), piece.get_dtype()
        expected = torch_shape(table[name][1])
        if shape != expected:
          raise UserError(f"{file.name}: {stored[name]} has shape {list(shape)}, config.json implies "
                          f"{list(expected)}; the weights and config.json do not match")
        if dtype not in READ_DTYPES:
          raise UserError(f"{file.name}: {stored[name]} is {dtype}; meshtrain reads float32, bfloat16 and float16 "
                          "weights")


def tensor_table(cfg: vae.VAEConfig) -> dict:
  """diffusers tensor name -> (Flax parameter path, Flax shape), in the tree's order."""
  return {diffusers_name(path): (path, tuple(leaf.shape)) for path, leaf in flatten(vae.param_shapes(cfg)).items()}


def diffusers_name(path: tuple[str, ...]) -> str:
  parts = []
  for key in path[:-1]:
    indexed = re.fullmatch(r"(.+)_(\d+)", key)  # down_blocks_0 -> down_blocks.0; conv_in stays
    parts += [indexed[1], indexed[2]] if indexed else [key]
  return ".".join([*parts, "bias" if path[-1] == "bias" else "weight"])


def flatten(tree: Mapping, prefix: tuple[str, ...] = ()) -> dict:
  out = {}
  for key, value in tree.items():
    out.update(flatten(value, (*prefix, key)) if isinstance(value, Mapping) else {(*prefix, key): value})
  return out


def torch_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
  """The diffusers (torch) shape of a Flax parameter of `shape`: HWIO -> OIHW, [in, out] -> [out, in]."""
  if len(shape) == 4:
    return (shape[3], shape[2], shape[0], shape[1])
  return shape[::-1] if len(shape) == 2 else shape


def torch_layout(w: np.ndarray) -> np.ndarray:
  if w.ndim == 4:
    return w.transpose(3, 2, 0, 1)
  return w.T if w.ndim == 2 else w


def flax_layout(w: np.ndarray) -> np.ndarray:
  if w.ndim == 4:
    return w.transpose(2, 3, 1, 0)
  return w.T if w.ndim == 2 else w
