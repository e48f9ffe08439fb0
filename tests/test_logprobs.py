"""Logprobs from the serving engine: each new token's and the prompt's (echo), against a float32 reference (the
training forward pass of the whole sequence, no cache), alone and under continuous batching; echo with max_tokens
0; ignore_eos and stop_token_ids."""
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request

import jax
import jax.numpy as jnp
import lm_eval
import numpy as np
import openai
import optax
import pytest
from lm_eval.tasks import TaskManager
from test_generate import train_tiny
from test_serve import (MAX_TOKENS, MODEL, PROMPTS, greedy, make_generator, params, run_staggered,  # noqa: F401
                        start_server)

from meshtrain import mesh as mesh_lib, sharding, train
from meshtrain.cli import convert
from meshtrain.data import tokenization
from meshtrain.errors import UserError
from meshtrain.inference import engine as engine_lib, generator, harness
from meshtrain.models.llama import Transformer

# The engine's prefill and cached decode against one forward pass of the whole sequence: the same math in another
# order (attention over a cache of other length, other fusions), float32.
ATOL = 2e-4


@pytest.fixture(scope="module")
def gen(params):  # noqa: F811
  return make_generator(params)


def reference(params, ids):  # noqa: F811
  """log p(ids[j + 1] | ids[:j + 1]) for each j, and the log-softmax rows [len(ids) - 1, V], by the training
  forward pass of the whole sequence in float32 (what the loss reads: its cross-entropy is minus their sum)."""
  logits_LV = np.asarray(jax.jit(lambda p, t: Transformer(MODEL).apply({"params": p}, t))(
      params, np.asarray([ids], np.int32))[0], np.float64)[:-1]
  lp_LV = logits_LV - np.log(np.exp(logits_LV - logits_LV.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits_LV.max(-1, keepdims=True)
  chosen = lp_LV[np.arange(len(ids) - 1), ids[1:]]
  loss = optax.softmax_cross_entropy_with_integer_labels(logits_LV, np.asarray(ids[1:])).sum()
  np.testing.assert_allclose(-chosen.sum(), loss, rtol=1e-6)  # optax in float32
  return chosen, lp_LV


def finish(engine, *requests):
  engine.submit(*requests)
  while not all(r.done for r in requests):
    engine.step()
  return requests


def test_new_tokens_logprobs_are_the_models_and_the_greedy_one_is_the_top(params, gen):  # noqa: F811
  engine = engine_lib.Engine(gen, slots=2)
  [r] = finish(engine, dataclasses.replace(greedy(0), logprobs=5))
  assert len(r.token_logprobs) == len(r.top_logprobs) == len(r.token_ids) == MAX_TOKENS[0]
  chosen, lp_LV = reference(params, PROMPTS[0] + r.token_ids)
  n = len(PROMPTS[0])
  np.testing.assert_allclose(r.token_logprobs, chosen[n - 1:], atol=ATOL)
  for lp, top, row in zip(r.token_logprobs, r.top_logprobs, lp_LV[n - 1:]):
    assert len(top) == 5 and top[0][1] == lp  # greedy: the token is the most likely one, bit for bit
    np.testing.assert_allclose([v for _, v in top], np.sort(row)[::-1][:5], atol=ATOL)
    assert [i for i, _ in top] == list(np.argsort(-row, kind="stable")[:5]) or np.ptp([v for _, v in top]) < 1e-3
  sampled = finish(engine, engine_lib.Request(prompt_ids=PROMPTS[1], max_tokens=12, temperature=1.0, seed=3,
                                              logprobs=0))[0]
  assert all(top == [] for top in sampled.top_logprobs)
  np.testing.assert_allclose(sampled.token_logprobs,
                             reference(params, PROMPTS[1] + sampled.token_ids)[0][len(PROMPTS[1]) - 1:], atol=ATOL)


def test_echo_scores_the_prompt_and_max_tokens_0_scores_it_alone(params, gen):  # noqa: F811
  engine = engine_lib.Engine(gen, slots=2)
  chosen, lp_LV = reference(params, PROMPTS[3])
  alone, first = finish(engine, engine_lib.Request(prompt_ids=PROMPTS[3], max_tokens=0, echo=True, logprobs=2),
                        engine_lib.Request(prompt_ids=PROMPTS[3], max_tokens=1, echo=True, logprobs=1))
  for r in (alone, first):
    assert r.prompt_logprobs[0] is None and r.prompt_top_logprobs[0] is None
    np.testing.assert_allclose(r.prompt_logprobs[1:], chosen, atol=ATOL)
  # The sum is minus the loss on the text (its cross-entropy, as training computes it), within float32 rounding.
  assert abs(sum(alone.prompt_logprobs[1:]) - chosen.sum()) < 1e-3
  assert alone.token_ids == [] and alone.finish_reason == "length" and alone.text == ""
  assert [len(t) for t in alone.prompt_top_logprobs[1:]] == [2] * (len(PROMPTS[3]) - 1)
  np.testing.assert_allclose([t[0][1] for t in alone.prompt_top_logprobs[1:]], lp_LV.max(-1), atol=ATOL)
  assert len(first.token_ids) == 1 and first.token_logprobs[0] == first.top_logprobs[0][0][1]
  with pytest.raises(UserError, match="at least 1"):
    engine.submit(engine_lib.Request(prompt_ids=[1], max_tokens=0))
  with pytest.raises(UserError, match="logprobs 21 must be between 0 and 20"):
    engine.submit(engine_lib.Request(prompt_ids=[1], logprobs=21))


def test_logprobs_under_continuous_batching_equal_a_solo_run(gen):
  """Requests with and without logprobs, echo and sampling, arriving while others decode: each gets the tokens and
  logprobs it gets alone (the logprobs are computed for every row of a step once any row asks; the others'
  tokens do not change)."""
  asks = [dict(logprobs=3), dict(), dict(logprobs=0, echo=True, temperature=1.0, seed=5), dict(logprobs=20),
          dict(echo=True, logprobs=1, max_tokens=0)]
  make = lambda i: engine_lib.Request(prompt_ids=PROMPTS[i], **{"max_tokens": MAX_TOKENS[i], **asks[i]})
  alone = [finish(engine_lib.Engine(gen, slots=4), make(i))[0] for i in range(len(PROMPTS))]
  together = [make(i) for i in range(len(PROMPTS))]
  run_staggered(engine_lib.Engine(gen, slots=4), together, every=1)
  fields = ("token_ids", "token_logprobs", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs")
  for a, b in zip(alone, together):
    assert a.token_ids == b.token_ids
    for f in fields[1:]:  # other row counts and spans of the same math: equal to float32 rounding
      x, y = getattr(a, f), getattr(b, f)
      assert len(x) == len(y), f
      flat = lambda v: [p for item in v if item is not None for p in (item if isinstance(item, list) else [item])]
      np.testing.assert_allclose(np.asarray(flat(x), np.float64).ravel(), np.asarray(flat(y), np.float64).ravel(),
                                 atol=ATOL, err_msg=f)
  assert together[1].token_logprobs == [] and together[4].token_ids == []


def test_ignore_eos_and_stop_token_ids(params, gen):  # noqa: F811
  engine = engine_lib.Engine(gen, slots=2)
  free = finish(engine, engine_lib.Request(prompt_ids=PROMPTS[0], max_tokens=20))[0]
  stop_at = free.token_ids[5]
  first = free.token_ids.index(stop_at)
  stopped = finish(engine, engine_lib.Request(prompt_ids=PROMPTS[0], max_tokens=20, stop_token_ids=(stop_at,)))[0]
  assert stopped.token_ids == free.token_ids[:first + 1] and stopped.finish_reason == "stop"
  assert stopped.text == gen.tokenizer.decode(np.asarray(free.token_ids[:first], np.int32))
  # ignore_eos: a model whose eos is its most likely first token still runs to max_tokens.
  eos_gen = make_generator(params)
  eos_gen.eos_id = free.token_ids[0]
  eos_engine = engine_lib.Engine(eos_gen, slots=2)
  ended = finish(eos_engine, engine_lib.Request(prompt_ids=PROMPTS[0], max_tokens=20))[0]
  assert ended.token_ids == free.token_ids[:1] and ended.finish_reason == "stop" and ended.text == ""
  kept = finish(eos_engine, engine_lib.Request(prompt_ids=PROMPTS[0], max_tokens=20, ignore_eos=True))[0]
  assert kept.token_ids == free.token_ids and kept.finish_reason == "length"
  assert kept.text == eos_gen.tokenizer.decode(np.asarray([t for t in free.token_ids if t != free.token_ids[0]],
                                                          np.int32))



# --- through the HTTP server, with the openai client and lm-evaluation-harness ---


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  return train_tiny(tmp_path_factory.mktemp("scored"))


@pytest.fixture(scope="module")
def server(workdir):
  # A served name, as vLLM's: the one name in /v1/models and every response, whatever the step.
  proc, url = start_server(workdir, "--slots", "4", "--served-model-name", "org/scorer", "--lazy")
  yield proc, url
  proc.kill()
  proc.wait()


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server[1], api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def scored(workdir):
  """log p of every token of a token sequence after the first, by the run's model in this process (the training
  forward pass in float32)."""
  g = generator.Generator.from_workdir(workdir)
  forward = jax.jit(lambda p, t: jax.nn.log_softmax(g.model.apply({"params": p}, t)[0, :-1].astype(jnp.float32)))

  def score(ids, rows=False, drawable=False):
    """The logprobs, and with `rows` whether each token is the most likely id the server could draw, or with
    `drawable` the logprobs of every id the server could draw [len(ids) - 1, num_ids]."""
    lp_LV = np.asarray(forward(g.params, np.asarray([ids], np.int32)))
    chosen = lp_LV[np.arange(len(ids) - 1), ids[1:]]
    if drawable:
      return chosen, lp_LV[:, :g.num_ids]
    return (chosen, chosen == lp_LV[:, :g.num_ids].max(-1)) if rows else chosen
  return score


def post(server, path, body):
  request = urllib.request.Request(server[1].removesuffix("/v1") + path, data=json.dumps(body).encode(),
                                   headers={"Content-Type": "application/json"})
  with urllib.request.urlopen(request, timeout=60) as response:
    return json.loads(response.read())


def test_completions_logprobs_echo_and_streams(client, scored):
  out = client.completions.create(model=None, prompt="def main(", max_tokens=8, temperature=0, logprobs=3)
  lp = out.choices[0].logprobs
  assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens
  assert all(v == max(top.values()) and len(top) <= 3 for v, top in zip(lp.token_logprobs, lp.top_logprobs))
  assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
  prompt = list(b"def main(")
  # echo: the prompt's text and tokens first, its first token without a logprob; max_tokens 0 scores it alone.
  for max_tokens in (0, 1):
    echoed = client.completions.create(model=None, prompt="def main(", max_tokens=max_tokens, temperature=0,
                                       logprobs=1, echo=True).choices[0]
    assert echoed.text.startswith("def main(") and len(echoed.logprobs.tokens) == len(prompt) + max_tokens
    assert echoed.logprobs.token_logprobs[0] is None and echoed.logprobs.top_logprobs[0] is None
    np.testing.assert_allclose(echoed.logprobs.token_logprobs[1:len(prompt)], scored(prompt), atol=ATOL)
  # The sum is minus the model's loss on the text.
  assert abs(sum(echoed.logprobs.token_logprobs[1:len(prompt)]) - scored(prompt).sum()) < 1e-3
  chunks = list(client.completions.create(model=None, prompt="def main(", max_tokens=8, temperature=0, logprobs=3,
                                          stream=True))
  streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
  assert streamed == lp.tokens
  assert [v for c in chunks if c.choices and c.choices[0].logprobs
          for v in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs


def test_prompt_logprobs_as_vllm_gives_them(client, workdir, scored):
  """vLLM's extension: each prompt token's logprob, its rank among the drawable ids and the k most likely, for
  completions (per choice, without echo's text) and chat (once, over the rendered conversation)."""
  prompt = list(b"def main(x):")
  out = client.completions.create(model=None, prompt="def main(x):", max_tokens=2, temperature=0, n=2,
                                  extra_body={"prompt_logprobs": 2})
  chosen, drawable_LV = scored(prompt, drawable=True)
  ordered_LV = -np.sort(-drawable_LV, axis=-1)
  for choice in out.choices:
    listed = choice.model_extra["prompt_logprobs"]
    assert not choice.text.startswith("def") and listed[0] is None and len(listed) == len(prompt)  # no echo
    for j, position in enumerate(listed[1:]):
      token = str(prompt[j + 1])
      mine = position.pop(token)
      np.testing.assert_allclose(mine["logprob"], chosen[j], atol=ATOL)
      # Its rank: 1 + the ids likelier than it (those within rounding of it may count either way).
      assert (drawable_LV[j] > chosen[j] + ATOL).sum() < mine["rank"] <= 1 + (drawable_LV[j] > chosen[j] - ATOL).sum()
      assert mine["decoded_token"] == chr(prompt[j + 1])
      # The 2 most likely (one of them may have been the token itself).
      assert len(position) == 2 - (mine["rank"] <= 2) and all(
          abs(a["logprob"] - ordered_LV[j, a["rank"] - 1]) <= ATOL for a in position.values())
      assert sorted(a["rank"] for a in position.values()) == [r for r in (1, 2) if r != mine["rank"]]
  assert out.choices[0].logprobs is None  # prompt_logprobs alone asks for no new tokens' logprobs
  # 0: the token alone; with echo and logprobs, each keeps its own count: the echoed alternatives are those of the
  # same request without prompt_logprobs (compared whole: keyed by text, ids that decode alike share a key).
  both = client.completions.create(model=None, prompt="def main(x):", max_tokens=1, temperature=0, logprobs=3,
                                   echo=True, extra_body={"prompt_logprobs": 0}).choices[0]
  assert [list(p) for p in both.model_extra["prompt_logprobs"][1:]] == [[str(t)] for t in prompt[1:]]
  echoed = client.completions.create(model=None, prompt="def main(x):", max_tokens=1, temperature=0, logprobs=3,
                                     echo=True).choices[0]
  assert both.logprobs.top_logprobs == echoed.logprobs.top_logprobs and both.logprobs.tokens == echoed.logprobs.tokens
  (workdir / "tokenizer").mkdir(exist_ok=True)
  (workdir / "tokenizer" / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
  chat = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "def main(x):"}],
                                        max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1})
  listed = chat.model_extra["prompt_logprobs"]
  assert [position[str(t)]["logprob"] for position, t in zip(listed[1:], prompt[1:])] == pytest.approx(
      chosen.tolist(), abs=ATOL)


def test_chat_logprobs(client, workdir):
  (workdir / "tokenizer").mkdir(exist_ok=True)
  (workdir / "tokenizer" / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
  out = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "x = "}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
  content = out.choices[0].logprobs.content
  assert len(content) == out.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
  assert all(c.logprob == c.top_logprobs[0].logprob and c.token == c.top_logprobs[0].token for c in content)
  assert all(c.bytes == list(c.token.encode()) for c in content)
  plain = client.chat.completions.create(model=None, messages=[{"role": "user", "content": "x = "}], max_tokens=5,
                                         temperature=0)
  assert plain.choices[0].logprobs is None and plain.choices[0].message.content == out.choices[0].message.content


def test_fields_that_would_change_the_result_are_honoured_or_refused(client, server):
  for extra, param in [({"suffix": "x"}, "suffix"), ({"best_of": 2}, "best_of"), ({"logprobs": 21}, "logprobs"),
                       ({"prompt_logprobs": 21}, "prompt_logprobs"),
                       ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                       ({"response_format": {"type": "json_object"}}, "response_format"),
                       ({"echo": True, "stream": True}, "echo"), ({"stop_token_ids": [10**6]}, "stop_token_ids"),
                       ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"41": -101}}, "logit_bias"),
                       ({"presence_penalty": 2.5}, "presence_penalty"),
                       ({"repetition_penalty": 0}, "repetition_penalty"),
                       ({"min_tokens": 5, "max_tokens": 2}, "min_tokens")]:
    with pytest.raises(openai.BadRequestError) as refused:
      client.completions.create(model=None, prompt="a", max_tokens=2, extra_body=extra)
    assert refused.value.body["param"] == param, extra
  with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
    client.chat.completions.create(model=None, messages=[{"role": "user", "content": "a"}], top_logprobs=2)
  # Neutral values and fields that cannot change the tokens pass.
  client.completions.create(model=None, prompt="a", max_tokens=2, presence_penalty=0, logit_bias={}, user="me",
                            best_of=1)
  # logit_bias is honoured: +100 on ")" makes every greedy token ")"; -100 on it keeps ")" out of a text that had it.
  forced = client.completions.create(model=None, prompt="f(", max_tokens=6, temperature=0,
                                     logit_bias={str(ord(")")): 100}, extra_body={"ignore_eos": True})
  assert forced.choices[0].text == ")" * 6
  kept = client.completions.create(model=None, prompt="f(", max_tokens=6, temperature=0, extra_body={
      "ignore_eos": True, "logit_bias": {str(ord(")")): 100}, "presence_penalty": 2.0, "frequency_penalty": 2.0,
      "repetition_penalty": 1.0, "min_tokens": 6})
  assert kept.usage.completion_tokens == 6
  # ignore_eos runs to max_tokens; stop_token_ids end on their token (not shown in the text).
  long = client.completions.create(model=None, prompt="a", max_tokens=12, temperature=0, logprobs=0,
                                   extra_body={"ignore_eos": True})
  assert long.usage.completion_tokens == 12 and long.choices[0].finish_reason == "length"
  cut = client.completions.create(model=None, prompt="a", max_tokens=12, temperature=0,  # every id ends it
                                  extra_body={"stop_token_ids": list(range(tokenization.VOCAB_SIZE))})
  assert cut.usage.completion_tokens == 1 and cut.choices[0].text == "" and cut.choices[0].finish_reason == "stop"


