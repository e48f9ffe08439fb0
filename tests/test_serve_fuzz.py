"""The server's edges: every reproduction of the adversarial probe (issue 44) is a 400 naming its field, never a 500
or a silent change, and every refusal is counted; then schemathesis fuzzes every endpoint of the server's own
/openapi.json (generated from meshtrain/inference/protocol.py), valid and invalid bodies, on a language model and on
a DiT run: no 500."""
import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import hypothesis
import pytest
import schemathesis
from test_generate import train_tiny
from test_sample import TINY_DIT
from test_serve import start_server

from meshtrain.inference import engine as engine_lib, image_engine, protocol


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  return train_tiny(tmp_path_factory.mktemp("fuzzed"))


@pytest.fixture(scope="module")
def server(workdir):
  (workdir / "tokenizer").mkdir(exist_ok=True)  # chat requests rendered, not refused for want of a template
  (workdir / "tokenizer" / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
  proc, url = start_server(workdir, "--slots", "2", "--lazy")
  yield url.removesuffix("/v1")
  proc.kill()
  proc.wait()


@pytest.fixture(scope="module")
def dit_server(tmp_path_factory):
  from meshtrain.cli import train
  tmp = tmp_path_factory.mktemp("fuzzed_dit")
  (tmp / "tiny_dit.py").write_text(TINY_DIT)
  assert train.main(["--config", str(tmp / "tiny_dit.py"), "--workdir", str(tmp / "dit"),
                     f"--config.data.data_dir={tmp / 'tfds'}"]) == 0
  proc, url = start_server(tmp / "dit", "--lazy")
  yield url.removesuffix("/v1")
  proc.kill()
  proc.wait()


def post(base: str, path: str, raw: bytes) -> tuple[int, dict]:
  request = urllib.request.Request(base + path, data=raw, headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(request, timeout=120) as response:
      return response.status, json.loads(response.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def refused(base: str) -> float:
  text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
  return sum(float(v) for v in re.findall(r'^meshtrain_serve_rejected_requests_total{status="\d+"} (\S+)$', text, re.M))


def test_the_limits_the_server_checks_are_the_engines():
  assert protocol.TOP_LOGPROBS == engine_lib.TOP_LOGPROBS and protocol.MAX_STEPS == image_engine.MAX_STEPS


# The probe's reproductions (issue 44): (path, raw JSON body, the field the 400 must name). Python's json reads
# NaN, Infinity and 1e400 (inf), as the server's parser does.
PROBE = [
    ("/v1/completions", b'{"prompt": "a", "max_tokens": NaN}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": Infinity}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 1e400}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 2.5}', "max_tokens"),
    ("/v1/completions", b'{"prompt": [1180591620717411303424]}', "prompt"),  # 2^70
    ("/v1/completions", b'{"prompt": [true, false]}', "prompt"),
    ("/v1/completions", b'{"prompt": "a", "temperature": 1e38}', "temperature"),
    ("/v1/completions", b'{"prompt": "a", "temperature": NaN}', "temperature"),
    ("/v1/completions", b'{"prompt": "a", "stream": "false"}', "stream"),
    ("/v1/completions", b'{"prompt": "a", "stream": true, "stream_options": {"include_usage": "no"}}',
     "stream_options"),
    ("/v1/completions", b'{"prompt": "a", "n": 1.5}', "n"),
    ("/v1/completions", b'{"prompt": "a", "seed": "7"}', "seed"),
    ("/v1/completions", b'{"prompt": "a", "logit_bias": {"41": NaN}}', "logit_bias"),
    ("/v1/completions", b'{"prompt": "a", "stop": [1]}', "stop"),
    ("/v1/completions", b'{"prompt": []}', "prompt"),
    ("/v1/completions", b'{"prompt": [384]}', "prompt"),  # past the model's vocabulary (384 rows)
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
     "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": 5, "content": "a"}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a"}], "logprobs": 1}', "logprobs"),
    ("/tokenize", b'{"prompt": 5}', "prompt"),
    ("/detokenize", b'{"tokens": [1180591620717411303424]}', "tokens"),
    ("/detokenize", b'{"tokens": [true]}', "tokens"),
]


def test_each_reproduction_is_a_400_naming_its_field_and_counted(server):
  before = refused(server)
  for path, raw, param in PROBE:
    status, body = post(server, path, raw)
    assert status == 400 and body["error"]["param"] == param, (raw, status, body)
    assert "--" not in body["error"]["message"], body  # the request's field, not a command-line flag
  # A body nested 100,000 arrays deep (under 1 MiB): deeper than Python's parser goes.
  status, body = post(server, "/v1/completions", b"[" * 100_000 + b"]" * 100_000)
  assert status == 400 and "nested too deeply" in body["error"]["message"]
  assert refused(server) - before == len(PROBE) + 1


def test_image_prompts_are_ascii_class_ids(dit_server):
  for prompt in ("²", "--3", "9" * 5000, "٣", "10"):
    status, body = post(dit_server, "/v1/images/generations", json.dumps({"prompt": prompt}).encode())
    assert status == 400 and body["error"]["param"] == "prompt", (prompt, body)
  status, body = post(dit_server, "/v1/images/generations", b'{"prompt": "3", "n": NaN}')
  assert status == 400 and body["error"]["param"] == "n"
  status, body = post(dit_server, "/v1/images/generations", b'{"prompt": "3"}')
  assert status == 200 and len(body["data"]) == 1


@pytest.mark.slow  # a server process of its own
def test_a_client_that_leaves_mid_body_leaves_no_traceback(workdir, tmp_path):
  log = tmp_path / "serve.log"
  with open(log, "w") as f:
    proc = subprocess.Popen([sys.executable, "-m", "meshtrain.serve", "--workdir", str(workdir), "--port", "0",
                             "--lazy", "--slots", "1"], stderr=f, text=True)
  try:
    deadline = time.monotonic() + 240
    while not (match := re.search(r"serving \S+ on http://([^:]+):(\d+)/v1", log.read_text())):
      assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
      time.sleep(0.2)
    host, port = match.group(1), int(match.group(2))
    with socket.create_connection((host, port)) as s:
      s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
    time.sleep(1)  # the server reads the part sent, then finds the connection closed
    assert post(f"http://{host}:{port}", "/v1/completions", b'{"prompt": "a", "max_tokens": 1}')[0] == 200
  finally:
    proc.terminate()
    proc.wait(timeout=60)
  assert "Traceback" not in log.read_text() and "ClientDisconnect" not in log.read_text(), log.read_text()


@pytest.mark.slow  # two serve processes up to loading the model
@pytest.mark.parametrize("args, needle", [
    (["--max-len", "1000000000"], "need a KV cache of"),
    (["--port", "{busy}"], "cannot listen on 127.0.0.1:{busy}"),
])
def test_serve_refuses_what_cannot_run_before_loading(workdir, args, needle):
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    args = [a.replace("{busy}", str(port)) for a in args]
    done = subprocess.run([sys.executable, "-m", "meshtrain.serve", "--workdir", str(workdir), "--lazy", *args],
                          capture_output=True, text=True, timeout=300)
  assert done.returncode == 2 and needle.replace("{busy}", str(port)) in done.stderr, done.stderr
  assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr


def fuzz(base: str, examples: int, path: str | None = None) -> None:
  """Every operation of the server's /openapi.json (or `path`'s POST), with schemathesis's bodies that fit the
  schema and bodies that do not (hypothesis, derandomized: the same cases each run): never a 500, every refusal
  counted."""
  schema = schemathesis.openapi.from_url(base + "/openapi.json")
  operations = schema if path is None else schema[path]["POST"]
  seen = {"calls": 0, "refused": 0}
  before = refused(base)
  for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
    @hypothesis.settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck), phases=[hypothesis.Phase.generate])
    @hypothesis.given(operations.as_strategy(generation_mode=mode))
    def call(case):
      if mode == schemathesis.GenerationMode.POSITIVE and isinstance(case.body, dict):
        case.body.pop("model", None)  # a random name is a 404 before anything else is read
      response = case.call(base_url=base, timeout=120)
      assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
      seen["calls"] += 1
      seen["refused"] += response.status_code >= 400
    call()
  assert refused(base) - before == seen["refused"], seen


def test_fuzzing_every_endpoint_finds_no_500(server):
  fuzz(server, examples=100)


def test_fuzzing_the_images_endpoint_finds_no_500(dit_server):
  fuzz(dit_server, examples=25, path="/v1/images/generations")
