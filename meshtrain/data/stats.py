"""What the first steps' batches hold, per source: the library behind `python -m meshtrain.data stats` and `show`.

Rows are read exactly as training reads them (the source a config selects, `Source.example_pair` of the global
example indices of steps 0..N-1), on one process and without devices, so what is printed is what the first N
steps train on, mixture proportions, padding and loss masks included.

Per source: `documents` (documents or records the rows read from; a document spanning two rows counts in both),
`tokens` (real tokens in the rows: up to the last trained target, so padding is not counted), `share` (of all
sources' tokens), `loss_tokens` (positions whose target is trained: every token of packed text, the completion or
the assistant's tokens of prompt/completion or chat rows), `padding` (fraction of row positions past the real
tokens) and `bytes_per_token` (UTF-8 bytes of the decoded tokens per token).

Captioned pictures (task=t2i, `image_stats`): the pictures of each split, the first N steps' rows (pictures and
distinct pictures read, distinct captions, caption bytes as the model reads them, the share that fill model.text_len
and so may be cut, the pixels' mean and standard deviation), and for your own pictures what their conversion saw:
pictures skipped, original widths and heights, caption lengths (meshtrain/data/captioned.py's manifest).
"""
import statistics
import dataclasses

import numpy as np

from meshtrain import config
from meshtrain.data import captioned, images, mixture, select
from meshtrain.step import IGNORE_ID

TRAINED_OPEN, TRAINED_CLOSE = "\u27e6", "\u27e7"  # show: ⟦ ⟧ around the tokens whose targets are trained


@dataclasses.dataclass
class _Counts:
  rows: int = 0
  documents: int = 0
  tokens: int = 0
  loss_tokens: int = 0
  positions: int = 0
  bytes: int = 0


def _rows(cfg, steps: int):
  """(source, names, iterator of (source position, example index)) over the first `steps` global batches."""
  src = select.make_source(cfg, cfg.data.train_split, shuffle=True)
  names = src.names if isinstance(src, mixture.MixtureSource) else [cfg.data.name]

  def indices():
    for i in range(steps * cfg.batch_size):
      yield (src.source_of(i)[0] if isinstance(src, mixture.MixtureSource) else 0), i
  return src, names, indices()


def real_tokens(targets_L: np.ndarray) -> int:
  """Tokens of a row before its padding: up to and including the position of its last trained target."""
  trained = np.flatnonzero(targets_L != IGNORE_ID)
  return int(trained[-1]) + 1 if len(trained) else 0


def stats(cfg, steps: int) -> dict:
  """{"steps", "batch_size", "seq_len", "tokenizer", "sources": {name: {documents, tokens, share, loss_tokens,
  padding, bytes_per_token}}} of the first `steps` batches of cfg's training data."""
  src, names, indices = _rows(cfg, steps)
  tok = select.tokenizer_for_config(cfg)
  counts = [_Counts() for _ in names]
  for k, i in indices:
    inputs_L, targets_L = src.example_pair(i)
    n = real_tokens(targets_L)
    c = counts[k]
    c.rows += 1
    c.documents += src.documents(i)
    c.tokens += n
    c.loss_tokens += int(np.sum(targets_L != IGNORE_ID))
    c.positions += len(targets_L)
    c.bytes += len(tok.decode(inputs_L[:n]).encode("utf-8"))
  total = sum(c.tokens for c in counts) or 1
  return {"steps": steps, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "tokenizer": str(cfg.data.tokenizer),
          "sources": {name: {"rows": c.rows, "documents": c.documents, "tokens": c.tokens,
                             "share": round(c.tokens / total, 4), "loss_tokens": c.loss_tokens,
                             "padding": round(1 - c.tokens / max(c.positions, 1), 4),
                             "bytes_per_token": round(c.bytes / max(c.tokens, 1), 3)}
                      for name, c in zip(names, counts)}}


def format_stats(result: dict) -> str:
  lines = [f"first {result['steps']} steps x {result['batch_size']} rows x {result['seq_len']} tokens, tokenizer "
           f"{result['tokenizer']}:",
           f"{'source':40} {'rows':>6} {'documents':>10} {'tokens':>10} {'share':>7} {'loss tokens':>12} "
           f"{'padding':>8} {'bytes/token':>12}"]
  for name, s in result["sources"].items():
    lines.append(f"{name[-40:]:40} {s['rows']:>6} {s['documents']:>10,} {s['tokens']:>10,} {s['share']:>7.1%} "
                 f"{s['loss_tokens']:>12,} {s['padding']:>8.1%} {s['bytes_per_token']:>12.2f}")
  return "\n".join(lines)


