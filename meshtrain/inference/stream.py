"""Where `python -m meshtrain.generate` prints completions, and how: as their tokens arrive (TextStream, the
`on_tokens` callback of Generator.generate), on process 0 only (results_stream)."""
import os
import sys

import jax
import numpy as np

from meshtrain.inference.generator import Generator, Output


class TextStream:
  """Prints completions as their tokens arrive. One prompt: its text, chunk by chunk. Several: each completion
  whole, under a `[i]` header, as soon as that row stops (rows stop at different times)."""

  def __init__(self, generator: Generator, count: int, out=None, summary=True):
    self.generator, self.count, self.out, self.summary = generator, count, out or sys.stdout, summary
    self.printed = [""] * count
    self.finished = [False] * count

  def __call__(self, t, out_BT, done_B):
    for i in range(self.count):
      if self.finished[i] or (self.count > 1 and not done_B[i]):
        continue
      row = out_BT[i]
      eos = np.flatnonzero(row == self.generator.eos_id) if self.generator.eos_id is not None else []
      text = self.generator.tokenizer.decode(row[:eos[0]] if len(eos) else row)
      if not done_B[i]:
        text = text.rstrip("\ufffd")  # a character cut between two chunks: print it once it is whole
      if self.count > 1:
        self.out.write(f"[{i}] ")
      self.out.write(text[len(self.printed[i]):] if text.startswith(self.printed[i]) else text)
      self.printed[i] = text
      if done_B[i]:
        self.out.write("\n")
        self.finished[i] = True
      self.out.flush()

  def close(self, output: Output):
    """Rows that ended without the loop seeing them stop (the last chunk), and a summary on stderr."""
    for i in range(self.count):
      if not self.finished[i]:
        if self.count > 1:
          self.out.write(f"[{i}] ")
        text = output.texts[i]
        self.out.write((text[len(self.printed[i]):] if text.startswith(self.printed[i]) else text) + "\n")
    self.out.flush()
    if self.summary:
      print(f"prefill {output.prompt_tokens} tokens in {output.prefill_s * 1e3:.1f} ms "
            f"({output.prefill_tokens_per_sec:,.0f} tokens/s); decode {output.decode_tokens} tokens in "
            f"{output.decode_s * 1e3:.1f} ms ({output.decode_tokens_per_sec:,.0f} tokens/s)", file=sys.stderr)


def results_stream(is_main: bool):
  """Where the completions go: stdout on process 0, nowhere on the others. With several processes the CPU backend's
  collectives library (gloo) prints `[Gloo] Rank 0 is connected to ...` lines to the process's stdout when it
  connects; they are sent to stderr from here on (file descriptor 1 becomes a copy of 2), so that stdout carries
  the completions (--json: one JSON object) and nothing else."""
  if jax.process_count() == 1:
    return sys.stdout if is_main else Discard()
  sys.stdout.flush()
  results = os.fdopen(os.dup(1), "w", encoding=sys.stdout.encoding, errors=sys.stdout.errors) if is_main else None
  os.dup2(2, 1)
  return results or Discard()


class Discard:
  """Where the text of processes other than 0 goes."""

  def write(self, text):
    pass

  def flush(self):
    pass
