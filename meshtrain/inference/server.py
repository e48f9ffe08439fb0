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
import traceback
import uuid

import numpy as np
import prometheus_client as prom
import uvicorn
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from meshtrain.data.chat import ChatTemplate
from meshtrain.errors import UserError
from meshtrain.inference import engine as engine_lib, image_engine, protocol

MAX_BODY_BYTES = 1 << 20
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
  prompt_logprobs: int | None  # vLLM's: each prompt token's logprob, rank and this many alternatives (None: none)
  ignore_eos: bool
  stop_token_ids: tuple[int, ...]
  processing: dict        # logit_bias, presence/frequency/repetition_penalty, min_tokens: engine.Request's fields


# Fields that would change the result and that the engine does not apply: refused (400 naming the field) unless
# they hold their neutral value, never ignored. Those that cannot change the tokens (`user`, `stream_options`
# extras, `metadata`, ...) are ignored as OpenAI's own server ignores what it does not use.
UNSUPPORTED = {"suffix": "", "response_format": None,
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
    # What is compiled (prefill and decode programs, or image samplers): after warming, a request compiles nothing more.
    prom.Gauge("meshtrain_serve_compiled_programs", "programs compiled", registry=r).set_function(
        lambda: engine.compiled_programs)
    self.prompt_tokens = prom.Counter("meshtrain_serve_prompt_tokens", "prompt tokens prefilled", registry=r)
    self.generation_tokens = prom.Counter("meshtrain_serve_generation_tokens", "tokens generated", registry=r)
    self.requests = prom.Counter("meshtrain_serve_requests", "requests finished (one per choice)", ["finish_reason"],
                                 registry=r)
    for reason in engine_lib.FINISH_REASONS:  # each series exported from the start, at 0 (a rate needs its first 0)
      self.requests.labels(reason)
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


def parse(model, body: dict):
  """`body` as its pydantic model (meshtrain/inference/protocol.py); a 400 naming the field otherwise."""
  try:
    return protocol.parse(model, body)
  except protocol.Invalid as e:
    raise ApiError(400, str(e), param=e.param) from None


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
        Route("/v1/images/generations", self.images, methods=["POST"]),
        Route("/openapi.json", self.openapi, methods=["GET"])],
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
        self.engine.warm(stop=self.stop)
        if not self.engine.ready:  # stopped while warming: nothing to serve
          return
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
      self.check_model(http.path_params["model"])
      return JSONResponse(self.model_card())
    return await self.guarded(http, one, counts=False)

  async def tokenize(self, http: HttpRequest) -> Response:
    return await self.guarded(http, self.tokens_of, counts=False)

  async def detokenize(self, http: HttpRequest) -> Response:
    return await self.guarded(http, self.text_of, counts=False)

  async def openapi(self, http: HttpRequest) -> Response:
    """The API's OpenAPI document, from the request models (meshtrain/inference/protocol.py)."""
    return await self.guarded(http, lambda _: JSONResponse(protocol.openapi("meshtrain", self.model_name)),
                              counts=False)

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
                           "programs": self.engine.to_warm}, status_code=503)
    status = 503 if self.draining else 200
    return JSONResponse({"status": "draining" if self.draining else "ok", "busy_slots": self.engine.busy,
                         "queue": self.engine.queued}, status_code=status)

  @property
  def ready(self) -> bool:
    """Whether every program a request can need is compiled (an image engine compiles on first use: always)."""
    return getattr(self.engine, "ready", True)

  def warming(self) -> str:
    return f"{self.engine.warmed} of {self.engine.to_warm} programs compiled"

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
    except Exception:  # a defect of the server, never of the request: its traceback in the log, counted, JSON
      traceback.print_exc()
      self.metrics.rejected.labels("500").inc()
      return ApiError(500, "internal error (the server's log has the traceback)", "server_error").response()

  @staticmethod
  async def body(http: HttpRequest) -> dict:
    if int(http.headers.get("content-length") or 0) > MAX_BODY_BYTES:
      raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    raw = b""
    try:
      async for chunk in http.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
          raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    except ClientDisconnect:  # gone mid-body: nobody reads an answer (499, nginx's "client closed request")
      raise ApiError(499, "the client disconnected before sending the whole body") from None
    try:
      body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ApiError(400, f"the request body is not JSON: {e}") from None
    except RecursionError:  # 1 MiB of "[[[[...": deeper than Python's parser goes
      raise ApiError(400, "the request body is nested too deeply to be a request") from None
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
    req = parse(protocol.TokenizeRequest, body)
    self.check_model(req.model)
    if req.messages is not None:
      [ids] = self.prompts_of(req, chat=True)
    else:
      if req.prompt is None:
        raise ApiError(400, "prompt must be a string (or send messages)", param="prompt")
      gen = self.engine.gen
      ids = gen.tokenizer.encode_with_specials(req.prompt).tolist()
      if gen.add_bos and req.add_special_tokens:
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
    req = parse(protocol.DetokenizeRequest, body)
    self.check_model(req.model)
    tokens, vocab = req.tokens, self.engine.gen.model_cfg.vocab_size
    if any(t >= vocab for t in tokens):
      raise ApiError(400, f"tokens must be a list of token ids 0..{vocab - 1}", param="tokens")
    return JSONResponse({"prompt": self.engine.gen.tokenizer.decode(np.asarray(tokens, np.int32))})

  def check_model(self, model: str | None) -> None:
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
    req = parse(protocol.ImageGenerationRequest, body)
    self.check_model(req.model)
    if req.response_format not in (None, "b64_json"):
      raise ApiError(400, "response_format must be b64_json (the images come back in the response; there are no "
                          "URLs to fetch them from)", param="response_format")
    height, width, _ = self.engine.image_shape
    if req.size not in (None, "auto", f"{width}x{height}"):
      raise ApiError(400, f"size {req.size!r}: this model draws {width}x{height} images", param="size")
    prompts = isinstance(self.engine, image_engine.PromptEngine)
    if prompts and not isinstance(req.prompt, str):
      raise ApiError(400, "prompt must be the text to draw", param="prompt")
    if not prompts and (req.steps is not None or req.guidance is not None):
      raise ApiError(400, "steps and guidance are set per request for text-to-image runs only; this DiT samples with "
                          "its run's", param="steps" if req.steps is not None else "guidance")
    if req.n > self.engine.max_n:
      raise ApiError(400, f"n {req.n} must be between 1 and {self.engine.max_n}", param="n")
    loop = asyncio.get_running_loop()
    finished = asyncio.Event()
    try:
      request = image_engine.ImageRequest(self.engine.condition_of(req.prompt), n=req.n, seed=req.seed,
                                          steps=req.steps, guidance=req.guidance,
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

  def prompts_of(self, req, chat: bool) -> list[list[int]]:
    """The token ids of the request's prompt(s): `messages` rendered by the chat template, or `prompt` (a string,
    a list of strings, a list of ids or a list of lists of ids)."""
    if chat:
      messages = [m.model_dump(exclude_none=True) for m in req.messages]
      for m in messages:
        if isinstance(m.get("content"), list):  # content parts: their text joined
          m["content"] = "".join(p.get("text") or "" for p in m["content"])
      if self.chat is None:
        try:
          self.chat = ChatTemplate.for_workdir(self.workdir)
        except UserError as e:
          raise ApiError(400, str(e).replace(" --messages", " chat messages"), param="messages") from None
      try:
        return [self.chat.encode(self.chat.render(messages, tools=req.tools))]
      except UserError as e:
        raise ApiError(400, f"the chat template refused the conversation: {e}", param="messages") from None
    prompt = req.prompt
    prompt = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    try:
      return [ids.tolist() for ids in self.engine.gen.encode(prompt)]
    except UserError as e:
      raise ApiError(400, str(e), param="prompt") from None

  def asked(self, body: dict, chat: bool) -> Asked:
    if self.makes_images:
      raise ApiError(400, "this server serves a DiT run: use /v1/images/generations")
    req = parse(protocol.ChatCompletionRequest if chat else protocol.CompletionRequest, body)
    self.check_model(req.model)
    for name, neutral in UNSUPPORTED.items():
      if name == "tools" and chat:
        continue  # rendered by the chat template
      value = body.get(name)
      if value is not None and value != neutral and not (name == "response_format" and value == {"type": "text"}):
        raise ApiError(400, f"{name} is not supported by this server, and ignoring it would change the result; "
                            "leave it out", param=name)
    if req.best_of is not None and req.best_of != req.n:
      raise ApiError(400, f"best_of {req.best_of} is not supported (only best_of = n, {req.n}): this server returns "
                          "every choice it samples", param="best_of")
    if chat:
      if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
      logprobs = (req.top_logprobs or 0) if req.logprobs else None
      if body.get("echo") not in (None, False):
        raise ApiError(400, "echo is for /v1/completions; chat completions do not echo the conversation", param="echo")
      echo, max_tokens = False, req.max_completion_tokens or req.max_tokens or self.engine.max_len
    else:
      logprobs, echo, max_tokens = req.logprobs, req.echo, req.max_tokens
      if max_tokens < (0 if echo else 1):
        raise ApiError(400, f"max_tokens {max_tokens} must be at least 1 (0 only with echo, to score the prompt)",
                       param="max_tokens")
    if echo and req.stream:
      raise ApiError(400, "echo with stream is not supported: ask without stream for the prompt's logprobs",
                     param="echo")
    if req.prompt_logprobs is not None and req.stream:  # as vLLM: they come with the whole response only
      raise ApiError(400, "prompt_logprobs with stream is not supported: ask without stream",
                     param="prompt_logprobs")
    vocab = self.engine.gen.model_cfg.vocab_size
    if any(i >= vocab for i in req.stop_token_ids or []):
      raise ApiError(400, f"stop_token_ids must be token ids of the model's vocabulary (0..{vocab - 1})",
                     param="stop_token_ids")
    if not chat and not isinstance(req.prompt, str) and not isinstance(req.prompt[0], str) and any(
        i >= vocab for ids in ([req.prompt] if isinstance(req.prompt[0], int) else req.prompt) for i in ids):
      raise ApiError(400, f"the prompt has a token id outside the model's vocabulary 0..{vocab - 1}", param="prompt")
    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return Asked(self.prompts_of(req, chat), max_tokens, req.temperature, req.top_p, max(req.top_k, 0), req.seed,
                 tuple(s for s in stop if s), req.n, req.stream, include_usage, logprobs, echo, req.prompt_logprobs,
                 req.ignore_eos, tuple(req.stop_token_ids or ()), self.processing_of(req))

  def processing_of(self, req) -> dict:
    """The request's logits processing (engine.Request's fields): logit_bias's keys are token ids as strings."""
    vocab = self.engine.gen.model_cfg.vocab_size
    bias = req.logit_bias or {}
    if len(bias) > engine_lib.MAX_BIAS or not all(key.isascii() and key.isdigit() and len(key) < 10
                                                  and int(key) < vocab for key in bias):
      raise ApiError(400, f"logit_bias must map at most {engine_lib.MAX_BIAS} token ids (0..{vocab - 1}, as "
                          "strings) to biases between -100 and 100", param="logit_bias")
    return {"logit_bias": {int(k): float(v) for k, v in bias.items()}, "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty, "repetition_penalty": req.repetition_penalty,
            "min_tokens": req.min_tokens}

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
                                   logprobs=asked.logprobs, echo=asked.echo or asked.prompt_logprobs is not None,
                                   prompt_top=asked.prompt_logprobs or 0, ignore_eos=asked.ignore_eos,
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
    reply = Reply(self, chat, requests, asked)
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

  def __init__(self, server: Server, chat: bool, requests: list, asked: Asked):
    self.server, self.chat, self.requests, self.asked = server, chat, requests, asked
    self.wants_logprobs = asked.logprobs is not None
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
      tops = [None if t is None else t[:self.asked.logprobs] for t in request.prompt_top_logprobs] + tops
    texts = [self.token_text(t) for t in ids]
    offsets = np.cumsum([0] + [len(t) for t in texts[:-1]]).tolist() if texts else []
    return {"tokens": texts, "token_logprobs": chosen, "text_offset": offsets,
            "top_logprobs": [None if top is None else {self.token_text(a): v for a, v in top} for top in tops]}

  def prompt_logprobs(self, request) -> list:
    """vLLM's prompt_logprobs: per prompt token (None for the first) {id: {logprob, rank, decoded_token}} for the
    token itself and the `prompt_logprobs` most likely (ranks 1, 2, ...; once if the token is one of them)."""
    k = self.asked.prompt_logprobs
    entry = lambda lp, rank, t: {"logprob": lp, "rank": rank, "decoded_token": self.token_text(t)}
    return [None] + [{t: entry(lp, rank, t), **{a: entry(v, j + 1, a) for j, (a, v) in enumerate(top[:k])}}
                     for t, lp, rank, top in zip(request.prompt_ids[1:], request.prompt_logprobs[1:],
                                                 request.prompt_ranks[1:], request.prompt_top_logprobs[1:])]

  def whole(self) -> dict:
    scored = self.asked.prompt_logprobs is not None
    if self.chat:
      choices = [{"index": i, "message": {"role": "assistant", "content": r.text}, "logprobs": self.logprobs(r),
                  "finish_reason": self.reason(r)} for i, r in enumerate(self.requests)]
    else:
      decode = self.server.engine.gen.tokenizer.decode
      echo = self.asked.echo
      choices = [{"index": i, "text": (decode(np.asarray(r.prompt_ids, np.int32)) if echo else "") + r.text,
                  "logprobs": self.logprobs(r, echo=echo), "finish_reason": self.reason(r),
                  **({"prompt_logprobs": self.prompt_logprobs(r)} if scored else {})}
                 for i, r in enumerate(self.requests)]
    out = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion", "created": self.created,
           "model": self.model, "choices": choices, "usage": self.usage()}
    if scored and self.chat:  # vLLM's chat response has them once: every choice shares the conversation
      out["prompt_logprobs"] = self.prompt_logprobs(self.requests[0])
    return out

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
