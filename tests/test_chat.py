"""Chat templates against the real client: meshtrain renders and encodes a conversation as transformers'
`apply_chat_template` does, the template travels with the run (from-hf, training, to-hf), and `python -m
meshtrain.generate --messages` prompts with it.

The templates in tests/chat_templates/ are the published ones of Qwen2.5-Instruct, Llama-3.2-Instruct,
Mistral-7B-Instruct (v0.1/v0.2) and Gemma-it (their tokenizer_config.json's chat_template), each with a tokenizer
trained here that has the family's special tokens: nothing is downloaded.

Needs transformers and torch (the `hf` extra), as tests/test_convert.py: MESHTRAIN_SKIP_HF_TESTS=1 skips it on
purpose, otherwise a missing transformers fails the import.
"""
import json
import os
import pathlib
import shutil

import pytest

try:
  import torch
  import transformers
except ImportError as e:
  if os.environ.get("MESHTRAIN_SKIP_HF_TESTS") == "1":
    pytest.skip("MESHTRAIN_SKIP_HF_TESTS=1: Hugging Face chat template tests skipped", allow_module_level=True)
  raise ImportError(f"tests/test_chat.py checks chat templates against transformers ({e}); install it with pip "
                    "install -e '.[test,hf]', or set MESHTRAIN_SKIP_HF_TESTS=1 to skip these tests knowingly") from e

from meshtrain.runtime import startup
from meshtrain.cli import convert, generate
from meshtrain.data import chat, tokenization as tokenizer_lib
from meshtrain.errors import UserError
from meshtrain.interop import hf_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]
TEMPLATES = REPO / "tests" / "chat_templates"
QWEN2_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
               r"""\s+(?!\S)|\s+""")

# The families: their specials (ids 0.. in this order), tokenizer_config.json as the hub has it, the template.
FAMILIES = {
    "qwen2.5": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
                 "pad_token": "<|endoftext|>", "unk_token": None, "split_special_tokens": False,
                 "errors": "replace", "model_max_length": 131072}, "qwen2.5-instruct.jinja"),
    # Qwen3's hybrid-thinking template: <think> blocks kept only after the last user query, reasoning_content,
    # messages[::-1] with a namespace, enable_thinking.
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
               "<tool_response>", "</tool_response>"],
              {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
               "pad_token": "<|endoftext|>", "unk_token": None, "split_special_tokens": False,
               "errors": "replace", "model_max_length": 131072}, "qwen3.jinja"),
    "llama-3.2": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                   "<|eom_id|>", "<|python_tag|>"],
                  {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
                   "eos_token": "<|eot_id|>", "model_max_length": 131072}, "llama-3.2-instruct.jinja"),
    "mistral": (["<unk>", "<s>", "</s>"],
                {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                 "unk_token": "<unk>", "pad_token": None}, "mistral-7b-instruct.jinja"),
    "gemma": (["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
              {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
               "pad_token": "<pad>", "unk_token": "<unk>"}, "gemma-it.jinja"),
}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather at a place, now: \"<b>\" & ünïcödé",
    "parameters": {"type": "object", "properties": {"place": {"type": "string", "description": "a city"}},
                   "required": ["place"]}}}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "  You answer in one line.  "}, {"role": "user", "content": "def main():\n    pass"},
     {"role": "assistant", "content": "A function that does nothing."}, {"role": "user", "content": "ünïcödé ✓ 日本"}],
    # Special-token strings typed inside a message are matched as specials, as transformers does by default.
    [{"role": "user", "content": "spell <|im_end|> and <|eot_id|> and </s> and <end_of_turn>"},
     {"role": "assistant", "content": " two  spaces\t"}, {"role": "user", "content": "\n"}],
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                          "arguments": {"place": "Paris"}}}]},
    {"role": "tool", "content": "{\"temperature\": 21}"},
]


def corpus():
  lines = [line for f in sorted((REPO / "meshtrain").glob("*.py")) for line in f.read_text().splitlines() if line]
  return lines[:1500] + ["You are a helpful assistant.", "system user assistant model", "ünïcödé ✓ 日本語"]


