"""Transformer encoder layer and stack over jagged batches, in ``nn.TransformerEncoder``'s conventions."""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .._validation import check_encoder_layer_args, check_int, check_module_input
from ..dispatch import Backend
from ..jagged import to_values_offsets
from .attention import BlockSelfAttention, RotaryBlockAttention

class JaggedTransformerEncoderLayer(nn.Module):
    """Self-attention (block or full) plus feed-forward, pre- or post-norm, over a jagged batch.

    The arguments and submodule names follow ``nn.TransformerEncoderLayer`` (``self_attn``,
    ``linear1``, ``linear2``, ``norm1``, ``norm2``, ``dropout``, ``dropout1``, ``dropout2``).
    Attention is :class:`BlockSelfAttention`, or :class:`RotaryBlockAttention` when ``rope_theta``
    is set; it has no dropout on the attention probabilities (``nn.MultiheadAttention`` does).

    Args:
        d_model: E, model width. nhead: query heads (E must be a multiple).
        dim_feedforward: hidden width of the feed-forward block.
        dropout: dropout after attention, inside and after the feed-forward block.
        activation: ``"relu"``, ``"gelu"`` or a callable.
        block_size: attention block length, ``None`` for full per-sequence attention.
        norm_first: pre-norm (``x + sa(norm1(x))``) instead of post-norm (``norm1(x + sa(x))``).
        rope_theta: rotary base; ``None`` (default) for no rotary embedding.
        rotary_dim: channels rotated per head (default all), rotary_interleaved: pairs
        ``(x[2i], x[2i+1])`` instead of split halves; both as in :class:`RotaryBlockAttention`.
        num_kv_heads: key/value heads for grouped-query attention (default ``nhead``).
        causal: causal masking inside each block. layer_norm_eps: LayerNorm epsilon.
        bias: biases in the linear and LayerNorm layers. backend: attention backend.
        validate: the attention's offset checks, as in :class:`BlockSelfAttention`.

    Forward:
        ``forward(x, offsets=None, positions=None, *, cpu_offsets=None, max_seqlen=None)`` with
        ``x`` packed ``values [T, E]`` plus ``offsets [B+1]``, a ``JaggedTensor`` or a
        ``Dict[str, JaggedTensor]``; returns the same kind, values ``[T, E]``. ``positions``
        (rotary layers only) as in :class:`RotaryBlockAttention`.

    Example:
        >>> import torch
        >>> from blockattn_layers import JaggedTransformerEncoderLayer
        >>> layer = JaggedTransformerEncoderLayer(32, 4, dim_feedforward=64, block_size=16, norm_first=True)
        >>> values, offsets = torch.randn(50, 32), torch.tensor([0, 20, 50])
        >>> layer(values, offsets).shape
        torch.Size([50, 32])
    """

    def __init__(
        self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
        activation: Union[str, Callable[[Tensor], Tensor]] = "relu", *, block_size: Optional[int] = 64,
        norm_first: bool = False, rope_theta: Optional[float] = None, num_kv_heads: Optional[int] = None,
        causal: bool = False, layer_norm_eps: float = 1e-5, bias: bool = True,
        backend: Union[str, Backend] = "auto", device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None, rotary_dim: Optional[int] = None, rotary_interleaved: bool = False,
        validate: Optional[bool] = None,
    ) -> None:
        super().__init__()
        check_encoder_layer_args(
            d_model, nhead, dim_feedforward, dropout, activation, block_size=block_size, norm_first=norm_first,
            rope_theta=rope_theta, num_kv_heads=num_kv_heads, causal=causal, layer_norm_eps=layer_norm_eps,
            bias=bias, backend=backend, rotary_dim=rotary_dim, rotary_interleaved=rotary_interleaved,
        )
        factory = {"device": device, "dtype": dtype}
        attn_kwargs = dict(block_size=block_size, num_kv_heads=num_kv_heads, bias=bias, causal=causal,
                           backend=backend, validate=validate, **factory)
        if rope_theta is None:
            self.self_attn = BlockSelfAttention(d_model, nhead, **attn_kwargs)
        else:
            self.self_attn = RotaryBlockAttention(d_model, nhead, rope_theta=rope_theta, rotary_dim=rotary_dim,
                                                  rotary_interleaved=rotary_interleaved, **attn_kwargs)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias, **factory)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias, **factory)
        self.norm_first = norm_first
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        # (A name is one of _validation.ACTIVATIONS, each a function of torch.nn.functional.)
        self.activation = getattr(F, activation) if isinstance(activation, str) else activation

    def _sa_block(self, x: Tensor, offsets: Tensor, positions: Optional[Tensor], hints: dict) -> Tensor:
        if positions is None:
            return self.dropout1(self.self_attn(x, offsets, **hints))
        return self.dropout1(self.self_attn(x, offsets, positions, **hints))

    def _ff_block(self, x: Tensor) -> Tensor:
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(
        self, x: Any, offsets: Optional[Tensor] = None, positions: Any = None, *,
        cpu_offsets: Optional[Tensor] = None, max_seqlen: Optional[int] = None,
    ) -> Any:
        values, offsets, layout = to_values_offsets(x, offsets)
        _check_input(self, values, offsets, layout.kind)
        if positions is not None:
            if not isinstance(self.self_attn, RotaryBlockAttention):
                raise ValueError("positions are used by rotary attention only: build the layer with rope_theta")
            positions = layout.flatten(positions)
        hints = {"cpu_offsets": cpu_offsets, "max_seqlen": max_seqlen}
        if self.norm_first:
            values = values + self._sa_block(self.norm1(values), offsets, positions, hints)
            values = values + self._ff_block(self.norm2(values))
        else:
            values = self.norm1(values + self._sa_block(values, offsets, positions, hints))
            values = self.norm2(values + self._ff_block(values))
        return layout.wrap(values)


