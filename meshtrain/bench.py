"""`python -m meshtrain.bench`: the command is meshtrain/cli/bench.py."""
from meshtrain import cli
from meshtrain.cli.bench import main

if __name__ == "__main__":
  cli.run(main)
