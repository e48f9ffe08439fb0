"""`python -m meshtrain.generate`: the command is meshtrain/cli/generate.py."""
from meshtrain import cli
from meshtrain.cli.generate import main

if __name__ == "__main__":
  cli.run(main)
