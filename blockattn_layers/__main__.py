"""``python -m blockattn_layers {demo,bench,info}``: see ``--help``."""
import sys

from .cli import main

sys.exit(main())
