"""Serving: the continuous-batching engine gives Generator.generate's greedy tokens alone and among concurrent
requests, a seeded request the same tokens at any concurrency; the HTTP server through the real openai client."""
import concurrent.futures
import dataclasses
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import openai
import pytest
import xla_fast
from test_generate import random_params, train_tiny

from meshtrain import config, mesh as mesh_lib, sharding
from meshtrain.errors import UserError
from meshtrain.inference import engine as engine_lib, generator, sampling
from meshtrain.models.llama import ModelConfig

MODEL = dataclasses.replace(ModelConfig.from_config(config.base_config().model), num_layers=2, num_heads=16,
                            num_kv_heads=8, head_dim=8)
MAX_LEN = 64
# 5 prompts of different lengths (two prompt buckets), each with its own max_tokens.
PROMPTS = [[72, 101, 108, 108, 111], list(range(40, 57)), [35], list(range(100, 130)), [7, 8, 9]]
MAX_TOKENS = [20, 12, 30, 9, 25]


@pytest.fixture(scope="module")
def params():
  return random_params(MODEL)


def make_generator(params, mesh=None, rules=None, scan_layers=None):
  return generator.Generator(params, MODEL, num_ids=MODEL.vocab_size, max_len=MAX_LEN, mesh=mesh, rules=rules,
                             scan_layers=scan_layers)


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
  # Staggered: 5 requests over 4 slots, joining mid-decode: one decode step per call (chunk=1), so each joins while
  # the others are mid-way; then the default chunk of steps per call, every request joining after a chunk.
  requests = [greedy(i) for i in range(len(PROMPTS))]
  assert run_staggered(engine_lib.Engine(gen, slots=4, chunk=1), requests, every=2) == 4
  assert [r.token_ids for r in requests] == expected
  requests = [greedy(i) for i in range(len(PROMPTS))]
  assert run_staggered(engine, requests, every=1) >= 2
  assert [r.token_ids for r in requests] == expected
  requests = [greedy(i) for i in range(len(PROMPTS))]  # all at once
  for r in requests:
    engine.submit(r)
  while any(not r.done for r in requests):
    engine.step()
  assert [r.token_ids for r in requests] == expected


def test_a_call_runs_a_chunk_only_when_quick_or_every_slot_is_busy(gen, expected):
  """With a slot free, a decode call runs a chunk of steps only if the measured step time makes it take at most
  CALL_BUDGET_S (a request arriving meanwhile waits for the calls in flight); with every slot busy, always a chunk.
  The tokens are generate's either way."""
  for slots, step_s, steps in ((2, 1.0, 1), (2, 1e-4, engine_lib.DECODE_CHUNK), (1, 1.0, engine_lib.DECODE_CHUNK)):
    engine = engine_lib.Engine(gen, slots=slots)
    request = engine.submit(greedy(0))  # 20 tokens: more than a chunk left after the first call
    engine.step()  # admitted: its prefill, and a first decode call
    engine._plan()  # plans the next call without running it (that call still in flight: `_ahead`)
    engine.step_s = step_s
    assert engine_lib.Plan.parse(engine._plan()).decode == steps, (slots, step_s)
    while not request.done:
      engine.step()
    assert request.token_ids == expected[0]


def test_the_next_call_is_dispatched_before_the_last_is_read_unless_a_request_leaves_in_it(gen, expected):
  """`_ahead`, with a slot free: the next decode call goes to the device before the last one's tokens are read while
  both calls take at most CALL_BUDGET_S and every request runs past the last call; not when one ends by its length
  in it or is cancelled, nor when the calls take longer (a request arriving would wait for both)."""
  engine = engine_lib.Engine(gen, slots=2)
  request = engine.submit(greedy(0))  # 20 tokens; one slot stays free
  engine.step()  # its prefill (token 1) and a first decode call (token 2), not yet read
  engine.step_s = engine_lib.CALL_BUDGET_S / 2
  assert engine.pending is not None and engine._ahead()
  engine.step_s = engine_lib.CALL_BUDGET_S
  assert not engine._ahead()
  engine.step_s = engine_lib.CALL_BUDGET_S / 2
  request.limit = 2  # would end with the call in flight
  assert not engine._ahead()
  request.limit = 20
  request.cancel()
  assert not engine._ahead()
  request.cancelled = False
  while not request.done:
    engine.step()
  assert request.token_ids == expected[0]


