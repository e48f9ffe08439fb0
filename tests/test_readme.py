"""The README's promises run: the Quickstart command (with fewer steps) and the research-code example of the docs;
the README stays short and every docs page is in the site's nav."""
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
import xla_fast

ROOT = pathlib.Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()


def quickstart_commands(config: str) -> list[list[str]]:
  """The Quickstart's `python -m meshtrain...` commands on the line that trains `config`, in order."""
  section = README.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
  (line,) = [l for l in section.splitlines() if f"python -m meshtrain.train --config {config}" in l]
  return [shlex.split(part[part.index("python -m meshtrain."):]) for part in line.split("&&")
          if "python -m meshtrain." in part]


def quickstart_train_command() -> list[str]:
  return quickstart_commands("configs/tiny.py")[0]


@pytest.mark.slow
def test_quickstart_trains(tmp_path):
  # The command as written, with fewer steps, compiled with xla_fast's flags (faster to compile; same program)
  argv = quickstart_train_command()
  argv[argv.index("--workdir") + 1] = str(tmp_path / "run")
  proc = subprocess.run([sys.executable, *argv[1:], "--config.steps=8", "--config.eval_every=8",
                         "--config.log_every=4"], capture_output=True, text=True, timeout=600,
                        cwd=pathlib.Path(__file__).parents[1], env=xla_fast.env())
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "train step compiled" in proc.stdout and "done: step 8" in proc.stdout
  assert (tmp_path / "run" / "checkpoints" / "8").is_dir() and (tmp_path / "run" / "loss.png").exists()


@pytest.mark.slow
def test_quickstart_image_generator(tmp_path):
  """The DiT line trains (2 steps, with the sample grid at the end) and samples from its workdir."""
  train, sample = quickstart_commands("configs/dit_digits.py")
  for argv, extra in ((train, ["--config.steps=2", "--config.eval_every=2", "--config.log_every=1"]), (sample, [])):
    argv = [str(tmp_path / a) if a.startswith(("runs/", "digits.png")) else a for a in argv]
    proc = subprocess.run([sys.executable, *argv[1:], *extra], capture_output=True, text=True, timeout=600,
                          cwd=pathlib.Path(__file__).parents[1], env=xla_fast.env())
    assert proc.returncode == 0, proc.stderr[-3000:]
  assert (tmp_path / "runs/dit/samples/step_2.png").exists() and (tmp_path / "digits.png").exists()
  assert "sample accuracy" in proc.stdout


def test_test_command_is_what_ci_runs():
  # CI runs the README's command as written (the default python3's .venv), then the same in the newest Python's venv
  # without the tests marked slow.
  section = README.split("Run the tests", 1)[1].split("```bash", 1)[1].split("```", 1)[0].strip()
  ci = (pathlib.Path(__file__).parents[1] / ".ci" / "run").read_text()
  assert section in ci and section.replace(".venv/", '"$venv"/') + ' -m "not slow"' in ci


def test_research_code_example(capsys):
  concepts = (ROOT / "docs" / "concepts.md").read_text()
  section = concepts.split("## Use the mesh and rules in your own code", 1)[1]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  exec(compile(code, "docs/concepts.md example", "exec"), {})
  out = capsys.readouterr().out
  assert "w_in" in out and "(embed, mlp)" in out and "(fsdp, tensor)" in out
  assert "P('fsdp', 'tensor') (32, 256)" in out


def test_readme_is_short():
  # The README says what meshtrain is and how to start; the rest lives in docs/ and benchmarks/.
  assert README.count("\n") <= 250, f"README.md has {README.count(chr(10))} lines; move the detail into docs/"


def test_every_docs_page_is_in_the_nav():
  # mkdocs.yml's nav lists every page, and every page it lists exists (`mkdocs build --strict` in CI checks links).
  nav = re.findall(r"^\s*-\s*[^:\n]+:\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)
  pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
  assert sorted(nav) == pages


def test_every_benchmark_is_listed():
  # benchmarks/README.md is the one index of the dated measurements: every dated file is listed there and every
  # file it links (reports, results/ data) exists; the site's page points to the folder and repeats no list.
  index = (ROOT / "benchmarks" / "README.md").read_text()
  files = sorted(p.name for p in (ROOT / "benchmarks").glob("*.md") if p.name != "README.md")
  assert files and all(re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md", f) for f in files), files
  for name in files:
    assert f"]({name})" in index, name
  for link in re.findall(r"\]\(([^)#\s]+)\)", index):
    assert (ROOT / "benchmarks" / link).exists(), link
  site = (ROOT / "docs" / "benchmarks.md").read_text()
  assert not any(name in site for name in files)


def test_experiments_hold_code_only():
  # Results live beside the dated reports (benchmarks/results/); experiments/ holds the scripts that make them.
  skip = {".venv", "wheels", "logs", "__pycache__"}
  others = [p for p in (ROOT / "experiments").rglob("*") if p.is_file()
            and not skip & set(p.relative_to(ROOT / "experiments").parts) and p.suffix not in (".py", ".sh", ".md")]
  assert not others, others


def test_docs_tell_no_history():
  # Docs pages say what is true now and why; dated numbers and what was tried live in benchmarks/. A page may link
  # a dated report as the evidence for a number it states.
  dated = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bwent from\b|\bused to\b", re.IGNORECASE)
  found = [f"{p.name}:{i}: {line.strip()[:80]}" for p in sorted((ROOT / "docs").glob("*.md"))
           for i, line in enumerate(p.read_text().splitlines(), 1)
           if dated.search(re.sub(r"\]\([^)]*\)|`[^`]*(benchmarks/|\.md)[^`]*`", "", line))]
  assert found == []
