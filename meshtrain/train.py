"""`python -m meshtrain.train`: the command is meshtrain/cli/train.py."""
from meshtrain import cli
from meshtrain.cli.train import main

if __name__ == "__main__":
  cli.run(main)
