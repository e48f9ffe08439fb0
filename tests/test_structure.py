"""The shape of meshtrain/, read from its own source with `ast`: the layering rules of docs/development.md hold.

- every module belongs to one of the layers meshtrain/__init__.py declares, and imports nothing from a later one
  (imports inside functions count too); no import cycle;
- no module uses another module's private (_underscore) names;
- the commands live in meshtrain/cli/, share no name with a library module, and are thin; `meshtrain/X.py` is only
  their alias; errors become exit codes in one place;
- imports inside functions are few (at most 3 per 1,000 lines), each with its reason on the line;
- no function is long, and no module names a dated benchmark report.
"""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parents[1]
PACKAGE = ROOT / "meshtrain"
# Third-party packages that take a second or more to import, or start a runtime: what a function-local import may
# keep off a fast path (argument checks, config validation, `--help`).
# numpy (~0.2 s) is one: the commands' argument and config checks load none of it. tokenizers and sentencepiece are
# light but absent from the GPU machine's package set (experiments/gpu_dryrun.sh): only runs that use them import them.
HEAVY = {"tokenizers", "sentencepiece", "jax", "jaxlib", "flax", "optax", "orbax", "tensorflow", "tensorflow_datasets",
         "grain", "torch", "transformers", "sklearn", "matplotlib", "PIL", "tensorboardX", "array_record", "jinja2",
         "scipy", "numpy", "pyarrow", "lm_eval",
         "threadpoolctl"}  # scikit-learn's: absent where scikit-learn is (the GPU machines)
COMMAND_MAX_LINES = 150
ALIAS_MAX_LINES = 6
LOCAL_IMPORTS_PER_1000_LINES = 3
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


DECLARED = {n.targets[0].id: ast.literal_eval(n.value) for n in TREES["meshtrain"].body
            if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
            and n.targets[0].id in ("LAYERS", "COMMANDS")}
LAYERS, ALIASES = DECLARED["LAYERS"], [f"meshtrain.{c}" for c in DECLARED["COMMANDS"]] + ["meshtrain.data.__main__"]
COMMANDS = sorted(m for m in MODULES if m.startswith("meshtrain.cli."))


def layer_of(module: str) -> int:
  """The index in LAYERS of the layer `module` belongs to (the command aliases: the last); the package root: -1."""
  if module == "meshtrain":
    return -1
  if module in ALIASES:
    return len(LAYERS) - 1
  top = module.split(".")[1]
  return next(i for i, names in enumerate(LAYERS) if top in names)


def test_the_analysis_sees_the_package():
  # Guards the checks below against passing vacuously: they see every module, its imports and the commands.
  assert {"meshtrain.config", "meshtrain.train", "meshtrain.tasks", "meshtrain.families.lm"} <= set(MODULES)
  assert "meshtrain.config" in EDGES["meshtrain.tasks"] and "jax" in heavy_at_import("meshtrain.families.lm")
  assert {f"meshtrain.cli.{c}" for c in ("train", "generate", "plan", "inspect")} <= set(COMMANDS)
  assert len(LAYERS) >= 8 and layer_of("meshtrain.families.lm") > layer_of("meshtrain.tasks.lm_config")


def test_every_module_is_in_a_declared_layer():
  missing = [m for m in MODULES if m != "meshtrain" and m not in ALIASES
             and not any(m.split(".")[1] in names for names in LAYERS)]
  assert missing == [], f"modules in no layer of meshtrain/__init__.py's LAYERS: {missing}"


def test_no_import_climbs_a_layer():
  upward = [f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
            for m in MODULES if m != "meshtrain" for t in sorted(EDGES[m]) if layer_of(t) > layer_of(m)]
  assert upward == []


def test_the_package_root_imports_only_the_jax_free_layers():
  assert all(layer_of(t) <= 1 for t in EDGES["meshtrain"]), EDGES["meshtrain"]
  assert heavy_at_import("meshtrain") == set()


def test_no_import_cycles():
  assert cycles() == []


