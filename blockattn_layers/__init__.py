"""blockattn-layers: block-diagonal self-attention over jagged sequences for ranking models."""
from .dispatch import AttentionRequest, Backend, BackendSpec, explain, explain_variants, registered_backends
from .determinism import fast_backward, use_fast_backward
from .config import EncoderConfig, EncoderLayerConfig, build_encoder, list_presets, load_config
from .fp8 import quantize_fp8
from .functional import block_attention, jagged_attention
from .jagged import (
    JaggedLayout, jagged_to_padded, lengths_to_key_padding_mask, lengths_to_offsets, offsets_to_lengths,
    padded_to_jagged, to_values_offsets,
)
from .modules import (
    BlockSelfAttention, JaggedSequenceEncoder, JaggedTransformerEncoder, JaggedTransformerEncoderLayer,
    RotaryBlockAttention, from_torch_encoder, to_fp8_inference,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionRequest",
    "Backend",
    "BackendSpec",
    "BlockSelfAttention",
    "EncoderConfig",
    "EncoderLayerConfig",
    "JaggedLayout",
    "JaggedSequenceEncoder",
    "JaggedTransformerEncoder",
    "JaggedTransformerEncoderLayer",
    "RotaryBlockAttention",
    "block_attention",
    "build_encoder",
    "explain",
    "explain_variants",
    "fast_backward",
    "from_torch_encoder",
    "jagged_attention",
    "jagged_to_padded",
    "lengths_to_key_padding_mask",
    "lengths_to_offsets",
    "list_presets",
    "load_config",
    "offsets_to_lengths",
    "padded_to_jagged",
    "quantize_fp8",
    "registered_backends",
    "to_fp8_inference",
    "to_values_offsets",
    "use_fast_backward",
]
