"""The OpenAI-compatible HTTP server over an Engine (meshtrain/inference/engine.py): `python -m meshtrain.serve`.

Starlette on uvicorn. The engine runs on one background thread that owns every JAX call; the handlers check a
request, encode its prompt, submit it to the engine's queue and await its tokens, which the engine thread hands back
through the event loop (`call_soon_threadsafe`). Endpoints: GET /v1/models, POST /v1/completions,
POST /v1/chat/completions (the run's chat template), with `stream: true` as server-sent events; for a DiT run
POST /v1/images/generations instead (meshtrain/inference/image_engine.py); GET /health, GET /metrics (Prometheus
text). Errors are OpenAI-style JSON. SIGTERM (or Ctrl-C) stops accepting requests (503),
lets the ones in flight finish within `grace_s`, and returns.
"""
import asyncio
import gc
import base64
import dataclasses
import hmac
import json
import sys
import threading
import time
import uuid

import numpy as np
import prometheus_client as prom
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from meshtrain.data.chat import ChatTemplate
from meshtrain.errors import UserError
from meshtrain.inference import engine as engine_lib, image_engine

MAX_BODY_BYTES = 1 << 20
MAX_N = 8
MAX_STOP = 4
RETRY_AFTER_S = 1
# How long a Python thread may hold the GIL while another waits for it (the interpreter's default is 5 ms). The
# engine thread wants it back each time a device call returns, while the event loop's thread is writing responses:
# at 5 ms, every return waited up to that long; at 0.5 ms the server's tokens/s at saturation is about a third higher
# (experiments/serve_bench.py measures it).
SWITCH_INTERVAL_S = 0.0005


class ApiError(Exception):
  """An OpenAI-style error response."""

  def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
               headers: dict | None = None):
    super().__init__(message)
    self.status, self.message, self.kind, self.param, self.headers = status, message, kind, param, headers

  def response(self) -> JSONResponse:
    return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                   "code": self.status}}, status_code=self.status, headers=self.headers)


@dataclasses.dataclass
class Asked:
  """What a completion request asks for, checked."""
  prompts: list[list[int]]
  max_tokens: int
  temperature: float
  top_p: float
  top_k: int
  seed: int | None
  stop: tuple[str, ...]
  n: int
  stream: bool
  include_usage: bool
  logprobs: int | None    # the most likely alternatives each token's logprobs list (None: no logprobs)
  echo: bool              # completions: the prompt's text and logprobs first
  ignore_eos: bool
  stop_token_ids: tuple[int, ...]
  processing: dict        # logit_bias, presence/frequency/repetition_penalty, min_tokens: engine.Request's fields


# Fields that would change the result and that the engine does not apply: refused (400 naming the field) unless
# they hold their neutral value, never ignored. Those that cannot change the tokens (`user`, `stream_options`
# extras, `metadata`, ...) are ignored as OpenAI's own server ignores what it does not use.
UNSUPPORTED = {"suffix": "", "prompt_logprobs": None, "response_format": None,
               "guided_json": None, "guided_regex": None, "guided_choice": None, "min_p": 0,
               "length_penalty": 1, "use_beam_search": False, "logits_processors": None}


