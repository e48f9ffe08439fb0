"""Evaluate a trained (or converted) language model on lm-evaluation-harness tasks, in this process, on the mesh.

  python -m meshtrain.eval --workdir W --tasks T1,T2 [--include-path DIR] [--limit N] [--num-fewshot K]
      [--batch-size B] [--step N] [--max-len N] [--json]
      [--config.mesh.*=... --config.sharding.rules=... --config.cpu_devices=N]

The harness's tasks run against meshtrain/inference/harness.py's MeshLM: loglikelihoods from the training forward
pass on the mesh, generations from the Generator; the same tasks through `python -m meshtrain.serve` and the
harness's `local-completions` give the same results (docs/evaluation.md). Nothing is downloaded: tasks come from
--include-path YAMLs over local files, or from datasets already in the local Hugging Face cache (the Hub is set
offline); a task whose data would have to be downloaded is an error before anything is compiled.

Prints the harness's table (--json: its `results`, one JSON object) on process 0.

Exit codes: 0 done, 2 a user mistake (an unknown task, data that would be downloaded, a workdir of another task,
a missing checkpoint), one `error:` line.
"""
import json
import pathlib

from meshtrain import cli, config as config_lib
from meshtrain.errors import ArgumentParser, UserError
from meshtrain.inference import harness_tasks
from meshtrain.runtime import startup


def parse_args(argv: list[str]):
  parser = ArgumentParser(prog="python -m meshtrain.eval", description=__doc__.split("\n\n")[0],
                          epilog="Mesh and sharding as for train: --config.mesh.data=8 --config.cpu_devices=8")
  parser.add_argument("--workdir", required=True, help="a training run's (or a converted model's) directory")
  parser.add_argument("--tasks", required=True, help="comma-separated harness task (or group) names")
  parser.add_argument("--include-path", default=None, help="a folder of task YAMLs (your own tasks)")
  parser.add_argument("--limit", type=int, default=None, help="at most N documents per task")
  parser.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
  parser.add_argument("--batch-size", type=int, default=8, help="rows per scoring or generation call")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
  parser.add_argument("--max-len", type=int, default=None, help="the context (default: the run's seq_len)")
  parser.add_argument("--json", action="store_true", help="print the harness's results as one JSON object")
  args, overrides = parser.parse_known_args(argv)
  for name in ("limit", "batch_size", "max_len"):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      raise UserError(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
  if args.num_fewshot is not None and args.num_fewshot < 0:
    raise UserError(f"--num-fewshot {args.num_fewshot} must be at least 0")
  workdir = pathlib.Path(args.workdir).expanduser()
  from meshtrain import checkpoint  # Orbax (and JAX): only once the arguments are checked
  _, meta = checkpoint.run_meta(args.workdir, args.step, "a training run or of a converted model")
  if (task := checkpoint.task_of(meta)) != "lm":
    raise UserError(f"{args.workdir} was trained with task={task}; the harness evaluates language models (task=lm)")
  cfg, args.dtype = config_lib.inference_config(overrides, "evaluation")
  args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
  return args, cfg, workdir


@cli.command
def main(argv: list[str]) -> int:
  args, cfg, workdir = parse_args(argv)
  manager = harness_tasks.load(args.tasks, args.include_path)
  # JAX and the harness: once the arguments and tasks are checked (and the Hub switched off)
  from meshtrain.inference import generator, harness  # pylint: disable=g-import-not-at-top
  startup.start(cfg)
  gen = generator.Generator.from_config(cfg, workdir, args.step, max_len=args.max_len, dtype=args.dtype)
  results = harness.evaluate(harness.MeshLM(gen, args.batch_size), args.tasks, manager, args.limit,
                             args.num_fewshot)
  if startup.is_main():
    if args.json:
      print(json.dumps(results["results"], default=str))
    else:
      print(harness.table(results))
  return 0
