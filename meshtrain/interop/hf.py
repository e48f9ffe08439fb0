"""Hugging Face checkpoints in and out (`from_hf`, `to_hf`): the library of `python -m meshtrain.convert`, for the
families of meshtrain/interop/hf_config.py (Llama, Mistral, Qwen2, Qwen3, Mixtral).

from_hf writes W/checkpoints/0 (parameters only, meta `params_only`), W/config.json (the matching meshtrain
config) and W/tokenizer/ (the model's tokenizer files), so `python -m meshtrain.generate --workdir W` and
`train --config.init_from=W` work on it. to_hf writes safetensors, config.json (the family's architecture) and the
tokenizer, loadable by transformers' AutoModelForCausalLM and AutoTokenizer.

Both stream, so that a model larger than the free memory converts: the process holds about its largest stored
array (a stack of every layer's up_proj, say) plus one tensor (from_hf) or one output shard (to_hf), not the
model. Safetensors are read and written one tensor at a time through their numpy API (no torch;
meshtrain/interop/weights.py). from_hf copies each tensor into its slot of a stacked array memory-mapped from a file
in the staged output (page cache, not the process's memory), then Orbax writes the arrays one at a time; to_hf
restores one stored array at a time. Output goes to a temporary directory beside the target, renamed into place at
the end: a failed conversion leaves nothing behind. Tokenizer files: meshtrain/interop/hf_tokenizer.py.

Layouts (HF's Linear stores weight [out, in]; meshtrain stores [in, out] with heads as their own axes):
  q_proj [H*E, D] -> q [D, H, E]      k_proj, v_proj [K*E, D] -> k, v [D, K, E]      o_proj [D, H*E] -> o [H, E, D]
  q_proj.bias [H*E] -> q_bias [H, E]   k_proj.bias, v_proj.bias [K*E] -> k_bias, v_bias [K, E]          (Qwen2)
  q_norm, k_norm [E] -> q_norm.scale, k_norm.scale [E]                                                  (Qwen3)
  gate_proj, up_proj [F, D] -> [D, F]  down_proj [D, F] -> [F, D]   embed_tokens [V, D] = embedding [V, D]
  block_sparse_moe.gate [X, D] -> moe.router [D, X]; experts.j.w1, w3 [F, D] -> moe.gate[j], moe.up[j] [D, F];
  experts.j.w2 [D, F] -> moe.down[j] [F, D]                                                             (Mixtral)
  lm_head [V, D] -> head [D, V]        *_layernorm, norm [D] -> scale [D]
The rotary convention is the same on both sides (rotate-half: the first and second half of each head form the
pairs), so no permutation of q/k rows is needed; tests/test_convert.py checks logits and greedy tokens against
transformers for every family.

JAX and Orbax (meshtrain.checkpoint) are imported inside the functions, after the arguments are checked:
`python -m meshtrain.convert` refuses a bad argument without loading them.
"""
import contextlib
import json
import math
import os
import pathlib
import shutil
import signal
import threading

import ml_dtypes
import numpy as np

from meshtrain import checkpoint, config as config_lib
from meshtrain.errors import UserError
from meshtrain.interop import hf_config, hf_tokenizer, weights
from meshtrain.runtime import host

# A layer's tensors: HF name (after model.layers.N.; {x} is the expert), meshtrain parameter path in the layer,
# how the HF tensor maps onto it (copy: as is; bias: [H*E] -> [H, E]; t: [out, in] -> [in, out...]; o: [D, H*E] ->
# [H, E, D]),
# and the HF shape, from the model fields (D, H, K, E, F, X).
ATTENTION_TENSORS = (
    ("input_layernorm.weight", ("attn_norm", "scale"), "copy", lambda s: (s.D,)),
    ("self_attn.q_proj.weight", ("attn", "q"), "t", lambda s: (s.H * s.E, s.D)),
    ("self_attn.k_proj.weight", ("attn", "k"), "t", lambda s: (s.K * s.E, s.D)),
    ("self_attn.v_proj.weight", ("attn", "v"), "t", lambda s: (s.K * s.E, s.D)),
    ("self_attn.o_proj.weight", ("attn", "o"), "o", lambda s: (s.D, s.H * s.E)),
    ("post_attention_layernorm.weight", ("mlp_norm", "scale"), "copy", lambda s: (s.D,)))
