"""lm-evaluation-harness tasks, loaded offline (no JAX): what `python -m meshtrain.eval` and training's harness hook
check before anything is compiled.

Tasks come from an --include-path folder of YAMLs over local files, or are the harness's own over datasets already
in the local Hugging Face cache: the Hub is switched off (HF_DATASETS_OFFLINE, HF_HUB_OFFLINE) before the harness
and `datasets` are imported, so a task whose data would be downloaded fails at once, as one UserError.
"""
import os
import pathlib

from meshtrain.errors import UserError


def load(names: list[str], include_path: str | None, what: str = "--tasks"):
  """The harness's TaskManager for `names`, every task's data loaded now: UserError naming an unknown task or one
  whose data is not on this machine (`what`: the option or config key that named them)."""
  os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
  try:
    from lm_eval import tasks as lm_eval_tasks  # pylint: disable=g-import-not-at-top  (reads the variables above)
  except ImportError:
    raise UserError(f"{what} needs lm-evaluation-harness: pip install -e \".[eval]\"") from None
  if include_path and not pathlib.Path(include_path).expanduser().is_dir():
    raise UserError(f"{what}: the include path {include_path} is not a folder of task YAMLs")
  manager = lm_eval_tasks.TaskManager(include_path=str(pathlib.Path(include_path).expanduser()) if include_path
                                      else None)
  unknown = [t for t in names if t not in manager.all_tasks]
  if not names or unknown:
    raise UserError(f"{what}: {', '.join(unknown) or 'none given'}: not a harness task here; `lm_eval ls tasks` "
                    "lists them, an include path adds your own YAMLs")
  try:
    manager.load(names)
  except Exception as e:  # datasets' offline and missing-file errors have no common type
    first = str(e).splitlines()[0] if str(e) else ""
    raise UserError(f"{what} {','.join(names)}: the data could not be loaded without downloading "
                    f"({type(e).__name__}: {first}); point the task at local files (dataset_path: json, "
                    "dataset_kwargs.data_files) or put the dataset in the Hugging Face cache first") from None
  return manager


def metrics(results: dict) -> dict[str, float]:
  """The harness's `results` as flat numbers: {"harness/TASK/METRIC": value}, its ",none" filter suffix and the
  standard errors left out."""
  out = {}
  for task, values in results["results"].items():
    for key, value in values.items():
      if isinstance(value, (int, float)) and not isinstance(value, bool) and "_stderr" not in key:
        out[f"harness/{task}/{key.removesuffix(',none')}"] = float(value)
  return out
