"""`python -m meshtrain.serve`: the command is meshtrain/cli/serve.py."""
from meshtrain import cli
from meshtrain.cli.serve import main

if __name__ == "__main__":
  cli.run(main)
