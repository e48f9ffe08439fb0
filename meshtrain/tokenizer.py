"""`python -m meshtrain.tokenizer`: the command is meshtrain/cli/tokenizer.py."""
from meshtrain import cli
from meshtrain.cli.tokenizer import main

if __name__ == "__main__":
  cli.run(main)