class JaggedTransformerEncoder(nn.Module):
    """A stack of ``num_layers`` deep copies of ``encoder_layer``, then an optional ``norm``.

    As ``nn.TransformerEncoder``: ``layers`` holds the copies (each with its own weights),
    ``norm`` is applied to the output. ``encoder_layer`` is a :class:`JaggedTransformerEncoderLayer`
    or any module whose forward takes ``(values, offsets, *, cpu_offsets, max_seqlen)`` (and
    ``positions=`` when positions are given). Layers are called through ``forward``, so hooks
    (FSDP2 ``fully_shard``, checkpoint wrappers) on each layer work.

    Forward:
        ``forward(x, offsets=None, positions=None, *, cpu_offsets=None, max_seqlen=None)``: as
        :class:`JaggedTransformerEncoderLayer`; returns the kind of ``x``.

    Example:
        >>> import torch
        >>> from blockattn_layers import JaggedTransformerEncoder, JaggedTransformerEncoderLayer
        >>> layer = JaggedTransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, block_size=None)
        >>> encoder = JaggedTransformerEncoder(layer, num_layers=2, norm=torch.nn.LayerNorm(32))
        >>> values, offsets = torch.randn(9, 32), torch.tensor([0, 4, 9], dtype=torch.int32)
        >>> encoder(values, offsets).shape
        torch.Size([9, 32])
    """

    def __init__(self, encoder_layer: nn.Module, num_layers: int, norm: Optional[nn.Module] = None) -> None:
        super().__init__()
        if not isinstance(encoder_layer, nn.Module):
            raise TypeError(f"encoder_layer must be an nn.Module, got {type(encoder_layer).__name__}")
        num_layers = check_int("num_layers", num_layers)
        if norm is not None and not isinstance(norm, nn.Module):
            raise TypeError(f"norm must be an nn.Module or None, got {type(norm).__name__}")
        self.layers = nn.ModuleList([copy.deepcopy(encoder_layer) for _ in range(num_layers)])
        self.num_layers = num_layers
        self.norm = norm

    def forward(
        self, x: Any, offsets: Optional[Tensor] = None, positions: Any = None, *,
        cpu_offsets: Optional[Tensor] = None, max_seqlen: Optional[int] = None,
    ) -> Any:
        values, offsets, layout = to_values_offsets(x, offsets)
        # (Not the dtype: a layer's parameters may take theirs only in its own forward, e.g. FSDP2's param_dtype.)
        _check_input(self.layers[0], values, offsets, layout.kind, with_dtype=False)
        extra = {"cpu_offsets": cpu_offsets, "max_seqlen": max_seqlen}
        if positions is not None:
            extra["positions"] = layout.flatten(positions)
        for layer in self.layers:
            values = layer(values, offsets, **extra)
        if self.norm is not None:
            values = self.norm(values)
        return layout.wrap(values)


def _check_input(layer: nn.Module, values: Tensor, offsets: Any, kind: str, with_dtype: bool = True) -> None:
    """The input checks of ``layer``'s forward, for the input as the caller gave it (``kind``):
    where it is a :class:`JaggedTransformerEncoderLayer`, its width and (``with_dtype``) its
    parameters' dtype too."""
    if not isinstance(layer, JaggedTransformerEncoderLayer):
        check_module_input(values, offsets, kind)
        return
    dtype = layer.linear1.weight.dtype if with_dtype else None
    check_module_input(values, offsets, kind, layer.self_attn.embed_dim, dtype, "d_model")