def test_prompt_buckets_pad_at_most_a_quarter_with_four_per_doubling():
  """Multiples of 16 up to 128 tokens, then an eighth of the next power of two: few compiled prefills for a long
  context (32 for 8K, not 512), none padding a prompt by more than a quarter past 128 tokens."""
  assert [sampling.bucket(n) for n in (1, 16, 17, 100, 128, 129, 160, 161, 257, 300, 1000, 1025)] == \
      [16, 16, 32, 112, 128, 160, 160, 192, 320, 320, 1024, 1280]
  assert len({sampling.bucket(n) for n in range(1, 8193)}) == 32
  assert all(n <= sampling.bucket(n) <= max(n + 15, 1.25 * n) for n in range(1, 8193))


def test_decode_attends_over_the_slots_in_use_not_the_context(params):
  """With a context of 300 (cache rows of 363 slots: 300 + the 63 a prompt of 257 pads), each decode call attends
  over the fewest of 64, 96, 128, 192, 256 slots that hold every busy row's slots after it, or the whole row: the
  tokens are generate's, alone and together, across every switch (a request of 250 tokens from a 16-slot prompt
  bucket passes slot 256; one from a 160-slot bucket starts past 128). Spans chosen 4 slots short change the tokens
  (checked: the row's newest keys go unread)."""
  gen = generator.Generator(params, MODEL, num_ids=MODEL.vocab_size, max_len=300)
  engine = engine_lib.Engine(gen, slots=2)
  assert engine.attends == [64, 96, 128, 192, 256, 363]
  plans = []
  run = engine._run
  engine._run = lambda plan: (plans.append(engine_lib.Plan.parse(plan)), run(plan))[1]
  reaches = []
  plan_ = engine._plan
  engine._plan = lambda: (plan_(), reaches.append(max((r.slot_end for r in engine.active.values()), default=0)))[0]
  # The first and third run to their limits (no end token); the last's prompt of 150 tokens pads to a bucket of 160.
  asks = [(PROMPTS[4], 250), (PROMPTS[3], 20), (PROMPTS[1], 150), (list(range(200, 350)), 12)]
  want = [gen.generate([p], n).token_ids[0] for p, n in asks]
  requests = [engine_lib.Request(prompt_ids=p, max_tokens=n) for p, n in asks]
  run_staggered(engine, requests, every=2)
  assert [r.token_ids for r in requests] == want
  used = [(p.attend, reach) for p, reach in zip(plans, reaches) if p.decode]
  # each span is the fewest that holds the busiest row's slots after the call (slot_end, counted after the call)
  assert all(span == min(n for n in engine.attends if n >= reach) for span, reach in used), used
  assert {span for span, _ in used} == set(engine.attends), used  # every span, the row included


@pytest.mark.parametrize("tensor", [False, True])
def test_decode_runs_the_busy_rows_not_every_slot(params, gen, expected, tensor):
  """With 8 slots each decode call decodes the first 2, 4 or 8 rows: the fewest that hold every busy slot (requests
  take the lowest free ones), so a request alone steps 2 rows, not 8. The tokens are generate's across every switch,
  the rows beyond a call's untouched by it (checked: the rows' new keys written into each other's rows change the
  first request's tokens; a count one short of the busiest slot leaves that slot without tokens). Also with the
  slots whole on every device (tensor=8, the kv heads split; scanned layers: one stacked cache)."""
  if tensor:
    gen = make_generator(params, mesh_lib.make_mesh({"data": 1, "tensor": 8}), sharding.rules_for("tp"), True)
  engine = engine_lib.Engine(gen, slots=8, chunk=1)
  assert engine.row_counts == [2, 4, 8]
  plans, busiest = [], []
  run = engine._run
  engine._run = lambda plan: (plans.append(engine_lib.Plan.parse(plan)), busiest.append(max(engine.active, default=-1)),
                              run(plan))[2]
  # One request, then two more (slots 0-2 busy), then five (every slot), each wave joining after two steps.
  waves, requests = [[0], [4, 1], [0, 4, 1, 3, 4]], []
  for wave in waves:
    requests += [engine.submit(greedy(i)) for i in wave]
    for _ in range(2):
      engine.step()
  assert len(engine.active) == 8
  while any(not r.done for r in requests):
    engine.step()
  assert [r.token_ids for r in requests] == [expected[i] for wave in waves for i in wave]
  used = [(p.rows, top) for p, top in zip(plans, busiest) if p.decode]
  assert all(rows == min(n for n in engine.row_counts if n > top) for rows, top in used), used
  assert {rows for rows, _ in used} == {2, 4, 8}, used
  # A request alone again, after the others left: the lowest slot, two rows.
  request = engine.submit(greedy(1))
  while not request.done:
    engine.step()
  assert request.token_ids == expected[1] and {p.rows for p in plans[-len(expected[1]):] if p.decode} == {2}


