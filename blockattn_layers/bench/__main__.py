"""``python -m blockattn_layers.bench``: see ``--help``."""
import sys

from .cli import main

sys.exit(main())
