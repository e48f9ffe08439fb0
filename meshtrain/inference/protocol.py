"""The HTTP API's request bodies as pydantic models mirroring OpenAI's schema (and vLLM's extensions), as vLLM's
entrypoints/openai/protocol.py: strict JSON types (no "false" for false, no true for 1, no 1.5 or 1e400 for an
integer, no NaN), bounded numbers, and the field named in every 400 (`parse`). GET /openapi.json is generated from
them (`openapi`), and tests/test_serve_fuzz.py fuzzes every endpoint against it.

What depends on the model (its vocabulary, context, chat template, number of images per request) and fields that
would change the result but are not applied are checked by the server (meshtrain/inference/server.py). Fields not
named here are allowed and ignored: OpenAI's own server ignores what it does not use, and the ones that would change
the output are refused by name there."""
from typing import Annotated, Any

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from meshtrain.inference.dit_request import MAX_STEPS

TOP_LOGPROBS = 20  # engine.TOP_LOGPROBS (the engine needs no pydantic): tests/test_serve_fuzz.py checks they agree
MAX_N = 8
MAX_STOP = 4
# Larger temperatures overflow float32 (1e38: every logit 0, then the sampler drew an id past the tokenizer); 100
# already makes any distribution flat to within 1% of uniform over a logit range of 1.
MAX_TEMPERATURE = 100.0
INT32 = 2**31 - 1

TokenId = Annotated[int, Field(ge=0, le=INT32)]
Float = Annotated[float, Field(allow_inf_nan=False)]


class Body(BaseModel):
  """Strict types; other fields allowed (and ignored unless the server refuses them by name)."""
  model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(Body):
  include_usage: bool = False


class Sampling(Body):
  """What completions and chat completions share."""
  model: str | None = None
  n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
  best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
  temperature: Annotated[Float, Field(ge=0, le=MAX_TEMPERATURE)] = 1.0
  top_p: Annotated[Float, Field(ge=0, le=1)] = 1.0
  top_k: Annotated[int, Field(ge=-1, le=INT32)] = 0
  seed: Annotated[int, Field(ge=-2**63, le=2**63 - 1 - MAX_N)] | None = None
  stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = Field(
      None, description=f"a string or a list of at most {MAX_STOP} strings")
  stream: bool = False
  stream_options: StreamOptions | None = None
  ignore_eos: bool = False
  stop_token_ids: list[TokenId] | None = None
  logit_bias: dict[str, Annotated[Float, Field(ge=-100, le=100)]] | None = None
  presence_penalty: Annotated[Float, Field(ge=-2, le=2)] = 0.0
  frequency_penalty: Annotated[Float, Field(ge=-2, le=2)] = 0.0
  repetition_penalty: Annotated[Float, Field(ge=1e-6, le=100)] = 1.0
  min_tokens: Annotated[int, Field(ge=0, le=INT32)] = 0
  prompt_logprobs: Annotated[int, Field(ge=0, le=TOP_LOGPROBS)] | None = None
  user: str | None = None


class CompletionRequest(Sampling):
  prompt: (Annotated[str, Field(min_length=1)] | Annotated[list[str], Field(min_length=1)]
           | Annotated[list[TokenId], Field(min_length=1)]
           | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]) = Field(
      description="a non-empty string, list of strings, list of token ids or list of lists of token ids")
  max_tokens: Annotated[int, Field(ge=0, le=INT32)] = 16
  logprobs: Annotated[int, Field(ge=0, le=TOP_LOGPROBS)] | None = None
  echo: bool = False
  suffix: str | None = None


class ContentPart(Body):
  type: str = "text"
  text: str | None = None


class Message(Body):
  role: str
  content: str | list[ContentPart] | None = Field(
      None, description='a string or a list of content parts {"type": "text", "text": TEXT}')


class ChatCompletionRequest(Sampling):
  messages: Annotated[list[Message], Field(min_length=1)]
  max_tokens: Annotated[int, Field(ge=1, le=INT32)] | None = None
  max_completion_tokens: Annotated[int, Field(ge=1, le=INT32)] | None = None
  logprobs: bool = False
  top_logprobs: Annotated[int, Field(ge=0, le=TOP_LOGPROBS)] | None = None
  tools: list[dict[str, Any]] | None = None


class ImageGenerationRequest(Body):
  model: str | None = None
  prompt: Annotated[str, Field(max_length=4096)] | Annotated[int, Field(ge=0, le=INT32)] = Field(
      description="the text to draw (text-to-image), or a class id or name (DiT)")
  n: Annotated[int, Field(ge=1, le=MAX_N)] = 1  # the image engine's max_n may be lower
  seed: Annotated[int, Field(ge=0, le=2**32 - 1)] | None = None
  steps: Annotated[int, Field(ge=1, le=MAX_STEPS)] | None = None
  guidance: Annotated[Float, Field(ge=0, le=100)] | None = None
  size: str | None = None
  response_format: str | None = None


class TokenizeRequest(Body):
  model: str | None = None
  prompt: str | None = None
  messages: Annotated[list[Message], Field(min_length=1)] | None = None
  tools: list[dict[str, Any]] | None = None  # with messages: rendered by the chat template, as in chat completions
  add_special_tokens: bool = True


class DetokenizeRequest(Body):
  model: str | None = None
  tokens: list[TokenId]


# POST path -> its body's model.
BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/v1/images/generations": ImageGenerationRequest, "/tokenize": TokenizeRequest,
          "/detokenize": DetokenizeRequest}


class Invalid(ValueError):
  """A body that does not fit its model: `param` the field (its top-level name), `message` what is wrong."""

  def __init__(self, message: str, param: str | None):
    super().__init__(message)
    self.param = param




def parse(model: type[BaseModel], body: dict) -> BaseModel:
  """`body` as `model`; Invalid naming the first field that does not fit, what it must be and what it was."""
  try:
    return model.model_validate(body)
  except pydantic.ValidationError as e:
    errors = e.errors(include_url=False)
    # The deepest mismatch is the one that says most (a union reports one per form, the outer ones first); the
    # union's own tags ("list[str]", "constrained-str") are left out of where it is.
    first = max(errors, key=lambda error: len(error["loc"]))
    loc = [part for part in first["loc"] if isinstance(part, int) or not any(c in part for c in "[]-")
           and part not in ("str", "int", "float", "bool", "dict", "list")]
    top = str(loc[0]) if loc else None
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    # A field of several forms: what it takes (its description) reads better than one form's mismatch.
    fields = model.model_fields if "content" not in loc else Message.model_fields
    field = fields.get("content" if "content" in loc else top)
    form = field.description if field is not None and len(errors) > 1 else None
    what = f"must be {form}" if form else first["msg"]
    raise Invalid(f"{'.'.join(map(str, loc)) or 'the body'}: {what} (got {shown})", top) from None


def openapi(title: str, version: str) -> dict:
  """An OpenAPI 3.1 document of the POST endpoints (their bodies' JSON schemas) and the GET ones."""
  schemas, paths = {}, {}
  for path, model in BODIES.items():
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schema.pop("$defs", {}))
    schemas[model.__name__] = schema
    paths[path] = {"post": {
        "operationId": model.__name__, "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
        "responses": {"200": {"description": "the result"}, "400": {"description": "an invalid request"}}}}
  for path in ("/v1/models", "/health", "/metrics", "/tokenizer_info"):
    paths[path] = {"get": {"operationId": path.strip("/").replace("/", "_"),
                           "responses": {"200": {"description": "the result"}}}}
  return {"openapi": "3.1.0", "info": {"title": title, "version": version}, "paths": paths,
          "components": {"schemas": schemas}}