class Metrics:
  """The server's Prometheus metrics, in their own registry."""

  def __init__(self, engine):
    self.registry = prom.CollectorRegistry()
    r = self.registry
    buckets = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)
    self.ttft = prom.Histogram("meshtrain_serve_time_to_first_token_seconds", "submit to first token", registry=r,
                               buckets=buckets)
    self.tpot = prom.Histogram("meshtrain_serve_time_per_output_token_seconds",
                               "per request: (last token - first token) / (tokens - 1)", registry=r, buckets=buckets)
    self.queue_time = prom.Histogram("meshtrain_serve_request_queue_time_seconds", "submit to getting a decode slot",
                                     registry=r, buckets=(.001, .0025) + buckets)
    self.e2e = prom.Histogram("meshtrain_serve_request_latency_seconds", "submit to last token", registry=r,
                              buckets=buckets)
    prom.Gauge("meshtrain_serve_queue_length", "requests waiting for a slot", registry=r).set_function(
        lambda: engine.queued)
    prom.Gauge("meshtrain_serve_busy_slots", "decode slots holding a request", registry=r).set_function(
        lambda: engine.busy)
    prom.Gauge("meshtrain_serve_slots", "decode slots", registry=r).set(engine.slots)
    if isinstance(engine, engine_lib.Engine):  # what is compiled: after warming, a request compiles nothing more
      prom.Gauge("meshtrain_serve_compiled_programs", "prefill and decode programs compiled", registry=r).set_function(
          lambda: len(engine.prefills) + len(engine.decodes))
    self.prompt_tokens = prom.Counter("meshtrain_serve_prompt_tokens", "prompt tokens prefilled", registry=r)
    self.generation_tokens = prom.Counter("meshtrain_serve_generation_tokens", "tokens generated", registry=r)
    self.requests = prom.Counter("meshtrain_serve_requests", "requests finished (one per choice)", ["finish_reason"],
                                 registry=r)
    self.rejected = prom.Counter("meshtrain_serve_rejected_requests", "requests refused", ["status"], registry=r)
    self.images = prom.Counter("meshtrain_serve_images", "images generated", registry=r)
    self.image_latency = prom.Histogram("meshtrain_serve_image_request_latency_seconds",
                                        "image request: submit to its PNGs", registry=r, buckets=buckets)

  def finished(self, request: engine_lib.Request) -> None:
    self.requests.labels(request.finish_reason).inc()
    self.prompt_tokens.inc(len(request.prompt_ids))
    self.generation_tokens.inc(len(request.token_ids))
    if request.admitted_at is not None:
      self.queue_time.observe(request.admitted_at - request.submitted_at)
    if request.first_token_at is not None:
      self.ttft.observe(request.first_token_at - request.submitted_at)
      self.e2e.observe(request.finished_at - request.submitted_at)
      if len(request.token_ids) > 1:
        self.tpot.observe((request.finished_at - request.first_token_at) / (len(request.token_ids) - 1))


def busy(full: Exception) -> ApiError:
  """The 429 for a full queue (either engine's QueueFull), with Retry-After."""
  return ApiError(429, f"the server is busy ({full}); retry later", "rate_limit_exceeded",
                  headers={"Retry-After": str(RETRY_AFTER_S)})


def number(body: dict, name: str, kind, default, low=None, high=None):
  """body[name] as `kind` (int or float) within [low, high]; ApiError 400 otherwise."""
  value = body.get(name)
  if value is None:
    return default
  if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
    raise ApiError(400, f"{name} must be {'an integer' if kind is int else 'a number'}, not {value!r}", param=name)
  if (low is not None and value < low) or (high is not None and value > high):
    bounds = f"at least {low}" if high is None else f"between {low} and {high}"
    raise ApiError(400, f"{name} {value} must be {bounds}", param=name)
  return kind(value)


