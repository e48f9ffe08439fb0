"""Chat templates: a conversation rendered and encoded as transformers' `apply_chat_template` renders and encodes it.

  convo = read_conversation("chat.json")           # [{"role", "content"}, ...] or {"messages": [...], "tools": [...]}
  chat = ChatTemplate.for_workdir("runs/qwen")     # the run's template (WORKDIR/tokenizer/), its special tokens
  text = chat.render(convo.messages, tools=convo.tools, add_generation_prompt=True)
  ids = chat.encode(text)                          # special-token strings as their ids, nothing added

Where the template comes from (transformers' rules, checked against transformers in tests/test_chat.py):
`chat_template.jinja` in the tokenizer directory wins over `tokenizer_config.json`'s `chat_template`; that may be
a string or a list of {"name", "template"}, of which "default" is used ("tool_use" when tools are given and it
exists). It is rendered by Jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the
loopcontrols extension and the `{% generation %}` tag, the `tojson` filter that does not escape HTML,
`raise_exception`, `strftime_now`, and the variables `messages`, `tools`, `documents`, `add_generation_prompt` and
the tokenizer's special tokens (`bos_token`, `eos_token`, ... as tokenizer_config.json and special_tokens_map.json
name them; a directory with neither gets those to-hf writes for it). The rendered text is encoded without adding
anything (the template writes BOS where the model wants one), special-token strings becoming their ids unless
tokenizer_config.json says split_special_tokens.

Nothing here imports JAX or jinja2 at import time: `python -m meshtrain.generate` checks a --messages file before
the runtime starts, and jinja2 is imported when a template is compiled.
"""
import contextvars
import dataclasses
import datetime
import functools
import json
import pathlib

import jinja2
import jinja2.ext
import jinja2.sandbox

from meshtrain.data import tokenization as tokenizer_lib
from meshtrain.errors import UserError

# The names transformers always passes as template variables when the tokenizer has them (its
# SPECIAL_TOKENS_ATTRIBUTES); any other `*_token` key of tokenizer_config.json is passed too.
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# transformers' aliases of a message's reasoning: the first present fills `reasoning_content` and `thinking`.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# (rendered blocks, spans) while ChatTemplate.assistant_spans renders; None otherwise (the generation tag's body).
_TRACKING = contextvars.ContextVar("meshtrain_chat_tracking", default=None)
HOW_TO_GIVE_ONE = ("put one into {dir}/chat_template.jinja (a Jinja chat template, as transformers'), or convert a "
                   "model that has one (python -m meshtrain.convert from-hf)")


@dataclasses.dataclass
class Conversation:
  """One --messages file: its messages (dicts with "role" and "content", other keys kept) and tools (or None)."""
  messages: list[dict]
  tools: list[dict] | None = None


def read_conversation(path: str | pathlib.Path) -> Conversation:
  """The conversation in the JSON file `path`: a list of {"role", "content"} messages, or an object
  {"messages": [...], "tools": [...]} (tools: JSON schemas of functions, as transformers takes them). UserError
  naming the file and the entry for anything else."""
  where = f"--messages {path}"
  try:
    data = json.loads(pathlib.Path(path).expanduser().read_text(encoding="utf-8"))
  except OSError as e:
    raise UserError(f"{where}: {e.strerror or e}") from e
  except (ValueError, UnicodeDecodeError) as e:
    raise UserError(f"{where} is not valid JSON ({e}); write a list of {{\"role\": ..., \"content\": ...}} "
                    "messages") from e
  tools = None
  if isinstance(data, dict):
    if "messages" not in data or set(data) - {"messages", "tools"}:
      raise UserError(f"{where}: an object must have \"messages\" (and optionally \"tools\") and nothing else, "
                      f"not {sorted(data)}")
    data, tools = data["messages"], data.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
      raise UserError(f"{where}: \"tools\" must be a list of objects (JSON schemas of functions)")
  if not isinstance(data, list):
    raise UserError(f"{where} must hold a JSON list of {{\"role\": ..., \"content\": ...}} messages, not "
                    f"{type(data).__name__}")
  if not data:
    raise UserError(f"{where} holds no messages")
  messages = []
  for i, message in enumerate(data):
    if not isinstance(message, dict):
      raise UserError(f"{where}: message {i} is {type(message).__name__}, not an object with \"role\" and "
                      "\"content\"")
    message = {k: v for k, v in message.items() if v is not None}  # as transformers: a null key is absent
    if not isinstance(message.get("role"), str):
      raise UserError(f"{where}: message {i} has no \"role\" string (e.g. \"user\")")
    content = message.get("content")
    if not (isinstance(content, str) or (content is None and "tool_calls" in message)):
      got = "no \"content\"" if content is None else f"\"content\" of type {type(content).__name__}"
      raise UserError(f"{where}: message {i} has {got}; it must be a string (only an assistant message with "
                      "\"tool_calls\" may have none)")
    messages.append(message)
  return Conversation(messages, tools)


