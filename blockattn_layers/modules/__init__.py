"""nn.Module layers built on block attention."""
from .attention import BlockSelfAttention, RotaryBlockAttention
from .convert import from_torch_encoder
from .embedding import JaggedSequenceEncoder
from .encoder import JaggedTransformerEncoder, JaggedTransformerEncoderLayer

__all__ = [
    "BlockSelfAttention",
    "JaggedSequenceEncoder",
    "JaggedTransformerEncoder",
    "JaggedTransformerEncoderLayer",
    "RotaryBlockAttention",
    "from_torch_encoder",
]
