"""Swap a padded ``nn.TransformerEncoder`` for the jagged encoder, weights included.

The recipe for a torchrec model that pads, encodes and unpads::

    # before: embeddings -> padded [B, N, E] + key_padding_mask -> nn.TransformerEncoder -> unpad
    jt = embedding_collection(kjt)["clicks"]
    padded = jt.to_padded_dense(desired_length=N)                  # [B, N, E]
    mask = lengths_to_key_padding_mask(jt.lengths(), N)            # True at padding
    out = encoder(padded, src_key_padding_mask=mask)[~mask]        # [T, E]

    # after: no padding; the same weights, full attention per sequence
    jagged_encoder = from_torch_encoder(encoder, block_size=None)
    out = jagged_encoder(jt)                                        # JaggedTensor, values [T, E]
    # or every feature at once: jagged_encoder(embedding_collection(kjt))

With ``block_size=None`` the outputs on valid tokens equal the original's in eval mode. Setting
``block_size`` then switches the converted model to block attention (a different model,
usually fine-tuned from the copied weights). The attention-probability dropout of
``nn.MultiheadAttention`` has no counterpart, so training-mode outputs differ.
"""
from __future__ import annotations

import copy
from typing import Optional, Union

from torch import nn

from .._validation import check_backend, check_block_size
from ..dispatch import Backend
from .encoder import JaggedTransformerEncoder, JaggedTransformerEncoderLayer

_RENAMES = {"self_attn.in_proj_weight": "self_attn.in_proj.weight", "self_attn.in_proj_bias": "self_attn.in_proj.bias"}


def _convert_layer(
    src: nn.TransformerEncoderLayer, block_size: Optional[int], backend: Union[str, Backend],
) -> JaggedTransformerEncoderLayer:
    attn = src.self_attn
    if not attn._qkv_same_embed_dim or attn.bias_k is not None or attn.add_zero_attn:
        raise ValueError(
            "only self-attention with kdim == vdim == embed_dim, no add_bias_kv and no add_zero_attn converts"
        )
    weight = src.linear1.weight
    dst = JaggedTransformerEncoderLayer(
        attn.embed_dim, attn.num_heads, src.linear1.out_features, src.dropout.p, src.activation,
        block_size=block_size, norm_first=src.norm_first, layer_norm_eps=src.norm1.eps,
        bias=src.linear1.bias is not None, backend=backend, device=weight.device, dtype=weight.dtype,
    )
    state = {_RENAMES.get(name, name): value for name, value in src.state_dict().items()}
    dst.load_state_dict(state)
    return dst.train(src.training)


def from_torch_encoder(
    module: Union[nn.TransformerEncoder, nn.TransformerEncoderLayer], block_size: Optional[int] = None,
    backend: Union[str, Backend] = "auto",
) -> Union[JaggedTransformerEncoder, JaggedTransformerEncoderLayer]:
    """Build the jagged equivalent of ``module`` with its weights copied.

    ``nn.TransformerEncoder`` gives a :class:`JaggedTransformerEncoder` (each layer converted,
    the final ``norm`` copied); ``nn.TransformerEncoderLayer`` gives a
    :class:`JaggedTransformerEncoderLayer`. Dtype, device and train/eval mode follow ``module``.
    ``block_size=None`` (default) keeps full attention, so on the valid tokens of a padded batch
    ``jagged(values, offsets)`` equals ``module(padded, src_key_padding_mask=mask)`` in eval mode.

    Example:
        >>> import torch
        >>> from blockattn_layers import from_torch_encoder, padded_to_jagged, lengths_to_key_padding_mask
        >>> layer = torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        >>> padded_encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
        >>> jagged_encoder = from_torch_encoder(padded_encoder)
        >>> x, lengths = torch.randn(2, 5, 16), torch.tensor([5, 3])
        >>> mask = lengths_to_key_padding_mask(lengths, 5)
        >>> values, offsets = padded_to_jagged(x, lengths)
        >>> expected = padded_encoder(x, src_key_padding_mask=mask)[~mask]
        >>> torch.allclose(jagged_encoder(values, offsets), expected, atol=1e-5)
        True
    """
    if not isinstance(module, (nn.TransformerEncoder, nn.TransformerEncoderLayer)):
        raise TypeError(
            f"module must be nn.TransformerEncoder or nn.TransformerEncoderLayer, got {type(module).__name__}"
        )
    block_size = check_block_size(block_size)
    check_backend(backend)
    if isinstance(module, nn.TransformerEncoderLayer):
        return _convert_layer(module, block_size, backend)
    layers = [_convert_layer(layer, block_size, backend) for layer in module.layers]
    encoder = JaggedTransformerEncoder(layers[0], len(layers), norm=None)
    encoder.layers = nn.ModuleList(layers)
    if module.norm is not None:
        encoder.norm = copy.deepcopy(module.norm)
    return encoder.train(module.training)

