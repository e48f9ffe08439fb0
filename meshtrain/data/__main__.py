"""`python -m meshtrain.data`: the command is meshtrain/cli/data_stats.py."""
from meshtrain import cli
from meshtrain.cli.data_stats import main

if __name__ == "__main__":
  cli.run(main)
