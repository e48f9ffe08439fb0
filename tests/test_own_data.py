"""Your own data: local .jsonl/.json/.parquet/.txt files and `datasets` directories as TFDS datasets (content-keyed,
converted once, safely from several processes), the held-out split, mixtures, chat rows, bad input, `python -m
meshtrain.data stats/show`, and the tokenizing pass split across processes."""
import hashlib
import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import numpy as np
import pytest
import two_processes

from meshtrain import config as config_lib
from meshtrain.cli import train
from meshtrain.data import __main__ as data_cli, files, mixture, packing, select, sft, stats, tokenization as tokenizer
from meshtrain.errors import UserError
from meshtrain.step import IGNORE_ID

REPO = pathlib.Path(__file__).resolve().parents[1]
# Documents of varied length and script; two are duplicates (they must land in the same split).
DOCS = [f"document {i}: " + "word " * (i % 17) + "ünïcödé ✓ 日本\n" for i in range(300)] + ["twice"] * 2
CHAT_TEMPLATE = ("{% for m in messages %}<|begin_of_text|>{{ m['role'] }}: {% if m['role'] == 'assistant' %}"
                 "{% generation %}{{ m['content'] }}<|endoftext|>{% endgeneration %}{% else %}{{ m['content'] }}"
                 "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|begin_of_text|>assistant: {% endif %}")


def write_jsonl(path: pathlib.Path, records) -> pathlib.Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
  return path


def make_cfg(tmp_path, name="", *overrides, **fields):
  cfg = config_lib.load(str(REPO / "configs" / "tiny.py"), [
      f"--config.data.data_dir={tmp_path / 'tfds'}", "--config.seq_len=32", "--config.batch_size=8",
      *([f"--config.data.name={name}"] if name else []), *overrides])
  cfg.unlock()
  for key, value in fields.items():
    cfg.data[key] = value
  return cfg


def split_texts(cfg, split, name=None, key="text"):
  ds = packing.open_split(cfg, split, name)
  return [ds[i][key].decode("utf-8") for i in range(len(ds))]


def converted_dirs(tmp_path):
  root = tmp_path / "tfds" / "meshtrain_files"
  return sorted(p.name for p in root.glob("files_*")) if root.exists() else []


# --- formats --------------------------------------------------------------------------------------------------


def write_every_format(root: pathlib.Path) -> dict[str, str]:
  """DOCS in each format meshtrain reads; data.name of each."""
  import datasets
  import pyarrow as pa
  import pyarrow.parquet as pq
  records = [{"text": d, "id": i} for i, d in enumerate(DOCS)]
  write_jsonl(root / "jsonl" / "a.jsonl", records[:100])
  write_jsonl(root / "jsonl" / "sub" / "b.jsonl", records[100:])
  (root / "array").mkdir(parents=True)
  (root / "array" / "all.json").write_text(json.dumps(records), encoding="utf-8")
  write_jsonl(root / "lines" / "all.json", records)  # what datasets' to_json writes: JSON lines named .json
  (root / "parquet").mkdir()
  table = pa.table({"id": [r["id"] for r in records], "text": DOCS})
  pq.write_table(table.slice(0, 150), root / "parquet" / "a.parquet", row_group_size=40)
  pq.write_table(table.slice(150), root / "parquet" / "b.parquet", row_group_size=40)
  (root / "txt").mkdir()
  for i, d in enumerate(DOCS):
    (root / "txt" / f"{i:03d}.txt").write_text(d, encoding="utf-8")
  datasets.Dataset.from_dict({"text": DOCS, "id": list(range(len(DOCS)))}).save_to_disk(
      str(root / "hf"), max_shard_size="20KB")
  return {"jsonl glob": str(root / "jsonl" / "**" / "*.jsonl"), "json array": str(root / "array" / "all.json"),
          "json lines": str(root / "lines"), "parquet": str(root / "parquet" / "*.parquet"),
          "txt": str(root / "txt"), "datasets": str(root / "hf")}


def test_every_format_converts_to_the_same_documents_and_split(tmp_path):
  names = write_every_format(tmp_path / "src")
  cfg = make_cfg(tmp_path, eval_fraction=0.1)
  held_out = {}
  for label, name in names.items():
    train_docs, eval_docs = split_texts(cfg, "train", name), split_texts(cfg, "validation", name)
    assert sorted(train_docs + eval_docs) == sorted(DOCS), label
    held_out[label] = sorted(eval_docs)
  # The split is a hash of each document's content: the same documents are held out whatever the format, about
  # eval_fraction of them, and a document's duplicates go with it.
  first = held_out["jsonl glob"]
  assert all(v == first for v in held_out.values()) and 0.04 * len(DOCS) < len(first) < 0.2 * len(DOCS)
  assert first.count("twice") in (0, 2)
  assert len(converted_dirs(tmp_path)) == len(names)