def train_tokenizer(directory: pathlib.Path, specials: list[str], qwen_style: bool = False,
                    vocab_size: int = 600) -> pathlib.Path:
  """A byte-level BPE with `specials` as ids 0.., trained on meshtrain's source; Qwen2's pre-tokenization (what
  transformers' Qwen2Tokenizer rebuilds the tokenizer with) when qwen_style, else GPT-2's."""
  import tokenizers
  from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  if qwen_style:
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(QWEN2_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  else:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(corpus(), trainer)
  directory.mkdir(parents=True, exist_ok=True)
  tok.save(str(directory / "tokenizer.json"))
  return directory


def family_dir(root: pathlib.Path, family: str, jinja_file: bool = False) -> pathlib.Path:
  """A tokenizer directory of `family` as the hub ships it: tokenizer.json, tokenizer_config.json with the chat
  template (or, jinja_file, the template in chat_template.jinja beside it)."""
  specials, config, template = FAMILIES[family]
  directory = train_tokenizer(root / family, specials, qwen_style=family.startswith("qwen"))
  config = dict(config, added_tokens_decoder={
      str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
               "special": True} for i, s in enumerate(specials)})
  text = (TEMPLATES / template).read_text()
  if jinja_file:
    (directory / "chat_template.jinja").write_text(text)
  else:
    config["chat_template"] = text
  (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
  return directory


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
  root = tmp_path_factory.mktemp("families")
  return {f: family_dir(root, f, jinja_file=f == "gemma") for f in FAMILIES}


def ours(directory) -> chat.ChatTemplate:
  return chat.ChatTemplate.from_directory(directory, tokenizer_lib.load(directory))


def theirs(directory):
  return transformers.AutoTokenizer.from_pretrained(directory)


def assert_same(directory, messages, add_generation_prompt, tools=None):
  mine, hf = ours(directory), theirs(directory)
  text = mine.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)
  expected = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    tokenize=False)
  assert text == expected
  ids = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True,
                               return_dict=False)
  assert mine.encode(text) == ids
  return text, ids


# --- rendering and encoding, as transformers ---


@pytest.mark.parametrize("family", ["qwen2.5", "llama-3.2", "gemma"])
def test_conversations_render_and_encode_as_transformers(dirs, family):
  for messages in CONVERSATIONS:
    if family == "gemma":  # Gemma's template refuses a system message, and needs alternating roles
      messages = [m for m in messages if m["role"] != "system"][:2 if len(messages) > 2 else None]
    for add_generation_prompt in (True, False):
      text, ids = assert_same(dirs[family], messages, add_generation_prompt)
      specials = FAMILIES[family][0]
      # The template's own special tokens became their ids (ids 0..): encoding them as text would fail here.
      assert sum(i < len(specials) for i in ids) >= 2, (family, text)
  if family == "llama-3.2":
    assert text.startswith("<|begin_of_text|><|start_header_id|>system") and ids[0] == 0


def test_qwen_and_llama_tools_branches_render_as_transformers(dirs):
  text, _ = assert_same(dirs["qwen2.5"], TOOL_CONVERSATION, True, tools=[WEATHER_TOOL])
  assert "<tools>\n{\"type\": \"function\"" in text and "ünïcödé" in text and "<tool_response>" in text
  assert '"arguments": {"place": "Paris"}' in text  # tojson: no HTML escaping, ensure_ascii off
  text, _ = assert_same(dirs["llama-3.2"], TOOL_CONVERSATION[:1], True, tools=[WEATHER_TOOL])
  assert "Environment: ipython" in text and '{\n    "type": "function"' in text  # tojson(indent=4)
  assert_same(dirs["llama-3.2"], TOOL_CONVERSATION, False, tools=[WEATHER_TOOL])


