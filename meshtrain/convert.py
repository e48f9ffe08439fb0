"""`python -m meshtrain.convert`: the command is meshtrain/cli/convert.py."""
from meshtrain import cli
from meshtrain.cli.convert import main

if __name__ == "__main__":
  cli.run(main)
