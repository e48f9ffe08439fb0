"""Supervised fine-tuning data: prompt/completion examples whose loss counts the completion tokens only.

`python_stdlib_sft` is a TFDS dataset built locally, like `python_stdlib`, from the same standard-library files
with the same per-file train/validation split: every function (or method) with a docstring is one example whose
`prompt` is its `def` line(s) and docstring and whose `completion` is the rest of its body. A model fine-tuned on
it learns to write a function from its signature and documentation.

`SftSource` turns the examples of any TFDS dataset with a prompt and a completion feature (data.format =
"prompt_completion", data.prompt_key, data.completion_key) into fixed-length rows: prompt tokens, completion
tokens, EOS; the targets of the prompt's tokens and of the padding are IGNORE_ID, so the loss and evaluation count
only what the model is asked to complete. One example is one row (nothing is packed across examples: a
completion must not attend to another example's text), and the batch at step k is a function of (seed, k) alone,
as for the text sources.
"""
import ast
import json
import pathlib
import warnings

import numpy as np
import tensorflow_datasets as tfds

from meshtrain.data import chat as chat_lib, packing, sources, stdlib_corpus, tfds_access
from meshtrain.errors import UserError
from meshtrain.step import IGNORE_ID

NAME = "python_stdlib_sft"
# Bump the dataset version with any change to what `examples` extracts, so a cached older build is not reused.
VERSION = "1.0.0"


def _dedent(line: str, prefix: str) -> str:
  """`line` without the function's own indentation `prefix` (a method's body lines lose the class's indent)."""
  if line.startswith(prefix):
    return line[len(prefix):]
  return line.lstrip(" \t") if not line.strip() or line[:len(prefix)].isspace() else line


def examples(text: str) -> list[tuple[int, str, str]]:
  """(line, prompt, completion) for each function in the Python source `text` that has a docstring and a body
  after it; [] when `text` does not parse (the stdlib holds a few deliberately broken test files).

  Positions come from `ast` (what `ast.get_source_segment` would cut, taken by whole lines so comments and blank
  lines stay), dedented by the `def` line's indent, so methods and nested functions read like top-level ones.
  """
  # ast counts lines at \n, \r\n and \r only; str.splitlines also splits at \f, \v and others, so split by hand.
  text = text.replace("\r\n", "\n").replace("\r", "\n")
  try:
    # Some stdlib files hold invalid string escapes ('\('): parsing them warns (DeprecationWarning, SyntaxWarning
    # from 3.12) into every build's output about code that is not ours.
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", (DeprecationWarning, SyntaxWarning))
      tree = ast.parse(text)
  except (SyntaxError, ValueError):  # ValueError: source holding NUL bytes
    return []
  lines = text.split("\n")
  found = []
  for node in ast.walk(tree):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node, False) is None:
      continue
    doc = node.body[0]
    # A body must follow on its own lines: `def f(): "doc"; return 1` has no separate completion.
    if len(node.body) < 2 or node.body[1].lineno <= doc.end_lineno:
      continue
    first = lines[node.lineno - 1]
    prefix = first[:len(first) - len(first.lstrip(" \t"))]
    cut = lambda begin, end: "".join(_dedent(line, prefix) + "\n" for line in lines[begin:end])
    prompt, completion = cut(node.lineno - 1, doc.end_lineno), cut(doc.end_lineno, node.end_lineno)
    if completion.strip():
      found.append((node.lineno, prompt, completion))
  return found