def test_no_private_names_across_modules():
  assert private_uses() == []


def test_config_imports_no_task():
  assert not {t for t in EDGES["meshtrain.config"] if t.startswith(("meshtrain.tasks", "meshtrain.families"))}


def test_library_imports_no_command():
  for m in MODULES:
    if m not in COMMANDS and m not in ALIASES and m != "meshtrain.cli":
      assert not EDGES[m] & {*COMMANDS, *ALIASES}, f"library module {m} imports a command"


def test_commands_share_no_name_with_a_library_module():
  library = {m.rsplit(".", 1)[-1] for m in MODULES if not m.startswith("meshtrain.cli") and m not in ALIASES}
  assert not {c.rsplit(".", 1)[-1] for c in COMMANDS} & library


@pytest.mark.parametrize("alias", ALIASES)
def test_command_aliases_only_run_their_command(alias):
  text = MODULES[alias].read_text()
  assert len(text.splitlines()) <= ALIAS_MAX_LINES and EDGES[alias] <= {"meshtrain.cli", *COMMANDS}, text


def test_errors_become_exit_codes_in_one_place():
  # A command raises UserError or RunAborted; meshtrain/cli/__init__.py prints it and returns 2 or 3.
  elsewhere = [str(MODULES[m].relative_to(ROOT)) for m in MODULES if m != "meshtrain.cli"
               and any(isinstance(n, ast.Return) and isinstance(n.value, ast.Constant) and n.value.value in (2, 3)
                       and isinstance(h, ast.ExceptHandler) for h in ast.walk(TREES[m]) for n in ast.walk(h))]
  assert elsewhere == []


def local_imports() -> list[tuple[str, Import]]:
  return [(m, imp) for m in MODULES for imp in IMPORTS[m] if imp.local]


def test_few_function_local_imports_each_with_its_reason():
  lines = sum(len(p.read_text().splitlines()) for p in MODULES.values())
  found = local_imports()
  where = [f"{MODULES[m].relative_to(ROOT)}:{imp.node.lineno}" for m, imp in found]
  assert len(found) <= LOCAL_IMPORTS_PER_1000_LINES * lines / 1000, (len(found), lines, where)
  silent = [w for (m, imp), w in zip(found, where)
            if "#" not in MODULES[m].read_text().splitlines()[imp.node.end_lineno - 1]]
  assert silent == [], "say on the line why these imports sit inside a function"


def test_function_local_imports_keep_a_heavy_package_off_the_path():
  wrong = []
  for m, imp in local_imports():
    at_import = heavy_at_import(m)
    brings = imp.external & HEAVY
    for target in imp.targets:
      brings |= heavy_at_import(target) | {p for parent in parents(target) for p in heavy_at_import(parent)}
    if not brings - at_import:
      wrong.append(f"{MODULES[m].relative_to(ROOT)}:{imp.node.lineno}: {ast.unparse(imp.node)}")
  assert wrong == [], "imports inside functions that keep nothing heavy off the path; move them to the top"


def test_no_module_names_a_dated_report():
  # Dated measurements live in benchmarks/; the code says what is true, not when it was measured.
  dated = re.compile(r"\b20\d\d-\d\d-\d\d\b")
  found = [f"{p.relative_to(ROOT)}:{i}" for p in MODULES.values()
           for i, line in enumerate(p.read_text().splitlines(), 1) if dated.search(line)]
  assert found == []


@pytest.mark.parametrize("module", COMMANDS)
def test_command_modules_are_thin(module):
  lines = len(MODULES[module].read_text().splitlines())
  assert lines <= COMMAND_MAX_LINES, f"{module} is {lines} lines; its work belongs in the library"


def test_no_long_functions():
  long = []
  for m, tree in TREES.items():
    limit = TRAIN_FUNCTION_MAX_LINES if m == "meshtrain.cli.train" else FUNCTION_MAX_LINES
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        n = node.end_lineno - node.lineno + 1
        if n > limit:
          long.append(f"{MODULES[m].relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines (limit {limit})")
  assert long == []