# Records whose text crosses any read boundary: multi-byte characters (split mid-character by small reads), \u escapes
# and surrogate pairs, nesting, and numbers that a cut read would end early ("1" of "1e+300").
ARRAY_RECORDS = [{"text": d, "id": i, "n": [1e300, -12345678901234567890, 0.5], "m": {"k": None, "ok": True}}
                 for i, d in enumerate(DOCS[:40])] + [{"text": "😀 \"quoted\" \\ tab\t"}]


def write_array(path: pathlib.Path, records, ascii_only=False) -> pathlib.Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(" \n" + json.dumps(records, ensure_ascii=ascii_only, indent=1) + "\n", encoding="utf-8")
  return path


def test_json_array_is_read_a_chunk_at_a_time(tmp_path, monkeypatch):
  item = files.Input("json", write_array(tmp_path / "a.json", ARRAY_RECORDS), (tmp_path / "a.json",))
  ascii_item = files.Input("json", write_array(tmp_path / "b.json", ARRAY_RECORDS, True), (tmp_path / "b.json",))
  fields = files.Fields("text", ("text",))
  expected = [(f"{item.path}[{i}]", r) for i, r in enumerate(ARRAY_RECORDS)]
  for chunk in (1, 2, 3, 7, 64, files.JSON_CHUNK):
    monkeypatch.setattr(files, "JSON_CHUNK", chunk)
    assert list(files.records(item, fields)) == expected, chunk
    assert [r for _, r in files.records(ascii_item, fields)] == ARRAY_RECORDS, chunk
  # Bounded memory: the first record comes after a few reads, not the file.
  opened = []
  def spy_open(*args, **kwargs):
    opened.append(open(*args, **kwargs))  # pylint: disable=consider-using-with
    return opened[-1]
  monkeypatch.setattr(files, "open", spy_open, raising=False)
  monkeypatch.setattr(files, "JSON_CHUNK", 64)
  reader = files.records(item, fields)
  assert next(reader) == expected[0]
  assert opened[-1].tell() < 1024 < item.path.stat().st_size // 4
  reader.close()
  monkeypatch.undo()
  # And through a conversion, with reads that split nearly every record.
  monkeypatch.setattr(files, "JSON_CHUNK", 5)
  cfg = make_cfg(tmp_path, eval_fraction=0.0)
  assert split_texts(cfg, "train", str(item.path)) == [r["text"] for r in ARRAY_RECORDS]


def test_json_array_bad_records_name_the_record_and_byte_offset(tmp_path, monkeypatch):
  monkeypatch.setattr(files, "JSON_CHUNK", 5)  # the messages do not depend on where the reads fall
  head, tail = b'[{"text": "a"},\n {"text": "', b'"},\n {"text": "b"}, {"text": "c"}]'
  cases = [(b"caf\xe9", "not UTF-8 at byte offset {} of the file (b'\\xe9\"}},'); re-encode the file as UTF-8",
            b"\xe9", ["a", "b", "c"]),
           (b'x" "y', "not valid JSON (Expecting ',' delimiter at byte offset {}); the records after it in the array "
            "are not read", b'"y', ["a"])]
  for n, (bad, message, at, kept) in enumerate(cases):
    raw, root = head + bad + tail, tmp_path / str(n)
    root.mkdir()
    (root / "bad.json").write_bytes(raw)
    with pytest.raises(UserError, match=re.escape(f"bad.json[1]: {message.format(raw.index(at))}")):
      split_texts(make_cfg(root, eval_fraction=0.0), "train", str(root / "bad.json"))
    assert converted_dirs(root) == []
    # Skipped: a record that is not UTF-8 alone; one that is not JSON ends the array (its end cannot be found).
    cfg = make_cfg(root, str(root / "bad.json"), eval_fraction=0.0, skip_bad_records=True)
    assert split_texts(cfg, "train", cfg.data.name) == kept and files.skipped_records(cfg) == 1


