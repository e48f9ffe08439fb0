"""Continuous batching for serving: a fixed number of decode slots, requests joining and leaving between steps.

JetStream's design, on a Generator's model, mesh, rules and placed parameters (meshtrain/inference/generator.py):

- one KV cache of [slots, S] rows (S: the context plus the longest padding a prompt bucket adds), sharded by the
  same logical rules as training (`cache_batch` over the batch axes, `cache_kv_heads` over `tensor`), donated to
  every call;
- `prefill`: the prompts admitted in one step whose lengths share a bucket (sampling.bucket), each left-padded to
  it exactly as Generator.generate pads it, as the rows of one call (`prefill_rows`: one compiled program per
  bucket and row count, compiled by `warm()` before serving or on first use), run through the model into a cache of P
  slots, their first tokens sampled, and each row's cache inserted into its free slot row: slots [0, P) of the row,
  its own first slot (start) and next slot (end); between decode steps;
- `decode`: one compiled step for all slots: each slot feeds its last token at its own next slot (KVCache.end is
  [slots]: every row writes and attends at its own position) and samples with its own temperature, top_p, top_k
  and key (vectorized over the slots); slots that hold no request compute too, and nothing reads them. A call runs
  a chunk of steps while no request waits for a slot, every request needs a chunk more, and either every slot is
  busy (with a request queued: no more steps than until the first slot frees by its length) or two chunks take at
  most CALL_BUDGET_S (by the measured step time), else one step. A call's tokens are read on the next engine step,
  after that step's call is dispatched (the device computes it while the host hands out the last one's text), when
  every slot is busy or both calls take at most CALL_BUDGET_S, and no request leaves by its length in the last call
  or is cancelled (`Engine._ahead`); otherwise first. ONE program per attention span and row count (a call's
  step count is its argument):
  a call attends over the cache's first `attend` slots (`Plan.attend`, the fewest of `Engine.attends`, 64, 96, 128,
  192, ..., the row, that hold every busy row's slots after it), not over rows the context long whatever the
  requests use, and decodes the cache's first `rows` rows (`Plan.rows`, the fewest of `Engine.row_counts`, a
  quarter, half or all of the slots, that hold every busy slot: requests take the lowest free slots), not every
  slot whatever the load.

A slot is freed at its request's end-of-sequence token, max_tokens, the context, a stop string, or when the request
is cancelled (the client went away). A request's token t is drawn with fold_in(key(seed), t) on its own row's
logits, so a seeded request gets the same tokens whatever else is in flight; temperature 0 is greedy (argmax), the
same tokens as Generator.generate for the same prompt.

Each step is a plan (swap in a newer checkpoint; admit these prompts into these slots; decode k steps) that
process 0 makes and every process runs: with several processes (one per host) serving one model, process 0 holds
the queue and the requests, broadcasts each plan (one small collective) and the others run the same programs on
their devices (`follow()`), so the collectives inside them meet; process 0 sends an empty plan at least every
`IDLE_S` while idle, and a last one that ends the others' loop.

Serving a run that is still training (`live`: meshtrain/inference/live.py), a newer checkpoint is swapped in
between steps once no request holds a slot: a request runs on one checkpoint from its first token to its last (the
choices of one request too: requests submitted together are admitted on the same one). While a swap waits, new
requests wait with it (at most the longest request in flight), then run on the new parameters, which are placed
like the old ones, so no program is compiled again. `Request.step` names the checkpoint that answered.

All JAX calls happen on the thread that calls `step()` / `run()` (the server runs one engine thread); `submit` and
`Request.cancel` may be called from any thread.
"""
import collections
import dataclasses
import secrets
import sys
import threading
import time
import typing

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from meshtrain import layout, sharding
from meshtrain.errors import UserError
from meshtrain.inference.generator import drawable, kv_cache_bytes, place
from meshtrain.inference.sampling import Sampling, bucket
from meshtrain.models.llama import init_cache
from meshtrain.runtime import startup

# Decode steps per device call while no request waits for a slot (Engine's `chunk`). A slot whose request ends
# inside a chunk computes the rest of it for nothing, and its client sees the chunk's tokens at once.
DECODE_CHUNK = 8
# With a slot free, a call runs a chunk only if two of them take at most this long (by the measured step time): a
# request that arrives meanwhile waits for the calls in flight (the one being read and the one dispatched ahead of
# it, `Engine._ahead`) before its prefill, so this bounds what they add to its time to first token. Small models'
# chunks on the CPU become single steps, pipelined, which halves their time to first token under load. With every
# slot busy, a request could not join before a slot frees anyway: chunks, whatever they take.
CALL_BUDGET_S = 0.005
# The shortest attention span of a decode program (Engine.attends): the spans grow from it by 1.5x and 4/3 in turn
# (64, 96, 128, 192, 256, ...: a call attends over at most 1.5x the slots it needs) up to the cache row: on the CPU
# attention is about half a decode step at 128 slots, so finer spans than doubling pay for their extra programs.
ATTEND_MIN = 64
# The decode programs' row counts (Engine.row_counts) are the slots divided by these: with few requests in flight a
# step decodes the busy rows only (a step's cost grows with its rows), so more slots cost nothing until requests use
# them. Not finer: each count multiplies the decode programs compiled (spans x rows), and one row costs
# about what two do.
ROW_DIVISORS = (4, 2, 1)
# A prefill's row counts (Engine.prefill_rows): one prompt, and the slots divided by powers of this, so that a call
# computes at most this many times the rows it fills, with few programs to compile (1, 2 and 8 rows for 8 slots).
PREFILL_ROW_RATIO = 4
# The most alternatives a token's logprobs list (OpenAI's bound on `logprobs` / `top_logprobs`): a step computes
# this many for every row when any row asks for some (one top_k program, not one per count), and each row keeps
# the number it asked for.
TOP_LOGPROBS = 20
# A request's logit_bias entries (OpenAI's bound: 300), and the tokens min_tokens holds back (the end-of-sequence
# token and stop_token_ids): fixed widths, so that a prefill's processing settings travel in one int32 array.
MAX_BIAS = 300
MAX_ENDS = 8
# Longest wait for a request while idle: also how often process 0 tells the other processes it is still there (the
# CPU backend's collectives give a peer that is late only so long).
IDLE_S = 0.5


class QueueFull(Exception):
  """The engine's queue holds max_queue requests already: try again later (HTTP 429)."""


FINISH_REASONS = ("stop", "length", "cancelled")  # Request.finish_reason once done


