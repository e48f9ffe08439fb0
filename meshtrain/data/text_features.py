"""The text-to-image family's frozen text encoder: a language model's hidden states of one layer, as Z-Image and
Flux2-klein take Qwen3's, computed once per caption and cached beside the data (the own encoder's byte ids are
meshtrain/data/images.py `caption_ids`; `images.Captions` gives either).

  --config.model.text_encoder=PATH      a meshtrain language-model workdir: one trained here, or a Hugging Face model
                                        converted into one (python -m meshtrain.convert from-hf HF_DIR --workdir PATH:
                                        Qwen3, Llama 3.x, Qwen2.5, Mistral, ...): its newest checkpoint; or
                                        PATH/checkpoints/N, that step (pin it if the language model still trains)
  --config.model.text_encoder_layer=K   its hidden states after K blocks, Hugging Face's hidden_states[K]: 0 the
                                        embeddings, the last (K = num_layers, or -1) through the final norm, negative K
                                        from the end (-2, the default: the last block's input, as Z-Image takes it)
  --config.model.text_width=G           must be the language model's width (d_model): a bad value is refused

A caption becomes the language model's tokens (its tokenizer; its BOS first where it has one, as generation does for
a converted model), cut at model.text_len tokens and padded after; `keep` marks the real tokens. The model is causal,
so a caption's features depend neither on the padding after it nor on the other captions of its batch: the cached
features of a caption are the ones a prompt gets when it is sampled or served (`FrozenTextEncoder.__call__`).

The features of a split's distinct captions are computed once and kept under
<data root>/meshtrain_text_features/<key>/ (data.data_dir, else $TFDS_DATA_DIR, else ~/tensorflow_datasets): the
captions (captions.json), features.npy (float32 [U, S, G]) and keep.npy (bool [U, S]). The key hashes the encoder's
checkpoint (its meta item, which holds the arrays' checksums), the layer, text_len and the split's dataset
(its directory, sizes and record counts), so another encoder, layer or dataset makes a new cache and an unchanged
one is reused by every later run. As the converted datasets are (meshtrain/data/files.py), it is written into a
temporary directory under a lock and renamed into place when whole: a killed run leaves nothing a later one would
take for a cache.
"""
import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import socket
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from meshtrain import checkpoint
from meshtrain.data import files, tfds_access, tokenization
from meshtrain.errors import UserError
from meshtrain.models.llama import HiddenStates, ModelConfig, layers_as

CACHE_DIR = "meshtrain_text_features"
BATCH = 32       # captions per compiled call: one program whatever the number of captions
FORMAT = 1       # bump with any change to what a cache holds


def source_meta(model_cfg) -> tuple[pathlib.Path, int, dict]:
  """(workdir, step, meta item) of the language model model.text_encoder names: its newest checkpoint, read as plain
  JSON (no parameters), checked to be a language model whose layer model.text_encoder_layer exists and whose width
  is model.text_width. UserError otherwise."""
  spec = model_cfg.text_encoder
  how = ("point model.text_encoder at a meshtrain language-model workdir (one trained with task=lm, or a Hugging "
         "Face model converted by python -m meshtrain.convert from-hf HF_DIR --workdir W), or set it to 'own' for "
         "the byte-level encoder trained with the model")
  path, step = pathlib.Path(spec).expanduser().absolute(), None
  if path.parent.name == "checkpoints" and path.name.isdigit():  # WORKDIR/checkpoints/N: that step, as init_from
    path, step = path.parent.parent, int(path.name)
  try:
    step, meta = checkpoint.run_meta(str(path), step, "a language model")
  except UserError as e:
    raise UserError(f"model.text_encoder={spec!r}: {e}; {how}") from None
  if (task := checkpoint.task_of(meta)) != "lm":
    raise UserError(f"model.text_encoder={spec!r} is a task={task} run, not a language model; {how}")
  lm = meta["config"]["model"]
  layers = int(lm["num_layers"])
  k = model_cfg.text_encoder_layer
  if not -(layers + 1) <= k <= layers:
    raise UserError(f"model.text_encoder_layer={k}: {spec} has {layers} blocks, so its hidden states are 0 (the "
                    f"embeddings) .. {layers} (the last, through the final norm), or -{layers + 1} .. -1 from the end")
  if int(lm["d_model"]) != model_cfg.text_width:
    raise UserError(f"model.text_width={model_cfg.text_width}, but the text encoder {spec} is {lm['d_model']} wide; "
                    f"set --config.model.text_width={lm['d_model']}")
  return path, step, meta


def layer_index(k: int, layers: int) -> int:
  """hidden_states[k] as an index 0 .. layers (Python's negative indexing of layers + 1 entries)."""
  return k % (layers + 1)


