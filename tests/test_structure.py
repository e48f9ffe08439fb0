"""The shape of meshtrain/, read from its own source with `ast`: the layering rules of docs/development.md hold.

- no import cycle between meshtrain's modules, counting imports inside functions;
- no module uses another module's private (_underscore) names;
- config imports nothing from the tasks, and the tasks import no command module;
- an import inside a function only where it keeps a heavy package (JAX, TFDS, torch, ...) off the importer's path;
- command modules (`python -m meshtrain.X`) are thin, and no function is long.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parents[1]
PACKAGE = ROOT / "meshtrain"
# Third-party packages that take a second or more to import, or start a runtime: what a function-local import may
# keep off a fast path (argument checks, config validation, `--help`).
# numpy (~0.2 s) is one: the commands' argument and config checks load none of it. tokenizers and sentencepiece are
# light but absent from the GPU machine's package set (experiments/gpu_dryrun.sh): only runs that use them import them.
HEAVY = {"tokenizers", "sentencepiece", "jax", "jaxlib", "flax", "optax", "orbax", "tensorflow", "tensorflow_datasets",
         "grain", "torch", "transformers", "sklearn", "matplotlib", "PIL", "tensorboardX", "array_record", "jinja2",
         "scipy", "numpy", "pyarrow"}
COMMAND_MAX_LINES = 150
FUNCTION_MAX_LINES = 100
TRAIN_FUNCTION_MAX_LINES = 60


def module_name(path: pathlib.Path) -> str:
  rel = path.relative_to(ROOT).with_suffix("")
  return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {m: ast.parse(p.read_text(), str(p)) for m, p in MODULES.items()}


def is_package(module: str) -> bool:
  return MODULES[module].name == "__init__.py"


class Import:
  """One import statement's meshtrain targets (modules) and names, and whether it sits inside a function."""

  def __init__(self, module: str, node, local: bool):
    self.node, self.local, self.targets, self.names, self.external = node, local, set(), [], set()
    self.aliases = {}  # local name -> the meshtrain module it is bound to
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name in MODULES:
          self.targets.add(alias.name)
          if alias.asname:
            self.aliases[alias.asname] = alias.name
        elif not alias.name.startswith("meshtrain"):
          self.external.add(alias.name.split(".")[0])
      return
    base = node.module or ""
    if node.level:
      package = module if is_package(module) else module.rpartition(".")[0]
      parts = package.split(".")[:len(package.split(".")) - node.level + 1]
      base = ".".join(parts + ([node.module] if node.module else []))
    if not base.startswith("meshtrain"):
      self.external.add(base.split(".")[0])
      return
    for alias in node.names:
      if f"{base}.{alias.name}" in MODULES:
        self.targets.add(f"{base}.{alias.name}")
        self.aliases[alias.asname or alias.name] = f"{base}.{alias.name}"
      else:
        self.targets.add(base)
        self.names.append((base, alias.name))


def imports(module: str) -> list[Import]:
  out = []

  def walk(node, local):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.Import, ast.ImportFrom)):
        out.append(Import(module, child, local))
      walk(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

  walk(TREES[module], False)
  return out


IMPORTS = {m: imports(m) for m in MODULES}
EDGES = {m: {t for i in IMPORTS[m] for t in i.targets if t != m} for m in MODULES}


def parents(module: str) -> list[str]:
  parts = module.split(".")
  return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in MODULES]


def heavy_at_import(module: str, seen=None) -> set[str]:
  """The heavy third-party packages importing `module` loads (module-level imports, its packages' too)."""
  seen = set() if seen is None else seen
  if module in seen:
    return set()
  seen.add(module)
  out = set()
  for imp in IMPORTS[module]:
    if imp.local:
      continue
    out |= imp.external & HEAVY
    for target in imp.targets:
      for m in [*parents(target), target]:
        out |= heavy_at_import(m, seen)
  return out


def cycles() -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in EDGES[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for m in MODULES:
    if m not in index:
      visit(m)
  return found


def private_uses() -> list[str]:
  out = []
  for m, tree in TREES.items():
    aliases = {}
    for imp in IMPORTS[m]:
      for base, name in imp.names:
        if name.startswith("_") and not name.startswith("__") and base != m:
          out.append(f"{m} imports {base}.{name}")
      aliases.update(imp.aliases)
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
          and node.attr.startswith("_") and not node.attr.startswith("__") and aliases[node.value.id] != m):
        out.append(f"{m} uses {aliases[node.value.id]}.{node.attr}")
  return out


def is_command(module: str) -> bool:
  return any(isinstance(n, ast.If) and "__main__" in ast.unparse(n.test) for n in TREES[module].body)


COMMANDS = sorted(m for m in MODULES if is_command(m))


def test_the_analysis_sees_the_package():
  # Guards the checks below against passing vacuously: they see every module, its imports and the commands.
  assert {"meshtrain.config", "meshtrain.train", "meshtrain.tasks", "meshtrain.tasks.lm"} <= set(MODULES)
  assert "meshtrain.config" in EDGES["meshtrain.tasks"] and "jax" in heavy_at_import("meshtrain.tasks.lm")
  assert {"meshtrain.train", "meshtrain.generate", "meshtrain.plan", "meshtrain.inspect"} <= set(COMMANDS)


def test_no_import_cycles():
  assert cycles() == []


def test_no_private_names_across_modules():
  assert private_uses() == []


def test_config_imports_no_task_and_tasks_import_no_command():
  assert not {t for t in EDGES["meshtrain.config"] if t.startswith("meshtrain.tasks")}
  for m in MODULES:
    if m.startswith("meshtrain.tasks"):
      assert not EDGES[m] & set(COMMANDS), f"{m} imports the command module(s) {EDGES[m] & set(COMMANDS)}"


def test_library_imports_no_command():
  for m in MODULES:
    if m not in COMMANDS:
      assert not EDGES[m] & set(COMMANDS), f"library module {m} imports command(s) {sorted(EDGES[m] & set(COMMANDS))}"


def test_function_local_imports_keep_a_heavy_package_off_the_path():
  wrong = []
  for m in MODULES:
    at_import = heavy_at_import(m)
    for imp in IMPORTS[m]:
      if not imp.local:
        continue
      brings = imp.external & HEAVY
      for target in imp.targets:
        brings |= heavy_at_import(target) | {p for parent in parents(target) for p in heavy_at_import(parent)}
      if not brings - at_import:
        wrong.append(f"{MODULES[m].relative_to(ROOT)}:{imp.node.lineno}: {ast.unparse(imp.node)}")
  assert wrong == [], "imports inside functions that keep nothing heavy off the path; move them to the top"


@pytest.mark.parametrize("module", COMMANDS)
def test_command_modules_are_thin(module):
  lines = len(MODULES[module].read_text().splitlines())
  assert lines <= COMMAND_MAX_LINES, f"{module} is {lines} lines; its work belongs in the library"


def test_no_long_functions():
  long = []
  for m, tree in TREES.items():
    limit = TRAIN_FUNCTION_MAX_LINES if m == "meshtrain.train" else FUNCTION_MAX_LINES
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        n = node.end_lineno - node.lineno + 1
        if n > limit:
          long.append(f"{MODULES[m].relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines (limit {limit})")
  assert long == []