BIAS_TENSORS = (("self_attn.q_proj.bias", ("attn", "q_bias"), "bias", lambda s: (s.H * s.E,)),
                ("self_attn.k_proj.bias", ("attn", "k_bias"), "bias", lambda s: (s.K * s.E,)),
                ("self_attn.v_proj.bias", ("attn", "v_bias"), "bias", lambda s: (s.K * s.E,)))
QK_NORM_TENSORS = (("self_attn.q_norm.weight", ("attn", "q_norm", "scale"), "copy", lambda s: (s.E,)),
                   ("self_attn.k_norm.weight", ("attn", "k_norm", "scale"), "copy", lambda s: (s.E,)))
MLP_TENSORS = (("mlp.gate_proj.weight", ("mlp", "gate"), "t", lambda s: (s.F, s.D)),
               ("mlp.up_proj.weight", ("mlp", "up"), "t", lambda s: (s.F, s.D)),
               ("mlp.down_proj.weight", ("mlp", "down"), "t", lambda s: (s.D, s.F)))
MOE_TENSORS = (("block_sparse_moe.gate.weight", ("moe", "router"), "t", lambda s: (s.X, s.D)),
               ("block_sparse_moe.experts.{x}.w1.weight", ("moe", "gate"), "t", lambda s: (s.F, s.D)),
               ("block_sparse_moe.experts.{x}.w3.weight", ("moe", "up"), "t", lambda s: (s.F, s.D)),
               ("block_sparse_moe.experts.{x}.w2.weight", ("moe", "down"), "t", lambda s: (s.D, s.F)))