@dataclasses.dataclass(eq=False)
class Request:
  """One completion. `on_update(request, delta_text)` is called on the engine thread after each new token whose text
  can be shown (stop strings held back until they cannot match) and once more when it finishes (finish_reason set:
  "stop" for its end-of-sequence token or a stop string, "length" for max_tokens or the context, "cancelled")."""
  prompt_ids: list[int]
  max_tokens: int = 16
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int | None = None
  stop: tuple[str, ...] = ()
  logprobs: int | None = None  # each new token's logprob and this many of the most likely (0-20); None: none
  echo: bool = False           # the prompt's logprobs too (its first token has none); max_tokens may then be 0
  prompt_top: int = 0          # with echo: at least this many of the most likely per prompt token (and `logprobs`)
  ignore_eos: bool = False     # the end-of-sequence token does not end it (it is kept, and shows no text)
  stop_token_ids: tuple[int, ...] = ()  # tokens that end it as its end-of-sequence token does
  # The logits it samples from (`processed`): {id: bias} added; presence and frequency penalties over its new
  # tokens, the repetition penalty over its prompt's and new tokens (vLLM's); its end tokens held back until it has
  # min_tokens new ones.
  logit_bias: dict = dataclasses.field(default_factory=dict)
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  repetition_penalty: float = 1.0
  min_tokens: int = 0
  on_update: object = None
  token_ids: list[int] = dataclasses.field(default_factory=list)  # new tokens, the end-of-sequence token included
  # With `logprobs`: per new token, its logprob and the `logprobs` most likely (id, logprob) pairs; with `echo`,
  # the same per prompt token (None for the first). Float32 log-softmax of the logits the token was drawn from.
  token_logprobs: list[float] = dataclasses.field(default_factory=list)
  top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
  prompt_logprobs: list = dataclasses.field(default_factory=list)
  prompt_top_logprobs: list = dataclasses.field(default_factory=list)
  prompt_ranks: list = dataclasses.field(default_factory=list)  # each prompt token's rank (1: the most likely)
  text: str = ""               # the completion's text (up to a stop string, which is left out)
  finish_reason: str | None = None
  submitted_at: float = 0.0
  admitted_at: float | None = None  # when it got a slot
  first_token_at: float | None = None
  finished_at: float | None = None
  cancelled: bool = False
  sent: int = 0                # characters of `text` handed to on_update so far
  limit: int = 0               # tokens it may make: max_tokens within the context
  group: int = 0               # requests submitted together (the choices of one HTTP request): one checkpoint
  step: int | None = None      # the checkpoint step that answers it (set when it gets a slot)
  slot_end: int = 0            # process 0: the next cache slot its row writes at, once the calls dispatched have run

  def cancel(self) -> None:
    """Free its slot at the next step (any thread)."""
    self.cancelled = True

  @property
  def done(self) -> bool:
    return self.finish_reason is not None

  @property
  def processed(self) -> bool:
    """Whether its logits are changed before sampling (any of logit_bias, the penalties, min_tokens)."""
    return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                or self.min_tokens)

  def processing(self, eos_id: int) -> np.ndarray:
    """Its processing settings as one int32 row (PROCESSING columns): the penalties' float32 bits, min_tokens, the
    end tokens (-1 padded), the bias ids (-1 padded) and the biases' float32 bits."""
    bits = lambda x: int(np.float32(x).view(np.int32))
    ends = ([] if self.ignore_eos else [eos_id]) + list(self.stop_token_ids)
    ids, values = list(self.logit_bias), list(self.logit_bias.values())
    return np.asarray([bits(self.presence_penalty), bits(self.frequency_penalty), bits(self.repetition_penalty),
                       self.min_tokens, *ends, *[-1] * (MAX_ENDS - len(ends)), *ids, *[-1] * (MAX_BIAS - len(ids)),
                       *map(bits, values), *[0] * (MAX_BIAS - len(values))], np.int32)


def sample_rows(logits_BV, keys_B, temp_B, top_p_B, top_k_B, num_ids: int):
  """Next token per row with each row's own setting ([B] arrays; keys_B typed keys): temperature 0 greedy, else
  softmax(logits / temperature) cut to the top_k most likely ids (0: all) and to the smallest set whose probability
  reaches top_p, as generator.sample does for one setting."""
  V = logits_BV.shape[-1]
  logits_BV = drawable(logits_BV, num_ids)
  greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)

  def cut(x_BV):
    """The top_k and top_p cuts of every row (a sort of each row's logits: only run when a row asks for one)."""
    sorted_BV = -jnp.sort(-x_BV, axis=-1)
    kth_B1 = jnp.take_along_axis(sorted_BV, jnp.clip(top_k_B - 1, 0, V - 1)[:, None], axis=-1)
    cut_k_B1 = (top_k_B > 0)[:, None]
    x_BV = jnp.where(cut_k_B1 & (x_BV < kth_B1), -jnp.inf, x_BV)
    sorted_BV = jnp.where(cut_k_B1 & (sorted_BV < kth_B1), -jnp.inf, sorted_BV)
    p_BV = jax.nn.softmax(sorted_BV, axis=-1)
    keep_BV = jnp.cumsum(p_BV, axis=-1) - p_BV < top_p_B[:, None]  # the most likely always stays
    cutoff_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((top_p_B < 1)[:, None] & (x_BV < cutoff_B1), -jnp.inf, x_BV)

  def draw(_):
    x_BV = logits_BV / jnp.where(temp_B > 0, temp_B, 1.0)[:, None]
    x_BV = jax.lax.cond(jnp.any((temp_B > 0) & ((top_k_B > 0) | (top_p_B < 1))), cut, lambda x: x, x_BV)
    drawn_B = jax.vmap(lambda key, x_V: jax.random.categorical(key, x_V))(keys_B, x_BV).astype(jnp.int32)
    return jnp.where(temp_B > 0, drawn_B, greedy_B)

  # Control flow on the device: a step whose rows are all greedy skips the draw, one without top_k/top_p the sort
  # (the sort of a 128K vocabulary per row is most of a sampling step). The rows' tokens are the same either way.
  return jax.lax.cond(jnp.any(temp_B > 0), draw, lambda _: greedy_B, None)


def logprobs_rows(logits_BV, token_B, want_B, num_ids: int):
  """Each row's token's logprob [B] and the TOP_LOGPROBS most likely ids < num_ids and their logprobs [B, A],
  float32: the model's own distribution (before temperature, top_p and top_k, as vLLM reports them), normalised
  over the whole vocabulary as the training loss is, so that a text's logprobs sum to minus its loss; the
  alternatives are ids the sampler can draw, so a greedy token's logprob is the top one. Computed only when some
  row asks (`want_B`): zeros otherwise."""
  A = min(TOP_LOGPROBS, num_ids)

  def compute(_):
    lp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
    top_lp_BA, top_id_BA = jax.lax.top_k(drawable(lp_BV, num_ids), A)
    return jnp.take_along_axis(lp_BV, token_B[:, None], axis=-1)[:, 0], top_id_BA.astype(jnp.int32), top_lp_BA

  B = logits_BV.shape[0]
  none = lambda _: (jnp.zeros(B, jnp.float32), jnp.zeros((B, A), jnp.int32), jnp.zeros((B, A), jnp.float32))
  return jax.lax.cond(jnp.any(want_B), compute, none, None)


PROCESSING = 4 + MAX_ENDS + 2 * MAX_BIAS  # columns of Request.processing
NEUTRAL = Request(prompt_ids=[], ignore_eos=True).processing(-1)  # a prefill row that changes no logit


def unpack_processing(x_RC):
  """Request.processing's rows as arrays: penalties [R, 3] (presence, frequency, repetition), min_tokens [R], end
  tokens [R, MAX_ENDS] and bias ids and values [R, MAX_BIAS] (-1: none)."""
  penalties_R3 = jax.lax.bitcast_convert_type(x_RC[:, :3], jnp.float32)
  ends = 4 + MAX_ENDS
  bias_R = jax.lax.bitcast_convert_type(x_RC[:, ends + MAX_BIAS:], jnp.float32)
  return penalties_R3, x_RC[:, 3], x_RC[:, 4:ends], x_RC[:, ends:ends + MAX_BIAS], bias_R