def test_conversion_is_keyed_by_content_and_done_once(tmp_path, capsys):
  src = write_jsonl(tmp_path / "a" / "corpus.jsonl", [{"text": d} for d in DOCS])
  cfg = make_cfg(tmp_path)
  split_texts(cfg, "train", str(src))
  assert "converted" in capsys.readouterr().out
  [first] = converted_dirs(tmp_path)
  moved = tmp_path / "elsewhere" / "renamed.jsonl"
  moved.parent.mkdir()
  src.rename(moved)
  assert split_texts(cfg, "train", str(moved)) and "converted" not in capsys.readouterr().out
  assert converted_dirs(tmp_path) == [first]  # a moved file is the same corpus
  with open(moved, "a", encoding="utf-8") as f:
    f.write(json.dumps({"text": "one more document"}) + "\n")
  assert "one more document" in split_texts(cfg, "train", str(moved)) + split_texts(cfg, "validation", str(moved))
  assert len(converted_dirs(tmp_path)) == 2  # an edited one is converted again


def test_globs_do_not_follow_directory_links(tmp_path):
  """`**` would follow a link to "." into 40 copies of each file and a link to ".." into the parent: links to
  directories under a glob's fixed part are not followed, so each file counts once (a linked file still counts)."""
  write_jsonl(tmp_path / "outside.jsonl", [{"text": "not mine"}])
  write_jsonl(tmp_path / "loop" / "a.jsonl", [{"text": d} for d in DOCS[:50]])
  (tmp_path / "loop" / "self").symlink_to(".")
  (tmp_path / "loop" / "up").symlink_to("..")
  (tmp_path / "loop" / "b.jsonl").symlink_to(tmp_path / "outside.jsonl")
  for spec in (tmp_path / "loop" / "**" / "*.jsonl", tmp_path / "loop"):
    found = [i.path.name for i in files.find_inputs(str(spec))]
    assert sorted(found) == ["a.jsonl", "b.jsonl"], (spec, found)


def test_extreme_mixture_weights_are_refused_before_anything_runs():
  for spec in ("a.jsonl=1e-300,b.jsonl=1e300", "a.jsonl=1,b.jsonl=1e-10", "a.jsonl=1e308,b.jsonl=1e308"):
    with pytest.raises(UserError, match="share at least 1e-09 of the total"):
      config_lib.parse_mixture(spec)
  assert config_lib.parse_mixture("a.jsonl=1e-6,b.jsonl=1") == [("a.jsonl", 1e-6), ("b.jsonl", 1.0)]


def test_a_killed_conversions_leftovers_are_cleared_by_the_next(tmp_path):
  src = write_jsonl(tmp_path / "c.jsonl", [{"text": d} for d in DOCS])
  cfg = make_cfg(tmp_path)
  corpus = files.resolve(str(src), cfg.data, cfg.data.eval_fraction)
  dead = _dead_pid()
  host = socket.gethostname()
  left = corpus.version_dir.parent / f".{files.VERSION}.tmp-{host}-{dead}-x1"  # what kill -9 mid-conversion leaves
  alive = corpus.version_dir.parent / f".{files.VERSION}.tmp-{host}-{os.getpid()}-x2"  # a conversion under way
  for d in (left, alive):
    (d / "train").mkdir(parents=True)
  split_texts(cfg, "train", str(src))
  assert not left.exists() and alive.exists()


def _dead_pid() -> int:
  """The pid of a process that has exited (and been reaped)."""
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  return proc.pid


@pytest.mark.slow  # three processes
def test_concurrent_conversions_make_one_dataset(tmp_path):
  src = write_jsonl(tmp_path / "corpus.jsonl", [{"text": d * 50} for d in DOCS])
  script = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from test_own_data import make_cfg, split_texts; "
            f"import pathlib; print(len(split_texts(make_cfg(pathlib.Path({str(tmp_path)!r})), 'train', "
            f"{str(src)!r})))")
  env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}:{REPO}"}
  procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True) for _ in range(3)]
  outs = [p.communicate(timeout=300)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0, 0], outs
  counts = {out.strip().splitlines()[-1] for out in outs}
  assert len(counts) == 1 and int(counts.pop()) > 250
  assert len(converted_dirs(tmp_path)) == 1
  assert sum("converted" in out for out in outs) == 1  # one converted, the others waited and read it
  leftovers = [p for p in (tmp_path / "tfds" / "meshtrain_files").rglob("*") if ".tmp" in p.name]
  assert leftovers == []


# --- bad input ------------------------------------------------------------------------------------------------