class Server:
  """The Starlette app over `engine` (not yet running: `serve()` runs it with uvicorn, `start_engine` alone for
  an app served otherwise). `run` names the model: /v1/models lists RUN@STEP, the step the engine serves now, and
  each response names the step that answered it; `workdir` is where the chat template is read; `api_key`, when
  set, is required as `Authorization: Bearer KEY` on every call."""

  def __init__(self, engine, run: str, workdir=None, api_key: str | None = None, grace_s: float = 30.0,
               served_name: str | None = None):
    self.engine, self.run, self.workdir, self.served_name = engine, run, workdir, served_name
    self.api_key, self.grace_s = api_key, grace_s
    self.metrics = Metrics(engine)
    self.draining = False
    self.inflight = 0
    self.stop = threading.Event()
    self.thread = None
    self.port, self.port_known = None, threading.Event()
    self.outbox, self.outbox_lock = [], threading.Lock()  # updates on their way to the event loop (hand_over)
    self.created = int(time.time())
    self.chat = None
    self.app = Starlette(routes=[
        Route("/v1/models", self.models, methods=["GET"]), Route("/health", self.health, methods=["GET"]),
        Route("/v1/models/{model:path}", self.model, methods=["GET"]),
        Route("/tokenize", self.tokenize, methods=["POST"]), Route("/detokenize", self.detokenize, methods=["POST"]),
        Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
        Route("/metrics", self.prometheus, methods=["GET"]),
        Route("/v1/completions", self.completions, methods=["POST"]),
        Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        Route("/v1/images/generations", self.images, methods=["POST"])],
        exception_handlers={404: self.no_route, 405: self.no_route})
    self.makes_images = isinstance(engine, image_engine.ImageEngine)

  @property
  def model_name(self) -> str:
    return self.name_at(self.engine.step_served)

  def name_at(self, step: int | None) -> str:
    if self.served_name is not None:  # the one name, whatever the step (vLLM's --served-model-name)
      return self.served_name
    return self.run if step is None else f"{self.run}@{step}"

  # --- the engine thread ---

  def start_engine(self, on_ready=None) -> None:
    """The engine thread: warms the engine unless it is ready, calls `on_ready(port)` once the server listens too
    (`listening(port)`, from `serve`), then runs the engine."""
    def run():
      if not getattr(self.engine, "ready", True):
        self.engine.warm()
        gc.freeze()  # the compiled programs too, as serving.serve freezes what start-up built
      if on_ready is not None:
        self.port_known.wait()
        on_ready(self.port)
      self.engine.run(self.stop)
    self.thread = threading.Thread(target=run, name="meshtrain-engine", daemon=True)
    self.thread.start()

  def listening(self, port: int) -> None:
    self.port = port
    self.port_known.set()

  def stop_engine(self) -> None:
    self.stop.set()
    with self.engine.lock:
      self.engine.lock.notify()
    if self.thread is not None:
      self.thread.join()

  def serve(self, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning", on_listening=None,
            on_ready=None) -> None:
    """Runs the server until SIGTERM/SIGINT (then drains: see the module docstring). `on_listening(port)` is called
    once it listens (port 0 picks a free port), `on_ready(port)` once the engine is warm too: /health says ok from
    then on, and requests are taken (503 before)."""
    config = uvicorn.Config(self.app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            lifespan="off")
    server = DrainingServer(config, self, on_listening)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    self.start_engine(on_ready)
    try:
      server.run()
    finally:
      self.stop_engine()

  # --- endpoints ---

  async def models(self, http: HttpRequest) -> Response:
    return await self.guarded(http, self.list_models, counts=False)

  async def model(self, http: HttpRequest) -> Response:
    def one(_):
      self.check_model({"model": http.path_params["model"]})
      return JSONResponse(self.model_card())
    return await self.guarded(http, one, counts=False)

  async def tokenize(self, http: HttpRequest) -> Response:
    return await self.guarded(http, self.tokens_of, counts=False)

  async def detokenize(self, http: HttpRequest) -> Response:
    return await self.guarded(http, self.text_of, counts=False)

  async def tokenizer_info(self, http: HttpRequest) -> Response:
    return await self.guarded(http, self.describe_tokenizer, counts=False)

  async def no_route(self, http: HttpRequest, exc) -> Response:
    """Unknown routes and methods: OpenAI's JSON error, not Starlette's plain text."""
    what = "route" if exc.status_code == 404 else f"method {http.method} for"
    self.metrics.rejected.labels(str(exc.status_code)).inc()
    return ApiError(exc.status_code, f"no {what} {http.url.path} on this server (see docs/serving.md)",
                    "not_found_error" if exc.status_code == 404 else "invalid_request_error").response()

  async def health(self, http: HttpRequest) -> Response:
    """200 `ok` once ready; 503 `warming` (with how many programs are compiled) before, as a readiness probe expects,
    and 503 `draining` after SIGTERM."""
    if not self.ready:
      return JSONResponse({"status": "warming", "programs_compiled": self.engine.warmed,
                           "programs": len(self.engine.programs())}, status_code=503)
    status = 503 if self.draining else 200
    return JSONResponse({"status": "draining" if self.draining else "ok", "busy_slots": self.engine.busy,
                         "queue": self.engine.queued}, status_code=status)

  @property
  def ready(self) -> bool:
    """Whether every program a request can need is compiled (an image engine compiles on first use: always)."""
    return getattr(self.engine, "ready", True)

  def warming(self) -> str:
    return f"{self.engine.warmed} of {len(self.engine.programs())} programs compiled"

  async def prometheus(self, http: HttpRequest) -> Response:
    return await self.guarded(http, lambda _: self.metrics_text(), counts=False)

  async def completions(self, http: HttpRequest) -> Response:
    return await self.guarded(http, lambda body: self.complete(http, body, chat=False))

  async def images(self, http: HttpRequest) -> Response:
    return await self.guarded(http, lambda body: self.generate_images(http, body))

  async def chat_completions(self, http: HttpRequest) -> Response:
    return await self.guarded(http, lambda body: self.complete(http, body, chat=True))

  async def guarded(self, http: HttpRequest, handler, counts: bool = True) -> Response:
    """Authorization, draining, the body, and errors as OpenAI-style JSON, around `handler(body)`."""
    try:
      if self.api_key is not None:
        given = http.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
          raise ApiError(401, "a valid API key is needed: Authorization: Bearer KEY", "authentication_error")
      if counts and self.draining:
        raise ApiError(503, "the server is shutting down", "service_unavailable", headers={"Retry-After": "5"})
      if counts and not self.ready:
        raise ApiError(503, f"warming up: {self.warming()}; GET /health says ok once every program is compiled",
                       "service_unavailable", headers={"Retry-After": "5"})
      body = await self.body(http) if http.method == "POST" else {}
      self.inflight += counts
      try:
        result = handler(body)
        return await result if asyncio.iscoroutine(result) else result
      finally:
        self.inflight -= counts
    except ApiError as e:
      self.metrics.rejected.labels(str(e.status)).inc()
      return e.response()

  @staticmethod
  async def body(http: HttpRequest) -> dict:
    if int(http.headers.get("content-length") or 0) > MAX_BODY_BYTES:
      raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    raw = b""
    async for chunk in http.stream():
      raw += chunk
      if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    try:
      body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ApiError(400, f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
      raise ApiError(400, "the request body must be a JSON object")
    return body

  def model_card(self) -> dict:
    model = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "meshtrain"}
    if not self.makes_images:
      model["max_model_len"] = self.engine.max_len
    return model

  def list_models(self, body) -> Response:
    return JSONResponse({"object": "list", "data": [self.model_card()]})

  def tokens_of(self, body: dict) -> Response:
    """vLLM's POST /tokenize: {"prompt": TEXT, "add_special_tokens": true} or {"messages": [...]} (rendered by the
    chat template) -> the ids. As vLLM's (and transformers'), a special token's text in the prompt is that token
    (clients look the end-of-sequence id up this way); add_special_tokens adds the beginning-of-sequence token where
    the run's completions add one."""
    if self.makes_images:
      raise ApiError(400, "this server serves an image run: it has no tokenizer")
    self.check_model(body)
    if "messages" in body:
      [ids] = self.prompts_of(body, chat=True)
    else:
      if not isinstance(body.get("prompt"), str):
        raise ApiError(400, "prompt must be a string (or send messages)", param="prompt")
      gen = self.engine.gen
      ids = gen.tokenizer.encode_with_specials(body["prompt"]).tolist()
      if gen.add_bos and body.get("add_special_tokens", True) is not False:
        ids = [gen.tokenizer.bos_id, *ids]
    return JSONResponse({"count": len(ids), "max_model_len": self.engine.max_len, "tokens": ids})

  def describe_tokenizer(self, body: dict) -> Response:
    """vLLM's GET /tokenizer_info: the special tokens (transformers' names), the context and the chat template,
    what lm-evaluation-harness's remote tokenizer reads."""
    if self.makes_images:
      raise ApiError(400, "this server serves an image run: it has no tokenizer")
    tokenizer = self.engine.gen.tokenizer
    info = {**tokenizer.special_tokens(), "model_max_length": self.engine.max_len, "vocab_size": tokenizer.vocab_size}
    try:
      if self.chat is None and self.workdir is not None:
        self.chat = ChatTemplate.for_workdir(self.workdir)
      if self.chat is not None:
        info["chat_template"] = self.chat.template()
    except UserError:
      pass  # no template: chat clients get a clear 400 from /v1/chat/completions
    return JSONResponse(info)

  def text_of(self, body: dict) -> Response:
    """vLLM's POST /detokenize: {"tokens": [ids]} -> {"prompt": TEXT}."""
    if self.makes_images:
      raise ApiError(400, "this server serves an image run: it has no tokenizer")
    self.check_model(body)
    tokens, vocab = body.get("tokens"), self.engine.gen.model_cfg.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                               for t in tokens):
      raise ApiError(400, f"tokens must be a list of token ids 0..{vocab - 1}", param="tokens")
    return JSONResponse({"prompt": self.engine.gen.tokenizer.decode(np.asarray(tokens, np.int32))})

  def check_model(self, body: dict) -> None:
    model = body.get("model")
    # RUN, or RUN@STEP of any step: a client that read /v1/models before a newer checkpoint was swapped in still
    # reaches the run (the response's `model` names the step that answered).
    if model is not None and model != self.served_name and not (
        model == self.run or (isinstance(model, str) and model.startswith(self.run + "@")
                              and model[len(self.run) + 1:].isdigit())):
      raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                     param="model")

  # --- images ---

  async def generate_images(self, http: HttpRequest, body: dict) -> Response:
    if not self.makes_images:
      raise ApiError(400, "this server serves a language model: use /v1/completions or /v1/chat/completions "
                          "(/v1/images/generations serves image runs)")
    self.check_model(body)
    if body.get("response_format", "b64_json") != "b64_json":
      raise ApiError(400, "response_format must be b64_json (the images come back in the response; there are no "
                          "URLs to fetch them from)", param="response_format")
    height, width, _ = self.engine.image_shape
    if body.get("size") not in (None, "auto", f"{width}x{height}"):
      raise ApiError(400, f"size {body.get('size')!r}: this model draws {width}x{height} images", param="size")
    prompts = isinstance(self.engine, image_engine.PromptEngine)
    if not isinstance(body.get("prompt"), (str, int)) or isinstance(body.get("prompt"), bool):
      raise ApiError(400, "prompt must be " + ("the text to draw" if prompts else "a class: its id or its name"),
                     param="prompt")
    if not prompts and ({"steps", "guidance"} & set(body)):
      raise ApiError(400, "steps and guidance are set per request for text-to-image runs only; this DiT samples with "
                          "its run's", param="steps" if "steps" in body else "guidance")
    loop = asyncio.get_running_loop()
    finished = asyncio.Event()
    try:
      request = image_engine.ImageRequest(self.engine.condition_of(body["prompt"]),
                                          n=number(body, "n", int, 1, 1, self.engine.max_n),
                                          seed=number(body, "seed", int, None, 0, 2**32 - 1),
                                          steps=number(body, "steps", int, None, 1, image_engine.MAX_STEPS),
                                          guidance=number(body, "guidance", float, None, 0, 100),
                                          on_done=lambda _: loop.call_soon_threadsafe(finished.set))
      self.engine.submit(request)
    except UserError as e:
      raise ApiError(400, str(e), param="prompt" if "prompt" in str(e) else None) from None
    except engine_lib.QueueFull as e:
      raise busy(e) from None
    try:
      while not finished.is_set():
        try:
          await asyncio.wait_for(finished.wait(), timeout=0.5)
        except TimeoutError:
          if await http.is_disconnected():
            return Response(status_code=499)
    finally:
      request.cancel()  # nothing if it ran
    self.metrics.images.inc(len(request.pngs))
    self.metrics.image_latency.observe(request.finished_at - request.submitted_at)
    return JSONResponse({"created": int(time.time()), "model": self.name_at(request.step),
                         "data": [{"b64_json": base64.b64encode(png).decode()} for png in request.pngs]})

  def metrics_text(self) -> Response:
    return Response(prom.generate_latest(self.metrics.registry), media_type=prom.CONTENT_TYPE_LATEST)

  # --- completions ---

  def prompts_of(self, body: dict, chat: bool) -> list[list[int]]:
    """The token ids of the request's prompt(s): `messages` rendered by the chat template, or `prompt` (a string,
    a list of strings, a list of ids or a list of lists of ids)."""
    if chat:
      messages = body.get("messages")
      if not isinstance(messages, list) or not messages or not all(
          isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise ApiError(400, "messages must be a non-empty list of {\"role\": ..., \"content\": ...}", param="messages")
      messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
      for m in messages:
        if isinstance(m.get("content"), list):  # content parts: their text joined
          m["content"] = "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))
      if self.chat is None:
        try:
          self.chat = ChatTemplate.for_workdir(self.workdir)
        except UserError as e:
          raise ApiError(400, str(e).replace(" --messages", " chat messages"), param="messages") from None
      try:
        return [self.chat.encode(self.chat.render(messages, tools=body.get("tools")))]
      except UserError as e:
        raise ApiError(400, f"the chat template refused the conversation: {e}", param="messages") from None
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(x, int) for x in prompt)):
      prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(
        isinstance(p, str) or (isinstance(p, list) and all(isinstance(x, int) for x in p)) for p in prompt):
      raise ApiError(400, "prompt must be a string, a list of strings or a list of token ids", param="prompt")
    try:
      return [ids.tolist() for ids in self.engine.gen.encode(prompt)]
    except UserError as e:
      raise ApiError(400, str(e), param="prompt") from None

  def asked(self, body: dict, chat: bool) -> Asked:
    if self.makes_images:
      raise ApiError(400, "this server serves a DiT run: use /v1/images/generations")
    self.check_model(body)
    for name, neutral in UNSUPPORTED.items():
      if name == "tools" and chat:
        continue  # rendered by the chat template
      value = body.get(name)
      if value is not None and value != neutral and not (name == "response_format" and value == {"type": "text"}):
        raise ApiError(400, f"{name} is not supported by this server, and ignoring it would change the result; "
                            "leave it out", param=name)
    n = number(body, "n", int, 1, 1, MAX_N)
    best_of = number(body, "best_of", int, None, 1)
    if best_of is not None and best_of != n:
      raise ApiError(400, f"best_of {best_of} is not supported (only best_of = n, {n}): this server returns every "
                          "choice it samples", param="best_of")
    if chat:
      top = number(body, "top_logprobs", int, None, 0, engine_lib.TOP_LOGPROBS)
      if top is not None and body.get("logprobs") is not True:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
      if not isinstance(body.get("logprobs", False), bool) and body.get("logprobs") is not None:
        raise ApiError(400, f"logprobs must be true or false, not {body['logprobs']!r}", param="logprobs")
      logprobs = (top or 0) if body.get("logprobs") else None
    else:
      logprobs = number(body, "logprobs", int, None, 0, engine_lib.TOP_LOGPROBS)
    echo = body.get("echo", False)
    if chat and "echo" in body and echo not in (False, None):
      raise ApiError(400, "echo is for /v1/completions; chat completions do not echo the conversation", param="echo")
    for name in ("echo", "ignore_eos", "stream"):
      if body.get(name) is not None and not isinstance(body[name], bool):
        raise ApiError(400, f"{name} must be true or false, not {body[name]!r}", param=name)
    if echo and body.get("stream"):
      raise ApiError(400, "echo with stream is not supported: ask without stream for the prompt's logprobs",
                      param="echo")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and
                                                 0 <= i < self.engine.gen.model_cfg.vocab_size for i in stop_ids):
      raise ApiError(400, "stop_token_ids must be a list of token ids of the model's vocabulary",
                     param="stop_token_ids")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > MAX_STOP:
      raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOP} strings", param="stop")
    top_k = number(body, "top_k", int, 0, -1)
    length_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    options = body.get("stream_options") or {}
    return Asked(self.prompts_of(body, chat), number(body, length_key, int, 16 if not chat else
                                                     self.engine.max_len, 0 if echo else 1),
                 number(body, "temperature", float, 1.0, 0.0), number(body, "top_p", float, 1.0, 0.0, 1.0),
                 max(top_k, 0), number(body, "seed", int, None, -2**63, 2**63 - 1 - MAX_N), tuple(s for s in stop if s),
                 n, bool(body.get("stream")), isinstance(options, dict) and bool(options.get("include_usage")),
                 logprobs, bool(echo), bool(body.get("ignore_eos")), tuple(stop_ids), self.processing_of(body))

  def processing_of(self, body: dict) -> dict:
    """The request's logits processing (engine.Request's fields), checked: OpenAI's bounds where it has them."""
    bias = body.get("logit_bias") or {}
    vocab = self.engine.gen.model_cfg.vocab_size
    try:
      bias = {int(k): v for k, v in bias.items()} if isinstance(bias, dict) else None
    except ValueError:
      bias = None
    if bias is None or len(bias) > engine_lib.MAX_BIAS or not all(
        0 <= k < vocab and isinstance(v, (int, float)) and not isinstance(v, bool) and -100 <= v <= 100
        for k, v in bias.items()):
      raise ApiError(400, f"logit_bias must map at most {engine_lib.MAX_BIAS} token ids (0..{vocab - 1}, as "
                          "strings) to biases between -100 and 100", param="logit_bias")
    return {"logit_bias": {k: float(v) for k, v in bias.items()},
            "presence_penalty": number(body, "presence_penalty", float, 0.0, -2.0, 2.0),
            "frequency_penalty": number(body, "frequency_penalty", float, 0.0, -2.0, 2.0),
            "repetition_penalty": number(body, "repetition_penalty", float, 1.0, 1e-6, 100.0),
            "min_tokens": number(body, "min_tokens", int, 0, 0)}

  async def complete(self, http: HttpRequest, body: dict, chat: bool) -> Response:
    asked = self.asked(body, chat)
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue = asyncio.Queue()

    def on_update(request, delta):  # the engine thread
      # Whether this update is the request's last, and how many tokens it has, taken here: by the time the stream
      # reads the update the engine may have gone on, and an earlier update read as the last would drop the text
      # after it.
      last = request.done
      if last:
        self.metrics.finished(request)
      self.hand_over(loop, updates, (request, delta, last, len(request.token_logprobs)))

    requests = [engine_lib.Request(prompt_ids=ids, max_tokens=asked.max_tokens, temperature=asked.temperature,
                                   top_p=asked.top_p, top_k=asked.top_k,
                                   seed=None if asked.seed is None else asked.seed + j, stop=asked.stop,
                                   logprobs=asked.logprobs, echo=asked.echo, ignore_eos=asked.ignore_eos,
                                   stop_token_ids=asked.stop_token_ids, on_update=on_update, **asked.processing)
                for ids in asked.prompts for j in range(asked.n)]
    try:
      self.engine.submit(*requests)  # together: one checkpoint answers all the choices
    except (UserError, engine_lib.QueueFull) as e:
      if isinstance(e, engine_lib.QueueFull):
        raise busy(e) from None
      named = [f for f in ("min_tokens", "stop_token_ids", "logit_bias", "max_tokens", "logprobs", "prompt")
               if f in str(e)]
      raise ApiError(400, str(e).replace("shorten the prompt", "shorten the prompt or lower max_tokens"),
                     param=named[0] if named else None) from None
    reply = Reply(self, chat, requests, asked.logprobs is not None)
    if asked.stream:
      return StreamingResponse(self.stream(reply, updates, asked.include_usage), media_type="text/event-stream")
    return await self.whole(http, reply, updates)

  async def whole(self, http: HttpRequest, reply: "Reply", updates: asyncio.Queue) -> Response:
    """Waits for every choice; cancels them if the client goes away meanwhile."""
    try:
      while not all(r.done for r in reply.requests):
        try:
          await asyncio.wait_for(updates.get(), timeout=0.5)
        except TimeoutError:
          if await http.is_disconnected():
            return Response(status_code=499)  # nobody reads it: the choices are cancelled below
    finally:
      self.inflight_done(reply)
    return JSONResponse(reply.whole())

  async def stream(self, reply: "Reply", updates: asyncio.Queue, include_usage: bool):
    self.inflight += 1  # the response outlives its handler
    try:
      # Nothing is sent before the first update: every chunk names the checkpoint that answers, known once the
      # request has a slot.
      update = await updates.get()
      events = []
      if reply.chat:
        events.append(reply.sse([reply.chunk(i, {"role": "assistant", "content": ""}, None)
                                 for i in range(len(reply.requests))]))
      unfinished = len(reply.requests)
      told = [0] * len(reply.requests)  # tokens whose logprobs each choice's chunks have carried
      while True:  # until every choice's last update, each read in the order the engine sent them
        request, delta, last, tokens = update
        i = reply.requests.index(request)
        reason = reply.reason(request) if last else None
        unfinished -= last
        if delta or reason:
          logprobs = reply.logprobs(request, told[i], tokens) if reply.wants_logprobs else None
          told[i] = tokens
          events.append(reply.sse([reply.chunk(i, {"content": delta} if reply.chat else delta, reason, logprobs)]))
        if not unfinished:
          break
        if updates.empty():
          # One write for what has arrived (several updates when the loop fell behind): each write is a send on
          # the socket and a pass through the ASGI stack, the event loop's biggest cost at saturation.
          if events:
            yield "".join(events)
            events = []
          update = await updates.get()
        else:
          update = updates.get_nowait()
      if include_usage:
        events.append(reply.sse([], usage=True))
      yield "".join(events) + "data: [DONE]\n\n"  # the last chunks in one write
    finally:
      self.inflight -= 1
      self.inflight_done(reply)

  def hand_over(self, loop, updates: asyncio.Queue, update) -> None:
    """Puts an update into a response's queue on the event loop (from the engine thread). The updates of one engine
    step (one per busy slot) go over in one wake-up of the loop, not one each: a wake-up is a write to the loop's
    pipe, a read and a pass of the loop, for every token of every request."""
    with self.outbox_lock:
      self.outbox.append((updates, update))
      wake = len(self.outbox) == 1
    if wake:
      loop.call_soon_threadsafe(self.deliver)

  def deliver(self) -> None:
    with self.outbox_lock:
      outbox, self.outbox = self.outbox, []
    for updates, update in outbox:
      updates.put_nowait(update)

  @staticmethod
  def inflight_done(reply: "Reply") -> None:
    for r in reply.requests:
      if not r.done:
        r.cancel()


