"""Benchmarks: ``python -m blockattn_layers.bench``."""
