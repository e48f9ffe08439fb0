"""`python -m meshtrain.eval`: the command is meshtrain/cli/eval.py."""
from meshtrain import cli
from meshtrain.cli.eval import main

if __name__ == "__main__":
  cli.run(main)
