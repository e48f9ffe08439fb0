"""The `python -m meshtrain...` command lines of the docs pages, run as written on small budgets, page by page in
the order the page gives them (a later command finds what an earlier one wrote), so a docs example cannot rot.

Each page runs in its own directory, where `configs/` is the repository's and `runs/tiny` (and the image runs a page
names without training them) are already trained, for 2 steps. What changes from the page: training runs 2 steps
(`BUDGET`), a server listens on a free port, compiles on first use (--lazy) and is stopped once it says "serving",
placeholders (`DIR`, `RUN`, `HF_DIR`, `[--opt N]`) are filled or dropped. A command that cannot run here is in
`CANNOT_RUN` with the reason.
"""
import json
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import xla_fast

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).parents[1]
BLOCK = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)
BUDGET = {"meshtrain.train": ["--config.steps=2", "--config.eval_every=2", "--config.checkpoint_every=2",
                              "--config.eval_batches=1", "--config.log_every=1", "--config.optimizer.warmup_steps=1"],
          "meshtrain.bench": ["--steps", "2", "--loop", "3"]}
# (page, what the line starts with) -> why it does not run here.
CANNOT_RUN = {
    ("generation.md", "python -m meshtrain.convert from-hf ~/models/"): "needs a downloaded Hugging Face model "
    "(no network here); tests/test_convert.py converts models transformers builds locally",
    ("generation.md", "python -m meshtrain.generate --workdir runs/qwen"): "needs the converted Qwen run above",
    ("serving.md", "python -m meshtrain.serve --workdir runs/qwen"): "needs a converted Qwen run (no network here)",
    ("huggingface.md", "python -m meshtrain.convert from-hf HF_DIR"): "HF_DIR is a downloaded model (no network "
    "here); tests/test_convert.py runs from-hf, generate, fine-tuning and to-hf on locally built models",
    ("huggingface.md", "python -m meshtrain.generate --workdir runs/hf"): "needs the from-hf run above",
    ("huggingface.md", "python -m meshtrain.train --config configs/finetune_hf.py"): "needs the from-hf run above",
    ("huggingface.md", "python -m meshtrain.convert to-hf --workdir runs/sft"): "needs the fine-tuned run above",
    ("huggingface.md", "python -m meshtrain.convert from-diffusers FLUX.1-dev"): "FLUX.1-dev is a downloaded "
    "pipeline (no network here); tests/test_flux_convert.py converts, samples and exports a pipeline diffusers saves "
    "locally",
    ("huggingface.md", "python -m meshtrain.sample --workdir runs/flux"): "needs the from-diffusers run above",
    ("huggingface.md", "python -m meshtrain.convert to-diffusers --workdir runs/flux"): "needs the from-diffusers "
    "run above",
    ("evaluation.md", "python -m meshtrain.eval --workdir runs/llama"): "runs/llama is a converted Llama",
    ("own-data.md", "python -m meshtrain.data show --config configs/tiny.py --rows 3 --config.data.name=chats.jsonl"):
    "its '...' stands for the chat run's data flags above (data.format=chat needs a converted model's tokenizer)",
    ("own-data.md", "python -m meshtrain.train --config configs/finetune_hf.py"): "init_from=runs/qwen: a converted "
    "Qwen run (no network here); tests/test_own_data.py trains chat records on a locally built model",
    ("image-generation.md", "python -m meshtrain.convert from-hf path/to/Qwen3"): "needs a downloaded Qwen3 (no "
    "network here); tests/test_frozen_text.py converts a Qwen3 transformers builds locally and trains on it",
    ("image-generation.md", "python -m meshtrain.train --config configs/t2i_tiny.py --workdir runs/t2i_qwen"):
    "needs the converted Qwen3 above",
    ("inspect-and-plan.md", "$ python -m meshtrain.plan"): "a search over every layout (1-3 minutes on 2 cores); "
    "tests/test_inspect.py plans smaller searches",
    ("inspect-and-plan.md", "python -m meshtrain.train --config configs/llama8b.py"): "an 8B model on 8 devices",
}


def own_text(cwd: pathlib.Path) -> None:
  """corpus/*.jsonl (the repository's Python files as documents) and chats.jsonl, as own-data.md's examples read."""
  (cwd / "corpus").mkdir()
  sources = sorted((ROOT / "meshtrain").rglob("*.py"))
  for i, half in enumerate((sources[::2], sources[1::2])):
    with open(cwd / "corpus" / f"part{i}.jsonl", "w") as f:
      f.writelines(json.dumps({"text": path.read_text()}) + "\n" for path in half)
  with open(cwd / "chats.jsonl", "w") as f:
    f.writelines(json.dumps({"messages": [{"role": "user", "content": f"What is {i}+{i}?"},
                                          {"role": "assistant", "content": f"{2 * i}."}]}) + "\n" for i in range(200))


def own_pictures(cwd: pathlib.Path) -> None:
  """pictures/ (class subfolders, as image-generation.md's folder example: 400 captions, so that its 1% held out
  by caption holds some) and prompts.txt."""
  from PIL import Image
  rng = np.random.default_rng(0)
  for i in range(400):
    colour, rgb = [("red", (220, 30, 30)), ("blue", (30, 30, 220))][i % 2]
    folder = cwd / "pictures" / f"{colour}_square_{i}"
    folder.mkdir(parents=True)
    pixels = np.full((32, 32, 3), 255, np.uint8)
    x, y = rng.integers(0, 16, 2)
    pixels[y:y + 16, x:x + 16] = rgb
    Image.fromarray(pixels).save(folder / "1.png")
  (cwd / "prompts.txt").write_text("a green square\na blue triangle\n")