def dense_rows(ids_RK, values_RK, V: int, fill=0):
  """[R, V] with row r's ids_RK[r] (-1: none) set to values_RK[r], `fill` elsewhere."""
  R = ids_RK.shape[0]
  rows = jnp.broadcast_to(jnp.arange(R)[:, None], ids_RK.shape)
  cols = jnp.where(ids_RK >= 0, ids_RK, V)  # out of range: dropped
  return jnp.full((R, V), fill, values_RK.dtype).at[rows, cols].set(values_RK, mode="drop")


def processed_logits(logits_BV, s: dict, t_B):
  """The logits each row samples from, vLLM's order: the repetition penalty on the tokens of its prompt and new
  tokens (positive logits divided by it, negative multiplied), the frequency and presence penalties on its new
  tokens' counts, its logit_bias, and its end tokens at -inf while it has fewer than min_tokens new tokens (`t_B`:
  new tokens before this one). Rows without processing keep their logits."""
  presence_B, frequency_B, repetition_B = (s["penalties_B3"][:, i, None] for i in range(3))
  counts_BV = s["counts_BV"]
  seen_BV = s["prompt_BV"] | (counts_BV > 0)
  x_BV = jnp.where(seen_BV, jnp.where(logits_BV > 0, logits_BV / repetition_B, logits_BV * repetition_B), logits_BV)
  x_BV = x_BV - frequency_B * counts_BV - presence_B * (counts_BV > 0) + s["bias_BV"]
  early_BV = dense_rows(s["ends_BE"], jnp.ones(s["ends_BE"].shape, bool), logits_BV.shape[-1], False)
  x_BV = jnp.where(early_BV & (t_B < s["min_B"])[:, None], -jnp.inf, x_BV)
  return jnp.where(s["processed_B"][:, None], x_BV, logits_BV)


def key_data(seed):
  """The key data of `jax.random.key(seed)` for a request's seed (traceable: the prefill derives its rows' keys on the
  device, not one host-side JAX call per prompt). JAX, 64-bit types off as meshtrain runs it, seeds a key with the
  seed's low 32 bits; the seed arrives as those bits (uint32), so the keys equal Generator.generate's
  (tests/test_serve.py checks seeds past 32 bits and negative ones against jax.random.key)."""
  return jax.random.key_data(jax.random.key(seed))


def neutral_processing(B: int, V: int) -> dict:
  """The engine state's logits processing rows with nothing to do: no penalties, bias, min_tokens or counts."""
  return {"processed_B": jnp.zeros(B, bool), "penalties_B3": jnp.tile(jnp.asarray([0.0, 0.0, 1.0]), (B, 1)),
          "min_B": jnp.zeros(B, jnp.int32), "ends_BE": jnp.full((B, MAX_ENDS), -1, jnp.int32),
          "bias_BV": jnp.zeros((B, V), jnp.float32), "counts_BV": jnp.zeros((B, V), jnp.int32),
          "prompt_BV": jnp.zeros((B, V), bool)}


class DecodeCall(typing.NamedTuple):
  """A decode call dispatched on process 0 and not yet read: its tokens [steps, rows] and their logprobs (on the
  device: `decode`'s out), the requests that held its slots when it was dispatched, its steps, and when it was
  dispatched."""
  out: dict
  active: dict
  steps: int
  dispatched_at: float


@dataclasses.dataclass
class Plan:
  """One engine step, as process 0 decides it: a checkpoint to swap in, prompts to admit (slot, (ids, seed,
  temperature, top_p, top_k, logprobs, echo)), decode steps to run, or the end of serving. Encoded as int32 for
  the broadcast."""
  swap: int | None = None
  admit: list = dataclasses.field(default_factory=list)     # (slot, Request): process 0's, before encoding
  prompts: list = dataclasses.field(default_factory=list)   # (slot, (ids, seed, temp, top_p, top_k, logprobs, echo))
  decode: int = 0
  eos_id: int = -1  # process 0's: the end-of-sequence id of the requests' processing rows
  attend: int = 0   # the cache slots the decode steps attend over (a program of Engine.attends)
  rows: int = 0     # the slots the decode steps decode: the first `rows` (a program of Engine.row_counts)
  stop: bool = False

  def encode(self) -> np.ndarray:
    as_int = lambda x: int(np.float32(x).view(np.int32))
    out = [int(self.stop), -1 if self.swap is None else self.swap, self.decode, self.attend, self.rows,
           len(self.admit)]
    for slot, r in self.admit:  # the seed (any 64-bit integer) as its low and high 32 bits
      low, high = np.asarray(r.seed & 0xFFFFFFFF, np.uint32).view(np.int32), r.seed >> 32
      out += [slot, low, high, as_int(r.temperature), as_int(r.top_p), r.top_k,
              -1 if r.logprobs is None else r.logprobs, int(r.echo), len(r.prompt_ids), *r.prompt_ids]
      out += [1, *r.processing(self.eos_id)] if r.processed else [0]
    return np.asarray(out, np.int32)

  @classmethod
  def parse(cls, x: np.ndarray) -> "Plan":
    x = [int(v) for v in x]
    as_float = lambda i: float(np.int32(i).view(np.float32))
    plan = cls(stop=bool(x[0]), swap=None if x[1] < 0 else x[1], decode=x[2], attend=x[3], rows=x[4])
    at = 6
    for _ in range(x[5]):
      slot, low, high, temp, top_p, top_k, logprobs, echo, n = x[at:at + 9]
      seed = (high << 32) | (low & 0xFFFFFFFF)
      ids, at = x[at + 9:at + 9 + n], at + 9 + n
      processing = np.asarray(x[at + 1:at + 1 + PROCESSING], np.int32) if x[at] else None
      at += 1 + (PROCESSING if x[at] else 0)
      plan.prompts.append((slot, (ids, seed, as_float(temp), as_float(top_p), top_k, logprobs, bool(echo),
                                  processing)))
    return plan


def most_padding(max_len: int) -> int:
  """The most a prompt shorter than max_len is padded to its bucket (bucket(n) - n at each bucket's first n: a
  few dozen buckets, where every n up to a context of 10^9 never finished)."""
  worst, n = 0, 1
  while n < max_len:
    worst = max(worst, bucket(n) - n)
    n = bucket(n) + 1
  return worst


def tops(ids_LA, logprobs_LA, k: int) -> list:
  """Per position, its k most likely (id, logprob) pairs, from a step's TOP_LOGPROBS."""
  return [list(zip(i[:k].tolist(), lp[:k].tolist())) for i, lp in zip(ids_LA, logprobs_LA)]


def logprobs_of(out: dict, row: int, k: int | None) -> list | None:
  """(logprob, top k pairs) of each token of row `row` of a prefill's or decode call's numpy out; None when the
  request asked for none."""
  if k is None:
    return None
  chosen, top_id, top_lp = (np.atleast_1d(out[name][row]) for name in ("logprob", "top_id", "top_logprob"))
  return list(zip(chosen.tolist(), tops(top_id.reshape(len(chosen), -1), top_lp.reshape(len(chosen), -1), k)))