BAD_CASES = {
    "malformed": (b'{"text": "fine"}\n{"text": "broken\n', r"bad\.jsonl:2: not valid JSON"),
    "missing key": (b'{"text": "fine"}\n{"body": "x", "id": 1}\n', r"bad\.jsonl:2: the record has no key 'text' "
                                                                    r"\(its keys: 'body', 'id'\)"),
    "not utf-8": (b'{"text": "fine"}\n{"text": "caf\xe9"}\n', r"bad\.jsonl:2: not UTF-8 at byte offset 30"),
    "not text": (b'{"text": "fine"}\n{"text": 3}\n', r"bad\.jsonl:2: 'text' holds int, not text"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_record_names_file_and_line_and_leaves_nothing(tmp_path, case):
  content, message = BAD_CASES[case]
  (tmp_path / "bad.jsonl").write_bytes(content + b'{"text": "after"}\n' * 3)
  cfg = make_cfg(tmp_path, eval_fraction=0.0)
  with pytest.raises(UserError, match=message + ".*data.skip_bad_records=true"):
    split_texts(cfg, "train", str(tmp_path / "bad.jsonl"))
  assert converted_dirs(tmp_path) == [] and not list((tmp_path / "tfds" / "meshtrain_files").rglob("*.array_record*"))
  # Skipped and counted instead, when asked.
  cfg = make_cfg(tmp_path, eval_fraction=0.0, skip_bad_records=True)
  assert split_texts(cfg, "train", str(tmp_path / "bad.jsonl")) == ["fine", "after", "after", "after"]
  assert files.skipped_records(cfg) == 0  # data.name is not this file
  cfg.data.name = str(tmp_path / "bad.jsonl")
  assert files.skipped_records(cfg) == 1


def write_bad_input(case: str, root: pathlib.Path) -> pathlib.Path:
  """A corpus of `case` (a key of OTHER_BAD_CASES): good documents and one bad; its data.name."""
  import datasets
  import pyarrow as pa
  import pyarrow.parquet as pq
  root.mkdir(parents=True)
  texts = ["one", "two", None, "three"]  # a null where the text should be: "row 2" is bad
  if case.startswith("parquet"):
    pq.write_table(pa.table({"text" if case == "parquet row" else "body": texts, "id": [0, 1, 2, 3]}),
                   root / "bad.parquet", row_group_size=2)
    return root / "bad.parquet"
  if case.startswith("datasets"):
    datasets.Dataset.from_dict({"text" if case == "datasets row" else "content": texts}).save_to_disk(str(root / "hf"))
    return root / "hf"
  if case == "txt not utf-8":
    for i, text in enumerate(["one", "two", "three"]):
      (root / f"{i}.txt").write_text(text, encoding="utf-8")
    (root / "3.txt").write_bytes("naïve café".encode() + b" caf\xe9")  # Latin-1 after UTF-8
    return root
  write_array(root / "a.json", [{"text": "four"}])
  (root / "b.json").write_bytes(b'[{"text": "ok"}, {"text": "caf\xe9"}]')
  return root / "*.json"


OTHER_BAD_CASES = {  # case: (the error line, the documents kept when data.skip_bad_records=true; None: not skippable)
    "parquet row": (r"bad\.parquet row 2: 'text' holds NoneType, not text; fix it, or set data.skip_bad_records=true",
                    ["one", "two", "three"]),
    "datasets row": (r"hf row 2: 'text' holds NoneType, not text; fix it", ["one", "two", "three"]),
    "parquet column": (r"bad\.parquet has no column 'text' \(its columns: 'body', 'id'\); set data\.text_key to the "
                       "column that holds it$", None),
    "datasets column": (r"hf has no column 'text' \(its columns: 'content'\); set data\.text_key", None),
    "txt not utf-8": (r"3\.txt: not UTF-8 at byte offset 16 \(b'\\xe9'\); re-encode the file as UTF-8; fix it",
                      ["one", "two", "three"]),
    "json not utf-8": (r"b\.json\[1\]: not UTF-8 at byte offset 30 of the file \(b'\\xe9\"}\]'\); re-encode",
                       ["four", "ok"]),
}


@pytest.mark.parametrize("case", sorted(OTHER_BAD_CASES))
def test_bad_parquet_datasets_txt_json_input_is_one_line_with_exit_2(tmp_path, capsys, monkeypatch, case):
  message, kept = OTHER_BAD_CASES[case]
  monkeypatch.setattr(files, "PARQUET_BATCH", 1)  # the bad row in a later read than the first: rows count on
  name = write_bad_input(case, tmp_path / "src")
  capsys.readouterr()  # save_to_disk's progress bar
  # The CLI in this process (the subprocess test above shows the same for a new interpreter).
  assert data_cli.main(["stats", "--config", str(REPO / "configs" / "tiny.py"), "--steps", "1",
                        f"--config.data.data_dir={tmp_path / 'tfds'}", f"--config.data.name={name}"]) == 2
  [line] = capsys.readouterr().err.splitlines()
  assert re.search("^error: .*" + message, line), line
  # Nothing but the content hashes and the conversion's lock file.
  assert [p for p in (tmp_path / "tfds").rglob("*")
          if p.is_file() and "hashes" not in p.parts and p.suffix != ".lock"] == []
  if kept is not None:
    cfg = make_cfg(tmp_path, str(name), eval_fraction=0.0, skip_bad_records=True)
    assert sorted(split_texts(cfg, "train", cfg.data.name)) == sorted(kept) and files.skipped_records(cfg) == 1


def test_bad_paths_and_empty_corpora(tmp_path):
  cfg = make_cfg(tmp_path)
  with pytest.raises(UserError, match=r"'\S*nothing/\*\.jsonl' is a glob that matches no file"):
    split_texts(cfg, "train", str(tmp_path / "nothing" / "*.jsonl"))
  (tmp_path / "empty.jsonl").write_text("\n\n")
  with pytest.raises(UserError, match="empty training corpus: it holds no records"):
    split_texts(cfg, "train", str(tmp_path / "empty.jsonl"))
  write_jsonl(tmp_path / "bad" / "x.jsonl", [{"text": 1}])
  with pytest.raises(UserError, match="all 1 records were bad"):
    split_texts(make_cfg(tmp_path, skip_bad_records=True), "train", str(tmp_path / "bad" / "x.jsonl"))
  (tmp_path / "data.csv").write_text("text\nhello\n")
  with pytest.raises(UserError, match=r"suffix '\.csv' is not one of \.jsonl, \.json, \.parquet, \.txt"):
    split_texts(cfg, "train", str(tmp_path / "data.csv"))
  write_jsonl(tmp_path / "small.jsonl", [{"text": "a"}, {"text": "b"}])
  with pytest.raises(UserError, match="data.eval_fraction=0.01 holds out none of the 2 documents"):
    split_texts(cfg, "validation", str(tmp_path / "small.jsonl"))
  assert converted_dirs(tmp_path) == [files.resolve(str(tmp_path / "small.jsonl"), cfg.data, 0.01).name]


def test_cli_bad_input_is_one_line_with_exit_2(tmp_path):
  (tmp_path / "bad.jsonl").write_bytes(b'{"text": "ok"}\n{"text": \n')
  for extra, expected in [([f"--config.data.name={tmp_path / 'bad.jsonl'}"], "bad.jsonl:2: not valid JSON"),
                          (["--config.data.mixture=python_stdlib=1,x"], "entry 'x' is not SRC=WEIGHT"),
                          (["--config.data.format=chat"], "has none; use the tokenizer of a converted model")]:
    proc = subprocess.run([sys.executable, "-m", "meshtrain.data", "stats", "--config", "configs/tiny.py",
                           f"--config.data.data_dir={tmp_path / 'tfds'}", *extra], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    [line] = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert expected in line


# --- mixtures, stats, show ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory):
  root = tmp_path_factory.mktemp("corpora")
  write_jsonl(root / "a.jsonl", [{"text": "A" * (10 + i)} for i in range(200)])
  write_jsonl(root / "b" / "b.jsonl", [{"text": "B" * (50 + i)} for i in range(200)])
  return root


def test_mixture_draws_exact_proportions_as_a_pure_function_of_step(two_corpora, tmp_path):
  spec = f"{two_corpora / 'a.jsonl'}=3,{two_corpora / 'b' / '*.jsonl'}=1"
  cfg = make_cfg(tmp_path, "", f"--config.data.mixture={spec}")
  src = select.make_source(cfg, "train", shuffle=True)
  assert isinstance(src, mixture.MixtureSource)
  for step in range(4):
    rows = src.rows(step, 8)
    firsts = set(rows["inputs"][:, 0].tolist())
    kinds = [chr(int(x)) for x in rows["inputs"][:, 0]]
    # Packed rows of A-only and B-only documents: each row is all A or all B (or EOS-separated runs of one).
    assert firsts <= {ord("A"), ord("B"), tokenizer.EOS_ID} and kinds.count("A") + kinds.count("B") >= 7
    assert sorted(src.source_of(step * 8 + r)[0] for r in range(8)) == [0] * 6 + [1] * 2
    # Any process's slice of the batch is the same rows, and a fresh source (a resumed run) reads the same.
    again = select.make_source(cfg, "train", shuffle=True)
    for key in rows:
      np.testing.assert_array_equal(np.concatenate([again.rows(step, 8, 0, 3)[key], again.rows(step, 8, 3, 8)[key]]),
                                    rows[key])
  result = stats.stats(cfg, 4)
  a, b = result["sources"].values()
  assert (a["rows"], b["rows"]) == (24, 8) and a["share"] == pytest.approx(0.75) and b["share"] == pytest.approx(0.25)
  # Bytes per token: the byte tokenizer's 1, less the EOS ids between documents (no bytes).
  assert a["padding"] == 0 and 0.9 < a["bytes_per_token"] < 1 and a["documents"] > b["documents"]


def test_mixture_with_tfds_and_eval_name(two_corpora, tmp_path):
  cfg = make_cfg(tmp_path, "", f"--config.data.mixture=python_stdlib=1,{two_corpora / 'a.jsonl'}=1",
                 f"--config.data.eval_name={two_corpora / 'b'}")
  assert len(select.make_source(cfg, "train", shuffle=True).parts) == 2
  evaluation = select.make_source(cfg, cfg.data.eval_split, shuffle=False)
  assert set(evaluation.rows(0, 8)["inputs"][:, :40].ravel().tolist()) <= {ord("B"), tokenizer.EOS_ID}


def test_stats_and_show_commands(two_corpora, tmp_path):
  base = [sys.executable, "-m", "meshtrain.data"]
  common = ["--config", "configs/tiny.py", f"--config.data.data_dir={tmp_path / 'tfds'}", "--config.batch_size=4",
            f"--config.data.mixture={two_corpora / 'a.jsonl'}=1,{two_corpora / 'b' / 'b.jsonl'}=1"]
  out = subprocess.run([*base, "stats", *common, "--steps", "3", "--json"], cwd=REPO, capture_output=True, text=True,
                       timeout=300, check=True).stdout
  sources = json.loads(out.strip().splitlines()[-1])["sources"]
  assert len(sources) == 2 and all({"documents", "tokens", "share"} <= s.keys() for s in sources.values())
  assert [s["share"] for s in sources.values()] == [0.5, 0.5]
  table = stats.format_stats(json.loads(out.strip().splitlines()[-1]))  # what stats prints without --json
  assert "bytes/token" in table and "a.jsonl" in table and "50.0%" in table
  shown = subprocess.run([*base, "show", *common, "--rows", "2"], cwd=REPO, capture_output=True, text=True,
                         timeout=300, check=True).stdout
  assert shown.count("--- row") == 2 and "AAAA" in shown and "⟦" in shown


# --- chat rows ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
  directory = tmp_path_factory.mktemp("chat_tok")
  tokenizer.train_bpe(DOCS * 3 + ["user: assistant: system:"], 400, directory)
  (directory / tokenizer.CHAT_TEMPLATE_FILE).write_text(CHAT_TEMPLATE)
  return directory


CONVERSATIONS = [
    {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i} ✓"},
                  {"role": "user", "content": "again?"}, {"role": "assistant", "content": "yes" * (i % 3 + 1)}]}
    for i in range(40)]


def test_chat_rows_train_on_the_assistant_only(chat_tokenizer, tmp_path):
  write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)
  cfg = make_cfg(tmp_path, str(tmp_path / "chat.jsonl"), "--config.data.format=chat",
                 f"--config.data.tokenizer={chat_tokenizer}", "--config.model.vocab_size=512", "--config.seq_len=128",
                 eval_fraction=0.0)
  src = select.make_source(cfg, "train", shuffle=False)
  assert isinstance(src, sft.ChatSource)
  tok = tokenizer.load(chat_tokenizer)
  for i in range(len(CONVERSATIONS)):
    inputs, targets = src.pair(i)
    messages = src.messages(i)
    trained = tok.decode(targets[targets != IGNORE_ID])
    assistant = "".join(m["content"] + "<|endoftext|>" for m in messages if m["role"] == "assistant")
    assert trained == assistant.replace("<|endoftext|>", "")  # decode() drops specials; the EOS ids are trained:
    assert int(np.sum(targets == tok.eos_id)) == 2
    assert tok.decode(inputs[inputs != tok.pad_id]).startswith("user: question")
  # A conversation longer than the row is cut at its end: what still fits of the assistant's text is trained.
  short = select.make_source(make_cfg(tmp_path, str(tmp_path / "chat.jsonl"), "--config.data.format=chat",
                                      f"--config.data.tokenizer={chat_tokenizer}", "--config.model.vocab_size=512",
                                      "--config.seq_len=16", eval_fraction=0.0), "train", shuffle=False)
  inputs, targets = short.pair(0)
  np.testing.assert_array_equal(inputs, src.pair(0)[0][:16])
  np.testing.assert_array_equal(targets, src.pair(0)[1][:16])


