"""`python -m meshtrain.sample`: the command is meshtrain/cli/sample.py."""
from meshtrain import cli
from meshtrain.cli.sample import main

if __name__ == "__main__":
  cli.run(main)