def test_qwen3_thinking_template_renders_as_transformers(dirs):
  """<think> blocks: split out of an assistant's content or given as reasoning_content, kept only after the last
  user query; tool responses; enable_thinking=false's empty think block."""
  thinking = [{"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
              {"role": "user", "content": "and 3+3?"},
              {"role": "assistant", "content": "6", "reasoning_content": "again"}]
  for add_generation_prompt in (True, False):
    text, _ = assert_same(dirs["qwen3"], thinking, add_generation_prompt)
    assert "add them" not in text and "<think>\nagain\n</think>\n\n6" in text
    text, _ = assert_same(dirs["qwen3"], thinking[:3], add_generation_prompt)
  assert_same(dirs["qwen3"], TOOL_CONVERSATION, True, tools=[WEATHER_TOOL])
  mine, hf = ours(dirs["qwen3"]), theirs(dirs["qwen3"])
  text = mine.render(thinking[:1], enable_thinking=False)
  assert text == hf.apply_chat_template(thinking[:1], add_generation_prompt=True, enable_thinking=False,
                                        tokenize=False)
  assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_mistral_template_and_its_raise_exception(dirs):
  assert_same(dirs["mistral"], [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                {"role": "user", "content": "c"}], True)
  bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
  with pytest.raises(Exception, match="Conversation roles must alternate") as theirs_error:
    theirs(dirs["mistral"]).apply_chat_template(bad, tokenize=False)
  assert type(theirs_error.value).__name__ == "TemplateError"
  with pytest.raises(UserError, match=r"refused the conversation: Conversation roles must alternate "
                                      r"user/assistant/user/assistant/\.\.\.$"):
    ours(dirs["mistral"]).render(bad)
  with pytest.raises(UserError, match="Only user and assistant roles are supported!"):
    ours(dirs["mistral"]).render([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}])
  # A template that fails on a conversation (here a string plus a number) is one line too, not a traceback.
  broken = chat.ChatTemplate("{{ messages[0].content + 1 }}", {}, tokenizer_lib.ByteTokenizer(), source="t.jinja")
  with pytest.raises(UserError, match=r"^the chat template \(t.jinja\) failed on the conversation: TypeError"):
    broken.render([{"role": "user", "content": "x"}])
  with pytest.raises(UserError, match=r"^the chat template \(t.jinja\) refused the conversation: "
                                      r"TemplateSyntaxError: "):
    chat.ChatTemplate("{% if %}", {}, tokenizer_lib.ByteTokenizer(), source="t.jinja").render([])


def test_chat_template_jinja_wins_over_tokenizer_config(dirs, tmp_path):
  directory = tmp_path / "both"
  shutil.copytree(dirs["gemma"], directory)
  config = json.loads((directory / "tokenizer_config.json").read_text())
  config["chat_template"] = "{{ 'from the config' }}"
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  assert theirs(directory).chat_template == (directory / "chat_template.jinja").read_text()
  text, _ = assert_same(directory, [{"role": "user", "content": "hi"}], True)
  assert text == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
  (directory / "chat_template.jinja").unlink()
  assert assert_same(directory, [{"role": "user", "content": "hi"}], True)[0] == "from the config"


def test_named_templates_default_and_tool_use(dirs, tmp_path):
  directory = tmp_path / "named"
  shutil.copytree(dirs["llama-3.2"], directory)
  config = json.loads((directory / "tokenizer_config.json").read_text())
  config["chat_template"] = [{"name": "default", "template": "D{{ messages | length }}"},
                             {"name": "tool_use", "template": "T{{ tools | length }}"}]
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  hi = [{"role": "user", "content": "hi"}]
  assert assert_same(directory, hi, True)[0] == "D1"
  assert assert_same(directory, hi, True, tools=[WEATHER_TOOL])[0] == "T1"
  config["chat_template"] = config["chat_template"][1:]
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  with pytest.raises(UserError, match="several chat templates \\(tool_use\\) and none named default"):
    ours(directory).render(hi)