def test_warm_runs_every_program_once_and_changes_no_answer(gen, expected):
  """warm() compiles and runs each prefill and decode program before any request (a first run costs more than the
  next: it would land in the first requests' latency); what it computes lands in no slot a request gets."""
  engine = engine_lib.Engine(gen, slots=2)
  before = engine.steps
  engine.warm(16)
  assert set(engine.prefills) == {(16, 1, False), (16, 2, False), (16, 2, True)}  # rows 1 and 2, echoed in 2
  assert int(engine.state["t_B"][0]) == len(engine.decodes)  # each decode program ran one step (row 0 is in all)
  requests = [greedy(0), greedy(4)]
  engine.submit(*requests)
  while not all(r.done for r in requests):
    engine.step()
  assert [r.token_ids for r in requests] == [expected[0], expected[4]] and engine.steps > before


def test_a_queued_request_joins_when_the_first_slot_frees_not_a_chunk_later(gen, expected):
  """With every slot busy, a call runs the chunk while nobody waits; with a request queued, no more steps than until
  the first slot frees by its length (one step when that is fewer than a chunk), so the request joins then. The
  tokens are generate's either way."""
  short = gen.generate([PROMPTS[4]], 5).token_ids[0]
  for queued, steps in ((False, engine_lib.DECODE_CHUNK), (True, 1)):
    engine = engine_lib.Engine(gen, slots=2)
    requests = [greedy(0), engine_lib.Request(prompt_ids=PROMPTS[4], max_tokens=5)] + [greedy(2)] * queued
    engine.submit(*requests)
    plan = engine._plan()  # admits the first two (20 and 5 tokens): 4 left for the second after its prefill
    assert engine_lib.Plan.parse(plan).decode == steps, queued
    engine._run(plan)
    while not all(r.done for r in requests):
      engine.step()
    assert [r.token_ids for r in requests] == [expected[0], short] + [expected[2]] * queued


def test_engine_on_a_tensor_parallel_mesh(params, expected):
  """On data=2 x tensor=4, with the layers scanned as on a GPU (one stacked cache, [layers, slots, ...]: the
  prefill's insert writes its rows into the stacked layout)."""
  mesh = mesh_lib.make_mesh({"data": 2, "tensor": 4})
  engine = engine_lib.Engine(make_generator(params, mesh, sharding.rules_for("tp"), scan_layers=True), slots=3)
  assert engine.slots == 4  # whole rows on both data shards
  k = engine.state["cache"].k_NBKSE  # stacked: [layers, slots, kv heads, S, head dim]
  assert k.ndim == 5 and tuple(k.sharding.spec)[1:3] == ("data", "tensor")  # slots over data, kv heads over tensor
  requests = [greedy(i) for i in range(len(PROMPTS))]
  run_staggered(engine, requests, every=1)  # prefills of 2 rows (one per data shard): a prompt and a dropped row
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


def test_a_request_seed_keys_its_slot_as_jax_random_key_does(gen):
  """The prefill derives each row's key on the device from the seed's low 32 bits: the key data a slot holds equals
  jax.random.key(seed)'s (what Generator.generate draws with) for seeds past 32 bits and negative ones too."""
  import jax
  engine = engine_lib.Engine(gen, slots=1)
  for seed in [0, 7, 2**31 + 5, 2**32 + 7, 2**40 + 3, 2**63 - 1, -1, -2**63]:
    request = engine.submit(engine_lib.Request(prompt_ids=PROMPTS[0], max_tokens=1, temperature=1.0, seed=seed))
    while not request.done:
      engine.step()
    np.testing.assert_array_equal(np.asarray(engine.state["key_B"])[0],
                                  np.asarray(jax.random.key_data(jax.random.key(seed))), err_msg=str(seed))


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


# --- the HTTP server, through the openai client, on a trained workdir ---

PROMPT_IDS = [[100, 101, 102, 40, 41], list(range(60, 80)), [35], list(range(70, 110)), [10, 32, 32]]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  return train_tiny(tmp_path_factory.mktemp("served"))  # its own: a test writes a chat template into it


def start_server(workdir, *args, launch=("-m", "meshtrain.serve")):
  """A `python -m meshtrain.serve` process (or `launch` of it) on a free port: (process, base URL)."""
  proc = subprocess.Popen([sys.executable, *launch, "--workdir", str(workdir), "--port", "0", *args],
                          stderr=subprocess.PIPE, text=True, env=xla_fast.env())
  lines = []
  deadline = time.monotonic() + 240
  while time.monotonic() < deadline:
    line = proc.stderr.readline()
    lines.append(line)
    if match := re.search(r"serving \S+ on (http://\S+/v1)", line):
      threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
      return proc, match.group(1)
    if not line and proc.poll() is not None:
      break
  proc.kill()
  raise AssertionError("the server did not start:\n" + "".join(lines))