@pytest.mark.slow  # a whole training run (the chat rows themselves: the test above)
def test_chat_fine_tune_runs(chat_tokenizer, tmp_path):
  write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS + [{"messages": [{"role": "user", "content": "no answer"}]}])
  assert train.main(["--config", "configs/tiny.py", "--workdir", str(tmp_path / "run"), "--config.steps=2",
                     f"--config.data.name={tmp_path / 'chat.jsonl'}", "--config.data.format=chat",
                     f"--config.data.data_dir={tmp_path / 'tfds'}", f"--config.data.tokenizer={chat_tokenizer}",
                     "--config.model.vocab_size=512", "--config.seq_len=64", "--config.eval_every=2",
                     "--config.data.eval_fraction=0.2", "--config.eval_batches=1", "--config.log_every=1",
                     "--config.data.skip_bad_records=true"]) == 0
  records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if "loss" in r] == [1, 2] and any("eval_loss" in r for r in records)
  assert records[0]["data/skipped_records"] == 1  # the bad line below, skipped and counted


# --- resume, and the tokenizing pass over processes ----------------------------------------------------------


@pytest.mark.slow  # two training runs each
@pytest.mark.parametrize("source", ["mixture", "parquet files alone"])
def test_training_on_files_resumes_exactly(two_corpora, tmp_path, source):
  """A run stopped after its step-2 checkpoint and resumed logs the losses of the run that was not: a mixture of
  a jsonl file and a TFDS dataset, and a glob of parquet files alone (`data.name`)."""
  import shutil
  if source == "mixture":
    data = f"--config.data.mixture={two_corpora / 'a.jsonl'}=2,python_stdlib=1"
  else:
    data = f"--config.data.name={write_every_format(tmp_path / 'src')['parquet']}"
  args = ["--config", "configs/tiny.py", "--config.steps=4", "--config.seq_len=32", "--config.checkpoint_every=2",
          "--config.eval_every=0", "--config.log_every=1", f"--config.data.data_dir={tmp_path / 'tfds'}", data]
  assert train.main([*args, "--workdir", str(tmp_path / "full")]) == 0
  shutil.copytree(tmp_path / "full", tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
  assert train.main([*args, "--workdir", str(tmp_path / "resumed")]) == 0
  losses = [[json.loads(l).get("loss") for l in (tmp_path / w / "metrics.jsonl").read_text().splitlines()]
            for w in ("full", "resumed")]
  assert losses[0] == losses[1] and None not in losses[0][:4]


def test_a_changed_input_is_refused_on_resume(tmp_path, capsys):
  """Every checkpoint records the contents of the files it trained on: the same path with other contents (here 400
  records appended) is refused on resume, naming the file; allow_data_change continues on the new contents from
  that step, saying so. The same contents under another name resume as they are."""
  src = write_jsonl(tmp_path / "data" / "edit.jsonl", [{"text": d} for d in DOCS])
  args = ["--config", "configs/tiny.py", "--config.seq_len=32", "--config.checkpoint_every=2", "--config.eval_every=0",
          "--config.model.num_layers=1", f"--config.data.data_dir={tmp_path / 'tfds'}",
          f"--config.data.name={tmp_path / 'data' / '*.jsonl'}", "--workdir", str(tmp_path / "w")]
  assert train.main([*args, "--config.steps=2"]) == 0
  with open(src, "a", encoding="utf-8") as f:
    f.writelines(json.dumps({"text": f"new document {i}"}) + "\n" for i in range(400))
  assert train.main([*args, "--config.steps=4"]) == 2
  err = capsys.readouterr().err
  assert f"was trained on other contents of data '{tmp_path / 'data' / '*.jsonl'}': {src} changed (" in err, err
  assert "--config.allow_data_change=true" in err and not (tmp_path / "w" / "checkpoints" / "4").exists()
  assert train.main([*args, "--config.steps=4", "--config.allow_data_change=true"]) == 0
  assert "resuming with the contents of data" in capsys.readouterr().out
  src.rename(tmp_path / "data" / "renamed.jsonl")  # moved: the same corpus, checked and accepted
  assert train.main([*args, "--config.steps=4"]) == 0 and "nothing to do" in capsys.readouterr().out
  meta = json.loads((tmp_path / "w" / "checkpoints" / "4" / "meta" / "metadata").read_text())
  [recorded] = meta["data_inputs"].values()
  assert recorded["files"] == 1 and recorded["listed"][0]["bytes"] == src.with_name("renamed.jsonl").stat().st_size


@pytest.mark.slow  # a whole training run
def test_training_on_a_parquet_txt_and_datasets_mixture(tmp_path):
  names = write_every_format(tmp_path / "src")
  spec = f"{tmp_path / 'src' / 'parquet' / 'a.parquet'}=2,{tmp_path / 'src' / 'txt' / '*.txt'}=1,{names['datasets']}=1"
  assert train.main(["--config", "configs/tiny.py", "--workdir", str(tmp_path / "run"), "--config.steps=2",
                     "--config.seq_len=32", "--config.batch_size=8", "--config.eval_every=0", "--config.log_every=1",
                     f"--config.data.data_dir={tmp_path / 'tfds'}", f"--config.data.mixture={spec}"]) == 0
  records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in records if "loss" in r]
  assert len(losses) == 2 and all(np.isfinite(losses))
  assert len(converted_dirs(tmp_path)) == 3  # each source converted once, as its own dataset