def test_special_token_variables_as_transformers_reads_them(dirs, tmp_path):
  directory = tmp_path / "variables"
  shutil.copytree(dirs["mistral"], directory)
  template = "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token }}|{{ image_token }}|{{ x_token }}"
  config = json.loads((directory / "tokenizer_config.json").read_text())
  config.update(chat_template=template, image_token="<unk>", extra_special_tokens={"x_token": "<s>"})
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  hi = [{"role": "user", "content": "hi"}]
  assert assert_same(directory, hi, True)[0] == "<s>|</s>|<unk>||<unk>|<s>"
  # Without added_tokens_decoder, special_tokens_map.json overrides the config's names (transformers' legacy path).
  del config["added_tokens_decoder"]
  (directory / "tokenizer_config.json").write_text(json.dumps(config))
  (directory / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<s>", "lstrip": False},
                                                                  "pad_token": "</s>"}))
  assert assert_same(directory, hi, True)[0] == "<s>|<s>|<unk>|</s>|<unk>|<s>"


FEATURES_TEMPLATE = """
{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}
  {%- if loop.index > 3 %}{% break %}{% endif -%}
  {%- if m.role == 'skip' %}{% continue %}{% endif -%}
  {%- set ns.n = ns.n + 1 %}
  {% generation %}{{ m.role }}:{{ m.content }}|{{ m.thinking }}|{{ m.reasoning_content }}{% endgeneration %}
{% endfor %}
{{ ns.n }}|{{ dict(a=1, b='<&>') | tojson }}|{{ {'k': 'ü'} | tojson(indent=2) }}|{{ strftime_now('%Y') }}
{%- if add_generation_prompt %}>{% endif %}"""


def test_template_features_as_transformers(dirs, tmp_path):
  # Whitespace control (trim_blocks, lstrip_blocks), loop controls, namespace, dict(), the tojson filter, the
  # {% generation %} tag, strftime_now, and the reasoning aliases of a message.
  directory = tmp_path / "features"
  shutil.copytree(dirs["mistral"], directory)
  (directory / "chat_template.jinja").write_text(FEATURES_TEMPLATE)
  messages = [{"role": "user", "content": "a", "reasoning": "r1"}, {"role": "skip", "content": "b"},
              {"role": "assistant", "content": "c", "thinking": "t", "reasoning_content": "r2"},
              {"role": "user", "content": "d"}]
  text, _ = assert_same(directory, messages, True)
  assert text.startswith('user:a|r1|r1assistant:c|t|r22|{"a": 1, "b": "<&>"}|{\n  "k": "ü"\n}|2') and text[-1] == ">"
  (directory / "chat_template.jinja").write_text("{% set ns = namespace(_private=1) %}")
  with pytest.raises(Exception, match="underscore"):
    theirs(directory).apply_chat_template(messages, tokenize=False)
  with pytest.raises(UserError, match="SecurityError: .*underscore"):
    ours(directory).render(messages)


def test_split_special_tokens_encodes_them_as_text(dirs, tmp_path):
  directory = tmp_path / "split"
  shutil.copytree(dirs["llama-3.2"], directory)
  config = json.loads((directory / "tokenizer_config.json").read_text())
  (directory / "tokenizer_config.json").write_text(json.dumps(dict(config, split_special_tokens=True)))
  _, ids = assert_same(directory, CONVERSATIONS[0], True)
  assert not set(ids) & set(range(len(FAMILIES["llama-3.2"][0])))


def sentencepiece_dir(directory: pathlib.Path, template: str) -> pathlib.Path:
  """A SentencePiece model (BPE, byte fallback; no tokenizer.json) with a tokenizer_config.json holding `template`."""
  import io

  import sentencepiece as spm
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus()), model_writer=model, vocab_size=400,
                                 model_type="bpe", byte_fallback=True, minloglevel=2)
  directory.mkdir(parents=True)
  (directory / "tokenizer.model").write_bytes(model.getvalue())
  (directory / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast", "legacy": True, "bos_token": "<s>", "eos_token": "</s>",
       "unk_token": "<unk>", "chat_template": template}))
  return directory