@pytest.fixture(scope="module")
def server(workdir):
  # Warmed (the default): every program compiled before the first request, so no test sees a queue held up by a
  # compile.
  proc, url = start_server(workdir, "--slots", "4", "--max-queue", "3")
  yield proc, url
  if proc.poll() is None:
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=server[1], api_key="none", max_retries=0, timeout=120)


def test_models_completions_and_usage(client, workdir):
  models = client.models.list().data
  assert [m.id for m in models] == [f"{workdir.name}@4"]
  out = client.completions.create(model=models[0].id, prompt="def main(", max_tokens=8, temperature=0,
                                  extra_body={"unknown_field": 1})  # ignored
  assert out.model == f"{workdir.name}@4" and out.choices[0].finish_reason in {"stop", "length"}
  assert out.usage.prompt_tokens == len("def main(") and 1 <= out.usage.completion_tokens <= 8
  several = client.completions.create(model=models[0].id, prompt="x = ", max_tokens=6, temperature=1.0, seed=3, n=3)
  assert [c.index for c in several.choices] == [0, 1, 2] and several.usage.completion_tokens <= 18
  again = client.completions.create(model=models[0].id, prompt="x = ", max_tokens=6, temperature=1.0, seed=3, n=3)
  assert [c.text for c in again.choices] == [c.text for c in several.choices]


@pytest.fixture(scope="module")
def generated(workdir):
  """`python -m meshtrain.generate`'s greedy completions of PROMPT_IDS (24 tokens each)."""
  proc = subprocess.run([sys.executable, "-m", "meshtrain.generate", "--workdir", str(workdir), "--json",
                         "--max-new-tokens", "24", *[a for p in PROMPT_IDS for a in ("--prompt-ids",
                                                                                     ",".join(map(str, p)))]],
                        capture_output=True, text=True, env=xla_fast.env(), timeout=300)
  assert proc.returncode == 0, proc.stderr
  return json.loads(proc.stdout)["completions"]


def test_greedy_equals_generate_under_concurrency(client, generated):
  expected = generated
  ask = lambda ids: client.completions.create(model=None, prompt=ids, max_tokens=24,
                                              temperature=0).choices[0].text
  with concurrent.futures.ThreadPoolExecutor(len(PROMPT_IDS)) as pool:
    futures = []
    for ids in PROMPT_IDS:  # staggered arrivals
      futures.append(pool.submit(ask, ids))
      time.sleep(0.05)
    assert [f.result() for f in futures] == expected
  assert [ask(ids) for ids in PROMPT_IDS[:2]] == expected[:2]  # one at a time


def test_streaming_with_usage(client):
  chunks = list(client.completions.create(model=None, prompt=[35, 36], max_tokens=12, temperature=0, stream=True,
                                          stream_options={"include_usage": True}))
  text = "".join(c.choices[0].text for c in chunks if c.choices)
  assert chunks[-1].usage.completion_tokens >= 1 and chunks[-1].choices == []
  assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in {"stop", "length"}
  whole = client.completions.create(model=None, prompt=[35, 36], max_tokens=12, temperature=0)
  assert text == whole.choices[0].text


def test_raw_sse_ends_with_done(server):
  request = urllib.request.Request(server[1] + "/completions", data=json.dumps(
      {"prompt": "a", "max_tokens": 4, "stream": True}).encode(), headers={"Content-Type": "application/json"})
  with urllib.request.urlopen(request, timeout=60) as response:
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = [line for line in response.read().decode().split("\n\n") if line]
  assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_chat_needs_a_template_then_uses_it(client, workdir):
  messages = [{"role": "user", "content": "hi"}]
  with pytest.raises(openai.BadRequestError, match="chat_template.jinja"):
    client.chat.completions.create(model=None, messages=messages, max_tokens=4)
  (workdir / "tokenizer").mkdir(exist_ok=True)  # a byte-tokenizer run has none
  (workdir / "tokenizer" / "chat_template.jinja").write_text(CHAT_TEMPLATE)
  out = client.chat.completions.create(model=None, messages=messages, max_tokens=6, temperature=0)
  assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
  assert out.usage.prompt_tokens == len("<|user|>hi\n<|assistant|>")
  streamed = list(client.chat.completions.create(model=None, messages=messages, max_tokens=6, temperature=0,
                                                 stream=True))
  assert "".join(c.choices[0].delta.content or "" for c in streamed) == out.choices[0].message.content


