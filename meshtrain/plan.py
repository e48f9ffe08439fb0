"""`python -m meshtrain.plan`: the command is meshtrain/cli/plan.py."""
from meshtrain import cli
from meshtrain.cli.plan import main

if __name__ == "__main__":
  cli.run(main)
