"""The Triton backend: kernels from ``blockattn_layers.kernels`` as registered ops.

Forward and backward are ``torch.library`` custom ops with fake implementations, joined by
``register_autograd``; only q, k, v and offsets (plus positions / cpu_offsets when given)
are saved for backward. Kernel sizes are runtime arguments, so batches of different T and B
reuse the compiled kernels.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
from torch import Tensor

from blockattn_layers.kernels._common import MAX_TILE
from blockattn_layers.kernels.block_bwd import block_attention_bwd
from blockattn_layers.kernels.block_fwd import block_attention_fwd, block_attention_fwd_planned

from ._op_registration import register_attention_pair
from ._params import AttentionParams
from .dispatch import AttentionRequest, BackendSpec, register_backend


def _triton_fwd(
    q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, block_size: int, scale: float, causal: bool,
    rope_theta: Optional[float], positions: Optional[Tensor], rotary_dim: int, rotary_interleaved: bool,
    cpu_offsets: Optional[Tensor], max_seqlen: Optional[int],
) -> Tensor:
    """Triton block-attention forward (``block_size <= 128``)."""
    return block_attention_fwd(
        q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim,
        rotary_interleaved, cpu_offsets,
    )


def _triton_bwd(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, block_size: int, scale: float,
    causal: bool, rope_theta: Optional[float], positions: Optional[Tensor], rotary_dim: int,
    rotary_interleaved: bool, cpu_offsets: Optional[Tensor], max_seqlen: Optional[int],
) -> Tuple[Tensor, Tensor, Tensor]:
    """Triton block-attention backward: ``(dq, dk, dv)``."""
    return block_attention_bwd(
        grad_out, q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim,
        rotary_interleaved, cpu_offsets,
    )


def _triton_fwd_planned(
    q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, block_size: int, scale: float, causal: bool,
    rope_theta: Optional[float], positions: Optional[Tensor], rotary_dim: int, rotary_interleaved: bool,
    cpu_offsets: Optional[Tensor], max_seqlen: Optional[int],
):
    """:func:`_triton_fwd` and its backward's launch, prepared on the caller's thread."""
    return block_attention_fwd_planned(
        q, k, v, offsets, block_size, scale, causal, rope_theta, positions, rotary_dim,
        rotary_interleaved, cpu_offsets,
    )


triton_fwd = torch.library.custom_op("blockattn::triton_fwd", _triton_fwd, mutates_args=())
triton_bwd = torch.library.custom_op("blockattn::triton_bwd", _triton_bwd, mutates_args=())
_attention = register_attention_pair(triton_fwd, triton_bwd, _triton_fwd, _triton_bwd, _triton_fwd_planned)


def run_triton(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, params: AttentionParams) -> Tensor:
    return _attention(q, k, v, offsets, *params.op_args())


def interpreter_active() -> bool:
    """``TRITON_INTERPRET=1``: the kernels run on CPU tensors through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _devices() -> frozenset:
    return frozenset({"cuda", "cpu"}) if interpreter_active() else frozenset({"cuda"})


def _extra_reasons(req: AttentionRequest) -> list:
    if req.device_type == "cuda" and not torch.cuda.is_available():
        return ["CUDA is not available"]
    return []


register_backend(BackendSpec(
    name="triton",
    run=run_triton,
    priority=10,
    devices=_devices,
    auto_devices=frozenset({"cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
    min_capability=(8, 0),
    head_dims=(16, 256),
    max_block_size=MAX_TILE,
    full_attention=False,
    extra_reasons=_extra_reasons,
    description="single-pass Triton kernels, one tile per block (block_size <= 128); CUDA sm_80+, "
    "or CPU tensors under TRITON_INTERPRET=1",
))