def test_errors(client, server):
  client.completions.create(model=None, prompt="a", max_tokens=2)  # one answered (metrics below), whatever ran before
  with pytest.raises(openai.NotFoundError, match="does not exist"):
    client.completions.create(model="other", prompt="a", max_tokens=2)
  with pytest.raises(openai.BadRequestError, match="context is 64"):
    client.completions.create(model=None, prompt="a" * 80, max_tokens=2)
  for bad in [{"temperature": -1}, {"top_p": 2}, {"n": 99}, {"max_tokens": 0}, {"stop": ["a"] * 9}]:
    with pytest.raises(openai.BadRequestError):
      client.completions.create(model=None, prompt="a", **bad)
  with pytest.raises(openai.BadRequestError, match="max_queue 3"):  # 8 choices at once could never wait together
    client.completions.create(model=None, prompt="a", max_tokens=60, n=8)
  metrics = urllib.request.urlopen(server[1].removesuffix("/v1") + "/metrics", timeout=30).read().decode()
  for name in ["meshtrain_serve_time_to_first_token_seconds_bucket", "meshtrain_serve_time_per_output_token_seconds",
               "meshtrain_serve_queue_length", "meshtrain_serve_busy_slots", "meshtrain_serve_generation_tokens_total",
               'meshtrain_serve_requests_total{finish_reason="length"}', 'status="400"']:
    assert name in metrics, name
  # Every request answered got a slot: as many queue times as requests finished.
  finished = sum(float(x) for x in re.findall(r'meshtrain_serve_requests_total\{finish_reason="\w+"\} (\S+)', metrics))
  queued = re.search(r"meshtrain_serve_request_queue_time_seconds_count (\S+)", metrics)
  assert finished >= 1 and queued and float(queued.group(1)) == finished, metrics
  assert json.loads(urllib.request.urlopen(server[1].removesuffix("/v1") + "/health").read())["status"] == "ok"