def test_probed_endpoints_and_json_errors(client, server, workdir):
  base = server[1].removesuffix("/v1")
  assert post(server, "/tokenize", {"prompt": "ab<eos>"})["tokens"] == [97, 98, tokenization.EOS_ID]
  assert post(server, "/detokenize", {"tokens": [97, 98]}) == {"prompt": "ab"}
  info = json.loads(urllib.request.urlopen(base + "/tokenizer_info", timeout=30).read())
  assert info["eos_token"] == "<eos>" and info["model_max_length"] == 64
  model = client.models.list().data[0].id
  assert model == "org/scorer" and client.completions.create(model=model, prompt="a", max_tokens=1).model == model
  assert client.models.retrieve(model).id == model and client.models.retrieve(workdir.name).id == model
  with pytest.raises(openai.NotFoundError):
    client.models.retrieve("another")
  for url, method in [(base + "/v1/nothing", "GET"), (base + "/v1/completions", "GET")]:
    with pytest.raises(urllib.error.HTTPError) as e:
      urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=30)
    assert e.value.code in (404, 405) and json.loads(e.value.read())["error"]["code"] == e.value.code


def test_guidellm_runs_a_bounded_load(server, workdir, tmp_path):
  """A load tester nobody here wrote (guidellm, as vLLM's users run it): 16 requests from 4 concurrent streams of
  16 prompt tokens and 8 new ones each, with the run's tokenizer exported for it. Every request succeeds with
  exactly 8 new tokens (guidellm sends ignore_eos) and 16 prompt tokens, as the server counts them. guidellm comes
  with the `hf` extra (it needs torch); MESHTRAIN_SKIP_HF_TESTS=1 skips this knowingly, as the other hf tests."""
  if os.environ.get("MESHTRAIN_SKIP_HF_TESTS") == "1":
    pytest.skip("MESHTRAIN_SKIP_HF_TESTS=1: guidellm (the hf extra) skipped")
  if importlib.util.find_spec("guidellm") is None:
    pytest.fail("guidellm is not installed: pip install -e '.[test,hf]' (or MESHTRAIN_SKIP_HF_TESTS=1 to skip)")
  assert convert.main(["to-hf", "--workdir", str(workdir), "--out", str(tmp_path / "hf")]) == 0
  metrics = lambda: urllib.request.urlopen(server[1].removesuffix("/v1") + "/metrics", timeout=30).read().decode()
  served = lambda text: float(re.search(r'^meshtrain_serve_requests_total{finish_reason="length"} (\S+)$', text,
                                         re.M).group(1))
  before = served(metrics())
  run = subprocess.run([sys.executable, "-m", "guidellm", "run",
                        f"--backend=kind=openai_http,target={server[1].removesuffix('/v1')},request_format=/v1/completions",
                        "--profile=kind=concurrent,streams=4", "--constraint=kind=max_requests,count=16",
                        f"--tokenizer=kind=huggingface_auto,model={tmp_path / 'hf'}",
                        "--data=kind=synthetic_text,prompt_tokens=16,output_tokens=8",
                        f"--output=kind=json,path={tmp_path / 'out.json'}", "--disable-console-interactive"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})  # nothing downloads: a local tokenizer
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  requests = json.loads((tmp_path / "out.json").read_text())["benchmarks"][0]["requests"]
  assert not requests["errored"] and not requests["incomplete"] and len(requests["successful"]) == 16
  assert all(r["output_metrics"]["text_tokens"] == 8 and r["input_metrics"]["text_tokens"] == 16
             for r in requests["successful"])
  assert served(metrics()) - before == 16