def show(cfg, count: int) -> list[dict]:
  """The first `count` rows of step 0 decoded: {"row", "source", "text"}, the trained tokens between ⟦ and ⟧."""
  src, names, indices = _rows(cfg, -(-count // cfg.batch_size))
  tok = select.tokenizer_for_config(cfg)
  out = []
  for row, (k, i) in zip(range(count), indices):
    inputs_L, targets_L = src.example_pair(i)
    n = real_tokens(targets_L)
    # Token j + 1 is trained where target j is; token 0 never is.
    trained = np.concatenate([[False], targets_L[:n - 1] != IGNORE_ID]) if n else np.zeros(0, bool)
    pieces, start = [], 0
    for j in range(1, n + 1):
      if j == n or trained[j] != trained[start]:
        text = tok.decode(inputs_L[start:j])
        pieces.append(f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}" if trained[start] else text)
        start = j
    out.append({"row": row, "source": names[k], "tokens": n, "text": "".join(pieces)})
  return out


def image_stats(cfg, steps: int) -> dict:
  """{"steps", "batch_size", "image_size", "text_len", "splits": {split: pictures}, "rows": {...}, and for a path
  or glob "converted": {...}} of cfg's captioned training pictures (task=t2i)."""
  train = images.make_source(cfg, cfg.data.train_split, shuffle=True)
  splits = {cfg.data.train_split: train.num_examples}
  if cfg.eval_every and cfg.data.eval_split:  # the eval split as training reads it: only when it evaluates
    splits[cfg.data.eval_split] = images.make_source(cfg, cfg.data.eval_split, shuffle=False).num_examples
  records, captions, lengths, pixels = set(), set(), [], []
  for i in range(steps * cfg.batch_size):
    image_HWC, ids_S = train.example(i)
    records.add(train.record_index(i) if hasattr(train, "record_index") else i)
    text = bytes((ids_S[ids_S > 0] - 1).astype(np.uint8).tolist())
    captions.add(text)
    lengths.append(len(text))
    pixels.append(image_HWC.astype(np.float64) / 255)
  pixels_NHWC = np.stack(pixels)
  out = {"steps": steps, "batch_size": cfg.batch_size, "image_size": cfg.model.image_size,
         "text_len": cfg.model.text_len, "splits": splits,
         "rows": {"pictures": len(lengths), "distinct_pictures": len(records), "distinct_captions": len(captions),
                  "caption_bytes": {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths)},
                  "at_text_len": round(sum(n >= cfg.model.text_len for n in lengths) / len(lengths), 4),
                  "pixel_mean": round(float(pixels_NHWC.mean()), 4), "pixel_std": round(float(pixels_NHWC.std()), 4)}}
  if config.is_path(cfg.data.name):
    manifest = captioned.prepare(cfg, quiet=True)[1]
    out["converted"] = {k: manifest[k] for k in ("skipped_records", "first_skipped", "original_width",
                                                  "original_height", "caption_chars")}
  return out


def format_image_stats(result: dict) -> str:
  rows, size = result["rows"], result["image_size"]
  b = rows["caption_bytes"]
  lines = [f"pictures ({size}x{size}): " + ", ".join(f"{split} {n:,}" for split, n in result["splits"].items()),
           f"first {result['steps']} steps x {result['batch_size']}: {rows['pictures']:,} pictures read "
           f"({rows['distinct_pictures']:,} distinct), {rows['distinct_captions']:,} distinct captions",
           f"caption bytes as read (model.text_len={result['text_len']}): min {b['min']}, median {b['median']:g}, "
           f"max {b['max']}; {rows['at_text_len']:.1%} fill text_len (longer ones are cut)",
           f"pixels in [0, 1]: mean {rows['pixel_mean']:.3f}, std {rows['pixel_std']:.3f}"]
  if conv := result.get("converted"):
    span = lambda s: f"{s['min']}..{s['max']} (median {s['median']:g})" if s else "-"
    lines.append(f"converted: original width {span(conv['original_width'])}, height {span(conv['original_height'])}, "
                 f"caption characters {span(conv['caption_chars'])}; {conv['skipped_records']} skipped"
                 + (f" (the first: {conv['first_skipped']})" if conv["first_skipped"] else ""))
  return "\n".join(lines)
