"""``python -m blockattn_layers.bench``: see ``--help``."""
import sys

from .cli import main

if __name__ == "__main__":  # not in --precompile's spawned workers, which import this module again
    sys.exit(main())