def test_byte_and_sentencepiece_tokenizers_encode_a_chat_as_transformers(tmp_path):
  template = (TEMPLATES / "mistral-7b-instruct.jinja").read_text()
  messages = [{"role": "user", "content": "x <s> y"}, {"role": "assistant", "content": " b"},
              {"role": "user", "content": "ünï</s>"}]
  # Bytes: the tokenizer.json to-hf writes for them, specials <pad> <eos> <bos>.
  byte_dir = tmp_path / "byte"
  byte_dir.mkdir()
  (byte_dir / "tokenizer.json").write_text(hf_tokenizer.byte_tokenizer_json())
  (byte_dir / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer_lib.BYTE_SPECIAL_TOKENS, "chat_template":
       template.replace("[INST]", "<eos>[INST]")}))
  mine = chat.ChatTemplate.from_directory(byte_dir, tokenizer_lib.ByteTokenizer())
  hf = theirs(byte_dir)
  text = mine.render(messages)
  assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert mine.encode(text) == hf.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
  assert mine.encode(text)[:2] == [tokenizer_lib.BOS_ID, tokenizer_lib.EOS_ID]
  # SentencePiece (no tokenizer.json): transformers' PreTrainedTokenizerFast built from the model matches the
  # control pieces and <unk>, and encodes the text between them as SentencePiece encodes it alone.
  sp_dir = sentencepiece_dir(tmp_path / "sp", template)
  mine = chat.ChatTemplate.from_directory(sp_dir, tokenizer_lib.load(sp_dir))
  text = mine.render(messages)
  expected = theirs(sp_dir).apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
  assert mine.encode(text) == expected and expected[0] == 1 and expected.count(2) >= 2


# --- the --messages file ---


@pytest.mark.parametrize("content, message", [
    (None, "No such file or directory"),
    ("[{\"role\": \"user\", ", "is not valid JSON"),
    ("{\"role\": \"user\", \"content\": \"hi\"}", "an object must have \"messages\""),
    ("\"hi\"", "must hold a JSON list of"),
    ("[]", "holds no messages"),
    ("[\"hi\"]", "message 0 is str, not an object"),
    ("[{\"content\": \"hi\"}]", "message 0 has no \"role\" string"),
    ("[{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"user\"}]", "message 1 has no \"content\""),
    ("[{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"hi\"}]}]",
     "message 0 has \"content\" of type list; it must be a string"),
    ("{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}], \"tools\": \"x\"}", "\"tools\" must be a list"),
])
def test_bad_messages_files_are_refused(tmp_path, content, message):
  path = tmp_path / "chat.json"
  if content is not None:
    path.write_text(content)
  with pytest.raises(UserError, match=f"^--messages {path}.*{message}"):
    chat.read_conversation(path)


def test_messages_file_forms(tmp_path):
  (tmp_path / "a.json").write_text(json.dumps([{"role": "user", "content": "hi", "name": None}]))
  assert chat.read_conversation(tmp_path / "a.json") == chat.Conversation([{"role": "user", "content": "hi"}])
  (tmp_path / "b.json").write_text(json.dumps({"messages": TOOL_CONVERSATION, "tools": [WEATHER_TOOL]}))
  assert chat.read_conversation(tmp_path / "b.json") == chat.Conversation(TOOL_CONVERSATION, [WEATHER_TOOL])


# --- the template travels with the run; generate --messages ---


def run_generate(argv: list[str]) -> int:
  """python -m meshtrain.generate in this process (the test session's 8 CPU devices)."""
  return generate.main([*argv, "--config.cpu_devices=8"])


def make_hf_model(path: pathlib.Path, tokenizer_dir: pathlib.Path, vocab: int) -> pathlib.Path:
  """A tiny random LlamaForCausalLM saved by transformers, with the tokenizer files of `tokenizer_dir`."""
  cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 tie_word_embeddings=True)
  torch.manual_seed(0)
  transformers.LlamaForCausalLM(cfg).save_pretrained(path)
  for f in tokenizer_dir.iterdir():
    shutil.copyfile(f, path / f.name)
  return path