class PythonStdlibSft(tfds.core.GeneratorBasedBuilder):
  """Functions of the Python standard library: `prompt` (def + docstring), `completion` (the body), `path`."""

  VERSION = tfds.core.Version(VERSION)
  RELEASE_NOTES = {"1.0.0": "Functions with a docstring from python_stdlib's files, split as python_stdlib."}

  def __init__(self, *, file_format=None, **kwargs):
    # array_record: random access without TensorFlow, as for python_stdlib.
    super().__init__(file_format=file_format or "array_record", **kwargs)

  def _info(self) -> tfds.core.DatasetInfo:
    return self.dataset_info_from_configs(
        description=f"Functions with a docstring in the Python standard library at {stdlib_corpus.stdlib_root()}: "
                    "prompt = def line(s) and docstring, completion = the rest of the body.",
        features=tfds.features.FeaturesDict({"prompt": tfds.features.Text(), "completion": tfds.features.Text(),
                                             "path": tfds.features.Text()}),
        homepage="https://docs.python.org/3/library/",
    )

  def _split_generators(self, dl_manager):
    del dl_manager  # nothing to download
    root = stdlib_corpus.stdlib_root()
    files = stdlib_corpus.source_files(root)
    if not files:
      raise RuntimeError(f"found no *.py files under the standard library at {root}")
    by_split = {"train": [], "validation": []}
    for rel in files:  # the file's split, as in python_stdlib: no function body is in both
      by_split[stdlib_corpus.split_of(rel)].append(rel)
    return {name: self._generate_examples(root, rels) for name, rels in by_split.items()}

  def _generate_examples(self, root: pathlib.Path, rels: list[str]):
    for rel in rels:
      text = (root / rel).read_bytes().decode("utf-8", errors="replace")
      for line, prompt, completion in examples(text):
        where = f"{rel}:{line}"  # unique: one function starts on each line at most
        yield where, {"prompt": prompt, "completion": completion, "path": where}


def build(data_dir: str = "") -> PythonStdlibSft:
  """Builds the dataset under `data_dir` ("" = TFDS default) unless it is there; locked, atomic (TFDS renames a
  finished temporary directory into place), built from local files only."""
  return tfds_access.build(data_dir, PythonStdlibSft)


# --- training rows ---------------------------------------------------------------------------------------------


def encode_example(prompt_ids: np.ndarray, completion_ids: np.ndarray, seq_len: int, pad_id: int,
                   eos_id: int) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, targets), each int32[seq_len], of one example: prompt, completion, EOS, then padding.

  Targets are the next token where that token belongs to the completion (its EOS included) and IGNORE_ID on
  the prompt and the padding, whose inputs are `pad_id`. What does not fit is cut so that the completion keeps at
  least half of the row: the prompt loses its beginning (the text right before the completion matters most to
  predicting it), the completion its end (then without EOS: the model must not learn to stop there).
  """
  length = seq_len + 1  # tokens [:-1] are the inputs and [1:] the targets
  completion_ids = np.concatenate([completion_ids, [eos_id]]).astype(np.int32)
  keep_prompt = min(len(prompt_ids), max(length - len(completion_ids), length // 2))
  keep_completion = min(len(completion_ids), length - keep_prompt)
  tokens = np.concatenate([prompt_ids[len(prompt_ids) - keep_prompt:], completion_ids[:keep_completion]])
  n = len(tokens)
  inputs_L = np.full(seq_len, pad_id, np.int32)
  targets_L = np.full(seq_len, IGNORE_ID, np.int32)
  inputs_L[:n - 1] = tokens[:-1]
  # Position j predicts token j + 1: trained where that token is a completion token (index >= keep_prompt).
  first = max(keep_prompt - 1, 0)
  targets_L[first:n - 1] = tokens[first + 1:]
  return inputs_L, targets_L


class SftSource(sources.Source):
  """One prompt/completion example per row; an epoch is a permutation of the examples (shuffle) or their order."""

  def __init__(self, data_source, *, tok, prompt_key: str, completion_key: str, seq_len: int, seed: int,
               name: str, split: str, shuffle: bool):
    self._data = data_source
    self._tok = tok
    self.prompt_key, self.completion_key = prompt_key, completion_key
    self.seq_len, self.shuffle = seq_len, shuffle
    self.pad_id = tok.pad_id
    self.num_sequences = len(data_source)
    if self.num_sequences == 0:
      raise UserError(f"split {split!r} of dataset {name!r} holds no examples; set data.train_split / "
                      "data.eval_split to a non-empty split")
    self._seed = sources.derive_seed("prompt_completion", seed, name, split)

  def sequence_index(self, example_index: int) -> int:
    n = self.num_sequences
    if not self.shuffle:  # evaluation: the same examples, in order, every time
      return example_index % n
    # A materialised permutation per epoch, as TfdsSource does for small splits (stdlib functions: ~8,000).
    order = sources.permutation(self._seed, example_index // n, n)
    return int(order[example_index % n])

  def sequence(self, seq_index: int) -> np.ndarray:
    raise TypeError("an SftSource row is not one shifted token sequence (its prompt targets are masked); use "
                    "rows() or pair()")

  def pair(self, seq_index: int) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of example `seq_index`, see encode_example."""
    record = self._data[seq_index]
    prompt, completion = (_text(record[k]) for k in (self.prompt_key, self.completion_key))
    return encode_example(self._tok.encode(prompt), self._tok.encode(completion), self.seq_len, self._tok.pad_id,
                          self._tok.eos_id)

  def example_pair(self, example_index: int) -> tuple[np.ndarray, np.ndarray]:
    return self.pair(self.sequence_index(example_index))


