"""What a generation request asks for and what it gets, JAX-free: the sampling settings and their checks, the prompt
length buckets the compiled prefills are made for, and the `Output` of one `Generator.generate` call. The commands
(`generate`, `serve`) check their arguments with these before JAX loads.
"""
import dataclasses

import numpy as np

from meshtrain.errors import UserError

PROMPT_BUCKET = 16  # prompts are padded to a multiple of this (up to 128 tokens), so nearby lengths share a prefill


def bucket(tokens: int) -> int:
  """The padded length of a prompt of `tokens` tokens: the next multiple of PROMPT_BUCKET up to 128, past that of an
  eighth of the next power of two (160, 192, 224, 256, 320, ...): at most a quarter more tokens than the prompt,
  four buckets per doubling. Each bucket is a compiled prefill (per row count, serving's): an 8K context has 32,
  where multiples of 16 made 512, whose compiles before serving took minutes and, at a context of 1024 on the
  CPU, ran out of memory for the JIT's code."""
  step = max(PROMPT_BUCKET, (1 << (max(tokens, 1) - 1).bit_length()) // 8)
  return -(-tokens // step) * step


@dataclasses.dataclass(frozen=True)
class Sampling:
  """temperature 0: greedy (argmax); else softmax(logits / temperature) restricted to the top_k most likely ids
  (0: all) and to the smallest set whose probability reaches top_p (1.0: all)."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def check(self, vocab_size: int | None) -> None:
    """UserError for a setting that cannot sample; `vocab_size` None: not known yet (before the model is read)."""
    if not (self.temperature >= 0 and np.isfinite(self.temperature)):
      raise UserError(f"--temperature {self.temperature} must be a finite number >= 0 (0: greedy)")
    if self.top_k < 0:
      raise UserError(f"--top-k {self.top_k} must be 0 (off) or a positive number of ids")
    if vocab_size is not None and self.top_k > vocab_size:
      raise UserError(f"--top-k {self.top_k} must be at most the vocabulary size {vocab_size}")
    if not 0 < self.top_p <= 1:
      raise UserError(f"--top-p {self.top_p} must be in (0, 1] (1: off)")


@dataclasses.dataclass
class Output:
  """What one `Generator.generate` call produced, per prompt in order, and how fast."""
  texts: list[str]
  token_ids: list[list[int]]   # the new tokens of each prompt, its end-of-sequence token included when it stopped there
  finish_reasons: list[str]    # eos | max_new_tokens | context (the prompt plus its tokens reached max_len)
  prompt_tokens: int           # real prompt tokens (no padding)
  prefill_s: float
  decode_s: float
  decode_tokens: int           # tokens made by the decode loop (each row's first token comes from the prefill)
  prompt_ids: list[list[int]] = dataclasses.field(default_factory=list)  # the ids each prompt was encoded to

  @property
  def prefill_tokens_per_sec(self) -> float:
    return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

  @property
  def decode_tokens_per_sec(self) -> float:
    return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

  def to_json(self) -> dict:
    return {"completions": self.texts, "token_ids": self.token_ids, "finish_reasons": self.finish_reasons,
            "prefill_tokens_per_sec": self.prefill_tokens_per_sec, "decode_tokens_per_sec": self.decode_tokens_per_sec,
            "prompt_tokens": self.prompt_tokens, "decode_tokens": self.decode_tokens,
            "prefill_s": self.prefill_s, "decode_s": self.decode_s, "prompt_ids": self.prompt_ids}
