"""`python -m meshtrain.inspect`: the command is meshtrain/cli/inspect.py."""
from meshtrain import cli
from meshtrain.cli.inspect import main

if __name__ == "__main__":
  cli.run(main)
