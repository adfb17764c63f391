"""Command line of ``python -m blockattn_layers``: ``demo``, ``bench`` and ``info``."""
from .main import main

__all__ = ["main"]