@pytest.fixture(scope="module")
def converted(dirs, tmp_path_factory):
  """from-hf of a tiny Llama with Llama 3.2's tokenizer files and chat template."""
  root = tmp_path_factory.mktemp("converted")
  hf = make_hf_model(root / "hf", dirs["llama-3.2"], vocab=640)
  assert convert.main(["from-hf", str(hf), "--workdir", str(root / "w")]) == 0
  return root


def test_generate_messages_prompt_ids_equal_transformers(converted, tmp_path, capsys):
  hf, workdir = converted / "hf", converted / "w"
  assert json.loads((workdir / "tokenizer" / "tokenizer_config.json").read_text())["chat_template"] == \
      theirs(hf).chat_template
  files = []
  for i, messages in enumerate(CONVERSATIONS[:2]):
    files += ["--messages", str(tmp_path / f"chat{i}.json")]
    (tmp_path / f"chat{i}.json").write_text(json.dumps(messages))
  assert run_generate(["--workdir", str(workdir), *files, "--json", "--max-new-tokens", "3"]) == 0
  out = json.loads(capsys.readouterr().out)
  expected = [theirs(hf).apply_chat_template(m, add_generation_prompt=True, return_dict=False)
              for m in CONVERSATIONS[:2]]
  assert out["prompt_ids"] == expected and expected[0][0] == 0
  assert len(out["token_ids"]) == 2 and all(1 <= len(t) <= 3 for t in out["token_ids"])
  # Text prompts report their ids too: a converted model's get its BOS in front.
  assert run_generate(["--workdir", str(workdir), "--prompt", "def main(", "--json", "--max-new-tokens", "2"]) == 0
  ids = json.loads(capsys.readouterr().out)["prompt_ids"]
  assert ids == [[0] + theirs(hf).encode("def main(", add_special_tokens=False)]
  # Ids as given; an empty prompt starts after an end-of-sequence token (<|eot_id|>, 4).
  assert run_generate(["--workdir", str(workdir), "--prompt-ids", "7,8", "--prompt", "", "--json",
                        "--max-new-tokens", "1"]) == 2  # one kind of prompt at a time
  capsys.readouterr()
  assert run_generate(["--workdir", str(workdir), "--prompt-ids", "7,8", "--prompt-ids", "", "--json",
                        "--max-new-tokens", "1"]) == 0
  assert json.loads(capsys.readouterr().out)["prompt_ids"] == [[7, 8], [4]]


def test_to_hf_keeps_the_template(converted, tmp_path):
  assert convert.main(["to-hf", "--workdir", str(converted / "w"), "--out", str(tmp_path / "out")]) == 0
  assert theirs(tmp_path / "out").chat_template == theirs(converted / "hf").chat_template


