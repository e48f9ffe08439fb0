"""Serving: the continuous-batching engine gives Generator.generate's greedy tokens alone and among concurrent
requests, a seeded request the same tokens at any concurrency; the HTTP server through the real openai client."""
import dataclasses

import numpy as np
import pytest

from meshtrain import config, mesh as mesh_lib, sharding
from meshtrain.errors import UserError
from meshtrain.inference import engine as engine_lib, generator
from meshtrain.models.llama import ModelConfig

from test_generate import random_params

MODEL = dataclasses.replace(ModelConfig.from_config(config.base_config().model), num_layers=2, num_heads=16,
                            num_kv_heads=8, head_dim=8)
MAX_LEN = 64
# 5 prompts of different lengths (two prompt buckets), each with its own max_tokens.
PROMPTS = [[72, 101, 108, 108, 111], list(range(40, 57)), [35], list(range(100, 130)), [7, 8, 9]]
MAX_TOKENS = [20, 12, 30, 9, 25]


@pytest.fixture(scope="module")
def params():
  return random_params(MODEL)


def make_generator(params, mesh=None, rules=None):
  return generator.Generator(params, MODEL, num_ids=MODEL.vocab_size, max_len=MAX_LEN, mesh=mesh, rules=rules)


@pytest.fixture(scope="module")
def gen(params):
  return make_generator(params)


@pytest.fixture(scope="module")
def expected(gen):
  """Generate's greedy tokens of each prompt, each alone."""
  return [gen.generate([p], n).token_ids[0] for p, n in zip(PROMPTS, MAX_TOKENS)]


def run_staggered(engine, requests, every: int = 3):
  """Submits request i after i * every engine steps; steps until all are done. The most slots ever busy."""
  pending, step, most = list(requests), 0, 0
  while pending or any(not r.done for r in requests):
    while pending and step >= (len(requests) - len(pending)) * every:
      engine.submit(pending.pop(0))
    engine.step()
    most = max(most, engine.busy)
    step += 1
  return most


def greedy(i):
  return engine_lib.Request(prompt_ids=PROMPTS[i], max_tokens=MAX_TOKENS[i])


def test_engine_greedy_equals_generate_alone_and_concurrent(gen, expected):
  engine = engine_lib.Engine(gen, slots=4)
  for i in range(len(PROMPTS)):  # one at a time
    request = engine.submit(greedy(i))
    while not request.done:
      engine.step()
    assert request.token_ids == expected[i], i
    assert request.finish_reason == ("stop" if expected[i][-1] == gen.eos_id else "length")
  requests = [greedy(i) for i in range(len(PROMPTS))]  # staggered: 5 requests over 4 slots, joining mid-decode
  assert run_staggered(engine, requests, every=2) == 4
  assert [r.token_ids for r in requests] == expected
  requests = [greedy(i) for i in range(len(PROMPTS))]  # all at once
  for r in requests:
    engine.submit(r)
  while any(not r.done for r in requests):
    engine.step()
  assert [r.token_ids for r in requests] == expected


def test_engine_on_a_tensor_parallel_mesh(params, expected):
  mesh = mesh_lib.make_mesh({"data": 2, "tensor": 4})
  engine = engine_lib.Engine(make_generator(params, mesh, sharding.rules_for("tp")), slots=3)
  assert engine.slots == 4  # whole rows on both data shards
  k = engine.state["cache"].k_NBKSE  # per layer on the CPU: [slots, kv heads, S, head dim]
  assert tuple(k[0].sharding.spec)[:2] == ("data", "tensor")  # slots over data, kv heads over tensor
  requests = [greedy(i) for i in range(len(PROMPTS))]
  run_staggered(engine, requests, every=1)
  assert [r.token_ids for r in requests] == expected


def test_seeded_sampling_is_the_same_at_any_concurrency(gen):
  engine = engine_lib.Engine(gen, slots=4)
  sampled = lambda seed: engine_lib.Request(prompt_ids=PROMPTS[0], max_tokens=24, temperature=1.0, top_p=0.9,
                                            top_k=50, seed=seed)
  alone = engine.submit(sampled(7))
  while not alone.done:
    engine.step()
  others = [dataclasses.replace(greedy(i)) for i in (1, 3)]
  among = [others[0], sampled(7), others[1], sampled(8)]
  run_staggered(engine, among, every=1)
  assert among[1].token_ids == alone.token_ids
  assert among[3].token_ids != alone.token_ids
  assert alone.token_ids != engine_lib.Request(prompt_ids=PROMPTS[0]).token_ids
  hot = engine.submit(engine_lib.Request(prompt_ids=PROMPTS[0], max_tokens=24, temperature=1.0, top_k=1, seed=9))
  while not hot.done:
    engine.step()
  greedy_one = engine.submit(engine_lib.Request(prompt_ids=PROMPTS[0], max_tokens=24))
  while not greedy_one.done:
    engine.step()
  assert hot.token_ids == greedy_one.token_ids  # top_k=1 is greedy whatever the temperature


def test_engine_stop_strings_cancel_and_bad_requests(gen, expected):
  engine = engine_lib.Engine(gen, slots=2, max_queue=2)
  texts = [gen.tokenizer.decode(np.asarray(x, np.int32)) for x in expected]
  i = int(np.argmax([len(t) for t in texts]))
  text = texts[i]
  stop = text[len(text) // 2:len(text) // 2 + 2]
  assert len(stop) == 2, texts
  deltas = []
  request = engine.submit(engine_lib.Request(prompt_ids=PROMPTS[i], max_tokens=MAX_TOKENS[i], stop=("zzzz", stop),
                                             on_update=lambda r, d: deltas.append(d)))
  while not request.done:
    engine.step()
  assert request.finish_reason == "stop" and request.text == text[:text.find(stop)]
  assert "".join(deltas) == request.text
  cancelled = engine.submit(greedy(0))
  engine.step()
  cancelled.cancel()
  engine.step()
  assert cancelled.finish_reason == "cancelled" and engine.busy == 0
  for bad, message in [(dict(prompt_ids=list(range(MAX_LEN))), "context is 64"),
                       (dict(prompt_ids=[1], max_tokens=0), "at least 1"),
                       (dict(prompt_ids=[1], top_p=0.0), "top_p"), (dict(prompt_ids=[1], temperature=-1.0), "tempera")]:
    with pytest.raises(UserError, match=message):
      engine.submit(engine_lib.Request(**bad))
  engine.submit(greedy(0))
  engine.submit(greedy(1))
  with pytest.raises(engine_lib.QueueFull):
    engine.submit(greedy(2))