class Sizes:
  """The model fields' sizes by their shape letters (llama.py's)."""

  def __init__(self, m: dict):
    self.N, self.D, self.H, self.K, self.E, self.F, self.V = (
        m[k] for k in ("num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "vocab_size"))
    self.X = m.get("num_experts", 0)


def layer_tensors(m: dict) -> tuple:
  """The per-layer tensor table (see ATTENTION_TENSORS) of a model with fields `m`."""
  return (ATTENTION_TENSORS + (BIAS_TENSORS if m.get("attention_bias") else ())
          + (QK_NORM_TENSORS if m.get("qk_norm") else ()) + (MOE_TENSORS if m.get("num_experts") else MLP_TENSORS))


# ----------------------------------------------------------------------------------------------------------------
# Output directories: written beside the target under a temporary name, renamed into place when complete.

def existing_parent(path: pathlib.Path) -> pathlib.Path:
  """The nearest directory above `path` that exists: where it would be created."""
  parent = path.absolute().parent
  while not parent.exists():
    parent = parent.parent
  return parent


def check_output(path: pathlib.Path, flag: str) -> None:
  """`path` may be created: absent, or an empty directory, with a writable parent."""
  if path.exists() or path.is_symlink():
    if not path.is_dir():
      raise UserError(f"{flag} {str(path)!r} exists and is not a directory; pass a new directory")
    if any(path.iterdir()):
      raise UserError(f"{flag} {str(path)!r} exists and is not empty; pass a new or empty directory (nothing was "
                      "overwritten)")
  parent = existing_parent(path)
  if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
    raise UserError(f"{flag} {str(path)!r} cannot be created: {str(parent)!r} is not a writable directory")


class Interrupts:
  """Ctrl-C (SIGINT), SIGTERM or SIGHUP during a conversion, noted by a handler and raised as KeyboardInterrupt at
  `check()` points in the conversion's own code (between tensors, before the final rename), so that the staged
  directory is removed whatever signal ends it (SIGKILL cannot be caught: the next conversion removes what it
  leaves, see staged()). Raised wherever the main thread happens to be, it could land inside Orbax's or
  TensorStore's waits, which swallowed it (the export finished, exit 0) or turned it into their own traceback.
  Outside the main thread (no signal handler possible) check() does nothing."""
  _pending = False
  SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

  @classmethod
  @contextlib.contextmanager
  def deferred(cls):
    if threading.current_thread() is not threading.main_thread():
      yield
      return
    cls._pending = False
    previous = {sig: signal.signal(sig, lambda *_: setattr(cls, "_pending", True)) for sig in cls.SIGNALS}
    try:
      yield
    finally:
      for sig, handler in previous.items():
        signal.signal(sig, handler)
      cls._pending = False

  @classmethod
  def check(cls) -> None:
    if cls._pending:
      cls._pending = False
      raise KeyboardInterrupt


def check_space(path: pathlib.Path, needed: int, what: str) -> None:
  """Refuses, before anything is written, an output whose file system has less than `needed` bytes free."""
  parent = existing_parent(path)
  free = shutil.disk_usage(parent).free
  if free < needed:
    raise UserError(f"{what} needs {needed / 1e9:.2f} GB of disk space in {str(parent)!r}, which has "
                    f"{free / 1e9:.2f} GB free; free some space or write elsewhere (nothing was written)")


@contextlib.contextmanager
def staged(target: pathlib.Path):
  """Yields a fresh directory beside `target` (same file system, so the final rename is atomic); renames it to
  `target` on success, removes it on any failure, Ctrl-C included (see Interrupts)."""
  target = target.absolute()
  target.parent.mkdir(parents=True, exist_ok=True)
  for left in target.parent.glob(f".{target.name}.partial-*"):  # left by conversions killed with SIGKILL
    if not host.process_alive(left.name.rpartition("-")[2]):
      shutil.rmtree(left, ignore_errors=True)
  tmp = target.with_name(f".{target.name}.partial-{os.getpid()}")
  shutil.rmtree(tmp, ignore_errors=True)  # left by a killed earlier conversion with the same pid
  tmp.mkdir()
  try:
    yield tmp
    Interrupts.check()
    if target.is_dir():
      target.rmdir()  # empty (checked before starting); rename cannot replace a directory on every system
    tmp.rename(target)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face -> meshtrain

def hf_tensors(m: dict) -> dict:
  """HF tensor name -> (meshtrain parameter path, index into it (layer, expert), HF shape, mapping) for model
  fields `m`."""
  s = Sizes(m)
  out = {"model.embed_tokens.weight": (("embedding",), (), (s.V, s.D), "copy"),
         "model.norm.weight": (("final_norm", "scale"), (), (s.D,), "copy")}
  if not m["tie_embeddings"]:
    out["lm_head.weight"] = (("head",), (), (s.V, s.D), "t")
  for i in range(s.N):
    for name, path, how, shape in layer_tensors(m):
      for x in range(s.X) if "{x}" in name else [None]:
        index = (i,) if x is None else (i, x)
        out[f"model.layers.{i}.{name.format(x=x)}"] = (("layers", *path), index, shape(s), how)
  return out


def meshtrain_shapes(m: dict) -> dict:
  """meshtrain parameter path -> shape (stacked over layers), the Flax tree's layout (see the module docstring)."""
  s = Sizes(m)
  shapes = {("embedding",): (s.V, s.D), ("final_norm", "scale"): (s.D,)}
  layer = {("attn_norm", "scale"): (s.D,), ("mlp_norm", "scale"): (s.D,), ("attn", "q"): (s.D, s.H, s.E),
           ("attn", "k"): (s.D, s.K, s.E), ("attn", "v"): (s.D, s.K, s.E), ("attn", "o"): (s.H, s.E, s.D),
           ("attn", "q_bias"): (s.H, s.E), ("attn", "k_bias"): (s.K, s.E), ("attn", "v_bias"): (s.K, s.E),
           ("attn", "q_norm", "scale"): (s.E,), ("attn", "k_norm", "scale"): (s.E,),
           ("mlp", "gate"): (s.D, s.F), ("mlp", "up"): (s.D, s.F), ("mlp", "down"): (s.F, s.D),
           ("moe", "router"): (s.D, s.X), ("moe", "gate"): (s.X, s.D, s.F), ("moe", "up"): (s.X, s.D, s.F),
           ("moe", "down"): (s.X, s.F, s.D)}
  for _, path, _, _ in layer_tensors(m):
    shapes[("layers", *path)] = (s.N, *layer[path])
  if not m["tie_embeddings"]:
    shapes[("head",)] = (s.D, s.V)
  return shapes


def check_tensors(files: dict, m: dict, hf_dir: pathlib.Path) -> str:
  """Every tensor the config implies is present with its shape, nothing unexpected is there; returns the
  param_dtype that holds the weights exactly. Reads only the safetensors headers."""
  expected = hf_tensors(m)
  ignored = {n for n in files if n.endswith("rotary_emb.inv_freq")}  # a buffer older transformers saved
  if m["tie_embeddings"]:
    ignored |= {"lm_head.weight"} & files.keys()  # some tied checkpoints store the shared matrix twice
  unexpected = sorted(set(files) - set(expected) - ignored)
  if unexpected:
    raise UserError(f"{str(hf_dir)!r} holds {len(unexpected)} tensor(s) a {hf_config.FAMILIES[m['family']]} with this "
                    f"config.json has not, e.g. {unexpected[0]!r} (biases, extra layers or another architecture); not "
                    "converted")
  missing = [n for n in expected if n not in files]
  if missing:
    hint = (" (tie_word_embeddings is false but there is no lm_head: set it to true if the head is the embedding)"
            if missing == ["lm_head.weight"] else "")
    raise UserError(f"{str(hf_dir)!r} lacks {len(missing)} tensor(s) its config.json implies, e.g. {missing[0]!r}"
                    f"{hint}; the weights and config.json do not match")
  dtypes = set()
  by_file = {}
  for name in expected:
    by_file.setdefault(files[name], []).append(name)
  for file, names in by_file.items():
    with weights.open_safetensors(file) as f:
      held = set(f.keys())
      for name in names:
        if name not in held:  # an index naming the wrong shard
          raise UserError(f"model.safetensors.index.json puts {name} in {file.name}, which does not hold it; fix "
                          "the index or re-save the model")
        piece = f.get_slice(name)
        shape, dtype = tuple(piece.get_shape()), piece.get_dtype()
        if shape != expected[name][2]:
          raise UserError(f"{file.name}: {name} has shape {list(shape)}, config.json implies "
                          f"{list(expected[name][2])}; the weights and config.json do not match")
        if dtype not in weights.PARAM_DTYPES:
          raise UserError(f"{file.name}: {name} is {dtype}; meshtrain converts float32, bfloat16 and float16 weights")
        dtypes.add(dtype)
  # One storage dtype for all parameters (meshtrain has one param_dtype): bfloat16 only if every tensor is.
  return "bfloat16" if dtypes == {"BF16"} else "float32"


def _to_meshtrain(how: str, w: np.ndarray, out: np.ndarray) -> None:
  """Copies HF tensor `w` into the meshtrain slot `out` (a view into the stacked array) by mapping `how`
  (ATTENTION_TENSORS), transposing on the way: writing through a reshaped view of the slot avoids a temporary of
  the transposed tensor."""
  if how in ("copy", "bias"):  # norms, embedding, biases ([H*E] -> [H, E])
    np.copyto(out.reshape(w.shape), w, casting="same_kind")
  elif how == "o":  # [D, H*E] -> [H, E, D]
    np.copyto(out.reshape(-1, out.shape[-1]), w.T, casting="same_kind")
  else:  # [out, in] -> [in, out...]: q, k, v ([D, H, E] slots), gate, up, down, router, experts, lm_head
    np.copyto(out.reshape(out.shape[0], -1), w.T, casting="same_kind")


def from_hf(hf_dir: str, workdir: str) -> pathlib.Path:
  """Converts the Hugging Face model in `hf_dir` (a family of hf_config.FAMILIES) into a meshtrain workdir;
  returns its path."""
  src, target = pathlib.Path(hf_dir).expanduser(), pathlib.Path(workdir).expanduser()
  if not src.is_dir():
    raise UserError(f"HF_DIR {hf_dir!r} is not a directory; pass a Hugging Face model directory (config.json and "
                    "*.safetensors)")
  check_output(target, "--workdir")
  m = hf_config.read(src)
  files = weights.weight_files(src)
  param_dtype = check_tensors(files, m, src)
  tokenizer_files = hf_tokenizer.tokenizer_files(src)
  tokenizer = hf_tokenizer.tokenizer_record(tokenizer_files, m["vocab_size"], src)
  cfg = _meshtrain_config(m, param_dtype, tokenizer_files, target)
  itemsize = stored_dtype(param_dtype).itemsize
  param_bytes = sum(math.prod(shape) * itemsize for shape in meshtrain_shapes(m).values())
  # The staged arrays and the checkpoint written from them are on disk together, until the former are removed.
  check_space(target, 2 * param_bytes + sum(f.stat().st_size for f in tokenizer_files) + (1 << 20),
              f"converting {str(src)!r}")

  # Everything checked: from here on only the machine can fail, and the staged directory is removed if it does.
  with staged(target) as tmp:
    staging = tmp / ".params"
    params = _read_weights(files, m, param_dtype, staging)
    if tokenizer_files:
      (tmp / "tokenizer").mkdir()
      for file in tokenizer_files:
        shutil.copyfile(file, tmp / "tokenizer" / file.name)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    meta = {"config": cfg, "params_only": True, "tokenizer": tokenizer, "layer_order": "sequential",
            "source": {"format": "huggingface", "architecture": hf_config.FAMILIES[m["family"]],
                       "path": str(src.absolute()),
                       "dtype": param_dtype}}
    weights.save_params(tmp, params, meta)
    del params  # unmaps the staged arrays, so that removing their files frees the disk space
    shutil.rmtree(staging)
  return target


def stored_dtype(param_dtype: str) -> np.dtype:
  """The numpy dtype from-hf stores parameters of `param_dtype` ("bfloat16" or "float32") in."""
  return np.dtype(ml_dtypes.bfloat16) if param_dtype == "bfloat16" else np.dtype(np.float32)


def _read_weights(files: dict, m: dict, param_dtype: str, staging: pathlib.Path) -> dict:
  """The meshtrain parameter tree of the HF tensors in `files`, in np.memmap arrays under `staging`: each HF
  tensor is read, copied into its slot of the stacked array (transposed on the way) and dropped. Memory-mapped,
  the model is page cache the kernel writes back and drops under pressure, not memory the process holds: a model
  larger than the free memory converts."""
  dtype = stored_dtype(param_dtype)
  staging.mkdir()
  params = {}
  for path, shape in meshtrain_shapes(m).items():
    node = params
    for key in path[:-1]:
      node = node.setdefault(key, {})
    file = staging / ".".join(path)
    # Its blocks reserved now: a memory-mapped file that the disk cannot hold ends the process with SIGBUS when the
    # page is written back; reserved, a full disk is an OSError here.
    with open(file, "wb") as f:
      if math.prod(shape):
        os.posix_fallocate(f.fileno(), 0, math.prod(shape) * dtype.itemsize)
    node[path[-1]] = np.memmap(file, dtype, mode="r+", shape=shape)
  expected = hf_tensors(m)
  by_file = {}
  for name in expected:
    by_file.setdefault(files[name], []).append(name)
  for file, names in by_file.items():
    with weights.open_safetensors(file) as f:
      for name in names:
        Interrupts.check()
        path, index, _, how = expected[name]
        node = params
        for key in path:
          node = node[key]
        _to_meshtrain(how, f.get_tensor(name), node[index] if index else node)
  return params


def _meshtrain_config(m: dict, param_dtype: str, tokenizer_files: list[pathlib.Path], workdir: pathlib.Path) -> dict:
  """base_config() with the HF model's fields: the config a converted workdir records."""
  cfg = config_lib.base_config()
  for key, value in m.items():
    if key not in ("family", "max_position_embeddings"):
      cfg.model[key] = value
  cfg.model.hf_model_type = m["family"]  # to-hf writes the same architecture back
  cfg.model.preset = "huggingface"
  cfg.model.init = "normal"  # HF weights are used as they are: no fan_in rescaling in the forward pass
  cfg.model.param_dtype = param_dtype
  # Compute in float32 whatever the storage: exact on the CPU, and what the logits tests compare; generate and
  # fine-tuning can pass --config.model.dtype=bfloat16.
  cfg.model.dtype = "float32"
  # The sequence length the model was trained for, capped: seq_len also sizes training batches and generation's
  # default cache, and Llama 3's 131,072 would make those huge by default.
  cfg.seq_len = min(m["max_position_embeddings"], 4096)
  if "tokenizer" in cfg.data:  # meshtrain.data.tokenization: the tokenizer travels in WORKDIR/tokenizer/
    main = next((f.name for f in tokenizer_files if f.name in ("tokenizer.json", "tokenizer.model")), None)
    cfg.data.tokenizer = "byte" if main is None else str(workdir.absolute() / "tokenizer" / main)
  config_lib.validate(cfg)
  return cfg.to_dict()


# ----------------------------------------------------------------------------------------------------------------
# meshtrain -> Hugging Face

def to_hf(workdir: str, step: int | None, out: str) -> tuple[pathlib.Path, list[str]]:
  """Exports the parameters of `workdir` (latest step, or `step`) as a Hugging Face model directory of the family
  hf_config.export_family picks; returns its path and notes about what changed on the way."""
  src, target = pathlib.Path(workdir).expanduser(), pathlib.Path(out).expanduser()
  if not (src / "checkpoints").is_dir():
    raise UserError(f"--workdir {workdir!r} holds no checkpoints (no {str(src / 'checkpoints')!r}); pass the "
                    "workdir of a training run or of from-hf")
  check_output(target, "--out")
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  # A live run's retention may delete the step while it is exported: the newest again, from scratch.
  return checkpoint.retrying(lambda at_step: _export(checkpoint, src, at_step, target), step)


def _export(checkpoint, src: pathlib.Path, step: int | None, target: pathlib.Path) -> tuple[pathlib.Path, list[str]]:
  """to_hf's export of one step, into a staged directory renamed to `target` at the end."""
  meta, stored, read = checkpoint.param_reader(src, step=step)
  model = meta["config"]["model"]
  if checkpoint.task_of(meta) != "lm":
    raise UserError(f"{str(src)!r} holds a {checkpoint.task_of(meta)} model; Hugging Face export is for language "
                    "models (task=lm)")
  family = hf_config.export_family(model)
  if meta.get("layer_order", "sequential") != "sequential":
    raise UserError(f"the checkpoint in {str(src)!r} stores its layers in {meta['layer_order']} order (circular "
                    "pipeline); export a checkpoint of a run with pipeline.schedule=gpipe or no pipeline")
  D, E = model["d_model"], model["head_dim"]
  fan_in = model.get("init") == "fan_in"
  tied = bool(model["tie_embeddings"])
  notes = []
  if tied and fan_in:
    # The forward pass divides tied logits by sqrt(D) (MaxText's normalisation): an HF tied model cannot, so
    # the head becomes its own matrix, embedding / sqrt(D).
    tied = False
    notes.append(f"model.init=fan_in with tied embeddings divides the logits by sqrt(d_model)={math.sqrt(D):g}; "
                 "exported untied, with lm_head = embedding / sqrt(d_model) (tie_word_embeddings=false)")
  dtype = np.dtype(stored["embedding"].dtype)
  dtype_name = "bfloat16" if dtype.name == "bfloat16" else "float32"
  # The forward pass multiplies w_q by sqrt(E): folded in, in float32. Exact for float32 weights and, stored as
  # bfloat16, whenever sqrt(E) is a power of two (E = 16, 64, 256); else rounded once to bfloat16 (E = 128: within
  # bfloat16's half-ulp, as the forward pass in a bfloat16 compute dtype would be too).
  q_scale = math.sqrt(E) if fan_in else None

  def tensors():
    """(HF name, its [out, in] numpy array) in the order the checkpoint is read, one stored array at a time (a
    stack of every layer's q, say): memory holds that array and the shard being built, never the model. Shards
    group tensors by kind rather than by layer; transformers reads them through the index in any order."""
    embedding = read(("embedding",))
    yield "model.embed_tokens.weight", embedding
    if not tied and "head" not in stored:  # tied + fan_in, untied on export
      yield "lm_head.weight", (embedding.astype(np.float32) / math.sqrt(D)).astype(dtype)
    del embedding
    for name, path, how, _ in layer_tensors(model):
      scale = q_scale if name == "self_attn.q_proj.weight" else None
      yield from _layer_tensors(name, how, _per_layer(read, stored, path, model["num_layers"]), scale)
    if family == "qwen2" and not model.get("attention_bias"):  # Qwen2 always has them: zeros are no bias
      s = Sizes(model)
      for i in range(s.N):
        for name, _, _, shape in BIAS_TENSORS:
          yield f"model.layers.{i}.{name}", np.zeros(shape(s), dtype)
    yield "model.norm.weight", read(("final_norm", "scale"))
    if "head" in stored:
      yield "lm_head.weight", _to_hf("t", read(("head",)))

  tok = hf_tokenizer.run_tokenizer(src, meta.get("tokenizer") or {})
  size = lambda leaf: math.prod(leaf.shape) * dtype.itemsize
  leaves = lambda tree: [x for v in tree.values() for x in (leaves(v) if isinstance(v, dict) else [v])]
  untied_head = size(stored["embedding"]) if not tied and "head" not in stored else 0
  check_space(target, sum(map(size, leaves(stored))) + untied_head + (1 << 20), f"exporting {str(src)!r}")
  with staged(target) as tmp:
    weights.write_safetensors(tmp, tensors())
    ids = hf_tokenizer.write_tokenizer(tmp, tok, src, meta["config"]["seq_len"])
    hf = hf_config.write(model, family, tied, dtype_name, meta["config"]["seq_len"], ids)
    (tmp / "config.json").write_text(json.dumps(hf, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({k: v for k, v in ids.items() if v is not None},
                                                           indent=2))
  return target, notes


def _per_layer(read, stored: dict, path: tuple, num_layers: int):
  """Each layer's parameter at `path`, layer 0 first: slices of the one stacked array (scan_layers=true; read
  once, released after the last layer) or each layer's own array (scan_layers=false: layer_0, layer_1, ...)."""
  if "layers" in stored:
    yield from read(("layers", *path))
  else:
    for i in range(num_layers):
      yield read((f"layer_{i}", *path))


def _layer_tensors(name: str, how: str, arrays, scale: float | None):
  """(HF name, tensor) of every layer's `name` tensor ({x}: every expert's) from `arrays` (its meshtrain parameter,
  layer by layer). A generator of its own so that the last layer's array is released when it ends, before the next
  is read."""
  for i, w in enumerate(arrays):
    for x, w_x in enumerate(w) if "{x}" in name else [(None, w)]:
      Interrupts.check()
      w_x = _to_hf(how, w_x)
      if scale:  # folded in float32, rounded once to the storage dtype
        w_x = (w_x.astype(np.float32) * scale).astype(w_x.dtype)
      yield f"model.layers.{i}.{name.format(x=x)}", w_x


def _to_hf(how: str, w: np.ndarray) -> np.ndarray:
  """The HF tensor ([out, in]) of its meshtrain parameter `w` (one layer's) by mapping `how`: the inverse of
  _to_meshtrain."""
  if how == "copy":  # norms, embedding
    return np.ascontiguousarray(w)
  if how == "bias":  # [H, E] -> [H*E]
    return np.ascontiguousarray(w.reshape(-1))
  if how == "o":  # [H, E, D] -> [D, H*E]
    return np.ascontiguousarray(w.reshape(-1, w.shape[-1]).T)
  return np.ascontiguousarray(w.reshape(w.shape[0], -1).T)  # [in, out...] -> [out, in]: q, k, v, gate, up, down, head