class FrozenTextEncoder:
  """Captions -> {"text_features": float32[N, S, G], "text_keep": bool[N, S]}: the language model's hidden states
  of model.text_encoder_layer, on this process's first device (the features are the same on every process)."""

  def __init__(self, model_cfg):
    self.workdir, self.step, meta = source_meta(model_cfg)
    self.text_len = model_cfg.text_len
    self.tokenizer = tokenization.from_workdir(self.workdir, meta.get("tokenizer"))
    self.add_bos = self.tokenizer.kind != "byte" and self.tokenizer.bos_id is not None
    self.pad_id = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else 0
    lm = ModelConfig.from_config(meta["config"]["model"])
    k = layer_index(model_cfg.text_encoder_layer, lm.num_layers)
    blocks = min(k, lm.num_layers)
    self.model = HiddenStates(dataclasses.replace(lm, num_layers=blocks, remat="none", scan_layers=True,
                                                  pipeline_stages=1), normed=k == lm.num_layers)
    params = layers_as(checkpoint.load_params(self.workdir, self.step)[0], lm.num_layers, True)
    params = {**params, "layers": jax.tree.map(lambda a: a[:blocks], params["layers"])} if blocks else {
        k_: v for k_, v in params.items() if k_ != "layers"}
    params.pop("head", None)
    self.params = jax.device_put(params, jax.local_devices()[0])
    self._features = jax.jit(lambda p, ids_BS: self.model.apply({"params": p}, ids_BS).astype(jnp.float32))

  def tokens(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32[N, S], keep bool[N, S]): each caption's tokens, cut at text_len, padded after."""
    ids_NS = np.full((len(texts), self.text_len), self.pad_id, np.int32)
    keep_NS = np.zeros((len(texts), self.text_len), bool)
    for i, ids in enumerate(self.tokenizer.encode_batch(list(texts))):
      ids = ([self.tokenizer.bos_id] if self.add_bos else []) + list(ids)
      ids = ids[:self.text_len]
      ids_NS[i, :len(ids)], keep_NS[i, :len(ids)] = ids, True
    return ids_NS, keep_NS

  def __call__(self, texts: list[str], progress: str | None = None) -> dict[str, np.ndarray]:
    ids_NS, keep_NS = self.tokens(texts)
    n = len(texts)
    features = np.zeros((n, self.text_len, self.model.cfg.d_model), np.float32)
    starts = range(0, n, BATCH)
    for start in tqdm.tqdm(starts, desc=progress, unit=" batches", disable=progress is None, mininterval=2):
      chunk = ids_NS[start:start + BATCH]
      padded = np.concatenate([chunk, np.full((BATCH - len(chunk), self.text_len), self.pad_id, np.int32)])
      features[start:start + len(chunk)] = np.asarray(self._features(self.params, padded))[:len(chunk)]
    # Padding's features are zeroed: the model masks them as keys, and a cache then holds no arbitrary numbers.
    return {"text_features": features * keep_NS[..., None], "text_keep": keep_NS}


@dataclasses.dataclass(frozen=True)
class Cache:
  """A split's cached features: row `index[caption]` of `features` and `keep` (memory-mapped)."""
  index: dict
  features: np.ndarray
  keep: np.ndarray

  def take(self, rows_N) -> dict[str, np.ndarray]:
    rows_N = np.asarray(rows_N)
    return {"text_features": np.asarray(self.features[rows_N]), "text_keep": np.asarray(self.keep[rows_N])}

  def row(self, caption: str) -> int:
    if caption not in self.index:
      raise UserError(f"the caption {caption[:60]!r} has no cached text features: the dataset changed under its "
                      "cache; delete the cache directory named in the run's log and run again")
    return self.index[caption]


def cache_key(model_cfg, dataset: dict) -> str:
  _, _, meta = source_meta(model_cfg)  # the checkpoint's meta item names its parameters by their checksums
  layers = int(meta["config"]["model"]["num_layers"])
  identity = {"format": FORMAT, "meta": meta, "layer": layer_index(model_cfg.text_encoder_layer, layers),
              "text_len": model_cfg.text_len, "dataset": dataset}
  return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cached(cfg, dataset: dict, captions) -> Cache:
  """The features of the split `dataset` describes (its identity: directory, split, sizes), computed from
  `captions()` (every caption of the split, in record order) the first time and read from the cache after."""
  key = cache_key(cfg.model, dataset)
  root = files.data_root(cfg.data.data_dir) / CACHE_DIR
  final = root / key
  if not (final / "keep.npy").is_file():
    with tfds_access.file_lock(root / f".{key}.lock"):
      if not (final / "keep.npy").is_file():  # another process may have made it while we waited
        _write(cfg, final, captions)
  index = {c: i for i, c in enumerate(json.loads((final / "captions.json").read_text()))}
  return Cache(index, np.load(final / "features.npy", mmap_mode="r"), np.load(final / "keep.npy", mmap_mode="r"))


def _write(cfg, final: pathlib.Path, captions) -> None:
  distinct = sorted(set(captions()))
  encoder = FrozenTextEncoder(cfg.model)
  out = encoder(distinct, progress=f"text features of {len(distinct)} captions ({cfg.model.text_encoder})")
  final.parent.mkdir(parents=True, exist_ok=True)
  tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{socket.gethostname()}-{os.getpid()}-",
                                      dir=final.parent))
  try:
    (tmp / "captions.json").write_text(json.dumps(distinct))
    np.save(tmp / "features.npy", out["text_features"])
    np.save(tmp / "keep.npy", out["text_keep"])
    os.rename(tmp, final)
    print(f"data: cached the text features of {len(distinct)} captions ({cfg.model.text_encoder}, hidden states "
          f"{cfg.model.text_encoder_layer}) in {final}", flush=True)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def synthetic_cache(model_cfg, seed: int, captions: int = 64) -> Cache:
  """data.name=synthetic: random features of `captions` made-up captions, every token kept. Benchmarks measure the
  model on them without a language model or a dataset (the features of a real one are inputs too)."""
  rng = np.random.default_rng([seed, captions])
  features = rng.standard_normal((captions, model_cfg.text_len, model_cfg.text_width)).astype(np.float32)
  return Cache({}, features, np.ones((captions, model_cfg.text_len), bool))