class Reply:
  """The OpenAI response objects for a request's choices."""

  def __init__(self, server: Server, chat: bool, requests: list, wants_logprobs: bool = False):
    self.server, self.chat, self.requests, self.wants_logprobs = server, chat, requests, wants_logprobs
    self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    self.created = int(time.time())

  @property
  def model(self) -> str:
    """RUN@STEP of the checkpoint that answers (every choice's: they are admitted on one)."""
    steps = [r.step for r in self.requests if r.step is not None]
    return self.server.name_at(steps[0]) if steps else self.server.model_name

  @staticmethod
  def reason(request) -> str:
    return "length" if request.finish_reason == "length" else "stop"

  def usage(self) -> dict:
    prompt = sum(len(r.prompt_ids) for r in self.requests)
    completion = sum(len(r.token_ids) for r in self.requests)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

  def token_text(self, token: int) -> str:
    return self.server.engine.gen.tokenizer.decode(np.asarray([token], np.int32))

  def logprobs(self, request, start: int = 0, end: int | None = None, echo: bool = False) -> dict | None:
    """The logprobs object of the request's new tokens [start, end) (every one it drew: the end-of-sequence or stop
    token that ended it too, as vLLM lists it, so that `echo` with max_tokens 1 lists exactly one), with the prompt's
    first when `echo`: OpenAI's completions form (tokens, token_logprobs, top_logprobs as {token: logprob},
    text_offset from `offset`) or chat's (content: [{token, logprob, bytes, top_logprobs}])."""
    if not self.wants_logprobs:
      return None
    end = len(request.token_logprobs) if end is None else end
    ids, chosen, tops = request.token_ids[start:end], request.token_logprobs[start:end], request.top_logprobs[start:end]
    if self.chat:
      entry = lambda t, lp: {"token": (s := self.token_text(t)), "logprob": lp, "bytes": list(s.encode())}
      return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]}
                          for t, lp, top in zip(ids, chosen, tops)]}
    if echo:
      ids = request.prompt_ids + ids
      chosen = request.prompt_logprobs + chosen
      tops = request.prompt_top_logprobs + tops
    texts = [self.token_text(t) for t in ids]
    offsets = np.cumsum([0] + [len(t) for t in texts[:-1]]).tolist() if texts else []
    return {"tokens": texts, "token_logprobs": chosen, "text_offset": offsets,
            "top_logprobs": [None if top is None else {self.token_text(a): v for a, v in top} for top in tops]}

  def whole(self) -> dict:
    if self.chat:
      choices = [{"index": i, "message": {"role": "assistant", "content": r.text}, "logprobs": self.logprobs(r),
                  "finish_reason": self.reason(r)} for i, r in enumerate(self.requests)]
    else:
      decode = self.server.engine.gen.tokenizer.decode
      choices = [{"index": i, "text": (decode(np.asarray(r.prompt_ids, np.int32)) if r.echo else "") + r.text,
                  "logprobs": self.logprobs(r, echo=r.echo), "finish_reason": self.reason(r)}
                 for i, r in enumerate(self.requests)]
    return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
            "model": self.model, "choices": choices, "usage": self.usage()}

  def chunk(self, i: int, delta, reason, logprobs=None) -> dict:
    if self.chat:
      return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    return {"index": i, "text": delta, "logprobs": logprobs, "finish_reason": reason}

  def sse(self, choices: list, usage: bool = False) -> str:
    event = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
             "created": self.created, "model": self.model, "choices": choices}
    if usage:
      event["usage"] = self.usage()
    return f"data: {json.dumps(event)}\n\n"


class DrainingServer(uvicorn.Server):
  """uvicorn's server whose SIGTERM/SIGINT drains first: new requests get 503 while the ones in flight finish
  (up to the grace period), then it stops and `run` returns (no signal re-raised: the process exits 0). A second
  signal stops at once."""

  def __init__(self, config, owner: Server, on_ready=None):
    super().__init__(config)
    self.owner, self.on_ready = owner, on_ready

  def handle_exit(self, sig, frame) -> None:
    if self.owner.draining:
      self.should_exit = True
      return
    self.owner.draining = True
    threading.Thread(target=self.drain, daemon=True).start()

  def drain(self) -> None:
    deadline = time.monotonic() + self.owner.grace_s
    while (self.owner.inflight > 0 or self.owner.engine.busy or self.owner.engine.queued) \
        and time.monotonic() < deadline:
      time.sleep(0.05)
    self.should_exit = True

  async def startup(self, sockets=None) -> None:
    await super().startup(sockets)
    if self.servers:
      port = self.servers[0].sockets[0].getsockname()[1]
      if self.on_ready is not None:
        self.on_ready(port)
      self.owner.listening(port)