def test_bad_arguments_exit_2_before_jax(workdir, tmp_path):
  for args, message in [(["--port", "70000"], "--port 70000"), (["--slots", "0"], "--slots 0"),
                        (["--config.steps=3"], "cannot be set for serving")]:
    proc = subprocess.run([sys.executable, "-m", "meshtrain.serve", "--workdir", str(workdir), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith("error: ") and message in proc.stderr
  proc = subprocess.run([sys.executable, "-m", "meshtrain.serve", "--workdir", str(tmp_path / "none")],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and "no such directory" in proc.stderr


def test_bfloat16_on_the_cpu_gets_a_note():
  from meshtrain.inference.serving import cpu_dtype_note
  note = cpu_dtype_note("cpu", "bfloat16")
  assert "bfloat16" in note and "--config.model.dtype=float32" in note
  assert all(cpu_dtype_note(p, d) is None for p, d in [("cpu", "float32"), ("cpu", "float16"), ("gpu", "bfloat16")])


def test_api_key_and_sigterm_drain(workdir):
  proc, url = start_server(workdir, "--slots", "2", "--api-key", "sesame", "--grace-s", "60", "--lazy")
  try:
    with pytest.raises(openai.AuthenticationError):
      openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=url, api_key="sesame", max_retries=0, timeout=120)
    health = url.removesuffix("/v1") + "/health"
    held = lambda: (lambda h: h["busy_slots"] + h["queue"])(json.loads(urllib.request.urlopen(health,
                                                                                              timeout=30).read()))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # 7 choices over 2 slots: several rounds of decode
      stream = pool.submit(lambda: list(client.completions.create(model=None, prompt="b", max_tokens=60,
                                                                  temperature=0, stream=True)))
      while held() == 0:
        time.sleep(0.005)
      in_flight = pool.submit(client.completions.create, model=None, prompt="a", max_tokens=60, temperature=0, n=6)
      while held() < 7:  # both requests are in: SIGTERM comes after they were accepted
        time.sleep(0.005)
      proc.send_signal(signal.SIGTERM)
      time.sleep(0.2)
      with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=None, prompt="c", max_tokens=2)
      assert e.value.status_code == 503
      out = in_flight.result()
      assert len(out.choices) == 6 and all(c.finish_reason in {"stop", "length"} for c in out.choices)
      assert stream.result()[-1].choices[0].finish_reason in {"stop", "length"}
    assert proc.wait(timeout=60) == 0
  finally:
    if proc.poll() is None:
      proc.kill()


def test_a_client_that_goes_away_frees_its_slots(workdir):
  """A stream whose client closes the connection: its choices still waiting for the one slot are cancelled, not
  computed for nobody, and the server carries on."""
  import http.client
  import urllib.parse
  proc, url = start_server(workdir, "--slots", "1", "--max-queue", "8", "--lazy")
  try:
    where = urllib.parse.urlparse(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(
        {"prompt": [35, 36], "max_tokens": 1000, "n": 8, "stream": True, "temperature": 0}),
        {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.read(6) == b"data: "  # choice 0 is running
    connection.close()  # the client goes away with choices 1-7 still queued behind choice 0
    base = url.removesuffix("/v1")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # until every choice has ended, by its length or cancelled
      health = json.loads(urllib.request.urlopen(base + "/health", timeout=30).read())
      if health["busy_slots"] == 0 and health["queue"] == 0:
        break
      time.sleep(0.05)
    metrics = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    found = re.search(r'meshtrain_serve_requests_total\{finish_reason="cancelled"\} (\d+)', metrics)
    # Choices that end before the server sees the connection close run to their length: a choice of this model is
    # ~60 ms of decoding, and on a loaded 2-core CI machine the close once took two of them to reach the engine
    # (an earlier form of this test, 4 choices and 3 cancellations asked, failed so). Two or more cancelled is a
    # queued choice cancelled (choice 0 alone is the one running), with six choices' time to spare.
    assert found and int(float(found.group(1))) >= 2, metrics
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
    assert client.completions.create(model=None, prompt=[35], max_tokens=2, temperature=0).choices[0].text is not None
  finally:
    proc.kill()
    proc.wait()


def test_a_full_queue_is_429_with_retry_after(gen):
  """The server's queue bound, with an engine that never takes a request (its thread not started): the first two
  choices wait, the third is refused with 429 and Retry-After, and the refusal is counted."""
  import uvicorn

  from meshtrain.inference.server import Server
  server = Server(engine_lib.Engine(gen, slots=1, max_queue=2), "random")
  web = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
  thread = threading.Thread(target=web.run, daemon=True)
  thread.start()
  while not web.started:
    time.sleep(0.01)
  url = f"http://127.0.0.1:{web.servers[0].sockets[0].getsockname()[1]}/v1"
  client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
  try:
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      waiting = pool.submit(client.completions.create, model=None, prompt=[35], max_tokens=2, n=2)
      while server.engine.queued < 2:
        time.sleep(0.01)
      with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=None, prompt=[36], max_tokens=2)
      assert e.value.response.headers["retry-after"] == "1" and "busy" in e.value.message
      for request in list(server.engine.queue):  # let the waiting one end (cancelled: its choices never ran)
        request.cancel()
      server.start_engine()
      assert [c.finish_reason for c in waiting.result().choices] == ["stop", "stop"]
    assert 'status="429"' in server.metrics_text().body.decode()
  finally:
    server.stop_engine()
    web.should_exit = True
    thread.join(timeout=30)


@pytest.mark.slow  # a whole training run, then a server process: the 3.11 suite runs it
def test_live_checkpoints_swap_in_without_compiling(tmp_path):
  """Serving a run that is still training: a checkpoint that appears (renamed into place, as Orbax commits one) is
  swapped in once the request in flight ends, which keeps its checkpoint to its last token; the request that waited
  runs on the new one; nothing is compiled again. Then the same through the command: /v1/models and each response
  name the step that answered."""
  import os
  import shutil

  from meshtrain.cli import train
  from meshtrain.inference.live import LiveCheckpoints
  run = tmp_path / "run"
  assert train.main(["--config", "configs/tiny.py", "--workdir", str(run), "--config.steps=4",
                     "--config.checkpoint_every=2", "--config.seq_len=64", "--config.batch_size=8",
                     "--config.eval_every=0", "--config.model.num_layers=2", "--config.log_every=2"]) == 0
  served = tmp_path / "served"
  shutil.copytree(run, served)
  shutil.rmtree(served / "checkpoints" / "4")

  def appear(step: int):
    shutil.copytree(run / "checkpoints" / str(step), served / "checkpoints" / f"tmp-{step}")
    os.rename(served / "checkpoints" / f"tmp-{step}", served / "checkpoints" / str(step))

  prompt = list(range(60, 80))
  expected = {s: generator.Generator.from_workdir(run, s).generate([prompt], 30).token_ids[0] for s in (2, 4)}
  assert expected[2] != expected[4]  # two more training steps change the greedy tokens
  engine = engine_lib.Engine(generator.Generator.from_workdir(served, 2), slots=2, step=2,
                             live=LiveCheckpoints(served, 2, poll_s=0))
  engine.warm(len(prompt))  # every program either checkpoint's requests could run
  programs = (dict(engine.prefills), dict(engine.decodes))
  first = engine.submit(engine_lib.Request(prompt_ids=prompt, max_tokens=30))
  engine.step()
  engine.step()
  appear(4)
  second = engine.submit(engine_lib.Request(prompt_ids=prompt, max_tokens=30))
  while not (first.done and second.done):
    engine.step()
  assert (first.step, second.step, engine.step_served) == (2, 4, 4)
  assert first.token_ids == expected[2] and second.token_ids == expected[4]
  # The same compiled programs, the same objects: nothing compiled again.
  assert (engine.prefills.keys(), engine.decodes.keys()) == (programs[0].keys(), programs[1].keys())
  assert all(now[k] is v for now, then in zip((engine.prefills, engine.decodes), programs) for k, v in then.items())

  shutil.rmtree(served / "checkpoints" / "4")
  proc, url = start_server(served, "--follow-s", "0.2", "--lazy")
  try:
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    ask = lambda: client.completions.create(model=f"{served.name}@2", prompt=prompt, max_tokens=30, temperature=0)
    before = ask()
    assert before.model == f"{served.name}@2"
    appear(4)
    deadline = time.monotonic() + 120
    while client.models.list().data[0].id != f"{served.name}@4":
      assert time.monotonic() < deadline, "the new checkpoint was not picked up"
      time.sleep(0.1)
    after = ask()  # the name read before the swap still reaches the run
    assert after.model == f"{served.name}@4" and after.choices[0].text != before.choices[0].text
  finally:
    proc.kill()
    proc.wait()


@pytest.mark.slow  # several processes (the slow marker's kind): the 3.11 suite runs it
@pytest.mark.parametrize("warm", [False, True], ids=["compiled-on-first-use", "warm"])
def test_two_processes_serve_like_one(workdir, generated, client, warm):
  """Two processes of 4 devices serve one model (fsdp=8 across both: every weight and slot row is split over the
  processes): process 0 serves HTTP and broadcasts each step's plan, both run it; concurrent greedy requests get
  one process's generate tokens, and logprobs (echoed too) one process's server's; SIGTERM to the launcher drains
  and both processes exit 0. Programs compiled on first use (both processes compile in the same step, then meet at
  a barrier: --lazy) or all of them before serving (every process runs each once, in the same order: their
  collectives meet)."""
  proc, url = start_server(workdir, "--slots", "8", "--config.mesh.data=1", "--config.sharding.rules=fsdp",
                           "--config.mesh.fsdp=4", "--config.mesh.nodes.fsdp=2", *["--lazy"] * (not warm),
                           launch=["-m", "meshtrain.launch", "--processes", "2", "--devices-per-process", "4",
                                   "--module", "meshtrain.serve", "--"])
  try:
    both = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    ask = lambda ids: both.completions.create(model=None, prompt=ids, max_tokens=24, temperature=0).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(len(PROMPT_IDS)) as pool:
      assert list(pool.map(ask, PROMPT_IDS)) == generated
    scored = lambda c: c.completions.create(model=None, prompt=PROMPT_IDS[1], max_tokens=4, temperature=0, logprobs=2,
                                            echo=True).choices[0].logprobs
    two, one = scored(both), scored(client)
    assert two.tokens == one.tokens
    np.testing.assert_allclose(two.token_logprobs[1:], one.token_logprobs[1:], atol=1e-4)
    time.sleep(1.5)  # idle: process 0 keeps the other one in step meanwhile
    assert ask(PROMPT_IDS[0]) == generated[0]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


def test_images_from_a_dit_run(tmp_path):
  """A DiT run behind /v1/images/generations through the openai client: b64 PNGs at the model's size, the pictures
  `python -m meshtrain.sample` draws for that class, count and seed; an unknown class, another size or a URL
  response is a 400; the completion endpoints say where to go."""
  import base64
  import io

  from PIL import Image
  from test_sample import TINY_DIT

  from meshtrain.cli import sample, train
  (tmp_path / "tiny_dit.py").write_text(TINY_DIT)
  run = tmp_path / "dit"
  assert train.main(["--config", str(tmp_path / "tiny_dit.py"), "--workdir", str(run),
                     f"--config.data.data_dir={tmp_path / 'tfds'}"]) == 0
  assert sample.main(["--workdir", str(run), "--classes", "3", "--per-class", "2", "--seed", "11",
                      "--config.cpu_devices=8",  # this process's JAX already has the 8 devices train asked for
                      "--out", str(tmp_path / "grid.png"), "--npy", str(tmp_path / "three.npz")]) == 0
  expected = np.round(np.load(tmp_path / "three.npz")["images"] * 255).astype(np.uint8)[..., 0]
  proc, url = start_server(run)
  try:
    base = url.removesuffix("/v1")
    # Ready means compiled: a request's n images padded to 1, 2, 4 or 8, sampled with once before "serving".
    assert health(base)[0] == 200 and compiled_programs(base) == 4
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    out = client.images.generate(model=f"{run.name}@2", prompt="3", n=2, response_format="b64_json",
                                 extra_body={"seed": 11})
    pictures = [np.asarray(Image.open(io.BytesIO(base64.b64decode(d.b64_json)))) for d in out.data]
    assert [p.shape for p in pictures] == [(8, 8), (8, 8)]
    np.testing.assert_array_equal(np.stack(pictures), expected)
    one = client.images.generate(model=None, prompt="7", response_format="b64_json")
    assert len(one.data) == 1
    for bad, match in [({"prompt": "cat"}, "names no class of this model: give a class id 0..9"),
                       ({"prompt": "3", "size": "64x64"}, "draws 8x8 images"),
                       ({"prompt": "3", "response_format": "url"}, "b64_json")]:
      with pytest.raises(openai.BadRequestError, match=match):
        client.images.generate(model=None, **bad)
    with pytest.raises(openai.BadRequestError, match="/v1/images/generations"):
      client.completions.create(model=None, prompt="a", max_tokens=2)
    assert client.models.list().data[0].id == f"{run.name}@2"
    assert compiled_programs(base) == 4  # nothing compiled inside a request
  finally:
    proc.kill()
    proc.wait()


def compiled_programs(base: str) -> int:
  metrics = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
  return int(float(re.search(r"^meshtrain_serve_compiled_programs (\S+)$", metrics, re.M).group(1)))


def health(base: str) -> tuple[int, dict]:
  try:
    with urllib.request.urlopen(base + "/health", timeout=30) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


@pytest.mark.slow  # a server process of its own
def test_sigterm_while_warming_stops_in_one_compile(workdir):
  """SIGTERM while the server compiles its programs ends it after the program in hand (exit 0, never "serving"),
  not after all of them: a big model's warm-up can take minutes. It used to finish warming first (86 s here)."""
  proc = subprocess.Popen([sys.executable, "-m", "meshtrain.serve", "--workdir", str(workdir), "--port", "0",
                           "--slots", "8"], stderr=subprocess.PIPE, text=True, env=xla_fast.env())
  try:
    while "listening on" not in (line := proc.stderr.readline()):
      assert line, "the server stopped before it listened"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rest = proc.communicate(timeout=240)[1]
    stopped_s = time.monotonic() - t0
  finally:
    proc.kill()
    proc.wait()
  assert proc.returncode == 0, rest
  assert "serving" not in rest, rest
  assert stopped_s < 60, f"took {stopped_s:.0f} s to stop"


@pytest.mark.slow  # a server warmed from cold (every program of 8 slots), then timed: the 3.11 suite runs it
def test_ready_means_compiled(workdir):
  """The server listens while it compiles: /health answers 503 `warming` with its progress and a request 503. Once
  it says "serving", no request compiles anything (the metrics' count holds), and a first burst of 8 concurrent
  requests finishes well ahead of the same requests one at a time (compiling inside requests made it 2x slower)."""
  proc = subprocess.Popen([sys.executable, "-m", "meshtrain.serve", "--workdir", str(workdir), "--port", "0",
                           "--slots", "8"], stderr=subprocess.PIPE, text=True, env=xla_fast.env())
  try:
    while not (listening := re.search(r"listening on (http://\S+):", line := proc.stderr.readline())):
      assert line, "the server stopped before it listened"
    base = listening.group(1)
    status, body = health(base)
    assert status == 503 and body["status"] == "warming" and 0 <= body["programs_compiled"] < body["programs"]
    request = urllib.request.Request(base + "/v1/completions", data=json.dumps({"prompt": [35]}).encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
      urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 503 and "warming up" in refused.value.read().decode()
    while "serving" not in (line := proc.stderr.readline()):
      assert line, "the server stopped before serving"
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
    assert health(base) == (200, {"status": "ok", "busy_slots": 0, "queue": 0})
    programs = compiled_programs(base)
    assert programs == body["programs"]
    # Before any request every finish reason's series is there, at 0: a reader of one finds its line.
    metrics = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    for reason in ("stop", "length", "cancelled"):
      assert f'meshtrain_serve_requests_total{{finish_reason="{reason}"}} 0.0' in metrics, metrics
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(8)]
    # Long enough answers (the context is 64) that decoding, not each request's HTTP round trip, is what is timed.
    ask = lambda ids: client.completions.create(model=None, prompt=ids, max_tokens=56, temperature=0,
                                                extra_body={"ignore_eos": True}).choices[0].text
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      together = list(pool.map(ask, prompts))
    burst = time.perf_counter() - t0
    t0 = time.perf_counter()
    alone = [ask(ids) for ids in prompts]
    one_at_a_time = time.perf_counter() - t0
    assert together == alone
    assert compiled_programs(base) == programs  # nothing compiled inside a request
    print(f"8 requests of 56 tokens: one at a time {one_at_a_time:.3f} s, 8 at once right after ready {burst:.3f} s")
    # 3.4-3.6x measured on the idle 2-core machine (the tiny model's step over 8 rows costs 2.5 times one row's, so
    # no more is reachable there); 2x here leaves room for the other test worker's load and still fails the lazy
    # server (0.5x: compiling inside the burst).
    assert one_at_a_time >= 2 * burst, (one_at_a_time, burst)
  finally:
    proc.kill()
    proc.wait()
