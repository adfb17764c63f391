"""The ``reference`` backend: the pure-PyTorch path (:mod:`blockattn_layers.reference`), any device.

Computes in its inputs' dtype (half types in float32) with autocast off, in chunks whose
memory stays bounded; for the kinds that save ``lse`` it returns the exact logsumexp too.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch
from torch import Tensor

from ... import reference
from ...dispatch import BackendSpec, register_backend
from ..library import call_saves_lse

_FLOATS = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})


def _autocast_off(device_type: str):
    """The reference computes in its inputs' dtype: autocast must not recast its internals."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _block(block_size: int) -> Optional[int]:
    return None if block_size == 0 else block_size


def _forward(
    q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, block_size: int, scale: float, causal: bool,
    rope_theta: Optional[float], positions: Optional[Tensor], rotary_dim: int, rotary_interleaved: bool,
    cpu_offsets: Optional[Tensor], max_seqlen: Optional[int],
) -> Tuple[Tensor, Optional[Tensor]]:
    args = (q, k, v, offsets, _block(block_size), scale, causal, rope_theta, positions, rotary_dim,
            rotary_interleaved, cpu_offsets, max_seqlen)
    with _autocast_off(q.device.type):
        if call_saves_lse(q, k, block_size, rope_theta, rotary_dim, rotary_interleaved):
            return reference.attention_forward_lse(*args)
        return reference.attention_forward(*args), None


def _backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Optional[Tensor], lse: Optional[Tensor],
    offsets: Tensor, block_size: int, scale: float, causal: bool, rope_theta: Optional[float],
    positions: Optional[Tensor], rotary_dim: int, rotary_interleaved: bool, cpu_offsets: Optional[Tensor],
    max_seqlen: Optional[int],
) -> Tuple[Tensor, Tensor, Tensor]:
    """Recomputes each chunk's probabilities from q, k, v (``out`` and ``lse`` are not needed)."""
    with _autocast_off(q.device.type):
        return reference.attention_backward(
            grad_out, q, k, v, offsets, _block(block_size), scale, causal, rope_theta, positions,
            rotary_dim, rotary_interleaved, cpu_offsets, max_seqlen,
        )


register_backend(BackendSpec(
    name="reference",
    forward=_forward,
    backward=_backward,
    priority=0,
    devices=None,
    auto_devices=None,
    dtypes=_FLOATS,
    description="pure PyTorch, any device; chunked so memory stays bounded; half types computed in float32",
))