def _text(value) -> str:
  """A text feature's value as str (bytes from array_record files, str under TFDS mocks)."""
  if isinstance(value, np.ndarray):
    value = value.item()
  return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def encode_masked(ids: list[int], mask: list[bool], seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """(inputs, targets), each int32[seq_len], of tokens `ids` whose targets count where `mask` is set: position j
  predicts token j + 1, trained when that token is masked in. What does not fit in seq_len + 1 tokens is cut at the
  end; the padding's inputs are `pad_id` and its targets IGNORE_ID."""
  tokens = np.asarray(ids[:seq_len + 1], np.int32)
  trained = np.asarray(mask[:seq_len + 1], bool)
  n = len(tokens)
  inputs_L = np.full(seq_len, pad_id, np.int32)
  targets_L = np.full(seq_len, IGNORE_ID, np.int32)
  inputs_L[:n - 1] = tokens[:-1]
  targets_L[:n - 1] = np.where(trained[1:], tokens[1:], IGNORE_ID)
  return inputs_L, targets_L


class ChatSource(SftSource):
  """One conversation per row (a record's data.messages_key: a list of {"role", "content"} messages, or its JSON
  text), rendered with the tokenizer's chat template; the loss falls on the assistant's tokens only
  (ChatTemplate.assistant_spans: the template's {% generation %} marks, else each assistant turn with its closing
  tokens)."""

  def __init__(self, data_source, *, chat, messages_key: str, **kwargs):
    super().__init__(data_source, prompt_key=messages_key, completion_key=messages_key, **kwargs)
    self._chat, self.messages_key = chat, messages_key

  def messages(self, seq_index: int) -> list[dict]:
    value = self._data[seq_index][self.messages_key]
    return json.loads(_text(value)) if isinstance(value, (str, bytes, np.ndarray)) else value

  def pair(self, seq_index: int) -> tuple[np.ndarray, np.ndarray]:
    text, spans = self._chat.assistant_spans(self.messages(seq_index))
    ids, mask = self._chat.encode_masked(text, spans)
    return encode_masked(ids, mask, self.seq_len, self._tok.pad_id)


def chat_template(cfg, tok):
  """The chat template of the tokenizer cfg.data.tokenizer names (its directory's chat_template.jinja or
  tokenizer_config.json); UserError saying how to give one."""
  directory = tok.path.parent if tok.path else None
  template = chat_lib.ChatTemplate.from_directory(directory, tok) if directory else None
  if template is None:
    raise UserError(f"data.format=chat renders each conversation with the tokenizer's chat template, and "
                    f"data.tokenizer={cfg.data.tokenizer!r} has none; " +
                    chat_lib.HOW_TO_GIVE_ONE.format(dir=directory or "the tokenizer's directory"))
  return template


def make_source(cfg, name: str, split: str, shuffle: bool, tok) -> SftSource:
  """The prompt/completion or chat source for `split` of `name` (python_stdlib_sft is built on first use; a path of
  files is converted on first use)."""
  data = cfg.data
  if name == NAME:
    build(data.data_dir)
  ds = packing.open_split(cfg, split, name)
  features = dict(ds.dataset_info.features.items())
  keys = ((("data.messages_key", data.messages_key),) if data.format == "chat" else
          (("data.prompt_key", data.prompt_key), ("data.completion_key", data.completion_key)))
  for key, value in keys:
    if value not in features:
      raise UserError(f"dataset {name!r} has no feature {key}={value!r} for data.format={data.format}; its features "
                      f"are: {', '.join(features) or 'none'}")
  common = dict(tok=tok, seq_len=cfg.seq_len, seed=cfg.seed, name=packing.order_name(name, ds), split=split,
                shuffle=shuffle)
  if data.format == "chat":
    return ChatSource(ds, chat=chat_template(cfg, tok), messages_key=data.messages_key, **common)
  return SftSource(ds, prompt_key=data.prompt_key, completion_key=data.completion_key, **common)
