"""The tiny model on the local Python-stdlib corpus with a 4,096-id byte-level BPE instead of bytes.

  python -m meshtrain.train --config configs/tiny_bpe.py --workdir runs/tiny_bpe

Nothing else is needed: on first use the BPE is trained on the corpus's train split (about 20 s on 2 cores) and
cached under the TFDS data dir (meshtrain_tokenizers/), then the split is tokenized once and its token stream
cached beside the document index (meshtrain_index/). The run copies the tokenizer into runs/tiny_bpe/tokenizer/,
where generate and export find it. Expect about 2-3 minutes on a 2-core CPU with 8 simulated devices; a BPE token
holds ~3.5 bytes, so each step sees ~3.5x the text of configs/tiny.py, and the loss per token falls from ~8.3
(uniform over 4,096 ids) to ~4.5. Compare runs with different tokenizers by eval_bits_per_byte, not eval_loss.
"""
import pathlib

from meshtrain.config import from_file


def get_config():
  c = from_file(str(pathlib.Path(__file__).with_name("tiny.py")))  # everything else as configs/tiny.py
  c.data.tokenizer = "bpe:4096"
  c.model.vocab_size = 4096  # exactly the tokenizer's ids; a multiple of 128 and of every tensor size that divides it
  return c