class Engine:
  """Continuous batching over `slots` decode rows of a Generator's model (module docstring).

    engine = Engine(Generator.from_workdir("runs/tiny"), slots=8)
    request = engine.submit(Request(prompt_ids=[...], max_tokens=64))
    while not request.done: engine.step()        # or engine.run(stop_event) on a thread

  `max_queue` bounds the requests waiting for a slot (submit raises QueueFull past it). `chunk`: decode steps per
  device call while no request waits for a free slot (one step per call when one does, so it joins at once).
  `step`: the checkpoint step of the generator's parameters; `live`: a LiveCheckpoints of its run, to swap in
  the newer ones as they appear (module docstring).
  """

  def __init__(self, generator, slots: int = 8, max_queue: int = 64, chunk: int = DECODE_CHUNK,
               step: int | None = None, live=None, warm_first: bool = False):
    if generator.max_len is None:
      raise UserError("serving needs a context length (the Generator's max_len)")
    self.gen = generator
    self.params = generator.params
    self.step_served = step
    self.live = live
    self.swap_to: int | None = None  # a newer checkpoint waiting for the slots to empty
    self.leader = jax.process_index() == 0
    self.processes = jax.process_count()
    self._groups = 0
    self.slots = -(-slots // generator.batch_ways) * generator.batch_ways  # whole rows on every batch shard
    self.max_len = generator.max_len
    self.max_bucket = bucket(self.max_len - 1)
    # A prompt of n tokens takes its bucket's P slots (P - n: up to 15 up to 128 tokens, a quarter of n past that),
    # then every new token but the last writes one: P + max_len - n - 1 slots, under max_len + the most any bucket
    # pads, and the longest bucket fits too. No longer than that (not max_bucket + max_len: 1.8x the memory).
    self.cache_len = max(self.max_len + most_padding(self.max_len), self.max_bucket)
    self._check_cache_fits()
    # The decode programs' attention spans (`Plan.attend`): each call attends over the fewest of these that holds
    # every busy row's slots, not over the context: 64, 96, 128, 192, ... while a quarter of the row or more is
    # left out, then the row.
    ladder = ((ATTEND_MIN << i) * (2 + j) // 2 for i in range(32) for j in (0, 1))  # 64, 96, 128, 192, ...
    self.attends = [n for n in ladder if 4 * n <= 3 * self.cache_len] + [self.cache_len]
    # The decode programs' row counts (`Plan.rows`): a quarter, half or all of the slots. All of them only with the
    # slots split over devices (batch_ways > 1): the first rows would sit on some devices, the others idle.
    ways = generator.batch_ways
    self.row_counts = sorted({-(-self.slots // d) for d in ROW_DIVISORS}) if ways == 1 else [self.slots]
    # A prefill's rows (`_rows`): one prompt, and the slots over powers of PREFILL_ROW_RATIO, in whole rows on
    # every batch shard. Prompts that ask for their own logprobs (echo: every column's logits, scoring) take the
    # most rows: one program per bucket for them.
    whole = lambda n: -(-n // ways) * ways
    self.prefill_rows = sorted({whole(1)} | {whole(-(-self.slots // PREFILL_ROW_RATIO ** k))
                                             for k in range(self.slots.bit_length())})
    self.echo_rows = self.prefill_rows[-1]
    self.max_queue = max_queue
    self.queue: collections.deque[Request] = collections.deque()
    self.active: dict[int, Request] = {}  # slot -> its request
    self.lock = threading.Condition()
    self.stop_len = 0
    self.chunk = max(1, chunk)
    self.prefills = {}  # (bucket, rows, echo) -> compiled prefill-and-insert
    self.steps = 0
    # Process 0: the last decode call, its tokens still on the device, read on the next step: after that step's
    # decode call is dispatched when it can be (`_ahead`), else first.
    self.pending: DecodeCall | None = None
    self.step_s: float | None = None  # process 0: a decode step's time, measured as calls are read (moving average)
    self.read_at = 0.0  # process 0: when the last call's tokens were read
    # Before the first request (`run`, `follow`), `warm()` compiles every program one can need, when `warm_first`:
    # `ready` says whether that is done, `warmed` of `to_warm` how far it is (counted once: /health is polled).
    self.ready, self.warmed = not warm_first, 0
    self._build()
    self.to_warm = len(self.programs())

  # --- compiled programs ---

  def _build(self) -> None:
    g, c, B, S = self.gen, self.gen.model_cfg, self.slots, self.cache_len
    self.replicated = NamedSharding(g.mesh, PartitionSpec())
    self.batch_sharding = sharding.batch_sharding(g.mesh, g.rules)

    def init():
      cache = init_cache(c, B, S, jnp.zeros(B, jnp.int32))
      return {"cache": cache.replace(end=jnp.zeros(B, jnp.int32)), "token_B": jnp.zeros(B, jnp.int32),
              "t_B": jnp.zeros(B, jnp.int32), "key_B": jnp.zeros((B, *key_data(0).shape), jnp.uint32),
              "temp_B": jnp.zeros(B, jnp.float32), "top_p_B": jnp.ones(B, jnp.float32),
              "top_k_B": jnp.zeros(B, jnp.int32), "logprobs_B": jnp.full(B, -1, jnp.int32),
              **neutral_processing(B, c.vocab_size)}

    def decode(params, state, attend):
      # Every row holding a request writes below `attend` during the call (the plan picks it so); a free row keeps
      # stepping with its next slot held at attend - 1: it writes within the cache and sees a slot (what it computes
      # is never read).
      cache = state["cache"]
      cache = cache.replace(end=jnp.minimum(cache.end, attend - 1), attend=attend)
      logits_B1V, cache = g.model.apply({"params": params}, state["token_B"][:, None], cache=cache)
      keys_B = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(state["key_B"]), state["t_B"])
      logits_BV, any_processed = logits_B1V[:, 0], jnp.any(state["processed_B"])
      drawn_BV = jax.lax.cond(any_processed, lambda: processed_logits(logits_BV, state, state["t_B"]),
                              lambda: logits_BV)
      token_B = sample_rows(drawn_BV, keys_B, state["temp_B"], state["top_p_B"], state["top_k_B"], g.num_ids)
      out = dict(zip(("token", "logprob", "top_id", "top_logprob"), (token_B, *logprobs_rows(
          logits_BV, token_B, state["logprobs_B"] >= 0, g.num_ids))))
      counts_BV = jax.lax.cond(any_processed, lambda c: c.at[jnp.arange(c.shape[0]), token_B].add(1), lambda c: c,
                               state["counts_BV"])
      return {**state, "cache": cache.replace(attend=0), "token_B": token_B, "t_B": state["t_B"] + 1,
              "counts_BV": counts_BV}, out

    def decode_steps(params, state, steps, attend, rows):
      """`steps` decode steps (1 .. chunk, an argument: one program serves single steps and chunks) in one device
      call of the first `rows` slots, attending over the cache's first `attend` slots: tokens [chunk, rows], their
      logprobs [chunk, rows] and top ones [chunk, rows, A], of which the first `steps` are the call's. The cache's
      arrays pass whole (the model writes into their first rows: llama.write_slots), the rows' start, end, tokens
      and sampling settings as the first `rows` of each."""
      cache = state["cache"]
      head = {k: v[:rows] for k, v in state.items() if k != "cache"}
      head["cache"] = cache.replace(start_B=cache.start_B[:rows], end=cache.end[:rows])
      blank = jax.tree.map(lambda a: jnp.zeros((self.chunk, *a.shape), a.dtype),
                           jax.eval_shape(lambda s: decode(params, s, attend)[1], head))

      def step(k, carry):
        s, out_KR = decode(params, carry[0], attend)
        return s, jax.tree.map(lambda buffer, x: buffer.at[k].set(x), carry[1], out_KR)
      head, out_KR = jax.lax.fori_loop(0, steps, step, (head, blank))
      merged = {k: state[k].at[:rows].set(v) for k, v in head.items() if k != "cache"}
      merged["cache"] = head["cache"].replace(start_B=cache.start_B, end=cache.end.at[:rows].set(head["cache"].end))
      return merged, out_KR

    self._decode_steps = decode_steps
    with jax.set_mesh(g.mesh), nn.logical_axis_rules(g.rules):
      init_c = jax.jit(init).lower().compile()
      self.state_shardings = init_c.output_shardings
      self.state = init_c()
    self.decodes = {}  # (attend, rows) -> compiled decode steps
    # A call's step count as the programs take it, placed once (a transfer per call costs a single step's time).
    self._step_counts = {k: place(np.int32(k), self.replicated) for k in sorted({1, self.chunk})}

  def _decode(self, steps: int, attend: int, rows: int):
    """`steps` decode steps of the first `rows` slots over the cache's first `attend` slots: a function of (params,
    state) running the compiled program of (attend, rows), compiled on first use, as `_prefill`."""
    if (attend, rows) not in self.decodes:
      g = self.gen
      with jax.set_mesh(g.mesh), nn.logical_axis_rules(g.rules):
        self.decodes[attend, rows] = jax.jit(
            self._decode_steps, static_argnums=(3, 4), donate_argnums=1,
            out_shardings=(self.state_shardings, self.replicated)).lower(
                self._abstract(g.params), self._abstract(self.state), self._step_counts[1], attend, rows).compile()
      startup.barrier("serving's first run of a compiled decode", g.barrier_timeout_s)
    program, count = self.decodes[attend, rows], self._step_counts[steps]
    return lambda params, state: program(params, state, count)

  @staticmethod
  def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)

  def _prefill(self, P: int, R: int, echo: bool = False):
    """The compiled prefill-and-insert of R prompts padded to P tokens, with the prompts' own logprobs when `echo`
    (compiled by `warm` or on first use; with several processes, all of them compile it in the same step, then wait
    for each other before its first run)."""
    if (P, R, echo) not in self.prefills:
      self.prefills[P, R, echo] = self._compile_prefill(P, R, echo)
      startup.barrier("serving's first run of a compiled prefill", self.gen.barrier_timeout_s)
    return self.prefills[P, R, echo]

  def _rows(self, count: int) -> int:
    """Rows of a prefill of `count` prompts: the fewest of `prefill_rows` that hold them."""
    return next(n for n in self.prefill_rows if n >= count)

  def _compile_prefill(self, P: int, R: int, echo: bool):
    g, c = self.gen, self.gen.model_cfg

    def prefill(params, state, tokens_RP, rows_R8, processing_RC):
      """Rows past the prompts (slot_R = slots, out of range) fill the batch: their writes are dropped. `rows_R8`:
      each row's start, slot, seed (its low 32 bits), temperature, top_p (float32 bits), top_k, logprobs (-1: none)
      and echo, one array (one transfer: eight cost the host more than a small model's prefill)."""
      start_R, slot_R, top_k_R, logprobs_R = rows_R8[:, 0], rows_R8[:, 1], rows_R8[:, 5], rows_R8[:, 6]
      temp_R, top_p_R = (jax.lax.bitcast_convert_type(rows_R8[:, i], jnp.float32) for i in (3, 4))
      key_data_R = jax.vmap(key_data)(jax.lax.bitcast_convert_type(rows_R8[:, 2], jnp.uint32))
      logits_RLV, pre = g.model.apply({"params": params}, tokens_RP, cache=init_cache(c, R, P, start_R),
                                      every_column=echo)
      keys_R = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(key_data_R), jnp.zeros(R, jnp.int32))
      # Every slot taken starts from its own request's settings; rows that change no logit (NEUTRAL: most
      # requests) skip the processing, as decode's steps do: one program serves both.
      penalties_R3, min_R, ends_RE, bias_ids_RK, bias_R = unpack_processing(processing_RC)
      processed_R = ((penalties_R3[:, 0] != 0) | (penalties_R3[:, 1] != 0) | (penalties_R3[:, 2] != 1)
                     | (bias_ids_RK >= 0).any(-1) | (min_R > 0))
      any_processed = jnp.any(processed_R)

      def settings():  # the rows' own [R, V] bias and prompt tokens: only built when some row asks
        prompt_RP = jnp.where(jnp.arange(P) >= start_R[:, None], tokens_RP, -1)
        return {**neutral_processing(R, c.vocab_size), "penalties_B3": penalties_R3, "min_B": min_R,
                "ends_BE": ends_RE, "bias_BV": dense_rows(bias_ids_RK, bias_R, c.vocab_size),
                "prompt_BV": dense_rows(prompt_RP, jnp.ones(prompt_RP.shape, bool), c.vocab_size, False),
                "processed_B": processed_R}
      rows = jax.lax.cond(any_processed, settings, lambda: neutral_processing(R, c.vocab_size))
      drawn_RV = jax.lax.cond(any_processed, lambda: processed_logits(logits_RLV[:, -1], rows, jnp.zeros(R, jnp.int32)),
                              lambda: logits_RLV[:, -1])
      token_R = sample_rows(drawn_RV, keys_R, temp_R, top_p_R, top_k_R, g.num_ids)
      rows["counts_BV"] = jax.lax.cond(any_processed, lambda c: c.at[jnp.arange(R), token_R].add(1), lambda c: c,
                                       rows["counts_BV"])
      out = dict(zip(("token", "logprob", "top_id", "top_logprob"),
                     (token_R, *logprobs_rows(logits_RLV[:, -1], token_R, logprobs_R >= 0, g.num_ids))))
      if echo:  # column j's logits score the prompt's token j + 1: [R, P - 1] and [R, P - 1, A]
        chosen, top_id, top_lp = logprobs_rows(logits_RLV[:, :-1].reshape(R * (P - 1), -1),
                                               tokens_RP[:, 1:].reshape(-1), jnp.ones(1, bool), g.num_ids)
        # Each prompt token's rank among the ids the sampler can draw (vLLM's prompt_logprobs give it): 1 + how
        # many are likelier.
        scores_RLV = logits_RLV[:, :-1].astype(jnp.float32)
        mine_RL1 = jnp.take_along_axis(scores_RLV, tokens_RP[:, 1:, None], axis=-1)
        rank = 1 + jnp.sum(drawable(scores_RLV, g.num_ids) > mine_RL1, axis=-1, dtype=jnp.int32)
        out.update(prompt_logprob=chosen.reshape(R, P - 1), prompt_top_id=top_id.reshape(R, P - 1, -1),
                   prompt_top_logprob=top_lp.reshape(R, P - 1, -1), prompt_rank=rank)
      # Each prompt's P slots go to the front of its slot's row (a scatter over the rows: one call for them all).
      insert = lambda full, new: (tuple(f.at[slot_R, :, :P].set(n, mode="drop") for f, n in zip(full, new))
                                  if isinstance(full, tuple) else full.at[:, slot_R, :, :P].set(new, mode="drop"))
      at = lambda x, new: x.at[slot_R].set(new, mode="drop")
      cache = state["cache"]
      cache = cache.replace(k_NBKSE=insert(cache.k_NBKSE, pre.k_NBKSE), v_NBKSE=insert(cache.v_NBKSE, pre.v_NBKSE),
                            start_B=at(cache.start_B, start_R), end=at(cache.end, jnp.full(R, P, jnp.int32)))
      return {"cache": cache, "token_B": at(state["token_B"], token_R), "t_B": at(state["t_B"], jnp.ones(R, jnp.int32)),
              "key_B": at(state["key_B"], key_data_R), "temp_B": at(state["temp_B"], temp_R),
              "top_p_B": at(state["top_p_B"], top_p_R), "top_k_B": at(state["top_k_B"], top_k_R),
              "logprobs_B": at(state["logprobs_B"], logprobs_R),
              **{k: at(state[k], v) for k, v in rows.items()}}, out

    args = (self._abstract(g.params), self._abstract(self.state),
            jax.ShapeDtypeStruct((R, P), jnp.int32, sharding=self.batch_sharding),
            jax.ShapeDtypeStruct((R, 8), jnp.int32, sharding=self.replicated),
            jax.ShapeDtypeStruct((R, PROCESSING), jnp.int32, sharding=self.replicated))
    with jax.set_mesh(g.mesh), nn.logical_axis_rules(g.rules):
      return jax.jit(prefill, donate_argnums=1, out_shardings=(self.state_shardings, self.replicated)).lower(
          *args).compile()

  def _check_cache_fits(self) -> None:
    """Refuses, before anything is compiled or allocated, slots whose KV cache (keys and values of every layer for
    every slot's cache_len positions, split over the mesh at best) and per-slot [V] arrays cannot fit a device."""
    c, mesh = self.gen.model_cfg, self.gen.mesh
    per_device = (kv_cache_bytes(c, self.slots, self.cache_len) + 3 * self.slots * c.vocab_size * 4) // mesh.size
    capacity, source = layout.device_memory(mesh)
    if per_device > capacity:
      raise UserError(f"{self.slots} slots of a {self.max_len:,}-token context (--slots, --max-len) need a KV cache "
                      f"of {per_device / 1e9:,.1f} GB per device, more than the {capacity / 1e9:,.1f} GB a device "
                      f"has ({source}); lower --max-len or --slots, or spread the model over more devices")

  @property
  def compiled_programs(self) -> int:
    return len(self.prefills) + len(self.decodes)

  def programs(self, longest: int | None = None) -> list[tuple]:
    """Every program a request of up to `longest` prompt tokens (default: the context) can need: ("prefill", P,
    rows, echo) for each bucket, and ("decode", attend, rows) for each span and row count (any call length)."""
    buckets = sorted({bucket(n) for n in range(1, min(longest or self.max_len - 1, self.max_len - 1) + 1)})
    prefills = [("prefill", P, R, False) for P in buckets for R in self.prefill_rows]
    prefills += [("prefill", P, self.echo_rows, True) for P in buckets]
    decodes = [("decode", attend, rows) for attend in self.attends for rows in self.row_counts]
    return prefills + decodes

  def warm(self, longest: int | None = None, stop: threading.Event | None = None) -> None:
    """Compiles every program of `programs(longest)` and runs each once (every process, in the same order, before
    any request), counting them in `warmed`: a program's first run costs more than the next (its buffers are
    allocated; 4-12 ms more for the tiny model's), which would land in the first requests' latency. The runs change
    no slot a request could hold: no slot holds one yet, and the prefills' rows are all past the slots (dropped).

    Once process 0's `stop` is set it returns after the program in hand, `ready` still False: a SIGTERM while a big
    model warms ends it in one compile, not in all of them. Every process learns that from process 0 before each
    program (one small broadcast), so all of them stop before the same one: none waits in a collective alone."""
    programs = self.programs(longest)
    self.warmed, self.to_warm = 0, len(programs)
    for kind, *key in programs:
      if self._agree(np.int32([stop is not None and stop.is_set()]) if self.leader else None)[0]:
        return
      if kind == "prefill":
        P, R, echo = key
        self._prefill_rows(P, [], echo, R)
      else:
        self.state, out_KR = self._decode(1, *key)(self.params, self.state)
        np.asarray(out_KR["token"])
      self.warmed += 1
    self.ready = True

  # --- requests ---

  def check(self, request: Request) -> None:
    """UserError for a request that cannot run: a prompt past the context, a bad length or sampling setting."""
    n = len(request.prompt_ids)
    if n == 0:
      raise UserError("the prompt is empty")
    if n >= self.max_len:
      raise UserError(f"the prompt is {n} tokens, but the model's context is {self.max_len} tokens, which leaves no "
                      "room for a new token; shorten the prompt")
    if request.max_tokens < (0 if request.echo else 1):
      raise UserError(f"max_tokens {request.max_tokens} must be at least {0 if request.echo else 1}")
    if request.logprobs is not None and not 0 <= request.logprobs <= TOP_LOGPROBS:
      raise UserError(f"logprobs {request.logprobs} must be between 0 and {TOP_LOGPROBS}")
    if not 0 <= request.prompt_top <= TOP_LOGPROBS:
      raise UserError(f"prompt_logprobs {request.prompt_top} must be between 0 and {TOP_LOGPROBS}")
    self.check_processing(request)
    vocab = self.gen.model_cfg.vocab_size
    if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab:
      raise UserError(f"the prompt has a token id outside the model's vocabulary 0..{vocab - 1}")
    if request.seed is not None and not -2**63 <= request.seed < 2**63:
      raise UserError(f"seed {request.seed} must be a 64-bit integer")
    try:
      Sampling(float(request.temperature), int(request.top_k), float(request.top_p)).check(vocab)
    except UserError as e:
      raise UserError(str(e).replace("--top-k", "top_k").replace("--top-p", "top_p")) from None

  def check_processing(self, request: Request) -> None:
    """UserError for logits processing settings out of range (OpenAI's bounds where it has them)."""
    vocab = self.gen.model_cfg.vocab_size
    bias = request.logit_bias
    if len(bias) > MAX_BIAS:
      raise UserError(f"logit_bias has {len(bias)} entries; at most {MAX_BIAS}")
    if any(not 0 <= i < vocab for i in bias) or any(not -100 <= v <= 100 for v in bias.values()):
      raise UserError(f"logit_bias maps token ids 0..{vocab - 1} to biases between -100 and 100")
    for name in ("presence_penalty", "frequency_penalty"):
      if not -2 <= getattr(request, name) <= 2:
        raise UserError(f"{name} {getattr(request, name)} must be between -2 and 2")
    if not 0 < request.repetition_penalty <= 100:
      raise UserError(f"repetition_penalty {request.repetition_penalty} must be above 0 (1: none) and at most 100")
    if not 0 <= request.min_tokens <= request.max_tokens:
      raise UserError(f"min_tokens {request.min_tokens} must be between 0 and max_tokens ({request.max_tokens})")
    if request.min_tokens and len(request.stop_token_ids) >= MAX_ENDS:
      raise UserError(f"min_tokens holds back at most {MAX_ENDS - 1} stop_token_ids; this request has "
                      f"{len(request.stop_token_ids)}")
    if any(not 0 <= i < vocab for i in request.stop_token_ids):
      raise UserError(f"stop_token_ids must be token ids 0..{vocab - 1}")

  def submit(self, *requests: Request) -> Request:
    """Queues the requests together (any thread): they run on one checkpoint. UserError for a bad one, QueueFull
    when they would take the queue past max_queue (none is queued then). Returns the first."""
    if len(requests) > self.max_queue:
      raise UserError(f"{len(requests)} choices at once are more than the queue holds (max_queue "
                      f"{self.max_queue}); ask for fewer (n, prompts) or raise the server's --max-queue")
    for request in requests:
      self.check(request)
      request.limit = min(request.max_tokens, self.max_len - len(request.prompt_ids))
      if request.seed is None:
        request.seed = secrets.randbits(31)
      request.submitted_at = time.perf_counter()
    with self.lock:
      if len(self.queue) + len(requests) > self.max_queue:
        raise QueueFull(f"{len(self.queue)} requests are waiting for a slot")
      self._groups += 1
      for request in requests:
        request.group = self._groups
      self.queue.extend(requests)
      self.lock.notify()
    return requests[0]

  @property
  def queued(self) -> int:
    return len(self.queue)

  @property
  def busy(self) -> int:
    return len(self.active)

  # --- the loop (the engine thread) ---

  def step(self) -> bool:
    """One plan: process 0 makes it (cancellations, a checkpoint swap, admissions into free slots, decode steps),
    every process runs it. False when there was nothing to do."""
    plan = self._agree(self._plan() if self.leader else None)
    return self._run(plan)

  def run(self, stop: threading.Event, idle_wait_s: float = IDLE_S) -> None:
    """Steps until `stop` is set; waits for a request while there is nothing to do (process 0). Warms first unless
    `ready`."""
    if not self.ready:
      self.warm()
    while not stop.is_set():
      if not self.step():
        with self.lock:
          if not self.queue and not stop.is_set():
            self.lock.wait(idle_wait_s)
    if self.pending is not None:
      self._read(self.pending)
      self.pending = None
    if self.processes > 1:
      self._agree(Plan(stop=True).encode())  # the other processes' follow() returns

  def follow(self) -> None:
    """The other processes' loop: run process 0's plans until it sends the last one (warmed first unless `ready`,
    as process 0's `run`: the programs' first runs, with their collectives, in the same order)."""
    if not self.ready:
      self.warm()
      if not self.ready:  # process 0 stopped while warming
        return
    while True:
      plan = self._agree(None)
      if Plan.parse(plan).stop:
        return
      self._run(plan)

  def _agree(self, plan: np.ndarray | None) -> np.ndarray:
    """Process 0's encoded plan, on every process: one broadcast of its length, one of the plan padded to a power
    of two (so that few sizes are ever compiled)."""
    if self.processes == 1:
      return plan
    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(plan) if self.leader else 0)))
    padded = np.zeros(max(64, 1 << (n - 1).bit_length()), np.int32)
    if self.leader:
      padded[:n] = plan
    return np.asarray(multihost_utils.broadcast_one_to_all(padded))[:n]

  def _plan(self) -> np.ndarray:
    """Process 0: what this step does, with its own bookkeeping (cancelled requests leave, admitted ones take their
    slots), encoded for the other processes."""
    if self.pending is not None and not self._ahead():
      self._read(self.pending)
      self.pending = None
    behind = self.pending.steps if self.pending is not None else 0  # steps decoded but not yet read
    for slot, request in list(self.active.items()):
      if request.cancelled:
        self._finish(slot, "cancelled")
    plan = Plan(eos_id=self.gen.eos_id)
    if self.live is not None and self.swap_to is None:
      self.swap_to = self.live.newer()
    if self.swap_to is not None and not self.active:
      plan.swap, self.swap_to = self.swap_to, None
    held = {r.group for r in self.active.values()}  # groups that must finish on the checkpoint they started on
    free = [s for s in range(self.slots) if s not in self.active]
    while free:
      with self.lock:
        if not self.queue or (self.swap_to is not None and self.queue[0].group not in held):
          break
        request = self.queue.popleft()
      if request.cancelled:
        self._done(request, "cancelled")
        continue
      slot = free.pop(0)
      self.active[slot] = request
      request.admitted_at = time.perf_counter()
      request.slot_end = bucket(len(request.prompt_ids))  # its prefill fills slots [0, P)
      plan.admit.append((slot, request))
    if self.active:
      waiting = bool(self.queue) and len(self.active) < self.slots
      admitted = {r for _, r in plan.admit}  # their first token comes from this step's prefill
      left = [r.limit - len(r.token_ids) - behind - (r in admitted) for r in self.active.values()]
      most = max(left)
      # A chunk (one host round trip, not `chunk`: what a small model's step on the CPU mostly is) when no request
      # waits for a free slot and a chunk's steps are needed: by some active request, or, with every slot busy and
      # a request queued, before the first slot frees by its length (the request joins then, not up to a chunk
      # later); and either every slot is busy or two chunks take at most CALL_BUDGET_S by the measured step time.
      # Else one step. Powers of two below the chunk measured no faster, each one more program to compile.
      full = len(self.active) == self.slots
      quick = self.step_s is not None and 2 * self.step_s * self.chunk <= CALL_BUDGET_S
      room = min(left) if full and self.queue else most
      chunked = not waiting and (full or quick) and room >= self.chunk
      plan.decode = 0 if most <= 0 else self.chunk if chunked else 1
      # The fewest cache slots the call's steps see: the rows' next slots after it (a chunk runs past a request's
      # end, which nothing reads; past the cache only beyond its limit: the context's S).
      reach = max(r.slot_end for r in self.active.values()) + plan.decode
      plan.attend = next((n for n in self.attends if n >= reach), self.cache_len)
      plan.rows = next(n for n in self.row_counts if n > max(self.active))  # the busy slots (lowest first: above)
      for r in self.active.values():
        r.slot_end += plan.decode
    return plan.encode()

  def _ahead(self) -> bool:
    """Whether the next decode call can be dispatched before the last one's tokens are read (process 0): no request
    leaves by its length in the last call, none is cancelled, and either every slot is busy (no request could be
    admitted before one leaves) or the last call and a step more take at most CALL_BUDGET_S (a request arriving
    now waits for both before its prefill). The device then computes the next call while this thread reads the last
    one's tokens, hands out their text and lets the server's event loop write them, instead of waiting for all of
    that between calls: with a slot free, what keeps single steps (the tiny model's on the CPU) as fast as chunks.
    A request that ends early inside the last call (its end-of-sequence token, a stop string) computes one call more
    for nothing, which nothing reads: its slot is freed a call later."""
    active = self.active.values()
    left = [r.limit - len(r.token_ids) - self.pending.steps for r in active]
    # With a slot free, a request arriving now waits for both calls: only while they stay within CALL_BUDGET_S.
    quick = self.step_s is not None and (self.pending.steps + 1) * self.step_s <= CALL_BUDGET_S
    return (bool(left) and min(left) >= 1 and not any(r.cancelled for r in active)
            and (len(self.active) == self.slots or quick))

  def _read(self, call: DecodeCall) -> None:
    """Reads a decode call's tokens (waiting for the device) and gives each request still in its slot its own, with
    their logprobs where it asked (read from the device only then)."""
    want = any(r.logprobs is not None for r in call.active.values())
    out = {k: np.swapaxes(np.asarray(v)[:call.steps], 0, 1) for k, v in call.out.items()
           if want or k == "token"}  # [R, steps, ...]
    # The call ran from its dispatch, or from the end of the one before it (read here last) if that was later.
    now = time.perf_counter()
    took = (now - max(call.dispatched_at, self.read_at)) / call.steps
    self.step_s, self.read_at = took if self.step_s is None else 0.8 * self.step_s + 0.2 * took, now
    for slot, request in call.active.items():
      if self.active.get(slot) is request:  # not finished (by an earlier call's tokens) or cancelled since
        self._take(slot, request, out["token"][slot].tolist(), logprobs_of(out, slot, request.logprobs))

  def _run(self, encoded: np.ndarray) -> bool:
    """Runs a plan (every process); process 0 takes the new tokens."""
    plan = Plan.parse(encoded)
    if plan.swap is not None:
      params = self.live.load(self.gen, plan.swap)
      if params is not None:
        self.params, self.step_served = params, plan.swap
        if self.leader:
          print(f"serving step {plan.swap} of {self.live.workdir} (nothing compiled again)", file=sys.stderr,
                flush=True)
    buckets = collections.defaultdict(list)  # one prefill call for the prompts of each bucket, echoed or not
    for slot, prompt in plan.prompts:
      buckets[bucket(len(prompt[0])), prompt[6]].append((slot, prompt))
    for (P, echo), prompts in buckets.items():
      out = self._prefill_rows(P, prompts, echo)
      if self.leader:
        for r, (slot, (ids, *_)) in enumerate(prompts):
          request = self.active[slot]
          request.step = self.step_served
          if request.echo:  # the prompt's token j + 1 is scored by column P - n + j
            cols = slice(P - len(ids), P - 1)
            request.prompt_logprobs = [None, *out["prompt_logprob"][r, cols].tolist()]
            k = max(request.logprobs or 0, request.prompt_top)
            request.prompt_top_logprobs = [None, *tops(out["prompt_top_id"][r, cols],
                                                       out["prompt_top_logprob"][r, cols], k)]
            request.prompt_ranks = [None, *out["prompt_rank"][r, cols].tolist()]
          if request.limit == 0:  # the prompt's logprobs alone (echo with max_tokens 0)
            self._finish(slot, "length")
            continue
          self._take(slot, request, [int(out["token"][r])], logprobs_of(out, r, request.logprobs))
    if plan.decode:
      decode = self._decode(plan.decode, plan.attend, plan.rows)
      self.state, out_KR = decode(self.params, self.state)  # not waited for
      self.steps += plan.decode
      if self.leader:
        earlier, self.pending = self.pending, DecodeCall(out_KR, dict(self.active), plan.decode,
                                                         time.perf_counter())
        if earlier is not None:  # this call was dispatched ahead of reading the last one (`_ahead`): read it now
          self._read(earlier)
    return bool(plan.swap is not None or plan.prompts or plan.decode)

  def _prefill_rows(self, P: int, prompts: list, echo: bool = False, R: int | None = None) -> dict:
    """Prefills the prompts of bucket P into their slots in one call of R rows (every process; default: the fewest
    for them, or `echo_rows` with the prompts' own logprobs when `echo`). Their first tokens and, for rows that
    asked, logprobs (`prefill`'s out, as numpy, process 0 only; the logprobs read only when some row asked)."""
    R = R or (self.echo_rows if echo else self._rows(len(prompts)))
    tokens_RP = np.full((R, P), self.gen.pad_id, np.int32)
    # Rows past the prompts: one padding token each (never written), the slot past the last (dropped), greedy.
    rows_R8 = np.tile(np.array([P - 1, self.slots, 0, 0, np.float32(1).view(np.int32), 0, -1, 0], np.int32), (R, 1))
    processing_RC = np.tile(NEUTRAL, (R, 1))
    for r, (slot, (ids, seed, temp, top_p, top_k, logprobs, _, processing)) in enumerate(prompts):
      tokens_RP[r, P - len(ids):] = ids
      rows_R8[r] = (P - len(ids), slot, np.uint32(seed & 0xFFFFFFFF).view(np.int32),
                    np.float32(temp).view(np.int32), np.float32(top_p).view(np.int32), top_k, logprobs, echo)
      if processing is not None:
        processing_RC[r] = processing
    self.state, out = self._prefill(P, R, echo)(
        self.params, self.state, place(tokens_RP, self.batch_sharding), place(rows_R8, self.replicated),
        place(processing_RC, self.replicated))
    if not self.leader:
      return {}
    wanted = ("token", "logprob", "top_id", "top_logprob") if (rows_R8[:, 6] >= 0).any() else ("token",)
    return {k: np.asarray(v) for k, v in out.items() if k in wanted or k.startswith("prompt_")}

  def _take(self, slot: int, request: Request, tokens: list[int], logprobs: list | None = None) -> None:
    """New tokens of the request in `slot` (one decode call's, and their logprobs where it asked): those up to its
    end, then its text, shown once."""
    if request.first_token_at is None:
      request.first_token_at = time.perf_counter()
    ends = set(request.stop_token_ids) | ({self.gen.eos_id} if not request.ignore_eos else set())
    reason = None
    for i, token in enumerate(tokens):
      request.token_ids.append(token)
      if logprobs is not None:
        request.token_logprobs.append(logprobs[i][0])
        request.top_logprobs.append(logprobs[i][1])
      if request.stop:  # the text after each token: the request ends on the token that completes a stop string
        request.text = self.text_of(request.token_ids, ends)
        for stop in request.stop:
          if stop and (at := request.text.find(stop)) >= 0:
            request.text, reason = request.text[:at], "stop"
      if reason is None and token in ends:
        reason = "stop"
      elif reason is None and len(request.token_ids) >= request.limit:
        reason = "length"
      if reason is not None:
        break
    if not request.stop:
      request.text = self.text_of(request.token_ids, ends)
    if request.cancelled:
      reason = "cancelled"
    if reason is not None:
      self._finish(slot, reason)
      return
    # Hold back what could still become a stop string, and a character still being decoded (bytes of UTF-8).
    hold = max([len(s) - 1 for s in request.stop if s] + [0])
    show = len(request.text) - hold
    while show > request.sent and request.text[show - 1] == "\ufffd":
      show -= 1
    if show > request.sent:
      self._update(request, request.text[request.sent:show])

  def text_of(self, ids: list[int], ends: set) -> str:
    """The text of a request's new tokens: without a last token that ended it (its end-of-sequence or stop token)
    and without end-of-sequence tokens it went past (ignore_eos), which have no text."""
    ids = ids[:-1] if ids and ids[-1] in ends else ids
    return self.gen.tokenizer.decode(np.asarray([t for t in ids if t != self.gen.eos_id], np.int32))

  def _finish(self, slot: int, reason: str) -> None:
    self._done(self.active.pop(slot), reason)

  def _done(self, request: Request, reason: str) -> None:
    request.finish_reason = reason
    request.finished_at = time.perf_counter()
    self._update(request, request.text[request.sent:])

  @staticmethod
  def _update(request: Request, delta: str) -> None:
    request.sent += len(delta)
    if request.on_update is not None:
      request.on_update(request, delta)