TWO_PROCESS_TOKENIZE = """
import hashlib, pathlib, sys
sys.path.insert(0, sys.argv[4])
from test_own_data import make_cfg
from meshtrain.data import select
cfg = make_cfg(pathlib.Path(sys.argv[3]), sys.argv[5], f"--config.data.tokenizer={sys.argv[6]}",
               "--config.model.vocab_size=512")
src = select.make_source(cfg, "train", shuffle=True)
print("rows", hashlib.sha256(src.rows(3, 8)["inputs"].tobytes()).hexdigest())
"""


def test_local_workers_tokenize_shares_into_the_same_cache(chat_tokenizer, tmp_path, capfd):
  corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": f"{k} {d * 3}"} for k in range(2) for d in DOCS])
  sources = {}
  for workers in (1, 2):
    cfg = make_cfg(tmp_path / f"w{workers}", str(corpus), f"--config.data.tokenizer={chat_tokenizer}",
                   "--config.model.vocab_size=512", f"--config.data.tokenize_workers={workers}")
    sources[workers] = select.make_source(cfg, "train", shuffle=True)
    out = capfd.readouterr().out
    assert ("(share 2 of 2)" in out) == (workers == 2), out  # two worker processes, each a share
  assert cache_digests(tmp_path / "w2") == cache_digests(tmp_path / "w1")
  np.testing.assert_array_equal(sources[2].rows(3, 8)["inputs"], sources[1].rows(3, 8)["inputs"])