def harness_task(cwd: pathlib.Path) -> None:
  """tasks/mytask.yaml as evaluation.md writes it, over a local file of three questions."""
  page = (ROOT / "docs" / "evaluation.md").read_text()
  (yaml,) = [b for b in BLOCK.findall(page) if b.startswith("# tasks/mytask.yaml")]
  data = cwd / "mytask.jsonl"
  data.write_text("".join(json.dumps({"question": f"{i} + {i} =", "choices": [str(2 * i), str(2 * i + 1)],
                                      "answer": 0}) + "\n" for i in range(3)))
  (cwd / "tasks").mkdir()
  (cwd / "tasks" / "mytask.yaml").write_text(yaml.replace("/data/mytask.jsonl", str(data)))


# What a page's commands read that the page shows but does not write.
SETUP = {"own-data.md": own_text, "image-generation.md": own_pictures, "evaluation.md": harness_task,
         "generation.md": lambda cwd: (cwd / "prompt.py").write_text("def main(")}


def commands(page: pathlib.Path) -> list[tuple[str, str]]:
  """The page's `python -m meshtrain...` command lines in its code blocks (continuation lines joined), each with the
  output line a transcript (`$ command`, then what it prints) shows under it, else ""."""
  found = []
  for block in BLOCK.findall(page.read_text()):
    lines = [line.strip() for line in block.replace("\\\n", " ").splitlines()]
    for i, line in enumerate(lines):
      if line.lstrip("$ ").startswith("python -m meshtrain."):
        shown = lines[i + 1] if line.startswith("$") and i + 1 < len(lines) else ""
        found.append((line, "" if shown.startswith("$") else shown))
  return found


def budget(words: list[str]) -> list[str]:
  """What shortens the command's run: 2 training steps (as many as a profile window needs), a short bench."""
  module = words[words.index("--module") + 1] if "--module" in words else words[2]
  if module == "meshtrain.launch":
    module = "meshtrain.train"
  extra = [] if "--data-only" in words else list(BUDGET.get(module, []))  # its own budget: --data-seconds
  for word in words:
    if word.startswith("--config.profile_steps="):
      extra[0] = f"--config.steps={word.split('-')[-1]}"
  return extra


PAGES = [page for page in sorted((ROOT / "docs").glob("*.md")) if commands(page)]


def reason_not_run(page: str, line: str) -> str | None:
  return next((why for (p, start), why in CANNOT_RUN.items() if p == page and line.startswith(start)), None)


def argv(line: str) -> list[str]:
  """The command's arguments as a shell would split them (comments dropped), placeholders filled."""
  words = shlex.split(line.lstrip("$ ").rstrip("&").strip(), comments=True)
  words = [w for w in words if not (w.startswith("[") or w.endswith("]") or w == "...")]
  fill = {"DIR": "runs/dir", "RUN": "runs/run", "KEY": "secret"}
  return [fill.get(w, w) for w in words]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """runs/tiny, runs/t2i and runs/dit trained 2 steps, for the pages that use them without training them."""
  runs = tmp_path_factory.mktemp("trained")
  for name, config in (("tiny", "configs/tiny.py"), ("t2i", "configs/t2i_tiny.py"), ("dit", "configs/dit_digits.py")):
    proc = subprocess.run([sys.executable, "-m", "meshtrain.train", "--config", config, "--workdir",
                           str(runs / name), *BUDGET["meshtrain.train"]], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=xla_fast.env())
    assert proc.returncode == 0, proc.stderr[-3000:]
  return runs


def run_serve(words: list[str], cwd: pathlib.Path) -> tuple[int, str]:
  """A server as written, on a free port and --lazy, until it says it is serving; then SIGTERM (it drains and exits
  0). --lazy: the warm-up compiles every program first (75 s for runs/tiny on a busy worker, 5 servers here), which
  tests/test_serve.py times once."""
  words = [w for i, w in enumerate(words) if w != "--port" and (i == 0 or words[i - 1] != "--port")]
  proc = subprocess.Popen([sys.executable, *words[1:], "--port", "0", "--lazy"], cwd=cwd, stderr=subprocess.PIPE,
                          text=True, env=xla_fast.env())
  lines = []
  while line := proc.stderr.readline():
    lines.append(line)
    if re.match(r"(\[p0\] )?serving \S+ on http", line):
      proc.send_signal(signal.SIGTERM)
      break
  lines.append(proc.communicate(timeout=300)[1])
  return proc.returncode, "".join(lines)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_pages_commands_run_as_written(page, trained, tmp_path):
  lines = commands(page)
  (tmp_path / "configs").symlink_to(ROOT / "configs")
  (tmp_path / "runs").mkdir()
  for name in ("tiny", "t2i", "dit"):
    shutil.copytree(trained / name, tmp_path / "runs" / name)
  if page.name in SETUP:
    SETUP[page.name](tmp_path)
  ran = []
  for line, shown in lines:
    if (why := reason_not_run(page.name, line)) is not None:
      print(f"not run: {line}\n  because: {why}")
      continue
    words = argv(line)
    if "meshtrain.serve" in words:
      code, output = run_serve(words, tmp_path)
    else:
      proc = subprocess.run([sys.executable, *words[1:], *budget(words)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=600, env=xla_fast.env())
      code, output = proc.returncode, proc.stdout + proc.stderr
    # A transcript that shows an error shows a refusal: exit code 2 and that line. Times shown may differ.
    expected = 2 if shown.startswith("error:") else 0
    printed = re.compile(r"[\d.]+ s\b".join(map(re.escape, re.split(r"\b[\d.]+ s\b", shown))))
    assert code == expected and printed.search(output), f"{page.name}: {line}\nexit code {code}\n{output[-3000:]}"
    ran.append(line)
  assert ran or all(reason_not_run(page.name, line) for line, _ in lines)