def test_template_in_a_jinja_file_travels_from_hf_and_back(dirs, tmp_path, capsys):
  hf = make_hf_model(tmp_path / "hf", dirs["gemma"], vocab=640)
  assert convert.main(["from-hf", str(hf), "--workdir", str(tmp_path / "w")]) == 0
  assert (tmp_path / "w" / "tokenizer" / "chat_template.jinja").read_text() == (hf / "chat_template.jinja").read_text()
  assert convert.main(["to-hf", "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "out")]) == 0
  assert theirs(tmp_path / "out").chat_template == (hf / "chat_template.jinja").read_text()
  (tmp_path / "chat.json").write_text(json.dumps([{"role": "user", "content": "hi"}]))
  capsys.readouterr()
  assert run_generate(["--workdir", str(tmp_path / "w"), "--messages", str(tmp_path / "chat.json"), "--json",
                        "--max-new-tokens", "1"]) == 0
  expected = theirs(tmp_path / "out").apply_chat_template([{"role": "user", "content": "hi"}],
                                                         add_generation_prompt=True, return_dict=False)
  assert json.loads(capsys.readouterr().out)["prompt_ids"] == [expected]


def test_a_training_run_carries_its_tokenizers_template(dirs, tmp_path):
  # data.tokenizer=DIR (as train's save_to_workdir copies it): the config (with its template) travels; a
  # chat_template.jinja beside the tokenizer too; a SentencePiece model's config template as chat_template.jinja.
  for family in ("qwen2.5", "gemma"):
    workdir = tmp_path / family
    tok = tokenizer_lib.load(dirs[family])
    tokenizer_lib.save_to_workdir(tok, workdir)
    assert tokenizer_lib.chat_template(workdir / "tokenizer") == theirs(dirs[family]).chat_template
    (tmp_path / f"{family}_out").mkdir()
    hf_tokenizer.write_tokenizer(tmp_path / f"{family}_out", tokenizer_lib.from_workdir(workdir), workdir, 64)
    assert theirs(tmp_path / f"{family}_out").chat_template == theirs(dirs[family]).chat_template
  # data.tokenizer=x.model: the template of the tokenizer_config.json beside it travels as chat_template.jinja (the
  # run keeps the model alone, and to-hf writes its own tokenizer_config.json for it).
  sp_dir = sentencepiece_dir(tmp_path / "sp", (TEMPLATES / "mistral-7b-instruct.jinja").read_text())
  workdir = tmp_path / "sp_run"
  tokenizer_lib.save_to_workdir(tokenizer_lib.load(sp_dir / "tokenizer.model"), workdir)
  assert sorted(p.name for p in (workdir / "tokenizer").iterdir()) == ["chat_template.jinja", "tokenizer.model"]
  (tmp_path / "sp_out").mkdir()
  hf_tokenizer.write_tokenizer(tmp_path / "sp_out", tokenizer_lib.from_workdir(workdir), workdir, 64)
  assert theirs(tmp_path / "sp_out").chat_template == theirs(sp_dir).chat_template
  # Rendered with the specials the export names, encoded as the export's tokenizer encodes (specials as text there:
  # meshtrain's tokenizer_config.json for a SentencePiece run says split_special_tokens).
  mine, messages = chat.ChatTemplate.for_workdir(workdir), [{"role": "user", "content": "hi"}]
  assert mine.encode(mine.render(messages)) == theirs(tmp_path / "sp_out").apply_chat_template(
      messages, add_generation_prompt=True, return_dict=False)
  # A byte run given a chat_template.jinja in WORKDIR/tokenizer/: it renders with the byte specials, and to-hf
  # writes it into the exported tokenizer_config.json, which transformers renders and encodes the same way.
  workdir = tmp_path / "byte"
  (workdir / "tokenizer").mkdir(parents=True)
  (workdir / "tokenizer" / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}")
  mine = chat.ChatTemplate.for_workdir(workdir)
  text = mine.render([{"role": "user", "content": "hi"}])
  assert text == "<bos>hi<eos>" and mine.encode(text) == [tokenizer_lib.BOS_ID, 104, 105, tokenizer_lib.EOS_ID]
  (tmp_path / "byte_out").mkdir()
  hf_tokenizer.write_tokenizer(tmp_path / "byte_out", tokenizer_lib.ByteTokenizer(), workdir, 64)
  assert theirs(tmp_path / "byte_out").apply_chat_template([{"role": "user", "content": "hi"}], return_dict=False,
                                                           add_generation_prompt=True) == mine.encode(text)


def fail_if_started(cfg):
  raise AssertionError("the runtime started: the mistake should have been refused before")


def test_generate_refusals_exit_2_before_the_runtime_starts(converted, dirs, tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(startup, "start", fail_if_started)
  workdir = converted / "w"
  bad = tmp_path / "bad.json"
  bad.write_text("[{\"role\": \"user\"}]")
  alternating = tmp_path / "alternating.json"
  alternating.write_text(json.dumps([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]))
  # A converted model without a template: the Llama one's workdir with the template removed.
  plain = tmp_path / "plain"
  shutil.copytree(workdir, plain)
  config = json.loads((plain / "tokenizer" / "tokenizer_config.json").read_text())
  del config["chat_template"]
  (plain / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(config))
  mistral = tmp_path / "mistral"
  shutil.copytree(workdir, mistral)
  shutil.copyfile(TEMPLATES / "mistral-7b-instruct.jinja", mistral / "tokenizer" / "chat_template.jinja")
  cases = [
      (workdir, ["--messages", str(bad)], f"--messages {bad}: message 0 has no \"content\""),
      (workdir, ["--messages", str(tmp_path / "none.json")], "No such file"),
      (workdir, ["--messages", str(bad), "--prompt", "x"], "not allowed with argument"),
      (plain, ["--messages", str(alternating)], f"{plain} has no chat template .* put one into "
                                                f"{plain / 'tokenizer'}/chat_template.jinja .*meshtrain.convert"),
      (mistral, ["--messages", str(alternating)], f"--messages {alternating}: the chat template "
                                                  ".*chat_template.jinja.* refused the conversation: Conversation "
                                                  "roles must alternate"),
  ]
  import re
  for w, args, message in cases:
    assert run_generate(["--workdir", str(w), *args, "--json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and re.search(message, err), err


# --- the assistant's tokens: what a chat fine-tune (data.format=chat) trains on ---

GENERATION_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
                       "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}"
                       "<|im_end|>{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                       "{% endif %}")
TWO_ANSWERS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def main():\n    pass"},
               {"role": "assistant", "content": "A function that does nothing."},
               {"role": "user", "content": "ünïcödé ✓ 日本"}, {"role": "assistant", "content": " Unicode, twice ✓ "}]


def test_assistant_mask_is_transformers_return_assistant_tokens_mask(dirs, tmp_path):
  directory = tmp_path / "marked"
  shutil.copytree(dirs["qwen2.5"], directory)
  config = json.loads((directory / "tokenizer_config.json").read_text())
  (directory / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=GENERATION_TEMPLATE)))
  mine = ours(directory)
  text, spans = mine.assistant_spans(TWO_ANSWERS)
  ids, mask = mine.encode_masked(text, spans)
  out = theirs(directory).apply_chat_template(TWO_ANSWERS, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
  assert ids == out["input_ids"] and mask == [bool(m) for m in out["assistant_masks"]]
  assert [text[s:e] for s, e in spans] == ["A function that does nothing.<|im_end|>", " Unicode, twice ✓ <|im_end|>"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_assistant_turns_of_unmarked_templates(dirs, family):
  """Published templates have no {% generation %} marks: each assistant turn is located by rendering the
  conversation before it (with the generation prompt) and through it; the text and ids are transformers'."""
  messages = [m for m in TWO_ANSWERS if m["role"] != "system" or family not in ("gemma", "mistral")]
  mine = ours(dirs[family])
  if family == "qwen3":
    # Qwen3's template writes an answer after the last user query with a <think> block and earlier ones without:
    # a turn renders differently once later messages follow, so it cannot be located without marks (refused, with
    # the fix); a conversation with one answer is located.
    with pytest.raises(UserError, match=r"renders the conversation up to assistant message 2 differently once later "
                                        r"messages follow.*add \{% generation %\}"):
      mine.assistant_spans(messages)
    messages = messages[:3]
  text, spans = mine.assistant_spans(messages)
  assert text == theirs(dirs[family]).apply_chat_template(messages, tokenize=False)
  answers = [m["content"] for m in messages if m["role"] == "assistant"]
  for (start, end), answer in zip(spans, answers, strict=True):
    # The turn: its content (as the template writes it: some strip it) and the closing tokens after it.
    assert answer.strip() in text[start:end] and text[start:end].rstrip().endswith(
        {"qwen2.5": "<|im_end|>", "qwen3": "<|im_end|>", "llama-3.2": "<|eot_id|>", "mistral": "</s>",
         "gemma": "<end_of_turn>"}[family])
  ids, mask = mine.encode_masked(text, spans)
  assert ids == theirs(dirs[family]).apply_chat_template(messages, tokenize=True, return_dict=False)
  trained = [i for i, m in zip(ids, mask) if m]
  assert "".join(mine.tokenizer.decode(trained).split()) == "".join("".join(answers).split())
