"""blockattn-layers: block-diagonal self-attention over jagged sequences for ranking models."""
from .dispatch import AttentionRequest, Backend, BackendSpec, explain, registered_backends
from .functional import block_attention, jagged_attention

__version__ = "0.1.0"

__all__ = [
    "AttentionRequest",
    "Backend",
    "BackendSpec",
    "block_attention",
    "explain",
    "jagged_attention",
    "registered_backends",
]
