"""The reference path as registered ``torch.library`` ops (forward, backward, autograd, fake).

Registering it makes the reference opaque to ``torch.compile``/``torch.export``: host-side
planning stays inside the op, graphs never break on it, and dynamic T and B do not recompile.
"""
from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import reference
from ._op_registration import register_attention_pair
from ._params import AttentionParams
from .dispatch import BackendSpec, register_backend

_FLOATS = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})


def _autocast_off(device_type: str):
    """The reference computes in its inputs' dtype: autocast must not recast its internals."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def _block(block_size: int) -> Optional[int]:
    return None if block_size == 0 else block_size


def _reference_fwd(
    q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, block_size: int, scale: float, causal: bool,
    rope_theta: Optional[float], positions: Optional[Tensor], rotary_dim: int, rotary_interleaved: bool,
    cpu_offsets: Optional[Tensor], max_seqlen: Optional[int],
) -> Tensor:
    """Reference forward; ``block_size == 0`` means full per-sequence attention."""
    with _autocast_off(q.device.type):
        return reference.attention_forward(
            q, k, v, offsets, _block(block_size), scale, causal, rope_theta, positions, rotary_dim,
            rotary_interleaved, cpu_offsets, max_seqlen,
        )


def _reference_bwd(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, block_size: int, scale: float,
    causal: bool, rope_theta: Optional[float], positions: Optional[Tensor], rotary_dim: int,
    rotary_interleaved: bool, cpu_offsets: Optional[Tensor], max_seqlen: Optional[int],
) -> Tuple[Tensor, Tensor, Tensor]:
    """Reference backward: ``(dq, dk, dv)``."""
    with _autocast_off(q.device.type):
        return reference.attention_backward(
            grad_out, q, k, v, offsets, _block(block_size), scale, causal, rope_theta, positions,
            rotary_dim, rotary_interleaved, cpu_offsets, max_seqlen,
        )


reference_fwd = torch.library.custom_op("blockattn::reference_fwd", _reference_fwd, mutates_args=())
reference_bwd = torch.library.custom_op("blockattn::reference_bwd", _reference_bwd, mutates_args=())
_attention = register_attention_pair(reference_fwd, reference_bwd, _reference_fwd, _reference_bwd)


def run_reference(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, params: AttentionParams) -> Tensor:
    return _attention(q, k, v, offsets, *params.op_args())


register_backend(BackendSpec(
    name="reference",
    run=run_reference,
    priority=0,
    devices=None,
    auto_devices=None,
    dtypes=_FLOATS,
    description="pure PyTorch, any device; chunked so memory stays bounded; half types computed in float32",
))