MC_DOCS = [{"question": "x = 1 +", "choices": [" 1", " foo", " ("], "answer": 0},
           {"question": "def f(", "choices": ["x):", "]]]", " pass"], "answer": 0},
           {"question": "import", "choices": [" os", "!!", " 7"], "answer": 0}]
GEN_DOCS = [{"question": "print(", "answer": "x"}, {"question": "for i in", "answer": " range"}]
TEXT_DOCS = [{"text": "def main():\n    return 0\n"}, {"text": "import os"}]


def harness_tasks(tmp_path):
  """Two lm-evaluation-harness tasks over local files (nothing downloaded): multiple choice and generate_until."""
  for name, docs in (("mc", MC_DOCS), ("gen", GEN_DOCS), ("text", TEXT_DOCS)):
    (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
  data = lambda name: f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / name}.jsonl\n" \
                      "test_split: test\n"
  (tmp_path / "mc.yaml").write_text(
      "task: meshtrain_mc\n" + data("mc") + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
      "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
  (tmp_path / "gen.yaml").write_text(
      "task: meshtrain_gen\n" + data("gen") + "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
      "doc_to_target: '{{answer}}'\ngeneration_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n"
      "metric_list:\n  - metric: exact_match\n")
  (tmp_path / "text.yaml").write_text(
      "task: meshtrain_text\n" + data("text") + "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
      "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n")
  return tmp_path


TASKS = ["meshtrain_mc", "meshtrain_gen", "meshtrain_text"]


@pytest.fixture(scope="module")
def through_server(server, client, tmp_path_factory):
  """lm-evaluation-harness's local-completions against the server, its tokenizer the server's own (/tokenize): the
  results with every sample."""
  model = client.models.list().data[0].id
  tasks = harness_tasks(tmp_path_factory.mktemp("tasks"))
  with pytest.MonkeyPatch.context() as env:
    env.setenv("HF_DATASETS_OFFLINE", "1")
    results = lm_eval.simple_evaluate(
        model="local-completions", tasks=TASKS, log_samples=True,
        model_args=f"model={model},base_url={server[1]}/completions,tokenizer_backend=remote,num_concurrent=1,"
                   "max_retries=1,tokenized_requests=True,max_length=64",
        task_manager=TaskManager(include_path=str(tasks)))
  return results, tasks


def test_lm_eval_harness_through_the_server(through_server, client, scored):
  """Every multiple-choice and perplexity loglikelihood the harness got through the server equals the model's in
  this process, and generate_until got the server's greedy completions."""
  results, _ = through_server
  mc = results["samples"]["meshtrain_mc"]
  assert len(mc) == len(MC_DOCS)
  for sample in mc:
    doc = sample["doc"]
    for choice, ((loglikelihood, is_greedy),) in zip(doc["choices"], sample["resps"]):
      # The harness puts its target_delimiter, a space, between the question and each choice.
      context, whole = list(doc["question"].encode()), list((doc["question"] + " " + choice).encode())
      expected, top = (x[len(context) - 1:] for x in scored(whole, rows=True))
      assert abs(loglikelihood - expected.sum()) < 1e-3 and is_greedy == top.all(), (doc, choice)
  assert 0 <= results["results"]["meshtrain_mc"]["acc,none"] <= 1
  # Perplexity: each text's loglikelihood after the beginning-of-sequence token (the harness's prefix, its id
  # looked up through /tokenizer_info and /tokenize).
  for sample in results["samples"]["meshtrain_text"]:
    ids = [tokenization.BOS_ID, *sample["doc"]["text"].encode()]
    assert abs(sample["resps"][0][0] - scored(ids).sum()) < 1e-3, sample["doc"]
  gen = results["samples"]["meshtrain_gen"]
  for sample in gen:
    served = client.completions.create(model=None, prompt=sample["doc"]["question"], max_tokens=6, temperature=0,
                                       stop=["\n", "<eos>"]).choices[0].text
    assert sample["resps"][0][0] == served


def test_in_process_harness_equals_the_server(through_server, workdir):
  """The same tasks on the mesh in this process (MeshLM, on data=2 x tensor=2 of 4 devices: the scoring batch split
  over data, the heads over tensor): every sample's loglikelihood to float32 rounding, the same greedy flags and
  generations, the same metrics; and `python -m meshtrain.eval` prints them."""
  served, tasks = through_server
  mesh = mesh_lib.make_mesh({"data": 2, "tensor": 2}, devices=jax.devices()[:4])
  gen = generator.Generator.from_workdir(workdir, mesh=mesh, rules=sharding.rules_for("fsdp_tp"))
  with pytest.MonkeyPatch.context() as env:
    env.setenv("HF_DATASETS_OFFLINE", "1")
    local = lm_eval.simple_evaluate(model=harness.MeshLM(gen, batch_size=4), tasks=TASKS, log_samples=True,
                                    task_manager=TaskManager(include_path=str(tasks)))
  for task in TASKS:
    pairs = list(zip(served["samples"][task], local["samples"][task], strict=True))
    for a, b in pairs:
      assert a["doc"] == b["doc"]
      if task == "meshtrain_gen":
        assert a["resps"] == b["resps"]
        continue
      for (x, *flag_x), (y, *flag_y) in zip((r[0] if isinstance(r[0], (list, tuple)) else r for r in a["resps"]),
                                            (r[0] if isinstance(r[0], (list, tuple)) else r for r in b["resps"])):
        assert abs(x - y) < 1e-3 and flag_x == flag_y, (task, a["doc"])
    assert served["results"][task] == local["results"][task] or task == "meshtrain_text"
  cli_out = subprocess.run([sys.executable, "-m", "meshtrain.eval", "--workdir", str(workdir), "--tasks",
                            "meshtrain_mc,meshtrain_gen", "--include-path", str(tasks), "--json"],
                           capture_output=True, text=True, timeout=600)
  assert cli_out.returncode == 0, cli_out.stderr[-3000:]
  printed = json.loads(cli_out.stdout.strip().splitlines()[-1])
  assert printed["meshtrain_mc"]["acc,none"] == served["results"]["meshtrain_mc"]["acc,none"]
  assert printed["meshtrain_gen"]["exact_match,none"] == served["results"]["meshtrain_gen"]["exact_match,none"]


def test_eval_refuses_unknown_tasks_and_downloads_before_jax(workdir, tmp_path):
  (tmp_path / "remote.yaml").write_text("task: needs_the_hub\ndataset_path: someone/not-on-this-machine\n"
                                        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{q}}'\n"
                                        "doc_to_choice: '{{c}}'\ndoc_to_target: 0\n")
  for args, message in [(["--tasks", "no_such_task"], "no_such_task: not a harness task"),
                        (["--tasks", "needs_the_hub", "--include-path", str(tmp_path)], "without downloading"),
                        (["--tasks", "x", "--limit", "0"], "--limit 0")]:
    out = subprocess.run([sys.executable, "-m", "meshtrain.eval", "--workdir", str(workdir), *args],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_harness_tasks_during_training_equal_eval_of_the_checkpoint(tmp_path):
  """harness.tasks every 2 steps: harness/TASK/METRIC in metrics.jsonl at steps 2 and 4 (the end), and the values
  at step 4 are what `python -m meshtrain.eval` gives on the step-4 checkpoint (on one device, the training on 8)."""
  (tmp_path / "tasks").mkdir()
  tasks = harness_tasks(tmp_path / "tasks")
  workdir = tmp_path / "run"
  assert train.main(["--config", "configs/tiny.py", "--workdir", str(workdir), "--config.steps=4",
                     "--config.seq_len=64", "--config.batch_size=8", "--config.eval_every=0",
                     "--config.model.num_layers=2", "--config.log_every=2", "--config.harness.tasks=meshtrain_mc,"
                     "meshtrain_text", f"--config.harness.include_path={tasks}", "--config.harness.every=2"]) == 0
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  judged = {r["step"]: r for r in records if "harness/meshtrain_mc/acc" in r}
  assert sorted(judged) == [2, 4] and "harness/meshtrain_text/word_perplexity" in judged[4]
  out = subprocess.run([sys.executable, "-m", "meshtrain.eval", "--workdir", str(workdir), "--tasks",
                        "meshtrain_mc,meshtrain_text", "--include-path", str(tasks), "--json"],
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  printed = json.loads(out.stdout.strip().splitlines()[-1])
  assert judged[4]["harness/meshtrain_mc/acc"] == printed["meshtrain_mc"]["acc,none"]
  np.testing.assert_allclose(judged[4]["harness/meshtrain_text/word_perplexity"],
                             printed["meshtrain_text"]["word_perplexity,none"], rtol=1e-4)


def test_harness_config_is_checked_before_training(tmp_path):
  base = ["--config", "configs/tiny.py", "--workdir", str(tmp_path / "run"), "--config.steps=2"]
  for extra, message in [(["--config.harness.tasks=no_such_task"], "no_such_task: not a harness task"),
                         (["--config.harness.tasks=x", "--config.mesh.sequence=2"], "mesh.sequence"),
                         (["--config.harness.tasks=x", "--config.harness.limit=-1"], "harness.limit")]:
    out = subprocess.run([sys.executable, "-m", "meshtrain.train", *base, *extra], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


# --- logits processing: logit_bias, penalties, min_tokens ---


@pytest.fixture(scope="module")
def processed_reference(params):  # noqa: F811
  """Greedy tokens with vLLM's logits processing, by the training forward pass of the whole sequence at every step
  (float64 arithmetic on its float32 logits), each row right-padded to one length: one compiled program."""
  L = 64
  forward = jax.jit(lambda p, t: Transformer(MODEL).apply({"params": p}, t))

  def greedy_processed(prompt, n, bias=None, presence=0.0, frequency=0.0, repetition=1.0, min_tokens=0, ends=()):
    ids, new = list(prompt), []
    V = MODEL.vocab_size
    for t in range(n):
      tokens = np.zeros((1, L), np.int32)
      tokens[0, :len(ids)] = ids
      logits = np.asarray(forward(params, tokens)[0, len(ids) - 1], np.float64)
      counts = np.bincount(new, minlength=V)
      seen = counts > 0
      seen[list(prompt)] = True
      x = np.where(seen, np.where(logits > 0, logits / repetition, logits * repetition), logits)
      x = x - frequency * counts - presence * (counts > 0)
      for i, b in (bias or {}).items():
        x[i] += b
      if t < min_tokens:
        x[list(ends)] = -np.inf
      new.append(int(np.argmax(x)))
      ids.append(new[-1])
    return new
  return greedy_processed


def test_logit_bias_penalties_and_min_tokens_equal_a_reference(gen, processed_reference):
  engine = engine_lib.Engine(gen, slots=4)
  plain = finish(engine, engine_lib.Request(prompt_ids=PROMPTS[0], max_tokens=20))[0].token_ids
  cases = [dict(logit_bias={plain[0]: -100.0}), dict(logit_bias={65: 100.0}),
           dict(logit_bias={plain[1]: -3.0, 66: 2.5}), dict(presence_penalty=1.5),
           dict(frequency_penalty=0.8), dict(repetition_penalty=1.3),
           dict(presence_penalty=-1.0, frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={plain[2]: 4.0})]
  rename = {"logit_bias": "bias", "presence_penalty": "presence", "frequency_penalty": "frequency",
            "repetition_penalty": "repetition"}
  for case in cases:
    got = finish(engine, engine_lib.Request(prompt_ids=PROMPTS[0], max_tokens=20, ignore_eos=True, **case))[0]
    expected = processed_reference(PROMPTS[0], 20, **{rename[k]: v for k, v in case.items()})
    assert got.token_ids == expected, case
  assert got.token_ids != plain


def test_min_tokens_holds_back_the_end_tokens(params, processed_reference):  # noqa: F811
  g = make_generator(params)
  engine = engine_lib.Engine(g, slots=2)
  plain = finish(engine, engine_lib.Request(prompt_ids=PROMPTS[0], max_tokens=20, ignore_eos=True))[0].token_ids
  g.eos_id = plain[0]
  eos_engine = engine_lib.Engine(g, slots=2)
  stopped = finish(eos_engine, engine_lib.Request(prompt_ids=PROMPTS[0], max_tokens=20))[0]
  assert stopped.token_ids == [plain[0]]
  held = finish(eos_engine, engine_lib.Request(prompt_ids=PROMPTS[0], max_tokens=20, min_tokens=5,
                                               stop_token_ids=(plain[3],)))[0]
  expected = processed_reference(PROMPTS[0], 20, min_tokens=5, ends=(plain[0], plain[3]))
  ends = [i for i, t in enumerate(expected) if t in (plain[0], plain[3]) and i >= 5]
  assert held.token_ids == expected[:ends[0] + 1] if ends else expected
  assert len(held.token_ids) > 5 and all(t not in (plain[0], plain[3]) for t in held.token_ids[:5])


def test_processed_requests_under_continuous_batching_equal_a_solo_run(gen):
  """Rows with and without processing, greedy and seeded, arriving while others decode: each gets its solo tokens
  (a step that processes some rows leaves the others' logits as they are; a slot's settings are its request's)."""
  asks = [dict(presence_penalty=1.0), dict(), dict(temperature=1.0, seed=3, logit_bias={70: 5.0}, top_k=20),
          dict(repetition_penalty=1.5, frequency_penalty=0.3), dict(temperature=0.8, seed=9)]
  make = lambda i: engine_lib.Request(prompt_ids=PROMPTS[i], **{"max_tokens": MAX_TOKENS[i], **asks[i]})
  alone = [finish(engine_lib.Engine(gen, slots=4), make(i))[0].token_ids for i in range(len(PROMPTS))]
  together = [make(i) for i in range(len(PROMPTS))] + [make(0), make(2)]  # slots reused by other settings
  run_staggered(engine_lib.Engine(gen, slots=4), together, every=1)
  assert [r.token_ids for r in together] == alone + [alone[0], alone[2]]


def test_processing_settings_are_checked(gen):
  engine = engine_lib.Engine(gen, slots=2)
  for bad, message in [(dict(logit_bias={10**6: 1.0}), "logit_bias"), (dict(logit_bias={1: 101.0}), "logit_bias"),
                       (dict(presence_penalty=3.0), "presence_penalty"), (dict(repetition_penalty=0.0), "repetition"),
                       (dict(min_tokens=30, max_tokens=10), "min_tokens"),
                       (dict(min_tokens=1, stop_token_ids=tuple(range(8))), "at most 7")]:
    with pytest.raises(UserError, match=message):
      engine.submit(engine_lib.Request(prompt_ids=[1], **bad))
