"""lm-evaluation-harness in this process, on the mesh: `python -m meshtrain.eval` and training's harness hook.

`MeshLM` is an lm_eval `LM` over a Generator's sharded model (meshtrain/inference/generator.py):
  - loglikelihood and loglikelihood_rolling: each (context, continuation) as one row of the training forward pass
    (no cache: every column's logits), the float32 log-softmax of the logits at the continuation's tokens summed;
    rows sorted by length, `batch_size` rows a call, padded to the prompt buckets of serving (sampling.bucket), so
    a task compiles a few programs, each on the Generator's mesh with the batch split over its batch axes;
  - generate_until: Generator.generate on batches of contexts, each cut at its task's stop strings.

It tokenizes as the harness does through the server (its `tokenizer_backend=remote`: POST /tokenize): a special
token's text is that token, nothing is added, and an empty context is the prefix token (the beginning-of-sequence
token where the tokenizer has one, else end-of-sequence); contexts are left-truncated to the context length as the
harness's API models truncate them. So the same tasks give the same results in-process and through
`python -m meshtrain.serve` (tests/test_logprobs.py), and a logprob is normalised over the whole vocabulary as the
loss is (minus the training loss on the continuation's tokens).
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import lm_eval
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from lm_eval import utils as lm_eval_utils
from lm_eval.api.model import TemplateLM

from meshtrain import sharding
from meshtrain.inference.generator import drawable, place
from meshtrain.inference.sampling import Sampling, bucket


def evaluate(lm, names: list[str], manager, limit: int | None = None, num_fewshot: int | None = None,
             **kwargs) -> dict:
  """The harness's simple_evaluate of tasks `names` (loaded by harness_tasks.load) on `lm`."""
  return lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                                 **kwargs)


def table(results: dict) -> str:
  """The harness's own results table."""
  return lm_eval_utils.make_table(results)


class MeshLM(TemplateLM):
  """An lm_eval LM over `gen` (a Generator with a context, `max_len`): module docstring."""

  def __init__(self, gen, batch_size: int = 8):
    super().__init__()
    if gen.max_len is None:
      raise ValueError("MeshLM needs the Generator's context (max_len)")
    self.gen = gen
    self.batch_size = -(-batch_size // gen.batch_ways) * gen.batch_ways  # whole rows on every batch shard
    self.max_length = gen.max_len
    self.rows_sharding = sharding.batch_sharding(gen.mesh, gen.rules)
    self._scorers = {}  # (rows, length) -> compiled

  @property
  def eot_token_id(self) -> int:
    return self.gen.eos_id

  @property
  def prefix_token_id(self) -> int:
    bos = self.gen.tokenizer.bos_id
    return bos if bos is not None else self.gen.eos_id

  def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
    del add_special_tokens, kwargs  # nothing added: as the harness's remote tokenizer asks the server
    return self.gen.tokenizer.encode_with_specials(string).tolist()

  def tok_decode(self, tokens) -> str:
    return self.gen.tokenizer.decode(np.asarray(tokens, np.int32))

  # --- scoring ---

  def _scorer(self, B: int, L: int):
    """The compiled scoring of B rows of L tokens: each position's target logprob and whether it is the most likely
    id the model could be sampled to ([B, L] each)."""
    if (B, L) not in self._scorers:
      g = self.gen

      def score(params, tokens_BL, targets_BL):
        logits_BLV = g.model.apply({"params": params}, tokens_BL)
        lp_BLV = jax.nn.log_softmax(logits_BLV.astype(jnp.float32), axis=-1)
        chosen_BL = jnp.take_along_axis(lp_BLV, targets_BL[..., None], axis=-1)[..., 0]
        return chosen_BL, chosen_BL == drawable(lp_BLV, g.num_ids).max(-1)

      rows = jax.ShapeDtypeStruct((B, L), jnp.int32, sharding=self.rows_sharding)
      params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), g.params)
      with jax.set_mesh(g.mesh), nn.logical_axis_rules(g.rules):
        self._scorers[B, L] = jax.jit(score, out_shardings=NamedSharding(g.mesh, PartitionSpec())).lower(
            params, rows, rows).compile()
    return self._scorers[B, L]

  def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
    """(sum of the continuation's logprobs, whether each of its tokens is the most likely) per request."""
    rows = []
    for _, context, continuation in requests:
      whole = (context + continuation)[-(self.max_length + 1):]
      rows.append((whole[:-1], whole[1:], len(continuation)))
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # similar lengths share a call
    results = [None] * len(rows)
    for start in range(0, len(order), self.batch_size):
      batch = order[start:start + self.batch_size]
      L = bucket(max(len(rows[i][0]) for i in batch))
      tokens_BL = np.full((self.batch_size, L), self.gen.pad_id, np.int32)
      targets_BL = np.zeros((self.batch_size, L), np.int32)
      for r, i in enumerate(batch):  # right-padded: a causal model's earlier columns do not see the padding
        tokens_BL[r, :len(rows[i][0])], targets_BL[r, :len(rows[i][1])] = rows[i][0], rows[i][1]
      chosen_BL, top_BL = (np.asarray(x) for x in self._scorer(self.batch_size, L)(
          self.gen.params, place(tokens_BL, self.rows_sharding), place(targets_BL, self.rows_sharding)))
      for r, i in enumerate(batch):
        n, k = len(rows[i][0]), rows[i][2]
        results[i] = (float(chosen_BL[r, n - k:n].sum()), bool(top_BL[r, n - k:n].all()))
        if requests[i][0] is not None:
          self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    """Each text's loglikelihood in disjoint windows of the context, each after the prefix token, as the harness's
    API models window it."""
    out = []
    for (text,) in [req.args for req in requests]:
      windows = [(None, *w) for w in map(lm_eval_utils.make_disjoint_window, lm_eval_utils.get_rolling_token_windows(
          token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length - 1,
          context_len=1))]
      out.append(sum(ll for ll, _ in self._loglikelihood_tokens(windows)))
      self.cache_hook.add_partial("loglikelihood_rolling", (text,), out[-1])
    return out

  # --- generation ---

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    """Greedy (or the task's temperature) completions of up to max_gen_toks tokens, each cut at its first stop
    string; the end-of-sequence token stops a row."""
    out = [None] * len(requests)
    groups = {}  # one generate call per batch of requests with the same settings
    for i, req in enumerate(requests):
      context, kwargs = req.args
      kwargs = dict(kwargs)
      until = kwargs.pop("until", None) or []
      until = [until] if isinstance(until, str) else list(until)
      steps = int(kwargs.pop("max_gen_toks", 256))
      temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", True) is not False else 0.0
      ids = self.tok_encode(context)[-(self.max_length - steps):] if steps < self.max_length else []
      groups.setdefault((steps, temperature), []).append((i, ids or [self.prefix_token_id], until))
    for (steps, temperature), items in groups.items():
      for start in range(0, len(items), self.batch_size):
        batch = items[start:start + self.batch_size]
        texts = self.gen.generate([ids for _, ids, _ in batch], steps, Sampling(temperature), seed=1234).texts
        for (i, _, until), text in zip(batch, texts):
          for stop in until:
            if stop and stop in text:
              text = text[:text.index(stop)]
          out[i] = text
          self.cache_hook.add_partial("generate_until", requests[i].args, text)
    return out
