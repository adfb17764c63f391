"""nn.Module layers built on block attention."""
from .attention import BlockSelfAttention, RotaryBlockAttention
from .convert import from_torch_encoder
from .embedding import JaggedSequenceEncoder
from .encoder import JaggedTransformerEncoder, JaggedTransformerEncoderLayer
from .fp8 import FP8QKVProjection, to_fp8_inference

__all__ = [
    "BlockSelfAttention",
    "FP8QKVProjection",
    "JaggedSequenceEncoder",
    "JaggedTransformerEncoder",
    "JaggedTransformerEncoderLayer",
    "RotaryBlockAttention",
    "from_torch_encoder",
    "to_fp8_inference",
]
