"""What a config selects: its tokenizer and, for a split, its source.

`tokenizer_for_config` loads the tokenizer cfg.data.tokenizer names (bytes, a file, or a bpe:N trained on the
dataset's train split the first time and cached). `make_source` picks the source family: labelled images for
task=dit (meshtrain/data/images.py), random tokens for data.name=synthetic (sources.py), prompt/completion rows for
data.format=prompt_completion (sft.py), and otherwise documents packed into sequences (packing.py).
"""
import hashlib
import re
import time

from meshtrain import config as config_lib
from meshtrain.data import files, images, mixture, packing, sources, tfds_access, tokenization as tokenizer
from meshtrain.errors import UserError

LISTED_FILES = 1000


def tokenizer_for_config(cfg) -> tokenizer.Tokenizer:
  """The tokenizer cfg.data.tokenizer names; "bpe:N" is trained on the dataset's train split the first time and
  cached under the TFDS data dir (keyed by the dataset's name, version and split, and N)."""
  spec = str(cfg.data.tokenizer)
  vocab_size = tokenizer.parse_bpe_spec(spec)
  if vocab_size is None:
    return tokenizer.load(spec)
  if packing.bpe_corpus(cfg) == sources.SYNTHETIC:
    raise UserError(f"data.tokenizer={spec!r} is trained on the dataset's text, and data.name=synthetic has none; "
                    "use data.tokenizer=byte with synthetic data")
  texts, info, cache_root = packing.train_texts(cfg)
  slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", cfg.data.train_split)
  out_dir = (cache_root / "meshtrain_tokenizers" / info.full_name.replace("/", "__") /
             f"bpe{vocab_size}-{slug}-{cfg.data.text_key}")
  if (out_dir / tokenizer.HF_FILE).is_file():
    return tokenizer.load(out_dir)
  with tfds_access.file_lock(out_dir.with_name(f".{out_dir.name}.lock")):
    if not (out_dir / tokenizer.HF_FILE).is_file():  # another process may have trained it while we waited
      t0 = time.perf_counter()
      tokenizer.train_bpe(texts, vocab_size, out_dir, length=len(texts))
      print(f"trained a {vocab_size}-id byte-level BPE on {len(texts)} documents of {info.full_name}/"
            f"{cfg.data.train_split} in {time.perf_counter() - t0:.1f}s; cached in {out_dir}", flush=True)
  return tokenizer.load(out_dir)


def check_vocab(cfg, tok: tokenizer.Tokenizer) -> None:
  """Refuses a model whose embedding cannot hold every id `tok` emits."""
  if cfg.model.vocab_size < tok.vocab_size:
    where = f" ({tok.path})" if tok.path else ""
    raise UserError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the vocabulary of the {tok.kind} "
                    f"tokenizer{where}, which has {tok.vocab_size} ids; set --config.model.vocab_size="
                    f"{tok.vocab_size} or more" + (f" (or data.name={sources.SYNTHETIC} for random tokens)"
                                                   if tok.kind == tokenizer.BYTE else ""))


def make_source(cfg, split: str, shuffle: bool,
                tok: tokenizer.Tokenizer | None = None) -> sources.Source | images.ImageSource:
  """The source for `split` of the data cfg selects; shuffle=True: a new permutation each epoch, else plain order.
  task=dit: an image source (meshtrain/data/images.py; `tok` is not used). data.mixture: its sources drawn in its
  proportions (meshtrain/data/mixture.py). The evaluation split (`split` == data.eval_split) of data.eval_name when
  that is set.

  `tok`: the tokenizer (default: the one cfg.data.tokenizer names, trained first if it is bpe:N).
  """
  data = cfg.data
  if cfg.get("task", "lm") in ("dit", "t2i"):  # labelled or captioned images, not tokens: meshtrain/data/images.py
    return images.make_source(cfg, split, shuffle)
  if data.eval_name and split == data.eval_split and split != data.train_split:
    # All of a path's documents (both of its splits), or the TFDS dataset's data.eval_split.
    name = data.eval_name
    return _one_source(cfg, name, "train+validation" if config_lib.is_path(name) else split, shuffle, tok)
  if not data.mixture:
    return _one_source(cfg, data.name, split, shuffle, tok)
  entries = config_lib.parse_mixture(data.mixture)
  if any(name != sources.SYNTHETIC for name, _ in entries):
    tok = tok or tokenizer_for_config(cfg)
  parts = [_one_source(cfg, name, split, shuffle, tok) for name, _ in entries]
  return mixture.MixtureSource(parts, [w for _, w in entries], [n for n, _ in entries])


def _one_source(cfg, name: str, split: str, shuffle: bool, tok) -> sources.Source:
  """The token source of one dataset `name` (a TFDS name, a path or glob of files, or synthetic)."""
  data = cfg.data
  if name == sources.SYNTHETIC:  # seq_len > 0 and the rest of the config: config.validate, which every entry point runs
    return sources.SyntheticSource(cfg.seed, split, cfg.seq_len, cfg.model.vocab_size)
  tok = tok or tokenizer_for_config(cfg)
  check_vocab(cfg, tok)
  if data.format in ("prompt_completion", "chat"):  # one example per row: meshtrain/data/sft.py
    from meshtrain.data import sft  # pylint: disable=g-import-not-at-top  (tensorflow_datasets: not on GPU machines)
    return sft.make_source(cfg, name, split, shuffle, tok)
  ds = packing.open_split(cfg, split, name)
  return packing.TfdsSource(ds, name=name, split=split, text_key=data.text_key, seq_len=cfg.seq_len, seed=cfg.seed,
                            shuffle=shuffle, index_dir=tfds_access.index_dir(ds), tok=tok,
                            order_key=packing.order_name(name, ds), tokenize_workers=data.tokenize_workers)


def input_files(cfg) -> dict[str, dict]:
  """The content of every file the run reads, by the data path (or glob) naming it: {spec: {files: count, digest: of
  the contents, listed: [{path, bytes, sha256}]}}
  over data.name (or data.mixture's paths) and data.eval_name. Every checkpoint records it, so a run resumed on edited,
  added or removed files is refused (meshtrain/checkpoint/resume.py) rather than continued on another corpus. The
  hashes come from the cache the conversion keeps (by path, size, mtime and inode): an unchanged file is not read."""
  data = cfg.data
  specs = [n for n, _ in config_lib.parse_mixture(data.mixture)] if data.mixture else [data.name]
  specs = [s for s in dict.fromkeys(specs + [data.eval_name]) if s and config_lib.is_path(s)]
  found = {}
  for spec in specs:
    if cfg.get("task", "lm") in ("dit", "t2i"):
      from meshtrain.data import captioned  # pylint: disable=g-import-not-at-top  (Pillow: not on GPU machines)
      paths, cache = captioned.inputs(spec), files.data_root(data.data_dir) / "meshtrain_images" / "hashes"
    else:
      paths = [p for item in files.find_inputs(spec) for p in item.parts]
      cache = files.data_root(data.data_dir) / "meshtrain_files" / "hashes"
    listed = [{"path": str(p), "bytes": p.stat().st_size,
               "sha256": files.input_hash(files.Input("file", p, (p,)), cache)} for p in paths]
    digest = hashlib.sha256("\0".join(sorted(f["sha256"] for f in listed)).encode()).hexdigest()
    # Each file listed (to name what changed) up to LISTED_FILES: a folder of a million pictures is one digest.
    found[spec] = {"files": len(listed), "digest": digest,
                   **({"listed": listed} if len(listed) <= LISTED_FILES else {})}
  return found