def with_reasoning_aliases(message: dict) -> dict:
  """transformers' aliasing of a message's reasoning: its first of REASONING_FIELDS also as `reasoning_content`
  (overriding) and `thinking` (unless set)."""
  reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
  if reasoning is None:
    return message
  return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def special_token_strings(directory: pathlib.Path) -> tuple[dict[str, str], bool | None]:
  """({name: token string}, split_special_tokens) as transformers reads them from `directory`'s
  tokenizer_config.json and special_tokens_map.json (which overrides the config's names where the config lists no
  added_tokens_decoder); ({}, None) where neither file exists."""
  files = {}
  for name in ("tokenizer_config.json", "special_tokens_map.json"):
    try:
      files[name] = json.loads((directory / name).read_text(encoding="utf-8"))
    except FileNotFoundError:
      continue
    except (OSError, ValueError) as e:
      raise UserError(f"cannot read {str(directory / name)!r}: {e}") from e
  if not files:
    return {}, None
  config = dict(files.get("tokenizer_config.json") or {})
  if "added_tokens_decoder" not in config:
    config.update(files.get("special_tokens_map.json") or {})
  extra = config.get("extra_special_tokens")
  named = {**config, **(extra if isinstance(extra, dict) else {})}
  out = {}
  for key, value in named.items():
    if isinstance(value, dict):  # an AddedToken: {"content": ..., "lstrip": ...}
      value = value.get("content")
    if (key in SPECIAL_TOKEN_KEYS or key.endswith("_token")) and isinstance(value, str):
      out[key] = value
  return out, bool(config.get("split_special_tokens", False))


