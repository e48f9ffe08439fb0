"""`python -m meshtrain.launch`: the command is meshtrain/cli/launch.py."""
from meshtrain import cli
from meshtrain.cli.launch import main

if __name__ == "__main__":
  cli.run(main)
