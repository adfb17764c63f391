"""YAML presets and experiment settings, installed as ``blockattn_layers.presets``."""