def cache_digests(tmp_path):
  found = sorted(p for p in (tmp_path / "tfds").rglob("*.tok-*") if not p.name.startswith("."))
  assert sorted(p.suffix for p in found) == [".bin", ".npy"], found  # the joined cache, no parts left
  return [hashlib.sha256(p.read_bytes()).hexdigest() for p in found]


def test_two_processes_tokenize_a_share_each_into_one_process_cache(chat_tokenizer, tmp_path, capsys):
  # 3 blocks of packing.SHARE_BLOCK documents: blocks 0 and 2 are process 0's share, block 1 process 1's.
  corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": f"{k} {d * 3}"} for k in range(2) for d in DOCS])
  cfg = make_cfg(tmp_path / "one", str(corpus), f"--config.data.tokenizer={chat_tokenizer}",
                 "--config.model.vocab_size=512")
  one = select.make_source(cfg, "train", shuffle=True)
  expected = hashlib.sha256(one.rows(3, 8)["inputs"].tobytes()).hexdigest()
  outs = two_processes.run(TWO_PROCESS_TOKENIZE, tmp_path, str(tmp_path / "two"), str(REPO / "tests"), str(corpus),
                           str(chat_tokenizer), timeout=300)
  for i, out in enumerate(outs):
    assert f"(share {i + 1} of 2)" in out and f"rows {expected}" in out, out
  assert cache_digests(tmp_path / "two") == cache_digests(tmp_path / "one")