@dataclasses.dataclass
class ChatTemplate:
  """A tokenizer's chat template(s), its special-token variables, and how its rendered text is encoded."""
  templates: str | dict[str, str]  # one template, or several by name (tokenizer_config.json's list form)
  special_tokens: dict[str, str]
  tokenizer: object  # meshtrain.data.tokenization.Tokenizer
  split_special_tokens: bool = False
  source: str = ""  # where the template was read, for messages

  @classmethod
  def from_directory(cls, directory, tokenizer) -> "ChatTemplate | None":
    """The template of the tokenizer files in `directory` (None if there is none), for `tokenizer` (theirs)."""
    directory = pathlib.Path(directory)
    templates = tokenizer_lib.chat_template(directory)
    if templates is None:
      return None
    specials, split = special_token_strings(directory)
    if split is None:  # no tokenizer_config.json: what to-hf writes for this tokenizer
      specials = tokenizer.special_tokens()
      split = tokenizer.kind == "sentencepiece"  # meshtrain's export encodes SentencePiece specials as text
    source = directory / tokenizer_lib.CHAT_TEMPLATE_FILE
    if not source.is_file():
      source = directory / tokenizer_lib.CONFIG_FILE
    return cls(templates, specials, tokenizer, split, str(source))

  @classmethod
  def for_workdir(cls, workdir) -> "ChatTemplate":
    """The template that travels with the run in `workdir` (WORKDIR/tokenizer/), for its tokenizer; UserError
    saying how to give one where there is none."""
    directory = pathlib.Path(workdir) / tokenizer_lib.WORKDIR_SUBDIR
    chat = cls.from_directory(directory, tokenizer_lib.from_workdir(workdir))
    if chat is None:
      raise UserError(f"{workdir} has no chat template to render --messages with (no tokenizer/chat_template.jinja, "
                      "no chat_template in tokenizer/tokenizer_config.json); " + HOW_TO_GIVE_ONE.format(dir=directory))
    return chat

  def template(self, tools=None) -> str:
    """The template used: the one, or of several the "tool_use" one when tools are given, else "default"."""
    if isinstance(self.templates, str):
      return self.templates
    if tools is not None and "tool_use" in self.templates:
      return self.templates["tool_use"]
    if "default" in self.templates:
      return self.templates["default"]
    raise UserError(f"{self.source} has several chat templates ({', '.join(sorted(self.templates))}) and none named "
                    "default; name one of them default")

  def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
             **variables) -> str:
    """The conversation as text, as transformers renders it; UserError for a template that raises (its
    raise_exception message), does not compile, or fails on this conversation (e.g. adds a string to a number)."""
    return self._render(messages, tools, add_generation_prompt, variables, None)

  def _render(self, messages, tools, add_generation_prompt, variables, generation_spans: list | None) -> str:
    """render(); with `generation_spans` a list, the [start, end) of each `{% generation %}` block's text in the
    result are appended to it (transformers' AssistantTracker)."""
    messages = [with_reasoning_aliases({k: v for k, v in m.items() if v is not None}) for m in messages]
    try:
      template = compile_template(self.template(tools))
      values = dict(messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
                    **{**self.special_tokens, **variables})
      if generation_spans is None:
        return template.render(**values)
      blocks = []
      token = _TRACKING.set((blocks, generation_spans))
      try:
        blocks.extend(template.generate(**values))  # generate(): the blocks so far are what a span's start counts
      finally:
        _TRACKING.reset(token)
      return "".join(blocks)
    except jinja2.TemplateError as e:
      raise UserError(f"the chat template ({self.source}) refused the conversation: "
                      f"{type(e).__name__ + ': ' if type(e) is not jinja2.TemplateError else ''}{e}") from e
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as e:
      raise UserError(f"the chat template ({self.source}) failed on the conversation: {type(e).__name__}: "
                      f"{e}") from e

  def assistant_spans(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """(the whole conversation rendered, [start, end) of each stretch of it the assistant wrote): what a chat
    fine-tune trains on. A template that marks them with `{% generation %}` says where they are (transformers'
    return_assistant_tokens_mask reads the same marks); otherwise assistant message k spans from the end of the
    conversation before it rendered with the generation prompt to the end of the conversation through it, the
    turn's closing tokens included (so the model learns to end its turn). UserError when the template does not
    render conversations that way (an earlier turn rendered differently once later turns follow)."""
    spans = []
    text = self._render(messages, tools, False, {}, spans)
    if spans:
      return text, [tuple(span) for span in spans]
    for k, message in enumerate(messages):
      if message.get("role") != "assistant":
        continue
      before = self._render(messages[:k], tools, True, {}, None)
      through = self._render(messages[:k + 1], tools, False, {}, None)
      if not (text.startswith(through) and through.startswith(before)):
        raise UserError(f"the chat template ({self.source}) renders the conversation up to assistant message {k} "
                        "differently once later messages follow, so the assistant's text cannot be located; add "
                        "{% generation %}...{% endgeneration %} around the assistant's content in the template (as "
                        "transformers' return_assistant_tokens_mask requires)")
      spans.append((len(before), len(through)))
    return text, spans

  def encode_masked(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """(ids of `text` as encode() gives them, whether each token overlaps one of `spans`): transformers'
    assistant mask, found without token offsets by encoding the text before each span boundary (a token that
    straddles a boundary overlaps the span, as in transformers)."""
    ids = self.encode(text)
    mask = [False] * len(ids)
    for start, end in spans:
      first = self._tokens_before(ids, text[:start], straddling=False)
      last = self._tokens_before(ids, text[:end], straddling=True)
      mask[first:last] = [True] * (last - first)
    return ids, mask

  def _tokens_before(self, ids: list[int], prefix: str, straddling: bool) -> int:
    """How many leading tokens of `ids` lie within `prefix` (its length in tokens where it ends at a token
    boundary); where a token straddles the prefix's end, it counts when `straddling`."""
    head = self.encode(prefix)
    common = next((i for i, (a, b) in enumerate(zip(head, ids)) if a != b), min(len(head), len(ids)))
    return common if common == len(head) or not straddling else common + 1

  def encode(self, text: str) -> list[int]:
    """Token ids of rendered text, as transformers' apply_chat_template(tokenize=True): nothing added, special-token
    strings as their ids (as text with split_special_tokens)."""
    if self.split_special_tokens:
      return self.tokenizer.encode(text).tolist()
    return self.tokenizer.encode_with_specials(text).tolist()


@functools.lru_cache(maxsize=8)
def compile_template(source: str):
  """`source` compiled in the environment transformers renders chat templates in (see the module docstring)."""

  class GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks the assistant's tokens in transformers' masks): its body."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      text = caller()
      tracking = _TRACKING.get()
      if tracking is not None:  # ChatTemplate.assistant_spans is rendering: note where this block's text lies
        blocks, spans = tracking
        start = len("".join(blocks))
        spans.append((start, start + len(text)))
      return text

  class Namespace(jinja2.utils.Namespace):
    """namespace() refusing underscore attributes, as transformers' sandbox does."""

    def __init__(*args, **kwargs):  # pylint: disable=no-method-argument  # Jinja's own signature trick
      self, attrs = args[0], dict(*args[1:], **kwargs)
      for name in attrs:
        Namespace.check(name)
      jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
      Namespace.check(name)
      jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check(name):
      if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")

  class Dict:
    """dict() and dict.fromkeys() without the dict type itself."""

    def __call__(self, *args, **kwargs):
      return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
      return dict.fromkeys(*args, **kwargs)

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                     extensions=[GenerationTag, jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.datetime.now().strftime(f),
                     dict=Dict(), namespace=Namespace)
  return env.from_string(source)


def conversation_prompts(workdir, paths: list[str], add_generation_prompt: bool = True) -> list[list[int]]:
  """Token ids of each --messages file's conversation rendered by the run's chat template: the prompts of
  `python -m meshtrain.generate --messages`. The files are read and checked before the template is looked for."""
  conversations = [read_conversation(p) for p in paths]
  chat = ChatTemplate.for_workdir(workdir)
  prompts = []
  for path, convo in zip(paths, conversations):
    try:
      text = chat.render(convo.messages, tools=convo.tools, add_generation_prompt=add_generation_prompt)
    except UserError as e:
      raise UserError(f"--messages {path}: {e}") from e
    prompts.append(chat.encode(text))
  return prompts
